"""Trainer: layer-wise parallel training of a graph on a machine, under a strategy.

    trainer = Trainer(graph, strategy, machine, lr=0.05, momentum=0.9, seed=0)
    loss = trainer.step(images, labels)        # numpy in, float out
    run = trainer.submit(images, labels)       # same, without waiting: several steps may be in flight
    history = trainer.fit(dataset, epochs=3)   # a dataset (taskrt.data.datasets), read by the workers
    run = trainer.submit_from(dataset, indices)  # one step of the samples `indices`, read by the workers
    trainer.save("ckpt.npz"); Trainer.load("ckpt.npz", machine)

Parameters live on their devices between steps: each shard's master copy and velocity on its
server device, as the futures the last step's update returned.

Lost workers: the trainer keeps a snapshot of parameters and momentum on the client (every
`snapshot_every` steps; by default as often as keeps its cost under 5% of the step time) and the
inputs of the steps since (of a step read from a dataset, only its sample indices).  When a
device's worker dies or its values are lost, the next `step`, `submit` or `result()` re-plans on
the devices left (with the strategy's own `replan`, which `search.optimize` gives its strategies:
search again; otherwise re-mapped, each layer keeping its split where it can), restores the
snapshot, replays the steps since it (reading a dataset's samples again) and goes on, with one
warning naming what was lost.

A step whose data cannot be read (a dataset file gone or cut short while training) raises
taskrt.data.datasets.DataReadError; it and the steps submitted after it never happen, and the
parameters stay those of the last finished step.
"""

from __future__ import annotations

import statistics
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from taskrt.data.arrays import batches_for_predict, bind_inputs, logits_layer
from taskrt.data.datasets import Batch, DataReadError, batch_indices, bind_dataset
from taskrt.data.reading import TileRead
from taskrt.execution.executor import StepRun, futures_of
from taskrt.execution.program_executor import MAX_WINDOW, make_executor
from taskrt.gpu.device import to_device
from taskrt.graph.graph import Graph
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import MachineError
from taskrt.ops.precision import PRECISIONS, set_precision
from taskrt.ops.rect import Rect
from taskrt.planning.fusion import run_of
from taskrt.planning.inprocess import buffer_tiles, shard_states
from taskrt.planning.lowering import lower
from taskrt.planning.memory import plan_memory
from taskrt.planning.params import init_buffers, init_parameters, resolve_dtype, unpack
from taskrt.training.checkpoint import FORMAT as CHECKPOINT_FORMAT
from taskrt.training.checkpoint import CheckpointError, Checkpoints, read_checkpoint, write_checkpoint
from taskrt.training.elastic import DeviceLost, LoggedStep, Snapshot, remap, snapshot_interval
from taskrt.transport.mailbox import PeerLost
from taskrt.transport.worker_reads import TIMED_OUT

MAX_IN_FLIGHT = 4  # steps submitted and not yet finished
CUT_LINEAGE_EVERY = 8  # steps: a cut is three round trips to the cluster; workers keep the task states in between
POLL_S = 1.0  # while waiting for a step, how often to check that its devices are still there
NOTICE_S = 5.0  # how long a connection error sending a step may wait for the scheduler to drop the worker
RESTART_GRACE_S = 10.0  # when no worker is left, how long to wait for a nanny to restart one
MAX_RECOVERIES = 8  # losses in a row (during the recovery from the one before) before giving up
LOST_STATUSES = ("error", "cancelled", "lost")

__all__ = ["Trainer", "StepFuture", "StepStats", "Checkpoints", "CheckpointError", "CHECKPOINT_FORMAT"]


class WorkerLostWarning(RuntimeWarning):
    """A worker was lost and the trainer recovered (see Trainer.recoveries)."""


@dataclass
class StepStats:
    """What the last finished step did."""

    step: int
    wall_s: float
    tasks: int
    tasks_by_phase: dict
    planned_bytes: dict  # (source device, destination device) -> bytes, from the plan
    memory: dict = field(default_factory=dict)  # device -> taskrt.planning.memory.DeviceMemory, from the plan
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
        self._error = None  # why the step never finished (see Trainer._roll_back)

    def result(self) -> float:
        """Wait for the step (its loss, and the runs that computed its new parameters: see
        `taskrt.planning.fusion.step_done_keys`) and return the loss.  Earlier steps finish first; a lost
        worker is recovered from (the step replayed) on the way."""
        if self._error is not None:
            raise self._error
        if self._loss is None:
            trainer = self._trainer
            for earlier in list(trainer._in_flight):
                if earlier is self:
                    break
                earlier.result()
            for _ in range(MAX_RECOVERIES):
                try:
                    values = trainer._collect(self.run)
                    break
                except DeviceLost as lost:
                    trainer._recover(lost)  # gives this future the run that replays its step
                except DataReadError as error:  # the step's data could not be read: it never happened
                    trainer._roll_back(error)
                    raise
            else:
                raise MachineError(f"step {self.run.step}: workers kept being lost ({MAX_RECOVERIES} times in a row)")
            # a loss part's value, or on a GPU device the sum of its losses (taskrt.execution.executor.loss_sum)
            total = sum(v[-1].sum() if isinstance(v, tuple) else float(v) for v in values)
            self._loss = float(total / trainer._batch)
            trainer._finished(self.run)
            trainer._cut_lineage(self.run)
            trainer._keep_good(self.run)
            # a finished step's future holds its loss, not its outputs: a caller keeping many
            # futures must not keep every step's parameters on the workers (the trainer keeps
            # what it needs of them)
            self.run = replace(self.run, outputs={})
        return self._loss

    def done(self) -> bool:
        return self.finished or self._error is not None or all(f.done() for f in self.run.futures())

    @property
    def finished(self) -> bool:
        return self._loss is not None


class Trainer:
    def __init__(self, graph, strategy, machine, lr=0.01, momentum=0.0, weight_decay=0.0, dtype="float32",
                 seed=0, precision="fp32", snapshot_every="auto", checkpoints: Checkpoints | None = None,
                 fused=True, cuda_graphs=True, executor=None, replan=None):
        """`precision` of GPU workers: strict float32 "fp32" (the default), "tf32" (tensor cores, about
        1e-3 relative error) or "bf16" (convolutions and products in bfloat16, everything else and
        the parameters float32: `ops.precision`); it is set on every worker of the machine.  CPU
        kernels ignore it.

        `snapshot_every`: steps between the snapshots a lost worker is recovered from ("auto": as
        often as keeps a snapshot's cost under 5% of the step time; None: no recovery, a lost
        worker ends the run with an error).  `checkpoints`: periodic checkpoints on disk,
        e.g. Checkpoints("ckpts", every=100, keep=3).
        `executor`: "programs" runs each step as one Dask task per device, the devices sending
        each other their values directly (`taskrt.execution.program_executor`; the default); "tasks" as a Dask
        task per plan task, or per fused run (`taskrt.execution.executor`), to watch a small run layer by
        layer in the dashboard's task stream.
        `fused` (executor "tasks"): run each device's tasks between two waits for another device as
        one Dask task (taskrt.planning.fusion; the default); False shows every layer's task in the task stream
        (and so picks executor "tasks" unless another is named).
        `cuda_graphs`: GPU workers replay each fused run as a CUDA graph once it has run twice
        (`taskrt.gpu.cuda_graphs`: one launch instead of one per kernel); False launches every kernel.
        `replan(graph, machine) -> Strategy`: the strategy for the devices left after a lost worker;
        by default the strategy's own (`Strategy.replan`: a searched one searches again), else the
        strategy re-mapped onto them (`taskrt.training.elastic.remap`)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
        if snapshot_every not in ("auto", None) and (isinstance(snapshot_every, bool) or not isinstance(
                snapshot_every, int) or snapshot_every < 1):
            raise ValueError(f"snapshot_every must be 'auto', None or a positive int (steps), got {snapshot_every!r}")
        if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
            raise ValueError(f"checkpoints must be a taskrt.Checkpoints(directory, every, keep), got {checkpoints!r}")
        self.graph = graph
        self.cluster_machine = machine  # every device; `machine` is the part of it in use
        self.machine = machine
        self.precision = precision
        self._given_strategy = strategy
        self._replan = replan if replan is not None else strategy.replan
        self.strategy = strategy.validated(graph, machine)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        if executor is None:
            executor = "programs" if fused else "tasks"
        self.executor = make_executor(machine, executor, fused, cuda_graphs)
        self.executor_kind = executor
        machine.client.run(set_precision, precision)
        self._plans = {}
        self.plan = self._plan("train")
        self._batch = graph.losses[0].shape[0] if graph.losses else None
        self.steps_done = 0  # steps submitted
        self._token = uuid.uuid4().hex[:6]  # keeps keys of two trainers on one cluster apart
        self._in_flight: list[StepFuture] = []
        self._last_finished = 0.0
        self._window_wall = 0.0  # seconds per step of the window last finished (see _finished)
        self._heaps_frozen = False  # see _finished
        self._cut_at = 0  # the step whose state was last given fresh keys
        self._aux_runs = 0
        self.stats: StepStats | None = None
        self._memory = None
        # recovery: the snapshot, the steps since, snapshots under way, what happened
        self.elastic = snapshot_every is not None
        self.snapshot_every = 1 if snapshot_every in ("auto", None) else snapshot_every
        self._auto_snapshots = snapshot_every == "auto"
        self.checkpoints = checkpoints
        self._live = list(range(machine.num_devices))  # devices of the whole machine in use
        self._log: list[LoggedStep] = []
        self._pending: list[tuple] = []  # (step, state futures, plan, write a checkpoint)
        self._walls: deque = deque(maxlen=20)
        self.recoveries: list[dict] = []
        self.snapshots_taken = 0
        from taskrt.observing.dashboard import Publisher

        self._publisher = Publisher(self)  # the dashboard's taskrt page
        params = init_parameters(graph, seed, self.dtype)
        velocity = {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
        running = init_buffers(graph, self.dtype)
        self._place(params, velocity)
        self._place_buffers(running)
        self.snapshot = Snapshot(0, params, velocity, running=running)
        self._good = (0, self._state, self._buffers)  # the last finished step's state (see _roll_back)
        self._rollbacks = 0
        self._bindings: dict = {}  # (id(dataset), with labels) -> taskrt.data.datasets.Binding
        self._placed: dict = {}  # (id(dataset), field, device) -> (dataset, future of its copy there)

    # ---- plans and state --------------------------------------------------------------------
    def _plan(self, mode):
        if mode not in self._plans:
            self._plans[mode] = lower(self.graph, self.strategy, mode, self.dtype.itemsize)
        return self._plans[mode]

    def _place(self, params, velocity):
        """Put each chunk of each shard's state, (weights, velocity), on its device."""
        address = self.machine.addresses()
        self._state = {}
        for (layer, index, k), chunk in shard_states(self.plan, params, velocity).items():
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

    def _gather(self, futures, step):
        try:
            return self.machine.client.gather(futures)
        except Exception as error:
            self._check_devices(step, error)
            raise

    def _collect(self, run: StepRun, name: str = "loss") -> list:
        """Wait for a training step (its losses and the runs that computed its new state:
        `taskrt.planning.fusion.step_done_keys`) and return the loss values (or those of output `name`, of a
        window of predict runs); raises DeviceLost when a device it runs on is lost (and the
        trainer recovers)."""
        values = self.executor.read_when_done(run, POLL_S)
        while values is TIMED_OUT:  # a long step: ask again while its devices are there and nothing failed
            if self._missing_devices() or any(f.status in LOST_STATUSES for f in run.futures()):
                break
            values = self.executor.read_when_done(run, POLL_S)
        if values is not None and values is not TIMED_OUT:
            return values
        self._await(run.outputs["done"], run.step)
        devices = [run.plan.by_key[key].device for key in run.plan.outputs[name]]
        return self._gather(self.executor.host_futures(run.outputs[name], devices), run.step)

    def _await(self, futures, step):
        """Wait for `futures`, checking every POLL_S that the devices are still there."""
        from distributed import wait

        while True:
            try:
                with self.machine.client.as_current():
                    wait(futures, timeout=POLL_S)
            except Exception:  # noqa: BLE001  (a timeout, or failed futures: looked at below)
                pass
            failed = [f for f in futures if f.status in LOST_STATUSES]
            if failed:
                self._failed(failed, step)
            if all(f.status == "finished" for f in futures):
                return
            missing = self._missing_devices()
            if missing:
                self._lost(missing, f"step {step} was running when device(s) {missing} lost their worker", step)

    def _missing_devices(self) -> list[int]:
        """Devices in use without a worker, by their number on the whole machine."""
        live = self.machine.live_devices()
        return [self._live[d.id] for d in self.machine.devices if d.id not in live]

    def _failed(self, failed, step):
        """Futures of a step failed: a lost device or lost values (DeviceLost), or the task's own error."""
        from distributed import KilledWorker

        missing = self._missing_devices()
        errors = [f.exception() for f in failed if f.status == "error"]
        # a program's peer (or the worker that held its state: taskrt.execution.program_executor) gone is a lost worker
        if missing or len(errors) < len(failed) or any(isinstance(e, (KilledWorker, PeerLost)) for e in errors):
            self._lost(missing, f"step {step} lost values its tasks need" + (
                f" with the worker(s) of device(s) {missing}" if missing else " (a worker died and was restarted)"),
                step)
        for error in errors:  # a window's read failed in its program, which aborted its peers' programs
            if isinstance(error, DataReadError):
                raise error
        self._gather(failed, step)  # raises the task's error

    def _lost(self, devices, reason, step):
        if not self.elastic:
            raise MachineError(f"step {step} failed: {reason}; parameters on it are gone. Restore the last "
                               "checkpoint with Trainer.load(path, machine).")
        raise DeviceLost(devices, reason)

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
        """Fail clearly, before any work, when a device or the parameters it held are gone (or,
        when elastic, recover); returns the devices' current addresses."""
        for _ in range(MAX_RECOVERIES):
            lost = [key for key, f in self._state.items() if run_of(f).status in LOST_STATUSES]
            lost_buffers = [key for key, f in self._buffers.items() if run_of(f).status in LOST_STATUSES]
            address = self.machine.live_devices()
            missing = [d.id for d in self.machine.devices if d.id not in address]
            if not lost and not lost_buffers and not missing:
                return address
            # named by their number on the whole machine
            missing = [self._live[d] for d in missing]
            held = [self.plan.shards[layer][shard].chunks[k][2] for layer, shard, k in lost]
            held += [self.plan.buffers[layer][g].device for layer, g in lost_buffers]
            lost_on = sorted({self._live[d] for d in held})
            if not self.elastic:
                where = ", ".join([f"{layer!r} (device {self.plan.shards[layer][shard].chunks[k][2]})"
                                   for layer, shard, k in lost]
                                  + [f"the running statistics of {layer!r} "
                                     f"(device {self.plan.buffers[layer][g].device})" for layer, g in lost_buffers])
                raise MachineError(
                    f"cannot run step {step}: "
                    + (f"device(s) {missing} have no worker: the worker was lost or is restarting. " if missing else "")
                    + (f"The parameters of {where} were lost with their worker. " if held else "")
                    + "Restore the last checkpoint with Trainer.load(path, machine)."
                )
            self._recover(DeviceLost(missing or lost_on, f"before step {step}, device(s) {missing or lost_on} "
                                     + ("had no worker" if missing else "lost the parameters they held")))
        raise MachineError(f"step {step}: workers kept being lost ({MAX_RECOVERIES} times in a row)")

    def _hyper(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def _run(self, mode, data, step, hyper=None, tag=None, check=True, address=None, started=None):
        """Submit a plan; `check`: first make sure the devices and state are there (recovering
        when elastic); without, a missing device raises MachineError.  `address`: the devices'
        worker addresses, when the caller has just checked them; `started`: when it began to."""
        if started is None:  # the step's time includes checking its devices and sending its data
            started = time.perf_counter()
        if address is None:
            address = self._check_state(step) if check else self.machine.addresses()
        plan = self._plan(mode)
        futures = self._reads(plan, data, address) if isinstance(data, Batch) else self.executor.scatter(
            plan, data, address)
        tag = tag or f"{step}-{self._token}"
        run = self.executor.submit(plan, step, tag, self._state, futures, hyper or self._hyper(), self._buffers,
                                   address=address)
        run.submitted, run.address = started, address
        return run

    def _run_logged(self, entry: LoggedStep, replay: int = 0, address=None, started=None) -> StepRun:
        """Submit a logged training step; its new state becomes the current state.  (The caller
        checked the devices: a check here could recover, and the recovery replays the log.)"""
        data = entry.arrays if entry.batch is None else entry.batch
        run = self._run("train", data, entry.step, entry.hyper, self._tag(entry, replay), check=False,
                        address=address, started=started)
        self._state = run.outputs["state"]  # the next step reads these, wherever they are
        self._buffers = run.outputs["buffers"]
        return run

    def _tag(self, entry: LoggedStep, replay: int = 0) -> str:
        # replays need new keys, and so do steps numbered again after a roll-back (_roll_back)
        return f"{entry.step}-{self._token}" + (f"-b{self._rollbacks}" if self._rollbacks else "") + (
            f"-r{replay}" if replay else "")

    def _run_window(self, entries: list, address: dict, started: float) -> list[StepRun]:
        """Submit logged steps read from a dataset as one program per device running them all
        (`ProgramExecutor.submit_window`); the last one's new state becomes the current state."""
        plan = self._plan("train")
        steps = [(e.step, self._tag(e), self._reads(plan, e.batch, address), e.hyper) for e in entries]
        runs = self.executor.submit_window(plan, steps, self._state, self._buffers, address)
        for run in runs:
            run.submitted, run.address = started, address
        self._state, self._buffers = runs[-1].outputs["state"], runs[-1].outputs["buffers"]
        return runs

    def steps_per_program(self, left: int, asked="auto") -> int:
        """How many of the next `left` steps read from a dataset one program per device runs
        (`fit`): each program is one Dask task per device, so a short step pays the scheduler,
        the worker's task handling and the client's bookkeeping once per program, not per step.
        `asked`: "auto" (`program_executor.auto_steps_per_program` of the recent steps' median,
        once three have been timed) or an int.  Always one with executor "tasks", while profiling, or
        where a device reads state another computes; a program never runs past a checkpoint
        that is due."""
        from taskrt.execution.program_executor import auto_steps_per_program

        if left <= 1 or not self._windows("train"):
            return 1
        if asked == "auto":
            if len(self._walls) < 3:
                return 1
            asked = auto_steps_per_program(statistics.median(self._walls))
        count = max(1, min(int(asked), left, MAX_WINDOW))
        if self.checkpoints is not None:  # end the program at the step whose checkpoint is due
            count = next((k for k in range(1, count + 1) if self.checkpoints.due(self.steps_done + k)), count)
        return count

    def _windows(self, mode: str) -> bool:
        """Whether steps of `mode` ("train", "predict") can run several to a program here."""
        from taskrt.execution.program_executor import windowable

        return (hasattr(self.executor, "submit_window") and not self.executor.profiling
                and windowable(self._plan(mode), self.executor.gpu_devices, self.executor.cuda_graphs))

    def _predict_window(self, batches: list) -> list[StepRun]:
        """Predict runs of `batches` (taskrt.data.datasets.Batch each), all run by one program per device
        (`evaluate`); their StepRuns, in order, each read with `_logits`."""
        address = self._check_state(self.steps_done)
        plan = self._plan("predict")
        steps = []
        for batch in batches:
            step = self._aux_tag("eval")
            steps.append((step, f"{step}-{self._token}", self._reads(plan, batch, address), self._hyper()))
        runs = self.executor.submit_window(plan, steps, self._state, self._buffers, address)
        for run in runs:
            run.address = address
        return runs

    def submit(self, *data) -> StepFuture:
        """Start one training step without waiting for it; returns a StepFuture."""
        return self._submit(arrays=bind_inputs(self.graph, data, self.dtype))

    def submit_from(self, dataset, indices) -> StepFuture:
        """Start one training step on samples `indices` of `dataset` (a taskrt.data.datasets dataset),
        without waiting for it: only the indices leave the client; each device reads its part of
        the batch itself (taskrt.data.reading)."""
        batch = Batch(self._bind(dataset), batch_indices(dataset, indices, self._batch))
        return self._submit(batch=batch)

    def fit(self, dataset, epochs: int = 1, shuffle: bool = True, seed: int = 0, last: str = "drop",
            eval_dataset=None, prefetch: int = 3, progress: bool = True, lr_schedule=None, on_epoch=None,
            steps_per_program="auto"):
        """Train on `dataset` (taskrt.data.datasets) for `epochs` epochs of seeded shuffled batches read
        by the workers, at most `prefetch` steps in flight; returns a taskrt.training.fit.History (loss per
        step, seconds and loss per epoch, and the evaluation on `eval_dataset` after each epoch).
        `last`: "drop" or "wrap" the last partial batch of an epoch.  `steps_per_program`: steps
        each device's program runs as one Dask task ("auto": short steps several at a time).
        See taskrt.training.fit.fit."""
        from taskrt.training.fit import fit

        return fit(self, dataset, epochs, shuffle, seed, last, eval_dataset, prefetch, progress, lr_schedule, on_epoch,
                   steps_per_program)

    def evaluate(self, dataset, prefetch: int = 2, steps_per_program="auto"):
        """Mean loss and accuracy over every sample of `dataset` (taskrt.training.fit.Evaluation), read by
        the workers in batches of the graph's batch size (several to a program where they are short:
        `steps_per_program`, as in `fit`)."""
        from taskrt.training.fit import evaluate

        return evaluate(self, dataset, prefetch, steps_per_program)

    def _bind(self, dataset, with_labels: bool = True):
        """`dataset` checked against the graph once (taskrt.data.datasets.bind_dataset)."""
        binding = self._bindings.get((id(dataset), with_labels))
        if binding is None or binding.dataset is not dataset:
            binding = bind_dataset(self.graph, dataset, self.dtype, with_labels)
            self._bindings[(id(dataset), with_labels)] = binding
        return binding

    def _reads(self, plan, batch: Batch, address: dict) -> dict:
        """{(input layer, part): TileRead} of a step read from a dataset: each part reads its Rect."""
        dataset = batch.binding.dataset
        reads = {}
        for layer, name, dtype in batch.binding.fields:
            for part in plan.data.get(layer, ()):
                source = self._placed_copy(dataset, name, dtype, part.device, address) if dataset.placed else dataset
                reads[(layer, part.index)] = TileRead(source, name, batch.indices, part.rect, dtype, layer)
        return reads

    def _placed_copy(self, dataset, field: str, dtype: str, device: int, address: dict):
        """The future of `field` of `dataset` on `device`: sent once (per trainer and machine view)."""
        key = (id(dataset), field, device)
        held = self._placed.get(key)
        if held is None or held[0] is not dataset or held[1].status in LOST_STATUSES:
            [future] = self.machine.client.scatter([dataset.array(field, dtype)], workers=[address[device]],
                                                   hash=False, direct=True)
            self._placed[key] = held = (dataset, future)
        return held[1]

    def _submit(self, arrays=None, batch=None) -> StepFuture:
        if self._in_flight and len(self._in_flight) >= MAX_IN_FLIGHT:
            self._in_flight.pop(0).result()  # bounds the history Dask keeps (see _cut_lineage)
        started = time.perf_counter()  # the step's time begins with checking its devices, as in _run
        address = self._check_state(self.steps_done + 1)  # recovers first, if a device was lost since
        self.steps_done += 1
        entry = LoggedStep(self.steps_done, arrays, self._hyper(), batch)
        if self.elastic:
            self._log.append(entry)
        try:
            run = self._run_logged(entry, address=address, started=started)
        except Exception as error:
            run = self._recover_sending(error, [entry])[0]
        future = StepFuture(self, run)
        self._in_flight = [f for f in self._in_flight if not f.finished] + [future]
        self._plan_snapshot(run)
        return future

    def _recover_sending(self, error: Exception, entries: list) -> list[StepRun]:
        """The logged steps `entries` failed to be sent with `error`: where a device was lost
        meanwhile, recover (which replays them from the log) and return their runs; else raise."""
        if not self.elastic:
            raise error
        missing = self._missing_devices()
        deadline = time.monotonic() + NOTICE_S
        while not missing and isinstance(error, OSError) and time.monotonic() < deadline:
            time.sleep(0.05)  # a closed connection to a worker the scheduler has yet to drop
            missing = self._missing_devices()
        if not missing:
            raise error
        what = (f"step {entries[0].step} was" if len(entries) == 1 else
                f"steps {entries[0].step}..{entries[-1].step} were")
        replayed = self._recover(DeviceLost(missing, f"{what} being sent"))
        return [replayed[e.step] for e in entries]

    def _submit_window(self, dataset, indices: list, lrs: list) -> list[StepFuture]:
        """Start one training step per index array of `indices` (on samples of `dataset`, with the
        learning rates `lrs`, None: the trainer's), all run by one program per device
        (`steps_per_program`); their StepFutures, in order."""
        binding = self._bind(dataset)
        while len({id(f.run.outputs.get("done")) for f in self._in_flight if not f.finished}) >= MAX_IN_FLIGHT:
            next(f for f in self._in_flight if not f.finished).result()
        started = time.perf_counter()
        address = self._check_state(self.steps_done + 1)
        entries = []
        for rows, lr in zip(indices, lrs):
            if lr is not None:
                self.lr = float(lr)
            self.steps_done += 1
            entries.append(LoggedStep(self.steps_done, None, self._hyper(),
                                      Batch(binding, batch_indices(dataset, rows, self._batch))))
        if self.elastic:
            self._log += entries
        try:
            runs = self._run_window(entries, address, started)
        except Exception as error:
            runs = self._recover_sending(error, entries)
        futures = [StepFuture(self, run) for run in runs]
        self._in_flight = [f for f in self._in_flight if not f.finished] + futures
        self._plan_snapshot(runs[-1])
        return futures

    def step(self, *data) -> float:
        """One SGD step on a batch; returns the mean loss over the batch."""
        return self.submit(*data).result()

    def profile(self, *data, steps: int = 3, path="trace.json", png=None, cost_model=None, reference=True):
        """`steps` training steps on a batch, profiled into per-device timelines, measured beside
        `cost_model`'s simulation of the same plan (e.g. `search.CostModel(machine)`; None: no
        simulated timeline); writes them as a Chrome trace (`path`) and a
        Gantt chart of the last step (`png`, default beside the trace) and shows that step on the
        dashboard.  Returns a taskrt.observing.profile.Profile (`summary()`: per device busy and waiting).
        The steps train as any step does; later steps are not profiled.  See taskrt.observing.profile."""
        from taskrt.observing.profile import profile

        return profile(self, data, steps=steps, path=path, png=png, cost_model=cost_model, reference=reference)

    def _cut_lineage(self, run: StepRun):
        """Every CUT_LINEAGE_EVERY steps, give the current state fresh keys once its step is done
        (see Executor.cut_lineage)."""
        if run.step - self._cut_at < CUT_LINEAGE_EVERY or run.position < run.window - 1:
            return
        self._cut_at = run.step
        # The step was done when the runs that computed its state ended; the tasks naming each
        # value come right after, and re-registering a value needs it named
        self._await(futures_of([*run.outputs["state"].values(), *run.outputs["buffers"].values()]), run.step)
        if self._state is run.outputs["state"]:
            self._state = self.executor.cut_lineage(self._state, run.tag)
        if self._buffers is run.outputs["buffers"] and self._buffers:
            self._buffers = self.executor.cut_lineage(self._buffers, f"{run.tag}.running")

    def _keep_good(self, run: StepRun):
        """Remember the state step `run.step` computed, the last finished step's (see _roll_back).
        (A step inside a window has no state of its own: its window's last step comes with it.)"""
        if run.step <= self._good[0] or run.position < run.window - 1:
            return
        if self.steps_done == run.step:  # the current state, perhaps under fresh keys (_cut_lineage)
            self._good = (run.step, self._state, self._buffers)
        else:
            self._good = (run.step, run.outputs["state"], run.outputs["buffers"])

    def _roll_back(self, error: Exception):
        """A step failed on its own (its data could not be read): it and the steps after it never
        happened.  Their StepFutures answer `error` (their tasks failed with it: each reads the
        state of the one before), the state goes back to the last finished step's, and training
        can go on from there; nothing finished is lost.  (Not `Client.cancel`: cancelling a key
        whose dependents no client holds fails an assertion in the scheduler, which drops the
        client's connection and with it every future, the finished state's too.)"""
        step, state, buffers = self._good
        self._rollbacks += 1
        self.executor.abort([f.run for f in self._in_flight if not f.finished], f"a step failed: {error!r}")
        for future in self._in_flight:
            if not future.finished:
                future._error = error
        self._in_flight = [f for f in self._in_flight if f.finished]
        self._state, self._buffers, self.steps_done = state, buffers, step
        self._log = [entry for entry in self._log if entry.step <= step]
        self._pending = [pending for pending in self._pending if pending[0] <= step]

    def _finished(self, run: StepRun):
        run.finished = time.perf_counter()
        if self.stats is not None and self.stats.step > run.step:
            return
        # With steps in flight, a step's own time starts when the one before it finished; the
        # steps of one window (`_submit_window`) share its time
        if run.position == 0:
            self._window_wall = (run.finished - max(run.submitted, self._last_finished)) / run.window
        self._last_finished = run.finished
        self.stats = StepStats(
            run.step, self._window_wall, len(run.plan.tasks), run.plan.phase_counts(),
            run.plan.bytes_by_pair(), self.memory(),
            _measure=lambda keys=run.keys, executor=self.executor: executor.measured_bytes(keys),
        )
        self._walls.append(self.stats.wall_s)
        self._snapshot_interval()  # the steps' time settles after the first, slow ones: the interval follows
        if not self._heaps_frozen:  # once, after the first step (outside its time): taskrt.machines.worker_setup
            self._heaps_frozen = True
            self.machine.freeze_worker_heaps()
        self._publisher.step_finished(run.step, self.stats.wall_s)
        while self._pending and self._pending[0][0] <= run.step:
            self._take_snapshot(*self._pending.pop(0))

    def publish(self, predicted_step_s: float | None = None) -> None:
        """Show this trainer on the dashboard's taskrt page now (it is also updated as steps
        finish, at most once a second), with `predicted_step_s` as the predicted step time."""
        if predicted_step_s is not None:
            self._publisher.predicted_s = float(predicted_step_s)
        self._publisher.publish()

    def memory(self) -> dict:
        """Bytes per device of a training step, by kind (taskrt.planning.memory): {device: DeviceMemory}."""
        if self._memory is None:
            self._memory = plan_memory(self.plan, self.dtype.itemsize)
        return self._memory

    def gradients(self, *data) -> dict:
        """Gradients of the mean loss for a batch, without updating: {layer: {"weight", "bias"}}."""
        arrays = bind_inputs(self.graph, data, self.dtype)
        run = self._run("gradients", arrays, self._aux_tag("grad"))
        grads = self._gather(list(run.outputs["grads"].values()), run.step)
        return self._assemble(dict(zip(run.outputs["grads"], grads)))

    def _states(self, state=None, plan=None) -> list:
        """The (weights, velocity) of every state chunk, as numpy, in the order of `state`
        (default: the current state)."""
        state, plan = state or self._state, plan or self.plan
        devices = [plan.shards[layer][shard].chunks[k][2] for layer, shard, k in state]
        return self._gather(self.executor.host_futures(list(state.values()), devices), self.steps_done)

    def _host_state(self, state=None, plan=None) -> tuple[dict, dict]:
        """(parameters, velocity) as full numpy tensors, fetched in one gather."""
        state = state or self._state
        values = self._states(state, plan)
        return (self._assemble({key: v[0] for key, v in zip(state, values)}, plan),
                self._assemble({key: v[1] for key, v in zip(state, values)}, plan))

    def parameters(self) -> dict:
        """Current parameters as full numpy tensors: {layer: {"weight": ..., "bias": ...}}."""
        self._check_state(self.steps_done)
        return self._host_state()[0]

    def _velocity(self) -> dict:
        return self._host_state()[1]

    def predict(self, x) -> np.ndarray:
        """Logits for any number of samples, in batches of the graph's batch size."""
        logits_layer(self.graph)  # one loss layer, or a clear error before any work
        x = np.asarray(x)
        out = []
        for chunk, used in batches_for_predict(self.graph, x):
            arrays = bind_inputs(self.graph, (chunk,), self.dtype, with_labels=False)
            out.append(self._logits(self._run("predict", arrays, self._aux_tag("predict")))[:used])
        return np.concatenate(out)

    def _logits(self, run: StepRun) -> np.ndarray:
        """The logits a predict run computed, as one numpy array of the batch."""
        target = logits_layer(self.graph)
        shape = self.graph[target].shape
        if run.shared is None:
            tiles = self._gather(run.outputs["logits"], run.step)
        else:  # a window's logits lie in its programs' results, read from their workers (`_predict_window`)
            try:
                tiles = self._collect(run, "logits")
            except DeviceLost as lost:  # as a predict run's gather reports it: nothing to recover
                raise MachineError(f"{run.step} failed: {lost.reason}") from None
        logits = np.empty(shape, dtype=self.dtype)
        for part, tile in zip(self.strategy[target].parts(shape), tiles):
            logits[part.rect.relative_to(Rect.full(shape))] = tile
        return logits

    # ---- snapshots and recovery -------------------------------------------------------------
    def _plan_snapshot(self, run: StepRun):
        """Mark step `run.step`'s state for a snapshot (taken when the step finishes) when one is
        due, or a periodic checkpoint."""
        checkpoint = self.checkpoints is not None and self.checkpoints.due(run.step)
        planned = self._pending[-1][0] if self._pending else self.snapshot.step
        if checkpoint or (self.elastic and run.step - planned >= self.snapshot_every):
            self._pending.append((run.step, dict(run.outputs["state"]), run.plan, checkpoint,
                                  dict(run.outputs["buffers"])))

    def _snapshot_interval(self):
        """With automatic snapshots, the interval that keeps their cost at the target share of the
        steps' recent time (`taskrt.training.elastic.snapshot_interval`)."""
        if self._auto_snapshots and self._walls and self.snapshot.seconds:
            logs_arrays = not self._log or self._log[-1].batch is None
            self.snapshot_every = snapshot_interval(self.snapshot.seconds, statistics.median(self._walls),
                                                    logs_arrays=logs_arrays)

    def _take_snapshot(self, step, state, plan, checkpoint, buffers):
        started = time.perf_counter()
        params, velocity = self._host_state(state, plan)
        running = self._running(buffers, plan)
        seconds = time.perf_counter() - started
        self.snapshot = Snapshot(step, params, velocity, seconds, running)
        self._log = [entry for entry in self._log if entry.step > step]
        self.snapshots_taken += 1
        self._snapshot_interval()
        if checkpoint:
            self.checkpoints.write(step, self._meta(step), params, velocity, running)

    def _recover(self, lost: DeviceLost) -> dict:
        """Re-plan on the devices left, restore the snapshot, replay the logged steps; returns
        {step: run} of the replayed steps (in-flight StepFutures get theirs)."""
        started = time.perf_counter()
        client = self.cluster_machine.client
        stale = [f for future in self._in_flight for f in future.run.futures()] + futures_of(self._state.values())
        self.executor.abort([f.run for f in self._in_flight if not f.finished], lost.reason)
        client.cancel(stale)
        self._pending = []
        before = list(self._live)
        for attempt in range(1, MAX_RECOVERIES + 1):
            live = self._wait_for_live()
            if not live:
                self._all_lost(lost)
            try:
                self._use(live)
                self._place(self.snapshot.params, self.snapshot.velocity)
                self._place_buffers({**init_buffers(self.graph, self.dtype), **(self.snapshot.running or {})})
                restored = (self.snapshot.step, self._state, self._buffers)
                runs = {entry.step: self._run_logged(entry, replay=len(self.recoveries) * MAX_RECOVERIES + attempt)
                        for entry in self._log}
                break
            except Exception:
                if sorted(self.cluster_machine.live_devices()) == live:
                    raise  # not a lost device: a real error
        else:
            raise MachineError(f"workers kept being lost ({MAX_RECOVERIES} times in a row) while recovering")
        unfinished = {future.run.step for future in self._in_flight if not future.finished}
        for future in self._in_flight:
            if not future.finished and future.run.step in runs:
                future.run = runs[future.run.step]
        # the last step already finished before the loss is the one a failed read rolls back to
        finished = [step for step in runs if step not in unfinished]
        self._good = restored if not finished else (
            max(finished), runs[max(finished)].outputs["state"], runs[max(finished)].outputs["buffers"])
        gone = sorted(set(before) - set(live))
        record = {
            "at_step": self.steps_done, "reason": lost.reason, "lost_devices": gone,
            "devices": live, "strategy": self.strategy.name, "snapshot_step": self.snapshot.step,
            "replayed": sorted(runs), "seconds": time.perf_counter() - started,
        }
        self.recoveries.append(record)
        self._publisher.publish(measure=False)
        replayed = f"steps {record['replayed'][0]}..{record['replayed'][-1]}" if runs else "no steps"
        warnings.warn(
            f"{lost.reason}; " + (f"lost device(s) {gone} of {self.cluster_machine!r}; " if gone else "")
            + f"re-planned on device(s) {live} ({self.strategy.name or 'strategy'}), restored the snapshot of "
            f"step {self.snapshot.step} and replayed {replayed}", WorkerLostWarning, stacklevel=3)
        return runs

    def _wait_for_live(self) -> list[int]:
        """The devices of the whole machine with a worker now; when none, waits RESTART_GRACE_S
        for a nanny to bring one back."""
        deadline = time.monotonic() + RESTART_GRACE_S
        while True:
            live = sorted(self.cluster_machine.live_devices())
            if live or time.monotonic() > deadline:
                return live
            time.sleep(0.2)

    def _use(self, live: list[int]):
        """Train on the devices `live` of the whole machine, under a strategy for them."""
        whole = self.cluster_machine
        view = whole if len(live) == whole.num_devices else whole.subset(live)
        if view is whole:
            strategy = self._given_strategy
        elif self._replan is not None:  # e.g. a searched strategy: search again for the smaller machine
            strategy = self._replan(self.graph, view)
        else:
            strategy = remap(self._given_strategy.validated(self.graph, whole), live)
        view.client.run(set_precision, self.precision)  # restarted workers start with the default
        self.machine, self._live = view, live
        self._placed = {}  # the devices are numbered anew: datasets are placed again as they are read
        self.executor = make_executor(view, self.executor_kind, self.executor.fused, self.executor.cuda_graphs)
        self.strategy = strategy.validated(self.graph, view)
        self._plans, self._memory = {}, None
        self.plan = self._plan("train")

    def _all_lost(self, lost: DeviceLost):
        where = ""
        if self.checkpoints is not None:
            latest = self.checkpoints.latest()
            if latest is None or int(latest.stem.split("-")[-1]) < self.snapshot.step:
                self.checkpoints.write(self.snapshot.step, self._meta(self.snapshot.step), self.snapshot.params,
                                       self.snapshot.velocity, self.snapshot.running)
            latest = self.checkpoints.latest()
            where = (f"The last checkpoint on disk is {latest} (step {int(latest.stem.split('-')[-1])}): "
                     "resume with Trainer.load(path, machine) on a new cluster.")
        else:
            where = (f"No checkpoint directory was given (Trainer(checkpoints=Checkpoints(...))); the snapshot of "
                     f"step {self.snapshot.step} is still in trainer.snapshot.")
        raise MachineError(f"{lost.reason}, and no worker is left (none came back within {RESTART_GRACE_S:.0f} s): "
                           f"training cannot go on. {where}")

    # ---- checkpoints ------------------------------------------------------------------------
    def _meta(self, steps_done: int) -> dict:
        return {
            "graph": self.graph.to_dict(), "strategy": self._given_strategy.validated(
                self.graph, self.cluster_machine).to_dict(),
            "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "dtype": self.dtype.name, "seed": self.seed, "steps_done": steps_done, "precision": self.precision,
        }

    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, fsync, rename): graph, strategy,
        hyper-parameters, step count, parameters and momentum, and a digest of every array."""
        for future in list(self._in_flight):
            future.result()
        params, velocity = self._host_state()
        write_checkpoint(path, self._meta(self.steps_done), params, velocity, self._running())

    @classmethod
    def load(cls, path, machine, strategy: Strategy | None = None, graph: Graph | None = None, **options) -> Trainer:
        """Resume from a checkpoint on `machine`, with its saved strategy or another one.  With
        `graph`, the checkpoint must be for that graph (CheckpointError names the difference).
        `options`: the Trainer's snapshot_every, checkpoints and replan (a saved strategy has no
        `replan`: without one, it is re-mapped after a lost worker)."""
        meta, params, velocity = read_checkpoint(path, graph)
        graph = Graph.from_dict(meta["graph"])
        strategy = strategy or Strategy.from_dict(meta["strategy"], source=str(path))
        trainer = cls(graph, strategy, machine, lr=meta["lr"], momentum=meta["momentum"],
                      weight_decay=meta["weight_decay"], dtype=meta["dtype"], seed=meta["seed"],
                      precision=meta.get("precision", "fp32"), **options)
        for layer, shapes in ((l.name, l.param_shapes) for l in graph if l.param_shapes):
            for name, shape in shapes.items():
                found = params.get(layer, {}).get(name)
                if found is None or found.shape != tuple(shape):
                    raise CheckpointError(f"{path}: parameter {layer}.{name} has shape "
                                          f"{None if found is None else found.shape}, the graph needs {tuple(shape)}")
        trainer._place(params, velocity)
        running = {**init_buffers(graph, trainer.dtype), **meta["running"]}
        trainer._place_buffers(running)
        trainer.steps_done = meta["steps_done"]
        trainer.snapshot = Snapshot(trainer.steps_done, params, velocity, running=running)
        return trainer
