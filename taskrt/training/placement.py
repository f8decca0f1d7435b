"""Parameters and their placement, a part of the Trainer: each shard's state (weights and the
optimizer's slots) and each batch norm's running statistics put on their devices, and read back as full numpy
tensors (`parameters`, `buffers`, `gradients`, a predict run's `logits`).
"""

from __future__ import annotations

import uuid

import numpy as np

from taskrt.data.arrays import bind_inputs, logits_layer
from taskrt.execution.executor import StepRun
from taskrt.gpu.device import to_device
from taskrt.machines.devices import MachineError
from taskrt.ops.rect import Rect
from taskrt.planning.inprocess import buffer_tiles, shard_states
from taskrt.planning.params import unpack
from taskrt.training.elastic import DeviceLost


class Placement:
    """The Trainer's part that places state on devices and reads it back."""

    def _place(self, params, slots: tuple):
        """Put each chunk of each shard's state, (weights, *optimizer slots), on its device."""
        address = self.machine.addresses()
        self._state = {}
        for (layer, index, k), chunk in shard_states(self.plan, params, *slots).items():
            device = self.plan.shards[layer][index].chunks[k][2]
            [future] = self.machine.client.scatter([chunk], workers=[address[device]], hash=False, direct=True)
            if device in self.executor.gpu_devices:  # created once on the GPU, updated there
                future = self.machine.client.submit(to_device, future, resources={self.machine.tag(device): 1},
                                                    key=f"{layer}-state-{index}-{k}-{uuid.uuid4().hex[:8]}")
            self._state[(layer, index, k)] = future

    def _place_buffers(self, running: dict):
        """Put each channel group's running statistics (batch norm) on its device."""
        address = self.machine.addresses()
        self._buffers = {}
        for (layer, index), tile in buffer_tiles(self.plan, running).items():
            device = self.plan.buffers[layer][index].device
            [future] = self.machine.client.scatter([tile], workers=[address[device]], hash=False, direct=True)
            if device in self.executor.gpu_devices:
                future = self.machine.client.submit(to_device, future, resources={self.machine.tag(device): 1},
                                                    key=f"{layer}-running-{index}-{uuid.uuid4().hex[:8]}")
            self._buffers[(layer, index)] = future

    def _running(self, buffers=None, plan=None) -> dict:
        """Running statistics as full (2, C) numpy arrays, {layer: array} (default: the current ones)."""
        buffers, plan = self._buffers if buffers is None else buffers, plan or self.plan
        keys = list(buffers)
        futures = self.executor.host_futures([buffers[k] for k in keys],
                                             [plan.buffers[layer][index].device for layer, index in keys])
        out = {}
        for (layer, index), tile in zip(keys, self._gather(futures, self.steps_done)):
            lo, hi = plan.buffers[layer][index].channels
            out.setdefault(layer, np.zeros((2, self.graph[layer].shape[1]), dtype=self.dtype))[:, lo:hi] = tile
        return out

    def buffers(self) -> dict:
        """Running statistics of every batch norm: {layer: {"running_mean": ..., "running_var": ...}}."""
        return {layer: {"running_mean": r[0], "running_var": r[1]} for layer, r in self._running().items()}

    def _assemble(self, flats: dict, plan=None) -> dict:
        """Full parameter tensors of every layer from flat per-chunk arrays {(layer, shard, chunk): flat}."""
        out = {}
        for layer, shards in (plan or self.plan).shards.items():
            shapes = self.graph[layer].param_shapes
            full = {k: np.zeros(s, dtype=self.dtype) for k, s in shapes.items()}
            for shard in shards:
                flat = np.concatenate([np.asarray(flats[(layer, shard.index, k)]) for k in range(len(shard.chunks))])
                for name, value in unpack(flat, shard.layout).items():
                    full[name][shard.rects[name].relative_to(Rect.full(shapes[name]))] = value
            out[layer] = full
        return out

    def _states(self, state=None, plan=None) -> list:
        """The (weights, *optimizer slots) of every state chunk, as numpy, in the order of `state`
        (default: the current state)."""
        state, plan = state or self._state, plan or self.plan
        devices = [plan.shards[layer][shard].chunks[k][2] for layer, shard, k in state]
        return self._gather(self.executor.host_futures(list(state.values()), devices), self.steps_done)

    def _host_state(self, state=None, plan=None) -> tuple[dict, tuple]:
        """(parameters, optimizer slots) as full numpy tensors, fetched in one gather; the slots
        in the optimizer's order (an accumulated gradient after them is left out)."""
        state = state or self._state
        values = self._states(state, plan)
        params = self._assemble({key: v[0] for key, v in zip(state, values)}, plan)
        return params, tuple(self._assemble({key: v[i] for key, v in zip(state, values)}, plan)
                             for i in range(1, 1 + len(self.optimizer.slots)))

    def parameters(self) -> dict:
        """Current parameters as full numpy tensors: {layer: {"weight": ..., "bias": ...}}."""
        self._check_state(self.steps_done)
        return self._host_state()[0]

    def state_dict(self) -> dict:
        """{name: numpy array} under the imported module's `state_dict()` names (batch norms' running
        statistics and num_batches_tracked included): `module.load_state_dict({k: torch.from_numpy(v)
        for k, v in trainer.state_dict().items()})` takes it (strict).  See taskrt.graph.from_torch."""
        from taskrt.graph.from_torch import state_dict

        params = self.parameters()
        return state_dict(self.graph, params, self._running(), self.steps_done)

    def optimizer_state(self) -> dict:
        """The optimizer's state as full numpy tensors, under `torch.optim`'s names:
        {slot: {layer: {"weight": ..., "bias": ...}}} ("momentum_buffer" for SGD; "exp_avg" and
        "exp_avg_sq" for Adam and AdamW)."""
        self._check_state(self.steps_done)
        return dict(zip(self.optimizer.slots, self._host_state()[1]))

    def logits(self, run: StepRun) -> np.ndarray:
        """The logits a predict run computed, as one numpy array of the batch."""
        target = logits_layer(self.graph)
        shape = self.graph[target].shape
        if run.shared is None:
            tiles = self._gather(run.outputs["logits"], run.step)
        else:  # a window's logits lie in its programs' results, read from their workers (`predict_window`)
            try:
                tiles = self._collect(run, "logits")
            except DeviceLost as lost:  # as a predict run's gather reports it: nothing to recover
                raise MachineError(f"{run.step} failed: {lost.reason}") from None
        logits = np.empty(shape, dtype=self.dtype)
        for part, tile in zip(self.strategy[target].parts(shape), tiles):
            logits[part.rect.relative_to(Rect.full(shape))] = tile
        return logits

    def gradients(self, *data) -> dict:
        """Gradients of the mean loss for a batch, without updating: {layer: {"weight", "bias"}}."""
        arrays = bind_inputs(self.graph, data, self.dtype)
        run = self._run("gradients", arrays, self._aux_tag("grad"))
        grads = self._gather(list(run.outputs["grads"].values()), run.step)
        return self._assemble(dict(zip(run.outputs["grads"], grads)))
