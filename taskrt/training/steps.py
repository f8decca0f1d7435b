"""Submitting steps, a part of the Trainer: one step or a window of steps (several to one program
per device), at most MAX_IN_FLIGHT in flight; waiting for them; and what a finished step leaves
(its stats, the last good state a failed read rolls back to, fresh keys every CUT_LINEAGE_EVERY
steps).  `fit` and `evaluate` (`taskrt.training.fit`) use its public methods.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, field, replace

from taskrt.data.arrays import bind_inputs
from taskrt.data.datasets import Batch, DataReadError, batch_indices, bind_dataset
from taskrt.data.reading import TileRead
from taskrt.execution.executor import StepRun, futures_of
from taskrt.execution.program_executor import MAX_WINDOW
from taskrt.machines.devices import MachineError
from taskrt.training.elastic import DeviceLost, LoggedStep
from taskrt.training.recovery import LOST_STATUSES, MAX_RECOVERIES, POLL_S
from taskrt.transport.worker_reads import TIMED_OUT

MAX_IN_FLIGHT = 4  # steps submitted and not yet finished


def applies(hyper: dict) -> bool:
    """Whether a step with these hyper-parameters updates the parameters (not a micro-batch before
    the last of an accumulation)."""
    position, count = hyper.get("accumulate", (0, 1))
    return position == count - 1
CUT_LINEAGE_EVERY = 8  # steps: a cut is three round trips to the cluster; workers keep the task states in between


@dataclass
class StepStats:
    """What the last finished step did."""

    step: int
    wall_s: float
    tasks: int
    tasks_by_phase: dict
    planned_bytes: dict  # (source device, destination device) -> bytes, from the plan
    # device -> taskrt.training.memory.MemoryUse: predicted peak, and measured in this step (where it was)
    memory: dict = field(default_factory=dict)
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
        peak = max(self.memory.items(), key=lambda item: item[1].predicted.total, default=None)
        memory = ""
        if peak:
            device, use = peak
            measured = f"{use.measured / 2**20:.1f} MiB measured, " if use.measured is not None else ""
            memory = f", most memory on device {device}: {measured}{use.predicted.total / 2**20:.1f} MiB predicted"
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
                except (OSError, TimeoutError, CancelledError) as error:  # the scheduler gone? say so
                    trainer._check_scheduler(error)
                    raise
            else:
                raise MachineError(f"step {self.run.step}: workers kept being lost ({MAX_RECOVERIES} times in a row)")
            # a loss part's value, or on a GPU device the sum of its losses (taskrt.execution.executor.loss_sum)
            total = sum(v[-1].sum() if isinstance(v, tuple) else float(v) for v in values)
            self._loss = float(total / trainer.batch_size)
            trainer.executor.finished(self.run)
            trainer._finished(self.run)
            trainer._cut_lineage(self.run)
            trainer._keep_good(self.run)
            # a finished step's future holds its loss, not its outputs: a caller keeping many
            # futures must not keep every step's parameters on the workers (the trainer keeps
            # what it needs of them)
            self.run = replace(self.run, outputs={}, reads=None, shared=None)
        return self._loss

    def done(self) -> bool:
        return self.finished or self._error is not None or all(f.done() for f in self.run.futures())

    @property
    def finished(self) -> bool:
        return self._loss is not None


class Submission:
    """The Trainer's part that submits steps and waits for them."""

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
        try:
            return self.machine.client.gather(self.executor.host_futures(run.outputs[name], devices))
        except Exception as error:  # noqa: BLE001  (looked at, then raised again)
            from distributed.client import FutureCancelledError

            # The runs ended, then a worker went with their values before they were read (its
            # devices missing, or the values cancelled as lost dependencies: restarted already)
            self._check_scheduler(error)
            missing = self._missing_devices()
            if missing or isinstance(error, FutureCancelledError):
                self._lost(missing, f"step {run.step} lost its values with a worker" + (
                    f" (device(s) {missing})" if missing else " (it died and was restarted)"), run.step)
            self._check_devices(run.step, error)
            raise

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

    def hyper(self, accumulate: tuple[int, int] | None = None) -> dict:
        """The next step's hyper-parameters: the optimizer's at the current learning rate, for the
        update it makes (or, a micro-batch `accumulate` = (i, of k), contributes to)."""
        hyper = self.optimizer.hyper(self.lr, self.updates_done + 1, self._left_out)
        if self._draws:  # dropout: every device draws the step's masks from the seed and the step's number
            hyper.update(seed=self.seed, draw=self.steps_done)
        if self.clip_grad_norm is not None:
            hyper["max_norm"] = self.clip_grad_norm
        if accumulate is not None and accumulate[1] > 1:
            hyper["accumulate"] = tuple(accumulate)
        return hyper

    def _count_step(self, accumulate) -> dict:
        """A new step number and its hyper-parameters; the update count follows where it updates."""
        self.steps_done += 1
        hyper = self.hyper(accumulate)
        if applies(hyper):
            self.updates_done += 1
        self._updates_after[self.steps_done] = self.updates_done
        return hyper

    def _aux_tag(self, what) -> str:
        self._aux_runs += 1
        return f"{self.steps_done}.{what}{self._aux_runs}"

    def _run(self, mode, data, step, hyper=None, tag=None, check=True, address=None, started=None):
        """Submit a plan; `check`: first make sure the devices and state are there (recovering
        when elastic); without, a missing device raises MachineError.  `address`: the devices'
        worker addresses, when the caller has just checked them; `started`: when it began to."""
        if started is None:  # the step's time includes checking its devices and sending its data
            started = time.perf_counter()
        if address is None:
            address = self._check_state(step) if check else self.machine.addresses()
        self._note_workers(address)
        plan = self._plan(mode)
        futures = self._reads(plan, data, address) if isinstance(data, Batch) else self.executor.scatter(
            plan, data, address)
        tag = tag or f"{step}-{self._token}"
        run = self.executor.submit(plan, step, tag, self._state, futures, hyper or self.hyper(), self._buffers,
                                   address=address)
        run.submitted, run.address = started, address
        return run

    def _note_workers(self, address: dict) -> None:
        """Remember which device each worker was, should its nanny restart it (`_check_memory_kills`)."""
        for device, worker in address.items():
            self._worker_devices[worker] = self.devices_in_use[device]

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
        self._note_workers(address)
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

        if left <= 1 or not self.runs_windows("train"):
            return 1
        if asked == "auto":
            if len(self._walls) < 3:
                return 1
            asked = auto_steps_per_program(statistics.median(self._walls))
        count = max(1, min(int(asked), left, MAX_WINDOW))
        if self.checkpoints is not None:  # end the program at the step whose checkpoint is due
            count = next((k for k in range(1, count + 1) if self.checkpoints.due(self.steps_done + k)), count)
        return count

    def runs_windows(self, mode: str) -> bool:
        """Whether steps of `mode` ("train", "predict") can run several to a program here."""
        from taskrt.execution.program_executor import windowable

        return (hasattr(self.executor, "submit_window") and not self.executor.profiling
                and windowable(self._plan(mode), self.executor.gpu_devices, self.executor.cuda_graphs))

    def predict_window(self, batches: list) -> list[StepRun]:
        """Predict runs of `batches` (taskrt.data.datasets.Batch each), all run by one program per device
        (`evaluate`); their StepRuns, in order, each read with `logits`."""
        address = self._check_state(self.steps_done)
        plan = self._plan("predict")
        steps = []
        for batch in batches:
            step = self._aux_tag("eval")
            steps.append((step, f"{step}-{self._token}", self._reads(plan, batch, address), self.hyper()))
        runs = self.executor.submit_window(plan, steps, self._state, self._buffers, address)
        for run in runs:
            run.address = address
        return runs

    def submit(self, *data) -> StepFuture:
        """Start one training step without waiting for it; returns a StepFuture."""
        return self._submit(arrays=bind_inputs(self.graph, data, self.dtype))

    def submit_from(self, dataset, indices, accumulate: tuple[int, int] | None = None) -> StepFuture:
        """Start one training step on samples `indices` of `dataset` (a taskrt.data.datasets dataset),
        without waiting for it: only the indices leave the client; each device reads its part of
        the batch itself (taskrt.data.reading).  `accumulate`: (micro-batch, of k) of an
        accumulation of gradients: only the last one updates the parameters (`fit`'s accumulate)."""
        batch = Batch(self.bind(dataset), batch_indices(dataset, indices, self.batch_size))
        return self._submit(batch=batch, accumulate=accumulate)

    def bind(self, dataset, with_labels: bool = True):
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

    def _submit(self, arrays=None, batch=None, accumulate=None) -> StepFuture:
        # At most MAX_IN_FLIGHT steps: wait for the oldest only (bounds the history Dask keeps, see
        # _cut_lineage).  Its result() waits for the steps before it, none after it; the steps
        # behind it stay in flight
        unfinished = [f for f in self._in_flight if not f.finished]
        if len(unfinished) >= MAX_IN_FLIGHT:
            unfinished[0].result()
        started = time.perf_counter()  # the step's time begins with checking its devices, as in _run
        address = self._check_state(self.steps_done + 1)  # recovers first, if a device was lost since
        hyper = self._count_step(accumulate)
        entry = LoggedStep(self.steps_done, arrays, hyper, batch)
        if self.elastic:
            self._log.append(entry)
        try:
            run = self._run_logged(entry, address=address, started=started)
        except Exception as error:
            run = self._recover_sending(error, [entry])[0]
        future = StepFuture(self, run)
        self._in_flight = [f for f in self._in_flight if not f.finished] + [future]
        if applies(hyper):  # snapshots and checkpoints hold no micro-batch's accumulated gradient
            self._plan_snapshot(run)
        return future

    def wait(self) -> None:
        """Wait for every step in flight (their errors, if any, are raised)."""
        for future in list(self._in_flight):
            future.result()

    def predict_run(self, batch) -> StepRun:
        """Start predicting `batch` (a taskrt.data.datasets.Batch, or arrays bound to the inputs):
        its StepRun, whose logits `logits(run)` reads."""
        return self._run("predict", batch, self._aux_tag("eval"))

    def submit_window(self, dataset, indices: list, lrs: list, accumulate: list | None = None) -> list[StepFuture]:
        """Start one training step per index array of `indices` (on samples of `dataset`, with the
        learning rates `lrs`, None: the trainer's), all run by one program per device
        (`steps_per_program`); their StepFutures, in order.  `accumulate`: per step, None or its
        (micro-batch, of k) in an accumulation of gradients."""
        binding = self.bind(dataset)
        while len({id(f.run.outputs.get("done")) for f in self._in_flight if not f.finished}) >= MAX_IN_FLIGHT:
            next(f for f in self._in_flight if not f.finished).result()
        started = time.perf_counter()
        address = self._check_state(self.steps_done + 1)
        entries = []
        for i, (rows, lr) in enumerate(zip(indices, lrs)):
            if lr is not None:
                self.lr = float(lr)
            hyper = self._count_step(None if accumulate is None else accumulate[i])
            entries.append(LoggedStep(self.steps_done, None, hyper,
                                      Batch(binding, batch_indices(dataset, rows, self.batch_size))))
        if self.elastic:
            self._log += entries
        try:
            runs = self._run_window(entries, address, started)
        except Exception as error:
            runs = self._recover_sending(error, entries)
        futures = [StepFuture(self, run) for run in runs]
        self._in_flight = [f for f in self._in_flight if not f.finished] + futures
        if applies(entries[-1].hyper):
            self._plan_snapshot(runs[-1])
        return futures

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
        for step in [s for s in self._updates_after if s < run.step]:
            del self._updates_after[step]

    def _roll_back(self, error: Exception):
        """A step failed on its own (its data could not be read, or a device ran out of memory): it
        and the steps after it never happened.  Their StepFutures answer `error` (their tasks
        failed with it: each reads the state of the one before), the state goes back to the last
        finished step's, and training can go on from there; nothing finished is lost.  (Not
        `Client.cancel`: cancelling a key whose dependents no client holds fails an assertion in
        the scheduler, which drops the client's connection and with it every future, the finished
        state's too.)"""
        step, state, buffers = self._good
        self._rollbacks += 1
        self.executor.abort([f.run for f in self._in_flight if not f.finished], f"a step failed: {error!r}")
        for future in self._in_flight:
            if not future.finished:
                future._error = error
        self._in_flight = [f for f in self._in_flight if f.finished]
        self._state, self._buffers, self.steps_done = state, buffers, step
        self.updates_done = self._updates_after.get(step, self.updates_done)
        self._log = [entry for entry in self._log if entry.step <= step]
        self._pending = [pending for pending in self._pending if pending[0] <= step]

    def _finished(self, run: StepRun):
        run.finished = time.perf_counter()
        self._note_memory(run)
        if self.stats is not None and self.stats.step > run.step:
            return
        # With steps in flight, a step's own time starts when the one before it finished; the
        # steps of one window (`submit_window`) share its time
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
        self.publisher.step_finished(run.step, self.stats.wall_s)
        while self._pending and self._pending[0][0] <= run.step:
            self._take_snapshot(*self._pending.pop(0))
