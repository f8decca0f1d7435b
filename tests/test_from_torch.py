"""`tr.from_torch`: a PyTorch module traced into a Graph that starts from the module's weights, one
step of which equals PyTorch's (float64), whose trained weights go back into the module under its
own names, and whose unsupported parts are all named at once."""

from __future__ import annotations

import numpy as np
import pytest

import taskrt as tr
from taskrt.graph.graph import GraphError

torch = pytest.importorskip("torch")
models = pytest.importorskip("torchvision.models")


def torch_step(module, x, y, lr=0.1, momentum=0.9, weight_decay=1e-4):
    """One SGD step of `module` in training mode: (loss, state_dict as numpy)."""
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    return float(loss), {k: v.detach().numpy() for k, v in module.state_dict().items()}


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)) if b.size else 0.0


def test_a_resnet_step_in_float64_equals_pytorchs_and_its_state_dict_loads_strictly():
    torch.manual_seed(0)
    module = models.resnet18(num_classes=10).double()
    g = tr.from_torch(module, (4, 3, 32, 32))
    assert "layer1.0.conv1" in g.layers and g["layer1.0.conv1"].kind == "conv2d"
    trainer = tr.SingleDeviceTrainer(g, lr=0.1, momentum=0.9, weight_decay=1e-4, dtype="float64")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 32, 32)), rng.integers(0, 10, 4)
    loss = trainer.step(x, y)
    expected_loss, expected = torch_step(module, x, y)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    got = trainer.state_dict()
    assert set(got) == set(expected)
    for key in expected:  # every parameter's update, running statistics, num_batches_tracked
        assert relative(got[key], expected[key]) < 1e-9, key
    fresh = models.resnet18(num_classes=10)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in got.items()}, strict=True)


def test_trained_weights_go_back_and_the_module_predicts_what_taskrt_predicts(machine4):
    """Trained on three devices in float32; the module, given the weights, predicts the same logits."""
    torch.manual_seed(1)
    module = models.resnet18(num_classes=5)
    g = tr.from_torch(module, (4, 3, 32, 32))
    P = tr.ParallelConfig
    strategy = tr.Strategy({l.name: P(n=2) if l.kind in ("conv2d", "batch_norm", "relu", "add") else P()
                            for l in g if not l.is_input})
    trainer = tr.Trainer(g, strategy, machine4, lr=0.05, momentum=0.9)
    rng = np.random.default_rng(1)
    for _ in range(3):
        trainer.step(rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 5, 4))
    module.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()}, strict=True)
    module.eval()
    x = rng.standard_normal((6, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    assert relative(trainer.predict(x), expected) < 1e-5
    assert int(trainer.state_dict()["bn1.num_batches_tracked"]) == 3


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _Custom(torch.nn.Module):
    def forward(self, x):
        return _Square.apply(x)


class _Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.square = _Custom()
        self.rnn = torch.nn.LSTM(4, 4, batch_first=True)
        self.pad = torch.nn.ReflectionPad2d(1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        x = self.pad(self.square(self.conv(x)))
        seq, _ = self.rnn(x.mean((2, 3)).unsqueeze(1))
        return self.fc(seq[:, 0])


def test_every_unsupported_part_is_named_at_once_with_its_module_path():
    with pytest.raises(GraphError) as raised:
        tr.from_torch(_Unsupported(), (2, 3, 8, 8))
    message = str(raised.value)
    for part in ("rnn (torch.nn.modules.rnn.LSTM)", "pad (torch.nn.modules.padding.ReflectionPad2d)", "apply"):
        assert part in message, message
    assert "unsupported operation(s)" in message


class _Branching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value: torch.fx cannot trace it
            x = -x
        return self.fc(x.mean((2, 3)))


def test_a_tracing_failure_says_why_and_the_usual_fixes():
    with pytest.raises(GraphError, match="torch.fx could not trace _Branching.*leaf_modules.*concrete_args"):
        tr.from_torch(_Branching(), (2, 3, 4, 4))


def test_bad_arguments_are_named():
    with pytest.raises(GraphError, match="input_shape must be"):
        tr.from_torch(models.resnet18(), (3, 32, 32))
    with pytest.raises(GraphError, match="loss 'mse' is not supported"):
        tr.from_torch(models.resnet18(), (2, 3, 32, 32), loss="mse")
    with pytest.raises(GraphError, match="takes a torch.nn.Module"):
        tr.from_torch(lambda x: x, (2, 3, 32, 32))
