"""What every worker process does once, and Python's garbage collector kept off long-lived objects.

Python's full (oldest-generation) collections walk every object a process holds: a worker holds
about 170,000 after importing numpy, Dask and the kernels, the local scheduler's process about
190,000, and each full collection paused them for 100-230 ms, a few times every hundred steps (LeNet-5 data
parallel on local(2): steps of 55 ms with spikes of 150-270 ms).  Objects that live as long as the
process (modules, compiled kernels) are moved out of the collector's reach with
`gc.freeze` once they exist: the pauses fall to 5-10 ms on workers, about 35 ms on the scheduler.
Frozen objects are still freed when their reference counts fall to zero, but never as cyclic
garbage, so the scheduler's process (with Machine.local, the client's) is frozen once, before any
trainer exists: a dropped trainer, in reference cycles with its dashboard publisher, stays
collectable.
"""

from __future__ import annotations

import gc
from collections import deque
from concurrent.futures import Executor, Future

from distributed import WorkerPlugin

TRANSFER_LOG_LENGTH = 10_000  # incoming transfers a worker remembers: the bytes of recent steps
INLINE = "taskrt-inline"  # the worker executor (Dask's `executor` annotation) of tasks run where they are sent


class InlineExecutor(Executor):
    """Runs each task at once, on the worker's event loop: for tasks that take microseconds (a
    fused run's exports, `taskrt.planning.fusion`), where the hand-off to the worker's thread and back
    costs more than the task.  On Machine.local(1) a LeNet-5 step, with six exports, took about
    1 ms less (25.8 against 27.0 ms, A/B in one process, 30 rounds)."""

    def submit(self, fn, /, *args, **kwargs):
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001  (the worker reports the task's error as usual)
            future.set_exception(error)
        return future


FREEZES = [0]  # freeze_heap calls in this process (the frozen count alone can fall: frozen objects still die)


def freeze_heap(dask_worker=None, dask_scheduler=None) -> int:
    """Collect garbage once, then freeze what is left (this process's long-lived objects);
    returns how many objects are frozen.  Run on workers and the scheduler."""
    gc.collect()
    gc.freeze()
    FREEZES[0] += 1
    return gc.get_freeze_count()


KEEP_FREE_SHARE = 4  # a worker keeps free for reuse up to 1/KEEP_FREE_SHARE of its memory limit
KEEP_HEAP_SHARE = 8  # and glibc's free heap up to 1/KEEP_HEAP_SHARE of it (Machine.local's MALLOC_TRIM_THRESHOLD_)


def keep_free_memory(worker) -> None:
    """Let `ops.reuse` keep up to a quarter of the worker's memory limit free.
    With steps sent ahead, the parameters of several steps live at once and die in bursts: on
    local(2), data parallel VGG-16-32's parameter server freed more than 1 GiB within a step, and
    each step after made 2-3 large arrays in new memory again (5,000-10,000 page faults and 30 ms
    of system time a step).  Dask's worker pauses at 80% of its limit: a quarter stays clear."""
    from taskrt.ops import reuse

    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    if limit:
        reuse.keep_at_most(limit // KEEP_FREE_SHARE)


class WorkerSetup(WorkerPlugin):
    """Worker plugin (workers that join later get it too): loads the kernels, adds the inline
    executor, freezes the heap, and keeps the log of incoming transfers TRANSFER_LOG_LENGTH long, so
    `Trainer.stats.measured_bytes` can count a step's bytes after it ends.  (Dask sizes that log by
    its low-level log length, which `Machine.local` keeps short: it also sizes every message
    stream's record of recent messages, task specs included, all in the collector's way.)"""

    name = "taskrt-worker-setup"

    def setup(self, worker):
        import taskrt.planning.tasks  # noqa: F401
        from taskrt import ops  # noqa: F401  (the kernels, before freezing: imported now rather than in the first step)
        from taskrt.gpu.device import share_torch_allocator

        share_torch_allocator()  # on a GPU worker: cupy's arrays from torch's pool (nothing on a CPU worker)
        keep_free_memory(worker)
        worker.executors.setdefault(INLINE, InlineExecutor())
        if worker.transfer_incoming_log.maxlen != TRANSFER_LOG_LENGTH:
            worker.transfer_incoming_log = deque(worker.transfer_incoming_log, maxlen=TRANSFER_LOG_LENGTH)
        freeze_heap()
