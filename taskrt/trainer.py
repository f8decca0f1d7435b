"""Trainer: layer-wise parallel training of a graph on a machine, under a strategy.

    trainer = Trainer(graph, strategy, machine, lr=0.05, momentum=0.9, seed=0)
    loss = trainer.step(images, labels)        # numpy in, float out
    run = trainer.submit(images, labels)       # same, without waiting: several steps may be in flight
    trainer.save("ckpt.npz"); Trainer.load("ckpt.npz", machine)

Parameters live on their devices between steps: each shard's master copy and velocity on its
server device, as the futures the last step's update returned.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ops.precision import PRECISIONS, set_precision
from ops.rect import Rect
from taskrt.data import batches_for_predict, bind_inputs, logits_layer
from taskrt.device import to_device, to_host
from taskrt.executor import Executor, StepRun
from taskrt.files import write_atomic
from taskrt.graph import Graph
from taskrt.lowering import lower
from taskrt.machine import MachineError, resource_tag
from taskrt.memory import plan_memory
from taskrt.params import init_buffers, init_parameters, pack, resolve_dtype, slice_params, unpack
from taskrt.strategy import Strategy

CHECKPOINT_FORMAT = "taskrt-checkpoint/1"
MAX_IN_FLIGHT = 4  # steps submitted and not yet finished


class CheckpointError(ValueError):
    pass


@dataclass
class StepStats:
    """What the last finished step did."""

    step: int
    wall_s: float
    tasks: int
    tasks_by_phase: dict
    planned_bytes: dict  # (source device, destination device) -> bytes, from the plan
    memory: dict = field(default_factory=dict)  # device -> taskrt.memory.DeviceMemory, from the plan
    _measure: object = field(repr=False, default=None)
    _measured: dict | None = field(repr=False, default=None)

    @property
    def measured_bytes(self) -> dict:
        """Bytes per device pair from the workers' transfer logs (read on first access)."""
        if self._measured is None:
            self._measured = self._measure()
        return self._measured

    @property
    def bytes_moved(self) -> int:
        return sum(self.planned_bytes.values())

    def summary(self) -> str:
        pairs = ", ".join(f"{s}->{d}: {b:,}" for (s, d), b in sorted(self.planned_bytes.items())) or "none"
        peak = max(self.memory.items(), key=lambda item: item[1].total, default=None)
        memory = f", most memory on device {peak[0]}: {peak[1].total / 2**20:.1f} MiB" if peak else ""
        return (f"step {self.step}: {self.wall_s * 1e3:.1f} ms, {self.tasks} tasks, "
                f"{self.bytes_moved:,} bytes moved ({pairs}){memory}")


class StepFuture:
    """A submitted training step; `result()` waits and returns the loss."""

    def __init__(self, trainer, run: StepRun):
        self._trainer, self.run, self._loss = trainer, run, None

    def result(self) -> float:
        """Wait for the whole step (loss and parameter updates) and return the loss."""
        if self._loss is None:
            values = self._trainer._gather(self.run.outputs["loss"], self.run.step)
            self._trainer._wait([*self.run.outputs["state"].values(), *self.run.outputs["buffers"].values()],
                                self.run.step)
            # a loss part's value, or on a GPU device the sum of its losses (taskrt.executor.loss_sum)
            total = sum(v if isinstance(v, float) else v[-1].sum() for v in values)
            self._loss = float(total / self._trainer._batch)
            self._trainer._finished(self.run)
            self._trainer._cut_lineage(self.run)
        return self._loss

    def done(self) -> bool:
        return all(f.done() for f in self.run.futures())

    @property
    def finished(self) -> bool:
        return self._loss is not None


class Trainer:
    def __init__(self, graph, strategy, machine, lr=0.01, momentum=0.0, weight_decay=0.0, dtype="float32",
                 seed=0, precision="fp32"):
        """`precision`: float32 on GPU workers, strict "fp32" (the default) or "tf32" (tensor cores,
        about 1e-3 relative error); it is set on every worker of the machine.  CPU kernels ignore it."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
        self.graph = graph
        self.machine = machine
        self.precision = precision
        self.strategy = strategy.validated(graph, machine)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        self.executor = Executor(machine)
        machine.client.run(set_precision, precision)
        self._plans = {}
        self.plan = self._plan("train")
        self._batch = graph.losses[0].shape[0] if graph.losses else None
        self.steps_done = 0  # steps submitted
        self._token = uuid.uuid4().hex[:6]  # keeps keys of two trainers on one cluster apart
        self._in_flight: list[StepFuture] = []
        self._last_finished = 0.0
        self._aux_runs = 0
        self.stats: StepStats | None = None
        self._memory = None
        params = init_parameters(graph, seed, self.dtype)
        self._place(params, {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()})
        self._place_buffers(init_buffers(graph, self.dtype))

    # ---- plans and state --------------------------------------------------------------------
    def _plan(self, mode):
        if mode not in self._plans:
            self._plans[mode] = lower(self.graph, self.strategy, mode, self.dtype.itemsize)
        return self._plans[mode]

    def _place(self, params, velocity):
        """Put each chunk of each shard's state, (weights, velocity), on its device."""
        address = self.machine.addresses()
        self._state = {}
        for layer, shards in self.plan.shards.items():
            for shard in shards:
                w = pack(slice_params(params[layer], shard.rects))
                v = pack(slice_params(velocity[layer], shard.rects))
                for k, (lo, hi, device) in enumerate(shard.chunks):
                    [future] = self.machine.client.scatter([(w[lo:hi].copy(), v[lo:hi].copy())],
                                                           workers=[address[device]], hash=False, direct=True)
                    if device in self.executor.gpu_devices:  # created once on the GPU, updated there
                        future = self.machine.client.submit(to_device, future, resources={resource_tag(device): 1},
                                                            key=f"{layer}-state-{shard.index}-{k}-{uuid.uuid4().hex[:8]}")
                    self._state[(layer, shard.index, k)] = future

    def _place_buffers(self, running: dict):
        """Put each channel group's running statistics (batch norm) on its device."""
        address = self.machine.addresses()
        self._buffers = {}
        for layer, buffers in self.plan.buffers.items():
            for b in buffers:
                tile = running[layer][:, b.channels[0] : b.channels[1]].copy()
                [future] = self.machine.client.scatter([tile], workers=[address[b.device]], hash=False, direct=True)
                if b.device in self.executor.gpu_devices:
                    future = self.machine.client.submit(to_device, future, resources={resource_tag(b.device): 1},
                                                        key=f"{layer}-running-{b.index}-{uuid.uuid4().hex[:8]}")
                self._buffers[(layer, b.index)] = future

    def _running(self) -> dict:
        """Running statistics as full (2, C) numpy arrays, {layer: array}."""
        client, keys, futures = self.machine.client, list(self._buffers), []
        for layer, index in keys:
            future, device = self._buffers[(layer, index)], self.plan.buffers[layer][index].device
            if device in self.executor.gpu_devices:
                future = client.submit(to_host, future, resources={resource_tag(device): 1}, pure=False)
            futures.append(future)
        out = {}
        for (layer, index), tile in zip(keys, self._gather(futures, self.steps_done)):
            lo, hi = self.plan.buffers[layer][index].channels
            out.setdefault(layer, np.zeros((2, self.graph[layer].shape[1]), dtype=self.dtype))[:, lo:hi] = tile
        return out

    def buffers(self) -> dict:
        """Running statistics of every batch norm: {layer: {"running_mean": ..., "running_var": ...}}."""
        return {layer: {"running_mean": r[0], "running_var": r[1]} for layer, r in self._running().items()}

    def _assemble(self, flats: dict) -> dict:
        """Full parameter tensors of every layer from flat per-chunk arrays {(layer, shard, chunk): flat}."""
        out = {}
        for layer, shards in self.plan.shards.items():
            shapes = self.graph[layer].param_shapes
            full = {k: np.zeros(s, dtype=self.dtype) for k, s in shapes.items()}
            for shard in shards:
                flat = np.concatenate([np.asarray(flats[(layer, shard.index, k)]) for k in range(len(shard.chunks))])
                for name, value in unpack(flat, shard.layout).items():
                    full[name][shard.rects[name].relative_to(Rect.full(shapes[name]))] = value
            out[layer] = full
        return out

    def _gather(self, futures, step):
        try:
            return self.machine.client.gather(futures)
        except Exception as error:
            self._check_devices(step, error)
            raise

    def _wait(self, futures, step):
        from distributed import wait

        with self.machine.client.as_current():
            wait(futures)
        failed = [f for f in futures if f.status != "finished"]
        if failed:
            self._gather(failed, step)  # raises the task's error, or names the lost device

    def _check_devices(self, step, error):
        try:
            self.machine.addresses()
        except MachineError as lost:
            raise MachineError(
                f"step {step} failed because a device was lost ({lost}); parameters on it are gone. "
                "Restore the last checkpoint with Trainer.load(path, machine)."
            ) from error

    # ---- training ---------------------------------------------------------------------------
    def _aux_tag(self, what) -> str:
        self._aux_runs += 1
        return f"{self.steps_done}.{what}{self._aux_runs}"

    def _check_state(self, step) -> dict:
        """Fail clearly, before any work, when a device or the parameters it held are gone;
        returns the devices' current addresses."""
        lost = [key for key, f in self._state.items() if f.status in ("lost", "error", "cancelled")]
        lost_buffers = [key for key, f in self._buffers.items() if f.status in ("lost", "error", "cancelled")]
        address, missing = {}, ""
        try:
            address = self.machine.addresses()
        except MachineError as error:
            missing = f"{error}. "
        if lost_buffers and not (lost or missing):
            where = ", ".join(f"{layer!r} (device {self.plan.buffers[layer][g].device})" for layer, g in lost_buffers)
            raise MachineError(f"cannot run step {step}: the running statistics of {where} were lost with their "
                               "worker. Restore the last checkpoint with Trainer.load(path, machine).")
        if lost or missing:
            where = ", ".join(f"{layer!r} (device {self.plan.shards[layer][shard].chunks[k][2]})"
                              for layer, shard, k in lost)
            raise MachineError(
                f"cannot run step {step}: {missing}"
                + (f"The parameters of {where} were lost with their worker. " if lost else "")
                + "Restore the last checkpoint with Trainer.load(path, machine)."
            )
        return address

    def _run(self, mode, data, step):
        started = time.perf_counter()  # the step's time includes sending its data
        address = self._check_state(step)
        plan = self._plan(mode)
        futures = self.executor.scatter(plan, data, address)
        hyper = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        run = self.executor.submit(plan, step, f"{step}-{self._token}", self._state, futures, hyper, self._buffers)
        run.submitted = started
        return run

    def submit(self, *data) -> StepFuture:
        """Start one training step without waiting for it; returns a StepFuture."""
        arrays = bind_inputs(self.graph, data, self.dtype)
        if self._in_flight and len(self._in_flight) >= MAX_IN_FLIGHT:
            self._in_flight.pop(0).result()  # bounds the history Dask keeps (see _cut_lineage)
        self.steps_done += 1
        run = self._run("train", arrays, self.steps_done)
        self._state = run.outputs["state"]  # the next step reads these, wherever they are
        self._buffers = run.outputs["buffers"]
        future = StepFuture(self, run)
        self._in_flight = [f for f in self._in_flight if not f.finished] + [future]
        return future

    def step(self, *data) -> float:
        """One SGD step on a batch; returns the mean loss over the batch."""
        return self.submit(*data).result()

    def _cut_lineage(self, run: StepRun):
        """Give the current state fresh keys once its step is done (see Executor.cut_lineage)."""
        if self._state is run.outputs["state"]:
            self._state = self.executor.cut_lineage(self._state, run.tag)
        if self._buffers is run.outputs["buffers"] and self._buffers:
            self._buffers = self.executor.cut_lineage(self._buffers, f"{run.tag}.running")

    def _finished(self, run: StepRun):
        run.finished = time.perf_counter()
        if self.stats is not None and self.stats.step > run.step:
            return
        # With steps in flight, a step's own time starts when the one before it finished.
        started = max(run.submitted, self._last_finished)
        self._last_finished = run.finished
        self.stats = StepStats(
            run.step, run.finished - started, len(run.plan.tasks), run.plan.phase_counts(),
            run.plan.bytes_by_pair(), self.memory(),
            _measure=lambda keys=run.keys: self.executor.measured_bytes(keys),
        )

    def memory(self) -> dict:
        """Bytes per device of a training step, by kind (taskrt.memory): {device: DeviceMemory}."""
        if self._memory is None:
            self._memory = plan_memory(self.plan, self.dtype.itemsize)
        return self._memory

    def gradients(self, *data) -> dict:
        """Gradients of the mean loss for a batch, without updating: {layer: {"weight", "bias"}}."""
        arrays = bind_inputs(self.graph, data, self.dtype)
        run = self._run("gradients", arrays, self._aux_tag("grad"))
        grads = self._gather(list(run.outputs["grads"].values()), run.step)
        return self._assemble(dict(zip(run.outputs["grads"], grads)))

    def _states(self) -> list:
        """The current (weights, velocity) of every state chunk, as numpy, in the order of `_state`."""
        client, futures = self.machine.client, []
        for (layer, shard, k), future in self._state.items():
            device = self.plan.shards[layer][shard].chunks[k][2]
            if device in self.executor.gpu_devices:  # brought to host memory on its worker
                future = client.submit(to_host, future, resources={resource_tag(device): 1}, pure=False)
            futures.append(future)
        return self._gather(futures, self.steps_done)

    def parameters(self) -> dict:
        """Current parameters as full numpy tensors: {layer: {"weight": ..., "bias": ...}}."""
        return self._assemble({key: state[0] for key, state in zip(self._state, self._states())})

    def _velocity(self) -> dict:
        return self._assemble({key: state[1] for key, state in zip(self._state, self._states())})

    def predict(self, x) -> np.ndarray:
        """Logits for any number of samples, in batches of the graph's batch size."""
        target = logits_layer(self.graph)
        shape = self.graph[target].shape
        x = np.asarray(x)
        out = []
        for chunk, used in batches_for_predict(self.graph, x):
            arrays = bind_inputs(self.graph, (chunk,), self.dtype, with_labels=False)
            run = self._run("predict", arrays, self._aux_tag("predict"))
            tiles = self._gather(run.outputs["logits"], run.step)
            logits = np.empty(shape, dtype=self.dtype)
            for part, tile in zip(self.strategy[target].parts(shape), tiles):
                logits[part.rect.relative_to(Rect.full(shape))] = tile
            out.append(logits[:used])
        return np.concatenate(out)

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, then rename): graph, strategy,
        hyper-parameters, step count, parameters, momentum and running statistics."""
        params, velocity, running = self.parameters(), self._velocity(), self._running()
        meta = {
            "format": CHECKPOINT_FORMAT, "graph": self.graph.to_dict(), "strategy": self.strategy.to_dict(),
            "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "dtype": self.dtype.name, "seed": self.seed, "steps_done": self.steps_done, "precision": self.precision,
        }
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for layer, p in params.items():
            for k, v in p.items():
                arrays[f"param/{layer}/{k}"] = v
                arrays[f"velocity/{layer}/{k}"] = velocity[layer][k]
        for layer, r in running.items():
            arrays[f"running/{layer}"] = r
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_atomic(path, buffer.getvalue())

    @classmethod
    def load(cls, path, machine, strategy: Strategy | None = None) -> Trainer:
        """Resume from a checkpoint on `machine`, with its saved strategy or another one."""
        try:
            with np.load(Path(path), allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
        if "meta" not in arrays:
            raise CheckpointError(f"{path} is not a taskrt checkpoint (no metadata)")
        meta = json.loads(arrays["meta"].tobytes().decode())
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
        graph = Graph.from_dict(meta["graph"])
        strategy = strategy or Strategy.from_dict(meta["strategy"], source=str(path))
        trainer = cls(graph, strategy, machine, lr=meta["lr"], momentum=meta["momentum"],
                      weight_decay=meta["weight_decay"], dtype=meta["dtype"], seed=meta["seed"],
                      precision=meta.get("precision", "fp32"))
        params, velocity = {}, {}
        for key, value in arrays.items():
            kind, _, rest = key.partition("/")
            if kind in ("param", "velocity"):
                layer, name = rest.rsplit("/", 1)
                (params if kind == "param" else velocity).setdefault(layer, {})[name] = value
        trainer._place(params, velocity)
        running = {key.partition("/")[2]: value for key, value in arrays.items() if key.startswith("running/")}
        if running:
            trainer._place_buffers({**init_buffers(graph, trainer.dtype), **running})
        trainer.steps_done = meta["steps_done"]
        return trainer
