"""Timing every task of a profiled step where it runs.  Runs on workers.

A profiled step's graph (`profiled_graph`) is the step's graph with each fused run replaced by a
`ProfiledRun` and each task left unfused wrapped in `Timed`: both time each task they run and keep
(Dask key, task key, start, end) in this process (`RECORDS`), which the client takes afterwards
(`take_records`).  Normal steps keep their plain `FusedRun`s, so they pay nothing for this.

Times are this process's wall clock in nanoseconds (`time.time_ns`).  Dask stamps its own records
(task stream, transfer logs) with the wall clock plus the worker's current estimate of its offset
to the scheduler's clock (`Worker.scheduler_delay`, re-estimated at each heartbeat: on a loaded
2-core host it wandered by +-12 ms between heartbeats), so each run keeps the estimate it ran
under beside its times, and the client can put both kinds of record on one clock.
On a CPU worker each task is timed by `time.perf_counter_ns` around its call, anchored once per
run at the wall clock.  On a GPU worker kernels are queued, so host time around a call is launch
time: a CUDA event is recorded before and after each task on the stream the kernels run on, the
run synchronizes once at its end, and each task's device time is placed at its events' offsets
from the run's first event, anchored at the wall-clock time that event was recorded (the stream
is idle then: the run before synchronized at its end).  A profiled run is never replayed as a
CUDA graph (`taskrt.gpu.cuda_graphs`): a replay has no per-task events.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from operator import getitem

from taskrt.planning.fusion import FusedRun

MAX_RECORDS = 200_000  # tasks a worker remembers until the client takes them
# (Dask key, task key, start ns, end ns, the worker's scheduler_delay then in seconds)
RECORDS: deque = deque(maxlen=MAX_RECORDS)


class _HostClock:
    """Times calls on this process's clock, anchored once at the wall clock."""

    def __init__(self):
        self.wall0, self.perf0 = time.time_ns(), time.perf_counter_ns()
        self.marks = []

    def call(self, key, fn, args):
        start = time.perf_counter_ns()
        value = fn(*args)
        self.marks.append((key, start, time.perf_counter_ns()))
        return value

    def spans(self) -> list:
        shift = self.wall0 - self.perf0
        return [(key, start + shift, end + shift) for key, start, end in self.marks]


class _CudaClock:
    """Times calls by CUDA events on the current stream (where cupy's and torch's kernels go)."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.first = cupy.cuda.Event()
        self.wall0 = time.time_ns()
        self.first.record()
        self.marks = []

    def call(self, key, fn, args):
        before, after = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        before.record()
        value = fn(*args)
        after.record()
        self.marks.append((key, before, after))
        return value

    def spans(self) -> list:
        if not self.marks:
            return []
        self.marks[-1][2].synchronize()  # once per run: every event before it has happened too
        elapsed = self.cupy.cuda.get_elapsed_time

        def at(event):  # ms after the first event -> wall-clock ns
            return self.wall0 + round(elapsed(self.first, event) * 1e6)

        return [(key, at(before), at(after)) for key, before, after in self.marks]


def _clock():
    from taskrt.gpu.device import is_gpu

    return _CudaClock() if is_gpu() else _HostClock()


@dataclass(frozen=True)
class _Step:
    """A run's step that calls its callable through the run's clock."""

    key: object
    fn: object
    clock: object

    def __call__(self, *args):
        return self.clock.call(self.key, self.fn, args)


@dataclass(frozen=True)
class ProfiledRun(FusedRun):
    """A FusedRun that times each of its steps (`RECORDS`); `name` is its Dask key."""

    name: object = None

    def __call__(self, *inputs):
        return self.timed(inputs)

    def timed(self, inputs, held=None):
        """The run on `inputs`, each step timed; `held`: as `FusedRun.run`'s."""
        clock, delay = _clock(), _scheduler_delay()
        steps = tuple((key, _Step(key, fn, clock), args) for key, fn, args in self.steps)
        try:
            return FusedRun(steps, self.exports, self.after).run(inputs, held=held)
        finally:
            _keep(self.name, clock, delay)

    def __repr__(self):
        return f"ProfiledRun({len(self.steps)} tasks, {len(self.exports)} outputs)"


@dataclass(frozen=True)
class Timed:
    """A task left unfused, timed (`RECORDS`) under its Dask key `name`."""

    fn: object
    name: object

    def __call__(self, *args):
        clock, delay = _clock(), _scheduler_delay()
        try:
            return clock.call(self.name, self.fn, args)
        finally:
            _keep(self.name, clock, delay)

    def __repr__(self):
        return f"Timed({self.fn!r})"


def _keep(name, clock, delay: float) -> None:
    RECORDS.extend((name, key, start, end, delay) for key, start, end in clock.spans())


def _scheduler_delay() -> float:
    """This worker's current `scheduler_delay` (0 outside a worker): read as a task starts, as Dask
    reads it for the task's own start and stop (a heartbeat during a long task moves it by
    milliseconds, which put a task's last steps outside its Dask task in a profiled step)."""
    from distributed import get_worker

    try:
        return get_worker().scheduler_delay
    except ValueError:
        return 0.0


def profiled_graph(dsk: dict) -> dict:
    """`dsk` (a step's graph: key -> (callable, *args)) with every task timed: fused runs as
    `ProfiledRun`s (never replayed as CUDA graphs), other tasks wrapped in `Timed`.  The values a
    fused run exports (getitems, run on the worker's event loop in microseconds) stay as they are."""
    out = {}
    for key, (fn, *args) in dsk.items():
        if isinstance(fn, FusedRun):
            fn = ProfiledRun(fn.steps, fn.exports, fn.after, None, key)
        elif fn is not getitem:
            fn = Timed(fn, key)
        out[key] = (fn, *args)
    return out


def take_records(dask_worker=None) -> tuple[dict, list]:
    """(this process's clocks now: {"time": wall-clock seconds, "delay": its scheduler_delay}; the
    records kept so far, which are forgotten here).  Run with `client.run`."""
    records = []
    while RECORDS:  # one at a time: a task on the worker's thread may be adding some meanwhile
        records.append(RECORDS.popleft())
    return {"time": time.time(), "delay": getattr(dask_worker, "scheduler_delay", 0.0)}, records
