"""The PyTorch peer: a taskrt Graph run as an ordinary PyTorch program, to measure the runtime against.

It is built from the graph itself, so both train exactly the same network: the same layers and
hyper-parameters, the same initial parameters (`taskrt.planning.params.init_parameters`), the same loss (mean
softmax cross-entropy over the batch) and the same update (SGD with momentum and weight decay in
PyTorch's formulation, which `ops.optim.SGD` follows).

    peer = TorchPeer(graph, init_parameters(graph, 0), lr=0.01, momentum=0.9, device="cuda")
    loss = peer.step(images, labels)           # numpy or torch tensors on the peer's device
    peer.gradients(images, labels)              # {layer: {"weight": ndarray, "bias": ndarray}}
    seconds, times = time_steps(lambda: peer.step(images, labels), warmup=3, repeats=10)
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from taskrt.data.arrays import batches_for_predict, bind_inputs, logits_layer


def _torch():
    import torch

    return torch


def forward_layer(layer, xs, params, running=None, mode="gradients"):
    """One graph layer as torch functional calls on tensors `xs` (the layer's inputs, in order).
    Batch norm: `running` is its (mean, variance) tensors, updated in place when `mode` is "train"
    and used instead of the batch's statistics when it is "predict"."""
    F = _torch().nn.functional
    op, kind = layer.op, layer.kind
    if kind == "batch_norm":
        w, b = params["weight"], params["bias"]
        if mode == "gradients":
            return F.batch_norm(xs[0], None, None, w, b, training=True, eps=op.eps)
        return F.batch_norm(xs[0], running[0], running[1], w, b, training=mode == "train", momentum=op.momentum,
                            eps=op.eps)
    if kind == "conv2d":
        y = F.conv2d(xs[0], params["weight"], params.get("bias"), op.stride, op.padding, op.dilation, op.groups)
        return F.relu(y, inplace=True) if op.activation == "relu" else y
    if kind == "linear":
        y = F.linear(xs[0], params["weight"], params.get("bias"))
        return F.relu(y, inplace=True) if op.activation == "relu" else y
    if kind == "pool2d" and op.mode == "max":
        return F.max_pool2d(xs[0], op.kernel, op.stride, op.padding)
    if kind == "pool2d":  # the graph's average pool counts padding as zeros
        return F.avg_pool2d(xs[0], op.kernel, op.stride, op.padding, count_include_pad=True)
    if kind == "relu":
        return F.relu(xs[0])
    if kind == "flatten":
        return xs[0].reshape(xs[0].shape[0], -1)
    if kind == "concat":
        return _torch().cat(xs, dim=1)
    if kind == "add":
        return xs[0] + xs[1]
    if kind == "softmax_cross_entropy":  # per-sample losses, as the graph's loss layer
        return F.cross_entropy(xs[0], xs[1], reduction="none")
    raise ValueError(f"layer {layer.name!r}: the torch peer has no translation for kind {kind!r}")


class TorchPeer:
    def __init__(self, graph, params, lr=0.01, momentum=0.0, weight_decay=0.0, device="cpu", dtype=None,
                 autocast=None):
        """`params` as `init_parameters` returns them; `dtype` defaults to theirs (float32 or float64).
        `autocast`: "bf16" runs the forward under `torch.autocast` in bfloat16 (float32 parameters)."""
        torch = _torch()
        self.graph = graph
        self.autocast = {"bf16": torch.bfloat16, None: None}[autocast]
        self.device = torch.device(device)
        first = next((v for p in params.values() for v in p.values()), np.zeros(0, np.float32))
        self.np_dtype = np.dtype(dtype or first.dtype)
        self.dtype = getattr(torch, self.np_dtype.name)
        missing = [l.name for l in graph if l.param_shapes and l.name not in params]
        if missing:
            raise ValueError(f"no parameters given for layers {missing}")
        self.params = {
            layer.name: {k: torch.tensor(np.asarray(params[layer.name][k]), dtype=self.dtype, device=self.device)
                         .requires_grad_() for k in layer.param_shapes}
            for layer in graph if layer.param_shapes
        }
        self.running = {layer.name: (torch.zeros(layer.shape[1], dtype=self.dtype, device=self.device),
                                     torch.ones(layer.shape[1], dtype=self.dtype, device=self.device))
                        for layer in graph if layer.op.buffer_shapes()}
        self.optimizer = torch.optim.SGD([t for p in self.params.values() for t in p.values()], lr=lr,
                                         momentum=momentum, weight_decay=weight_decay)

    # ---- the network ------------------------------------------------------------------------
    def inputs(self, *data, with_labels=True) -> dict:
        """Input tensors by layer name: from torch tensors already on the device as they are, from
        anything else checked and converted as the runtime's trainers do."""
        torch = _torch()
        names = [l.name for l in self.graph.inputs if with_labels or l.op.dtype != "int64"]
        given = data[0] if len(data) == 1 and isinstance(data[0], dict) else dict(zip(names, data))
        if len(given) == len(names) and all(isinstance(v, torch.Tensor) for v in given.values()):
            return dict(given)
        bound = bind_inputs(self.graph, data, self.np_dtype, with_labels=with_labels)
        return {name: torch.from_numpy(a).to(self.device) for name, a in bound.items()}

    def activations(self, inputs: dict, stop_at=None, mode="gradients") -> dict:
        acts = dict(inputs)
        for layer in self.graph:
            if layer.is_input:
                continue
            acts[layer.name] = forward_layer(layer, [acts[src] for src in layer.inputs],
                                             self.params.get(layer.name, {}), self.running.get(layer.name), mode)
            if layer.name == stop_at:
                break
        return acts

    def _loss(self, acts):
        return sum(acts[loss.name].mean() for loss in self.graph.losses)

    # ---- public, as the runtime's trainers ----------------------------------------------------
    def loss(self, *data) -> float:
        with _torch().no_grad():
            return float(self._loss(self.activations(self.inputs(*data))))

    def gradients(self, *data) -> dict:
        """Parameter gradients of the mean loss, {layer: {"weight": ndarray, "bias": ndarray}}; no update."""
        torch = _torch()
        tensors = [t for p in self.params.values() for t in p.values()]
        grads = torch.autograd.grad(self._loss(self.activations(self.inputs(*data))), tensors)
        flat = iter(grads)
        return {name: {k: next(flat).detach().cpu().numpy() for k in p} for name, p in self.params.items()}

    def step(self, *data) -> float:
        """One SGD step; returns the loss before the update (waits for the step, as `Trainer.step`)."""
        return float(self.step_queued(*data).item())

    def step_queued(self, *data):
        """One SGD step, not waited for: the loss as a tensor on the device (as a training loop that
        reads its losses later queues its steps)."""
        torch = _torch()
        self.optimizer.zero_grad(set_to_none=True)
        if self.autocast is None:
            loss = self._loss(self.activations(self.inputs(*data), mode="train"))
        else:
            with torch.autocast(self.device.type, dtype=self.autocast):
                loss = self._loss(self.activations(self.inputs(*data), mode="train")).float()
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def predict(self, x) -> np.ndarray:
        """Logits for any number of samples, in batches of the graph's batch size."""
        torch = _torch()
        target = logits_layer(self.graph)
        out = []
        with torch.no_grad():
            for chunk, used in batches_for_predict(self.graph, np.asarray(x)):
                acts = self.activations(self.inputs(chunk, with_labels=False), stop_at=target,
                                        mode="predict")
                out.append(acts[target][:used].cpu().numpy())
        return np.concatenate(out)

    def parameters(self) -> dict:
        return {name: {k: t.detach().cpu().numpy().copy() for k, t in p.items()} for name, p in self.params.items()}


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    torch = _torch()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, warmup=3, repeats=10, device=None) -> tuple[float, list[float]]:
    """Median wall time of `step()` over `repeats` runs after `warmup` untimed ones, and every time.

    With a CUDA `device`, the device is synchronized before and after each run, so a run's time covers
    its GPU work and nothing queued before it.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        start = time.perf_counter()
        step()
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times
