"""Recovery from lost workers, a part of the Trainer: noticing that a device lost its worker or the
values it held, re-planning on the devices left (the strategy's own `replan`, else re-mapped),
restoring the last snapshot and replaying the steps since it (`taskrt.training.elastic` keeps
them), and, when no worker is left, saying where the last checkpoint is.

Reads the trainer's machine, executor, plan, state and log; sets them anew on a recovery.
"""

from __future__ import annotations

import time
import warnings

from taskrt.data.datasets import DataReadError
from taskrt.execution.executor import StepRun, futures_of
from taskrt.execution.held import StepOutOfMemory
from taskrt.execution.program_executor import make_executor
from taskrt.machines.devices import MachineError
from taskrt.ops.precision import set_precision
from taskrt.planning.fusion import run_of
from taskrt.planning.params import init_buffers
from taskrt.training.elastic import DeviceLost, remap
from taskrt.training.memory import MEMORY_EVENTS, MIB, ran_out
from taskrt.transport.mailbox import PeerLost

POLL_S = 1.0  # while waiting for a step, how often to check that its devices are still there
NOTICE_S = 5.0  # how long a connection error sending a step may wait for the scheduler to drop the worker
RESTART_GRACE_S = 10.0  # when no worker is left, how long to wait for a nanny to restart one
MAX_RECOVERIES = 8  # losses in a row (during the recovery from the one before) before giving up
LOST_STATUSES = ("error", "cancelled", "lost")
MEMORY_EVENT_S = 0.5  # how long a lost worker waits for its nanny's word that it went over its memory_limit


class WorkerLostWarning(RuntimeWarning):
    """A worker was lost and the trainer recovered (see Trainer.recoveries)."""


class Recovery:
    """The Trainer's part that notices lost devices and recovers from them."""

    def _gather(self, futures, step):
        try:
            return self.machine.client.gather(futures)
        except StepOutOfMemory as error:
            raise self._out_of_memory(error, step, roll_back=False) from error
        except Exception as error:
            self._check_scheduler(error)
            self._check_devices(step, error)
            raise

    def _check_scheduler(self, error: Exception | None = None) -> None:
        """Raise MachineError, naming where to resume from, when the client lost its scheduler
        (the workers' state went with it: nothing to recover from on this cluster)."""
        client = self.cluster_machine.client
        if client is None:
            return
        deadline = time.monotonic() + (NOTICE_S if isinstance(error, OSError) else 0.0)
        while client.status in ("running", "newly-created"):  # a comm error may come before the client knows
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        try:
            address = client.scheduler.address
        except Exception:  # noqa: BLE001  (a client that is closing: its address is only for the message)
            address = "?"
        raise MachineError(
            f"lost the connection to the Dask scheduler at {address} (it stopped, or cannot be reached; the "
            f"client is {client.status!r}): the state on the workers is gone with it, training cannot go on "
            f"here. {self._where_to_resume()}") from error

    def _where_to_resume(self) -> str:
        """Where training can resume from: the last checkpoint on disk (the snapshot written as one
        first, when it is newer), or the snapshot in memory."""
        if self.checkpoints is None:
            return (f"No checkpoint directory was given (Trainer(checkpoints=Checkpoints(...))); the snapshot of "
                    f"step {self.snapshot.step} is still in trainer.snapshot.")
        latest = self.checkpoints.latest()
        if latest is None or int(latest.stem.split("-")[-1]) < self.snapshot.step:
            self.checkpoints.write(self.snapshot.step, self._meta(self.snapshot.step), self.snapshot.params,
                                   self._named_slots(self.snapshot.slots), self.snapshot.running)
        latest = self.checkpoints.latest()
        return (f"The last checkpoint on disk is {latest} (step {int(latest.stem.split('-')[-1])}): "
                "resume with Trainer.load(path, machine) on a new cluster.")

    def _live_devices(self) -> dict:
        """The devices in use that have a worker (`Machine.live_devices`), or MachineError when the
        scheduler is gone."""
        self._check_scheduler()
        try:
            return self.machine.live_devices()
        except OSError as error:  # distributed's CommClosedError too
            self._check_scheduler(error)
            raise

    def _missing_devices(self) -> list[int]:
        """Devices in use without a worker, by their number on the whole machine."""
        live = self._live_devices()
        return [self.devices_in_use[d.id] for d in self.machine.devices if d.id not in live]

    def _failed(self, failed, step):
        """Futures of a step failed: a lost device or lost values (DeviceLost), or the task's own error."""
        from distributed import KilledWorker

        errors = [f.exception() for f in failed if f.status == "error"]
        for error in errors:  # a device ran out of memory: not a lost worker, nothing to recover
            if isinstance(error, StepOutOfMemory):
                raise self._out_of_memory(error, step) from error
        missing = self._missing_devices()
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
        self._check_scheduler()
        self._check_memory_kills(step)
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

    def _check_state(self, step) -> dict:
        """Fail clearly, before any work, when a device or the parameters it held are gone (or,
        when elastic, recover); returns the devices' current addresses."""
        self._check_scheduler()
        for _ in range(MAX_RECOVERIES):
            lost = [key for key, f in self._state.items() if run_of(f).status in LOST_STATUSES]
            lost_buffers = [key for key, f in self._buffers.items() if run_of(f).status in LOST_STATUSES]
            address = self._live_devices()
            missing = [d.id for d in self.machine.devices if d.id not in address]
            if not lost and not lost_buffers and not missing:
                return address
            self._check_memory_kills(step)
            # named by their number on the whole machine
            missing = [self.devices_in_use[d] for d in missing]
            held = [self.plan.shards[layer][shard].chunks[k][2] for layer, shard, k in lost]
            held += [self.plan.buffers[layer][g].device for layer, g in lost_buffers]
            lost_on = sorted({self.devices_in_use[d] for d in held})
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

    def _recover_sending(self, error: Exception, entries: list) -> list[StepRun]:
        """The logged steps `entries` failed to be sent with `error`: where a device was lost
        meanwhile, recover (which replays them from the log) and return their runs; else raise."""
        self._check_scheduler(error)
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

    def _recover(self, lost: DeviceLost) -> dict:
        """Re-plan on the devices left, restore the snapshot, replay the logged steps; returns
        {step: run} of the replayed steps (in-flight StepFutures get theirs)."""
        self._check_scheduler()
        started = time.perf_counter()
        client = self.cluster_machine.client
        stale = [f for future in self._in_flight for f in future.run.futures()] + futures_of(self._state.values())
        self.executor.abort([f.run for f in self._in_flight if not f.finished], lost.reason)
        client.cancel(stale)
        self._pending = []
        before = list(self.devices_in_use)
        for attempt in range(1, MAX_RECOVERIES + 1):
            live = self._wait_for_live()
            if not live:
                self._all_lost(lost)
            try:
                self._use(live)
                self._place(self.snapshot.params, self.snapshot.slots)
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
        self.publisher.publish(measure=False)
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
        self.machine, self.devices_in_use = view, live
        self._placed = {}  # the devices are numbered anew: datasets are placed again as they are read
        self.executor = make_executor(view, self.executor_kind, self.executor.fused, self.executor.cuda_graphs)
        self.strategy = strategy.validated(self.graph, view)
        self._plans, self._measured, self._measured_max = {}, {}, {}
        self.plan = self._plan("train")
        self._check_memory(replanned=view is not whole)

    def _all_lost(self, lost: DeviceLost):
        raise MachineError(f"{lost.reason}, and no worker is left (none came back within {RESTART_GRACE_S:.0f} s): "
                           f"training cannot go on. {self._where_to_resume()}")

    # ---- out of memory -------------------------------------------------------------------------
    def _out_of_memory(self, error: StepOutOfMemory, step, roll_back: bool = True):
        """The DeviceMemoryError of a step whose program ran out of memory; with `roll_back`, that
        step and those after it never happened (`_roll_back`): the state is the last finished step's."""
        step = next((f.run.step for f in self._in_flight if f.run.tag == error.tag), step)
        cause = (f"{error.error}, with {error.held / MIB:.1f} MiB of the step's values held "
                 f"(at most {error.peak / MIB:.1f} MiB before)")
        failure = ran_out(self.devices_in_use[error.device], step, cause, self.memory().get(error.device),
                          self._good[0])
        if roll_back:
            self._roll_back(failure)
        return failure

    def _check_memory_kills(self, step) -> None:
        """Where a Dask nanny restarted one of this trainer's workers for going over its memory_limit
        (its event on the scheduler, MEMORY_EVENTS): raise DeviceMemoryError rather than recover (the
        step would run out again).  Elastic, the state of the last finished step is restored first
        (the snapshot, and the steps since replayed); otherwise it went with the worker."""
        if all(d.memory is None for d in self.cluster_machine.devices):
            return  # workers without a memory limit: no nanny restarts one for it
        client = self.cluster_machine.client
        deadline = time.monotonic() + MEMORY_EVENT_S
        while True:  # the nanny's word may come just after the worker is missed
            try:
                events = client.get_events(MEMORY_EVENTS)
            except Exception:  # noqa: BLE001  (no word from the scheduler: a lost worker as any other)
                return
            kills = [(t, event) for t, event in events if event.get("worker") in self._worker_devices
                     and (t, event.get("worker")) not in self._kills_seen]
            if kills or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not kills:
            return
        self._kills_seen.update((t, event["worker"]) for t, event in kills)
        t, event = kills[0]
        device = self._worker_devices[event["worker"]]
        cause = (f"the Dask nanny restarted its worker at {event.get('rss', 0) / MIB:.0f} MiB of process memory, "
                 "over its memory_limit")
        use = self.memory().get(self.devices_in_use.index(device)) if device in self.devices_in_use else None
        if not self.elastic:
            raise ran_out(device, step, cause, use, self._good[0], "The parameters it held are gone: restore the "
                          "last checkpoint with Trainer.load(path, machine).")
        failure = ran_out(device, step, cause, use, self._good[0])
        self._roll_back(failure)
        with warnings.catch_warnings():  # the error says what happened
            warnings.simplefilter("ignore", WorkerLostWarning)
            self._recover(DeviceLost([device], f"the worker of device {device} went over its memory_limit"))
        raise failure
