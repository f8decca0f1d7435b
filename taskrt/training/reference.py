"""The single-device network: whole tensors in one process, no partitioning, no Dask.

It is what every parallel configuration must reproduce, and the trainer `make run` starts from.
The same optimizers (`ops.optim`), clipping and accumulation as `Trainer`:

    t = SingleDeviceTrainer(g, optimizer=tr.optim.AdamW(1e-3), clip_grad_norm=1.0)
    t.accumulate(x1, y1); t.step(x2, y2)     # one update from the two micro-batches' mean gradient
"""

from __future__ import annotations

import numpy as np

from taskrt.data.arrays import batches_for_predict, bind_inputs, logits_layer
from taskrt.ops import optim
from taskrt.ops.rect import Rect
from taskrt.planning.params import init_buffers, init_parameters, resolve_dtype


class SingleDeviceTrainer:
    def __init__(self, graph, lr=None, momentum=None, weight_decay=None, dtype="float32", seed=0, optimizer=None,
                 clip_grad_norm=None):
        """`optimizer`, `lr`/`momentum`/`weight_decay` and `clip_grad_norm` as `Trainer`'s."""
        self.graph = graph
        self.optimizer = optim.optimizer_of(optimizer, lr, momentum, weight_decay)
        self.lr = self.optimizer.lr
        self.clip_grad_norm = optim.check_clip(clip_grad_norm)
        self._left_out = self.optimizer.left_out(graph)
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        self._mode = "gradients"  # of the last forward: its backward draws what it drew
        self.params = init_parameters(graph, seed, self.dtype)
        # the optimizer's state under torch.optim's names: {slot: {layer: {name: array}}}
        self.state = {slot: {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in self.params.items()}
                      for slot in self.optimizer.slots}
        self.running = init_buffers(graph, self.dtype)  # batch norm: (2, C) running mean and variance
        self.steps_done = 0
        self.updates_done = 0
        self._accumulated, self._micro_batches = None, 0  # gradients summed by `accumulate`

    @property
    def velocity(self) -> dict:
        """SGD's momentum buffer."""
        return self.state["momentum_buffer"]

    @property
    def momentum(self) -> float:
        return getattr(self.optimizer, "momentum", 0.0)

    @property
    def weight_decay(self) -> float:
        return self.optimizer.weight_decay

    # ---- the network ------------------------------------------------------------------------
    def _draw(self, mode, layer) -> dict:
        """A random op's draw (seed, step) as the Trainer gives it: a step draws its own number,
        `gradients` the last step's; nothing in prediction."""
        if mode == "predict" or not getattr(layer.op, "random", False):
            return {}
        return {"draw": (self.seed, self.steps_done + (mode == "train"))}

    def _forward(self, data, stop_at=None, mode="gradients"):
        """`mode`: "train" also updates the running statistics, "predict" normalizes with them."""
        acts = dict(data)
        self._mode = mode
        for layer in self.graph:
            if layer.is_input:
                continue
            xs = [acts[src] for src in layer.inputs]
            params = self.params.get(layer.name, {})
            if layer.name in self.running and mode == "predict":
                acts[layer.name] = layer.op.infer(xs[0], self.running[layer.name], params)
            else:
                acts[layer.name] = layer.op.forward(xs, params, Rect.full(layer.shape), **self._draw(mode, layer))
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
                Rect.full(layer.shape), need_dx, **self._draw(self._mode, layer),
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

    def accumulate(self, *data) -> float:
        """Forward and backward of a micro-batch, its gradients added to those of the micro-batches
        before it; the next `step` updates from their mean.  Returns the micro-batch's loss."""
        acts = self._forward(bind_inputs(self.graph, data, self.dtype), mode="train")
        grads = self._backward(acts)
        if self._accumulated is None:
            self._accumulated = grads
        else:
            for name, layer_grads in grads.items():
                for key, g in layer_grads.items():
                    self._accumulated[name][key] = self._accumulated[name][key] + g
        self._micro_batches += 1
        self.steps_done += 1
        return self._loss(acts)

    def step(self, *data) -> float:
        """One update: from this batch's gradients, or with the micro-batches `accumulate` summed
        before it, from the mean over all of them (clipped to `clip_grad_norm`)."""
        acts = self._forward(bind_inputs(self.graph, data, self.dtype), mode="train")
        grads = self._backward(acts)
        count = 1 + self._micro_batches
        if self._accumulated is not None:
            grads = {name: {key: self._accumulated[name][key] + g for key, g in layer_grads.items()}
                     for name, layer_grads in grads.items()}
        scale = 1.0 / count
        if self.clip_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_ on the mean gradient
            norm = float(np.sqrt(sum(float(np.sum((g * scale) ** 2)) for p in grads.values() for g in p.values())))
            scale *= min(1.0, self.clip_grad_norm / (norm + 1e-6))
        self.updates_done += 1
        hyper = self.optimizer.hyper(self.lr, self.updates_done, self._left_out)
        for name, layer_grads in grads.items():
            for key, g in layer_grads.items():
                w = self.params[name][key]
                slots = tuple(self.state[slot][name][key] for slot in self.optimizer.slots)
                decays = [(0, 0.0)] if (name, key) in self._left_out else None
                w_new, *new = optim.update(hyper, w.reshape(-1), tuple(s.reshape(-1) for s in slots),
                                           np.asarray(g).reshape(-1), decays, scale)
                self.params[name][key] = w_new.reshape(w.shape)
                for slot, value in zip(self.optimizer.slots, new):
                    self.state[slot][name][key] = value.reshape(w.shape)
        self._accumulated, self._micro_batches = None, 0
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

    def state_dict(self) -> dict:
        """{name: numpy array} under the imported module's `state_dict()` names (see Trainer.state_dict)."""
        from taskrt.graph.from_torch import state_dict

        return state_dict(self.graph, self.parameters(), {k: r.copy() for k, r in self.running.items()},
                          self.steps_done)

    def buffers(self):
        """Running statistics of every batch norm: {layer: {"running_mean", "running_var"}}."""
        return {name: {"running_mean": r[0].copy(), "running_var": r[1].copy()} for name, r in self.running.items()}
