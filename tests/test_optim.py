"""Optimizers as `torch.optim` computes them (float64): SGD with Nesterov momentum, Adam and AdamW
(weight decay left out where asked), gradient clipping by the global norm and gradient
accumulation, on one device against PyTorch and under random strategies against one device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taskrt as tr
from taskrt.ops.optim import OptimizerError
from taskrt.planning.memory import plan_memory
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import random_strategies

torch = pytest.importorskip("torch")

TOL = 1e-9
STEPS = 10
OPTIMIZERS = {
    "sgd-nesterov": (lambda: tr.optim.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
                     lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (lambda: tr.optim.Adam(0.01, weight_decay=1e-2),
             lambda groups: torch.optim.Adam(groups, lr=0.01)),
    "adamw-no-decay": (lambda: tr.optim.AdamW(0.01, weight_decay=0.1, no_decay=("bias", "norm")),
                       lambda groups: torch.optim.AdamW(groups, lr=0.01)),
}


def net(batch=4, norm=True) -> tr.Graph:
    g = tr.Graph("optim_net")
    x = g.input("image", (batch, 3, 8, 8))
    y = g.conv2d(x, 4, 3, padding=1, activation="relu", name="conv")
    if norm:
        y = g.batch_norm(y, name="bn")
    y = g.pool2d(y, 2, name="pool")
    y = g.linear(g.flatten(y, name="flat"), 8, activation="relu", name="fc1")
    g.softmax_cross_entropy(g.linear(y, 5, name="fc2"), name="loss")
    return g


def torch_net(params: dict, norm=True):
    layers = [torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()]
    names = ["conv", None]
    if norm:
        layers.append(torch.nn.BatchNorm2d(4))
        names.append("bn")
    layers += [torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.ReLU(),
               torch.nn.Linear(8, 5)]
    names += [None, None, "fc1", None, "fc2"]
    module = torch.nn.Sequential(*layers).double()
    with torch.no_grad():
        for name, layer in zip(names, layers):
            if name is not None:
                for key, value in params[name].items():
                    getattr(layer, key).copy_(torch.from_numpy(value))
    return module, {name: layer for name, layer in zip(names, layers) if name is not None}


def torch_groups(layers: dict, optimizer) -> list[dict]:
    """Parameter groups as a PyTorch user writes them: the ones left out get weight_decay 0."""
    graph_kinds = {"conv": "conv2d", "bn": "batch_norm", "fc1": "linear", "fc2": "linear"}
    decayed, kept = [], []
    for name, layer in layers.items():
        for key, p in layer.named_parameters():
            out = optimizer.no_decay and (("bias" in optimizer.no_decay and key == "bias")
                                          or ("norm" in optimizer.no_decay and graph_kinds[name] == "batch_norm"))
            (kept if out else decayed).append(p)
    return [{"params": decayed, "weight_decay": optimizer.weight_decay}, {"params": kept, "weight_decay": 0.0}]


def strategy(graph, **configs) -> tr.Strategy:
    """Every layer on device 0 unless named."""
    return tr.Strategy({l.name: configs.get(l.name, tr.ParallelConfig()) for l in graph if not l.is_input})


def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape), rng.integers(0, 5, shape[0])) for _ in range(count)]


def torch_train(graph, params, make_torch, optimizer, data, clip=None, norm=True):
    module, layers = torch_net(params, norm)
    opt = make_torch(torch_groups(layers, optimizer))
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        losses.append(float(loss))
    return losses, {name: {k: v.detach().numpy() for k, v in layer.named_parameters()}
                    for name, layer in layers.items()}, opt


def assert_params_close(actual, expected, tol=TOL):
    for layer in expected:
        for name, value in expected[layer].items():
            err = np.max(np.abs(actual[layer][name] - value)) / max(np.max(np.abs(value)), 1e-30)
            assert err < tol, f"{layer}.{name}: relative error {err:.3g}"


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ten_steps_on_one_device_equal_torch_optim(name, clip):
    make, make_torch = OPTIMIZERS[name]
    graph = net()
    trainer = SingleDeviceTrainer(graph, optimizer=make(), clip_grad_norm=clip, dtype="float64", seed=1)
    data = batches(graph, STEPS)
    torch_losses, expected, opt = torch_train(graph, trainer.parameters(), make_torch, trainer.optimizer, data, clip)
    losses = [trainer.step(x, y) for x, y in data]
    np.testing.assert_allclose(losses, torch_losses, rtol=TOL)
    assert_params_close(trainer.parameters(), expected)
    # and the optimizer's state, under torch.optim's names
    module_params = {id(p): (layer, key) for layer, mod in torch_net(trainer.parameters())[1].items()
                     for key, p in mod.named_parameters()}
    assert module_params  # (a fresh module: the names are what is compared)
    for slot in trainer.optimizer.slots:
        for state in opt.state.values():
            assert slot in state


def test_clipping_scales_only_past_the_norm_and_as_torch_does():
    graph = net(norm=False)
    data = batches(graph, 3)
    for clip in (1e-3, 1e6):  # clips every step; never clips
        make, make_torch = OPTIMIZERS["sgd-nesterov"]
        trainer = SingleDeviceTrainer(graph, optimizer=make(), clip_grad_norm=clip, dtype="float64")
        _, expected, _ = torch_train(graph, trainer.parameters(), make_torch, trainer.optimizer, data, clip,
                                     norm=False)
        for x, y in data:
            trainer.step(x, y)
        assert_params_close(trainer.parameters(), expected)


@pytest.mark.parametrize("name", ["sgd-nesterov", "adamw-no-decay"])
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(name):
    """k micro-batches accumulated, then one update: the step PyTorch takes on the k-times batch."""
    make, make_torch = OPTIMIZERS[name]
    k, micro = 3, 2
    graph = net(batch=micro, norm=False)
    trainer = SingleDeviceTrainer(graph, optimizer=make(), clip_grad_norm=0.5, dtype="float64", seed=2)
    data = batches(graph, 4 * k, seed=5)
    whole = [(np.concatenate([x for x, _ in data[i:i + k]]), np.concatenate([y for _, y in data[i:i + k]]))
             for i in range(0, len(data), k)]
    torch_losses, expected, _ = torch_train(graph, trainer.parameters(), make_torch, trainer.optimizer, whole,
                                            clip=0.5, norm=False)
    losses = []
    for i in range(0, len(data), k):
        micro_losses = [trainer.accumulate(*batch) for batch in data[i:i + k - 1]] + [trainer.step(*data[i + k - 1])]
        losses.append(np.mean(micro_losses))
    np.testing.assert_allclose(losses, torch_losses, rtol=TOL)
    assert_params_close(trainer.parameters(), expected)


@pytest.mark.parametrize("name, clip", [("sgd-nesterov", 0.05), ("adam", None), ("adamw-no-decay", 0.05)])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_over_three_devices_equal_one_device(machine4, name, clip, data):
    """Parameters split over c and replicated (over n, h, w; ps and all-reduce), ten updates (a
    clipping norm every step reaches)."""
    graph = net()
    _, strategy = data.draw(random_strategies(graph, max_devices=3))
    make, _ = OPTIMIZERS[name]
    reference = SingleDeviceTrainer(graph, optimizer=make(), clip_grad_norm=clip, dtype="float64", seed=3)
    trainer = Trainer(graph, strategy, machine4, optimizer=make(), clip_grad_norm=clip, dtype="float64", seed=3,
                      snapshot_every=None)
    for x, y in batches(graph, STEPS, seed=7):
        assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=TOL)
    assert_params_close(trainer.parameters(), reference.parameters())
    state = trainer.optimizer_state()
    for slot in reference.optimizer.slots:
        assert_params_close(state[slot], reference.state[slot])
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


@pytest.mark.parametrize("per_program", [1, 4])
def test_fit_accumulating_equals_one_device_on_the_whole_batches(machine4, per_program):
    k, micro = 2, 2
    graph = net(batch=micro, norm=False)
    P = tr.ParallelConfig
    split = strategy(graph, conv=P(n=2), pool=P(c=2), fc1=P(c=2, devices=(1, 2)), fc2=P(n=2, sync="allreduce"))
    make, _ = OPTIMIZERS["adamw-no-decay"]
    trainer = Trainer(graph, split, machine4, optimizer=make(), clip_grad_norm=0.5, dtype="float64", seed=4,
                      snapshot_every=None)
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((24, 3, 8, 8)), rng.integers(0, 5, 24)
    history = trainer.fit(tr.ArrayDataset({"images": x, "labels": y}), epochs=2, shuffle=False, progress=False,
                          accumulate=k, steps_per_program=per_program)
    reference = SingleDeviceTrainer(net(batch=micro * k, norm=False), optimizer=make(), clip_grad_norm=0.5,
                                    dtype="float64", seed=4)
    expected = [reference.step(x[i:i + micro * k], y[i:i + micro * k]) for _ in range(2)
                for i in range(0, 24, micro * k)]
    np.testing.assert_allclose(history.losses, expected, rtol=TOL)
    assert_params_close(trainer.parameters(), reference.parameters())
    assert trainer.updates_done == len(expected) and trainer.steps_done == k * len(expected)


def test_checkpoints_carry_adamw_and_continue_identically(machine4, tmp_path):
    graph = net()
    split = strategy(graph, conv=tr.ParallelConfig(c=2), fc1=tr.ParallelConfig(n=2, sync="allreduce"))
    make, _ = OPTIMIZERS["adamw-no-decay"]
    data = batches(graph, 6, seed=9)
    whole = Trainer(graph, split, machine4, optimizer=make(), clip_grad_norm=1.0, dtype="float64")
    for x, y in data:
        whole.step(x, y)
    first = Trainer(graph, split, machine4, optimizer=make(), clip_grad_norm=1.0, dtype="float64")
    for x, y in data[:3]:
        first.step(x, y)
    first.save(tmp_path / "c.npz")
    resumed = Trainer.load(tmp_path / "c.npz", machine4)
    assert resumed.optimizer == first.optimizer and resumed.clip_grad_norm == 1.0 and resumed.updates_done == 3
    for x, y in data[3:]:
        resumed.step(x, y)
    assert_params_close(resumed.parameters(), whole.parameters(), 1e-12)
    for slot in ("exp_avg", "exp_avg_sq"):
        assert_params_close(resumed.optimizer_state()[slot], whole.optimizer_state()[slot], 1e-12)


def test_memory_counts_each_slot_and_the_plan_its_clipping_scalars(machine4):
    graph = net(norm=False)
    split = strategy(graph, fc1=tr.ParallelConfig(c=2))
    sgd = Trainer(graph, split, machine4, lr=0.01, momentum=0.9)
    adam = Trainer(graph, split, machine4, optimizer=tr.optim.Adam(), clip_grad_norm=1.0)
    def optimizer_state(t):  # the whole optimizer state (the search's sum), not what a peak holds of it
        return sum(m.optimizer for m in plan_memory(t.plan, slots=len(t.optimizer.slots)).values())

    assert optimizer_state(adam) == 2 * optimizer_state(sgd)
    phases = adam.plan.phase_counts()
    assert phases["gnorm"] == 2 and phases["gtotal"] == 1 and "gnorm" not in sgd.plan.phase_counts()
    # a sum of squares from device 1 to device 0 and the coefficient back: 8 bytes each way
    more = {pair: adam.plan.bytes_by_pair().get(pair, 0) - sgd.plan.bytes_by_pair().get(pair, 0)
            for pair in set(adam.plan.bytes_by_pair()) | set(sgd.plan.bytes_by_pair())}
    assert {pair: b for pair, b in more.items() if b} == {(1, 0): 8, (0, 1): 8}


def test_bad_settings_are_named():
    with pytest.raises(OptimizerError, match="nesterov=True needs a momentum above 0"):
        tr.optim.SGD(0.1, nesterov=True)
    with pytest.raises(OptimizerError, match=r"betas\[1\] must lie in \[0, 1\)"):
        tr.optim.Adam(betas=(0.9, 1.5))
    with pytest.raises(OptimizerError, match="no_decay \\['biases'\\] unknown"):
        tr.optim.AdamW(no_decay=("biases",))
    with pytest.raises(OptimizerError, match="give either optimizer= or the SGD shorthand"):
        SingleDeviceTrainer(net(), lr=0.1, optimizer=tr.optim.Adam())
    with pytest.raises(OptimizerError, match="clip_grad_norm must be None or a positive number"):
        SingleDeviceTrainer(net(), clip_grad_norm=0)
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        from taskrt.training.fit import fit

        fit(None, None, accumulate=0)


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device)
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 1, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_fused_gpu_kernels_compute_what_the_numpy_loops_compute(name):
    """One elementwise kernel per run of equal weight decay on cupy arrays, the numba loop on numpy."""
    import cupy

    make, _ = OPTIMIZERS[name]
    optimizer = make()
    rng = np.random.default_rng(3)
    w, g = rng.standard_normal(1000), rng.standard_normal(1000)
    slots = tuple(np.abs(rng.standard_normal(1000)) for _ in optimizer.slots)
    segments = ((0, optimizer.weight_decay), (700, 0.0))  # a weight, then a bias left out of decay
    hyper = optimizer.hyper(step=3)
    expected = optimizer.update(hyper, w, slots, g, segments, 0.5)
    got = optimizer.update(hyper, cupy.asarray(w), tuple(map(cupy.asarray, slots)), cupy.asarray(g), segments, 0.5)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(cupy.asnumpy(a), b, rtol=1e-12)
