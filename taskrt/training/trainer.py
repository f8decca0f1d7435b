"""Trainer: layer-wise parallel training of a graph on a machine, under a strategy.

    trainer = Trainer(graph, strategy, machine, lr=0.05, momentum=0.9, seed=0)
    loss = trainer.step(images, labels)        # numpy in, float out
    run = trainer.submit(images, labels)       # same, without waiting: several steps may be in flight
    history = trainer.fit(dataset, epochs=3)   # a dataset (taskrt.data.datasets), read by the workers
    run = trainer.submit_from(dataset, indices)  # one step of the samples `indices`, read by the workers
    trainer.save("ckpt.npz"); Trainer.load("ckpt.npz", machine)

Parameters live on their devices between steps: each shard's master copy and the optimizer's
state (`taskrt.ops.optim`) on its server device, as the futures the last step's update returned.

Lost workers: the trainer keeps a snapshot of parameters and optimizer state on the client (every
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

Memory (`taskrt.training.memory`): `trainer.memory()` gives each device's predicted peak beside
the peaks its worker measured; a strategy predicted not to fit a device's memory raises
DeviceMemoryError before any step (`check_memory=False`: train anyway), and so does a step that
runs out of memory, the parameters staying those of the last finished step.
"""

from __future__ import annotations

import uuid
from collections import deque

import numpy as np

from taskrt.data.arrays import batches_for_predict, bind_inputs, logits_layer
from taskrt.execution.program_executor import make_executor
from taskrt.ops.optim import check_clip, optimizer_of
from taskrt.ops.precision import PRECISIONS, set_precision
from taskrt.planning.lowering import lower
from taskrt.planning.params import init_buffers, init_parameters, resolve_dtype
from taskrt.planning.peak import peak_memory
from taskrt.training.checkpoint import FORMAT as CHECKPOINT_FORMAT
from taskrt.training.checkpoint import CheckpointError, Checkpoints
from taskrt.training.elastic import LoggedStep, Snapshot
from taskrt.training.memory import MemoryUse, check_fits, memory_kills
from taskrt.training.placement import Placement
from taskrt.training.recovery import Recovery, WorkerLostWarning
from taskrt.training.snapshots import Snapshots
from taskrt.training.steps import MAX_IN_FLIGHT, StepFuture, StepStats, Submission


def zero_slots(optimizer, params: dict) -> tuple[dict, ...]:
    """The optimizer's state at the start: one {layer: {name: zeros}} per slot, in its order."""
    return tuple({name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
                 for _ in optimizer.slots)


__all__ = ["Trainer", "StepFuture", "StepStats", "Checkpoints", "CheckpointError", "CHECKPOINT_FORMAT",
           "WorkerLostWarning", "MAX_IN_FLIGHT"]


class Trainer(Submission, Recovery, Snapshots, Placement):
    """Layer-wise parallel training of a graph on a machine, under a strategy.  Its parts, one job
    each: submitting steps (`taskrt.training.steps`), recovery from lost workers
    (`taskrt.training.recovery`), snapshots and checkpoints (`taskrt.training.snapshots`), the
    state's placement on devices (`taskrt.training.placement`)."""

    def __init__(self, graph, strategy, machine, lr=None, momentum=None, weight_decay=None, dtype="float32",
                 seed=0, precision="fp32", snapshot_every="auto", checkpoints: Checkpoints | None = None,
                 fused=True, cuda_graphs=True, executor=None, replan=None, optimizer=None, clip_grad_norm=None,
                 check_memory=True):
        """`optimizer`: `taskrt.optim.SGD`, `Adam` or `AdamW` (`torch.optim`'s update rules; its
        state lives beside each parameter shard on its device); `lr`, `momentum` and
        `weight_decay` are SGD's shorthand (default: SGD at lr 0.01).  `trainer.lr` is the learning
        rate of the next step (`fit`'s `lr_schedule` sets it).  `clip_grad_norm`: clip the
        gradients to this global norm before each update, as `torch.nn.utils.clip_grad_norm_`
        (one scalar reduced across the devices per step).

        `precision` of GPU workers: strict float32 "fp32" (the default), "tf32" (tensor cores, about
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
        strategy re-mapped onto them (`taskrt.training.elastic.remap`).
        `check_memory`: raise DeviceMemoryError before any step where the strategy's predicted peak
        (`taskrt.planning.peak`) exceeds a device's memory (`Device.memory`; unknown: not checked),
        and where a strategy re-planned after a lost worker does; False trains anyway."""
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
        self.optimizer = optimizer_of(optimizer, lr, momentum, weight_decay)
        self.lr = self.optimizer.lr
        self.clip_grad_norm = check_clip(clip_grad_norm)
        self._left_out = self.optimizer.left_out(graph)  # (layer, parameter) without weight decay
        self._draws = any(getattr(layer.op, "random", False) for layer in graph)  # dropout layers
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        if executor is None:
            executor = "programs" if fused else "tasks"
        self.executor = make_executor(machine, executor, fused, cuda_graphs)
        self.executor_kind = executor
        machine.client.run(set_precision, precision)
        self._plans = {}
        self.plan = self._plan("train")
        self.check_memory = bool(check_memory)
        self._measured: dict = {}  # device -> (bytes held at most, GPU allocator bytes) of the last measured step
        self._measured_max: dict = {}  # device -> the most bytes held in any step so far
        self._worker_devices: dict = {}  # worker address -> its device on the whole machine, as steps were sent
        self._kills_seen = memory_kills(machine.client)  # a nanny's restarts over memory_limit, before this trainer
        self.batch_size = graph.losses[0].shape[0] if graph.losses else None
        self.steps_done = 0  # steps submitted
        self.updates_done = 0  # optimizer updates submitted (fewer than steps when accumulating)
        self._updates_after: dict[int, int] = {}  # step -> updates_done after it, for a roll-back
        self._last_update_step = 0  # the last step submitted that updated (see _plan_snapshot)
        self._token = uuid.uuid4().hex[:6]  # keeps keys of two trainers on one cluster apart
        self._in_flight: list[StepFuture] = []
        self._last_finished = 0.0
        self._window_wall = 0.0  # seconds per step of the window last finished (see _finished)
        self._heaps_frozen = False  # see _finished
        self._cut_at = 0  # the step whose state was last given fresh keys
        self._aux_runs = 0
        self.stats: StepStats | None = None
        # recovery: the snapshot, the steps since, snapshots under way, what happened
        self.elastic = snapshot_every is not None
        self.snapshot_every = 1 if snapshot_every in ("auto", None) else snapshot_every
        self._auto_snapshots = snapshot_every == "auto"
        self.checkpoints = checkpoints
        self.devices_in_use = list(range(machine.num_devices))  # devices of the whole machine in use
        self._check_memory()  # before anything is placed
        self._log: list[LoggedStep] = []
        self._pending: list[tuple] = []  # (step, state futures, plan, write a checkpoint)
        self._walls: deque = deque(maxlen=20)
        self.recoveries: list[dict] = []
        self.snapshots_taken = 0
        from taskrt.observing.dashboard import Publisher

        self.publisher = Publisher(self)  # the dashboard's taskrt page
        params = init_parameters(graph, seed, self.dtype)
        slots = zero_slots(self.optimizer, params)
        running = init_buffers(graph, self.dtype)
        self._place(params, slots)
        self._place_buffers(running)
        self.snapshot = Snapshot(0, params, slots, running=running)
        self._good = (0, self._state, self._buffers)  # the last finished step's state (see _roll_back)
        self._rollbacks = 0
        self._bindings: dict = {}  # (id(dataset), with labels) -> taskrt.data.datasets.Binding
        self._placed: dict = {}  # (id(dataset), field, device) -> (dataset, future of its copy there)

    @property
    def momentum(self) -> float:
        return getattr(self.optimizer, "momentum", 0.0)

    @property
    def weight_decay(self) -> float:
        return self.optimizer.weight_decay

    def _plan(self, mode):
        if mode not in self._plans:
            self._plans[mode] = lower(self.graph, self.strategy, mode, self.dtype.itemsize,
                                      clip=self.clip_grad_norm is not None)
        return self._plans[mode]

    def step(self, *data) -> float:
        """One SGD step on a batch; returns the mean loss over the batch."""
        return self.submit(*data).result()

    def fit(self, dataset, epochs: int = 1, shuffle: bool = True, seed: int = 0, last: str = "drop",
            eval_dataset=None, prefetch: int = 3, progress: bool = True, lr_schedule=None, on_epoch=None,
            steps_per_program="auto", accumulate: int = 1):
        """Train on `dataset` (taskrt.data.datasets) for `epochs` epochs of seeded shuffled batches read
        by the workers, at most `prefetch` steps in flight; returns a taskrt.training.fit.History (loss per
        step, seconds and loss per epoch, and the evaluation on `eval_dataset` after each epoch).
        `last`: "drop" or "wrap" the last partial batch of an epoch.  `steps_per_program`: steps
        each device's program runs as one Dask task ("auto": short steps several at a time).
        `accumulate`: micro-batches per update (their mean gradient, as one step on a k-times
        larger batch).  See taskrt.training.fit.fit."""
        from taskrt.training.fit import fit

        return fit(self, dataset, epochs, shuffle, seed, last, eval_dataset, prefetch, progress, lr_schedule, on_epoch,
                   steps_per_program, accumulate)

    def evaluate(self, dataset, prefetch: int = 2, steps_per_program="auto"):
        """Mean loss and accuracy over every sample of `dataset` (taskrt.training.fit.Evaluation), read by
        the workers in batches of the graph's batch size (several to a program where they are short:
        `steps_per_program`, as in `fit`)."""
        from taskrt.training.fit import evaluate

        return evaluate(self, dataset, prefetch, steps_per_program)

    def profile(self, *data, steps: int = 3, path="trace.json", png=None, cost_model=None, reference=True):
        """`steps` training steps on a batch, profiled into per-device timelines, measured beside
        `cost_model`'s simulation of the same plan (e.g. `search.CostModel(machine)`; None: no
        simulated timeline); writes them as a Chrome trace (`path`) and a
        Gantt chart of the last step (`png`, default beside the trace) and shows that step on the
        dashboard.  Returns a taskrt.observing.profile.Profile (`summary()`: per device busy and waiting).
        The steps train as any step does; later steps are not profiled.  See taskrt.observing.profile."""
        from taskrt.observing.profile import profile

        return profile(self, data, steps=steps, path=path, png=png, cost_model=cost_model, reference=reference)

    def publish(self, predicted_step_s: float | None = None) -> None:
        """Show this trainer on the dashboard's taskrt page now (it is also updated as steps
        finish, at most once a second), with `predicted_step_s` as the predicted step time."""
        if predicted_step_s is not None:
            self.publisher.predicted_s = float(predicted_step_s)
        self.publisher.publish()

    def memory(self) -> dict:
        """{device: taskrt.training.memory.MemoryUse}: a training step's predicted peak by kind
        (`taskrt.planning.peak`) beside the peak its worker measured in the last finished step and
        the most so far (`taskrt.training.memory.summary` prints them), and the device's memory."""
        out = {}
        for d, peak in self._predicted_peaks().items():
            held, allocated = self._measured.get(d, (None, None))
            out[d] = MemoryUse(peak, held, self._measured_max.get(d), allocated, self.machine.devices[d].memory)
        return out

    def _check_memory(self, replanned: bool = False) -> None:
        """DeviceMemoryError where the strategy's predicted peak exceeds a device's memory (unless
        `check_memory` is off)."""
        if self.check_memory:
            check_fits(self._predicted_peaks(), self.machine,
                       self.devices_in_use, self.graph.name, self.strategy.name, replanned)

    def _predicted_peaks(self) -> dict:
        """peak_memory of the training plan, kept while the plan is (a replay of every device's
        program: 0.1 s for ResNet-50, too long to repeat for every look at the dashboard)."""
        plan, slots, peaks = getattr(self, "_peaks", (None, None, None))
        if plan is not self.plan or slots != len(self.optimizer.slots):
            slots = len(self.optimizer.slots)
            self._peaks = (self.plan, slots, peak_memory(self.plan, self.dtype.itemsize, slots))
        return self._peaks[2]

    def _note_memory(self, run) -> None:
        """Keep the memory `run`'s programs measured (each device's last, and its most so far)."""
        for device, (held, allocated) in (run.memory or {}).items():
            self._measured[device] = (held, allocated)
            self._measured_max[device] = max(held, self._measured_max.get(device, 0))

    def predict(self, x) -> np.ndarray:
        """Logits for any number of samples, in batches of the graph's batch size."""
        logits_layer(self.graph)  # one loss layer, or a clear error before any work
        x = np.asarray(x)
        out = []
        for chunk, used in batches_for_predict(self.graph, x):
            arrays = bind_inputs(self.graph, (chunk,), self.dtype, with_labels=False)
            out.append(self.logits(self._run("predict", arrays, self._aux_tag("predict")))[:used])
        return np.concatenate(out)
