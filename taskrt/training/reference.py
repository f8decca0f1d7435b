"""The single-device network: whole tensors in one process, no partitioning, no Dask.

It is what every parallel configuration must reproduce, and the trainer `make run` starts from.
"""

from __future__ import annotations

import numpy as np

from taskrt.data.arrays import batches_for_predict, bind_inputs, logits_layer
from taskrt.ops import sgd_update
from taskrt.ops.rect import Rect
from taskrt.planning.params import init_buffers, init_parameters, resolve_dtype


class SingleDeviceTrainer:
    def __init__(self, graph, lr=0.01, momentum=0.0, weight_decay=0.0, dtype="float32", seed=0):
        self.graph = graph
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.dtype = resolve_dtype(dtype)
        self.params = init_parameters(graph, seed, self.dtype)
        self.velocity = {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in self.params.items()}
        self.running = init_buffers(graph, self.dtype)  # batch norm: (2, C) running mean and variance
        self.steps_done = 0

    # ---- the network ------------------------------------------------------------------------
    def _forward(self, data, stop_at=None, mode="gradients"):
        """`mode`: "train" also updates the running statistics, "predict" normalizes with them."""
        acts = dict(data)
        for layer in self.graph:
            if layer.is_input:
                continue
            xs = [acts[src] for src in layer.inputs]
            params = self.params.get(layer.name, {})
            if layer.name in self.running and mode == "predict":
                acts[layer.name] = layer.op.infer(xs[0], self.running[layer.name], params)
            else:
                acts[layer.name] = layer.op.forward(xs, params, Rect.full(layer.shape))
            if layer.name in self.running and mode == "train":
                stats = layer.op.partial_stats(xs[0])
                self.running[layer.name] = layer.op.update_running(self.running[layer.name], stats)
            if layer.name == stop_at:
                break
        return acts

    def _backward(self, acts):
        needed = self.graph.needs_backward()
        dacts, grads = {}, {}
        for loss in self.graph.losses:
            n = loss.shape[0]
            dacts[loss.name] = np.full(loss.shape, 1.0 / n, dtype=self.dtype)
        for layer in reversed(list(self.graph)):
            if layer.name not in needed or layer.name not in dacts:
                continue
            xs = [acts[src] for src in layer.inputs]
            need_dx = [src in needed for src in layer.inputs]
            dxs, dparams = layer.op.backward(
                dacts[layer.name], xs, acts[layer.name], self.params.get(layer.name, {}),
                Rect.full(layer.shape), need_dx,
            )
            if dparams:
                grads[layer.name] = dparams
            for src, dx in zip(layer.inputs, dxs):
                if dx is not None:
                    dacts[src] = dacts[src] + dx if src in dacts else dx
        return grads

    def _loss(self, acts):
        return float(sum(acts[loss.name].mean() for loss in self.graph.losses))

    # ---- public -----------------------------------------------------------------------------
    def gradients(self, *data):
        acts = self._forward(bind_inputs(self.graph, data, self.dtype))
        return self._backward(acts)

    def loss(self, *data) -> float:
        return self._loss(self._forward(bind_inputs(self.graph, data, self.dtype)))

    def step(self, *data) -> float:
        acts = self._forward(bind_inputs(self.graph, data, self.dtype), mode="train")
        grads = self._backward(acts)
        for name, layer_grads in grads.items():
            for key, g in layer_grads.items():
                self.params[name][key], self.velocity[name][key] = sgd_update(
                    self.params[name][key], self.velocity[name][key], g, self.lr, self.momentum, self.weight_decay
                )
        self.steps_done += 1
        return self._loss(acts)

    def predict(self, x) -> np.ndarray:
        """Logits for any number of samples (run in batches of the graph's batch size)."""
        target = logits_layer(self.graph)
        x = np.asarray(x)
        out = []
        for chunk, used in batches_for_predict(self.graph, x):
            acts = self._forward(bind_inputs(self.graph, (chunk,), self.dtype, with_labels=False), stop_at=target,
                                 mode="predict")
            out.append(acts[target][:used])
        return np.concatenate(out)

    def parameters(self):
        return {name: {k: v.copy() for k, v in p.items()} for name, p in self.params.items()}

    def buffers(self):
        """Running statistics of every batch norm: {layer: {"running_mean", "running_var"}}."""
        return {name: {"running_mean": r[0].copy(), "running_var": r[1].copy()} for name, r in self.running.items()}
