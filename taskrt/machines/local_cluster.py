"""Starting a local cluster (Machine.local): one single-threaded worker process per device on
127.0.0.1, with the Dask settings and worker environment a training step wants; GPU workers
through dask-cuda when it is installed."""

from __future__ import annotations

import ast
import logging
import os
import sys

from taskrt.machines.devices import MachineError, resource_tag

DASK_SETTINGS = {
    "distributed.scheduler.active-memory-manager.start": False,
    # Dask's debugging logs (transitions, events, each message stream's recent messages with their
    # task specs) 100 entries long, not 1000: fewer objects for Python's full garbage collections
    # to walk in the scheduler (taskrt.machines.worker_setup); the workers' transfer logs stay long
    "distributed.admin.low-level-log-length": 100,
    "distributed.worker.daemon": False,
    # No pause at 80% of a memory_limit: a worker's memory is the step's own values and what the
    # allocator keeps for the next step (below), which a pause never frees; paused, a worker never
    # starts its next program and training stalls for good.  The trainer checks each step's peak
    # against the devices' memory before it runs (taskrt.machines.machine.usable_memory, from the
    # limit at which the nanny ends a worker), and a worker the nanny ends anyway is a
    # DeviceMemoryError naming the device and the step (taskrt.training.memory).
    "distributed.worker.memory.pause": False,
    # A step's temporaries must land on memory the worker already has.  Dask's nanny gives its workers
    # MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's dynamic mmap threshold: every large
    # temporary became a fresh mmap that page-faulted again (kernels 1.6x slower than in-process).
    # glibc's defaults are not enough either: tasks run on a worker thread, whose malloc arena gives
    # whole 64 MiB heaps back to the system as soon as they are empty, so the next step faults them in
    # again (VGG-16-32: 14,000 page faults and 80 ms of system time per step, against 80 faults
    # in-process).  One arena, allocations up to 32 MiB (glibc's largest threshold) from it, and up to
    # 1 GiB of free memory kept: 150 faults and 2 ms.  Larger arrays come from ops.reuse.
    "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 1,
    "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 32 << 20,
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 1 << 30,
    # An idle local(2) cluster's processes woke up hundreds of times a second (each event loop's
    # blocked-loop tick every 20 ms, each worker's statistical profiler every 10 ms, the memory
    # monitors every 100 ms): 200 ms of processor time a second, taken from the kernels of a
    # step on a host with a core per worker.  Coarser: 50 ms a second idle, VGG-16-32's searched
    # step on local(2) 7% faster.  The dashboard's profile and system pages keep working, coarser.
    "distributed.admin.tick.interval": "200ms",
    "distributed.worker.profile.interval": "100ms",
    "distributed.worker.memory.monitor-interval": "500ms",
    "distributed.admin.system-monitor.interval": "1s",
}


TRIM = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"


def kept_heap(memory_limit) -> int:
    """glibc's MALLOC_TRIM_THRESHOLD_ for workers of `memory_limit` (as Dask's Nanny takes it): the
    free heap a worker keeps for its next step, 1 GiB (above), but at most 1/KEEP_HEAP_SHARE of a
    limit, which the devices' memory leaves room for (taskrt.machines.machine.usable_memory).
    Measured: VGG-16-32 at batch 64 kept 220-340 MiB of free heap, which a worker at a limit of
    1.3 GiB had no room for."""
    from distributed.worker_memory import parse_memory_limit

    from taskrt.machines.worker_setup import KEEP_HEAP_SHARE

    limit = parse_memory_limit(memory_limit, 1, logger=logging.getLogger("taskrt"))
    return min(DASK_SETTINGS[TRIM], limit // KEEP_HEAP_SHARE) if limit else DASK_SETTINGS[TRIM]


def start(n: int, memory_limit="auto", quiet=True, gpu: bool = False):
    """(client, cluster, GPUs used) of a new local cluster of `n` workers, each tagged with its
    device's resource (taskrt.machines.machine.resource_tag); see Machine.local."""
    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import taskrt.observing.dashboard  # noqa: F401  (registers the dashboard's taskrt page before the scheduler starts)
    from taskrt.machines.batching import shorten_batching

    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"Machine.local needs a positive number of devices, got {n!r}")
    where = outside_main_guard()
    if where:
        raise MachineError(
            f"Machine.local is called at {where}, outside `if __name__ == \"__main__\":`. Its workers are "
            "processes that import your script again, and each would run this line too. Put the code that "
            "creates the machine (and trains) under `if __name__ == \"__main__\":`.")
    gpus = local_gpu_count() if gpu else 0
    if not gpu and n > (os.cpu_count() or 1):
        logging.getLogger("taskrt").warning(
            "Machine.local(%d) on %d cores: timings are not meaningful, bytes and results are",
            n, os.cpu_count())
    trim = kept_heap(memory_limit)
    dask.config.set({**DASK_SETTINGS, TRIM: trim})
    # A Nanny takes a variable already in this process's environment over the config's, and it
    # copies the config's into this environment as it spawns: an earlier machine's would stay
    os.environ[TRIM.rsplit(".", 1)[1]] = str(trim)
    level = logging.WARNING if quiet else logging.INFO
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}
    if gpu and n == gpus and has_dask_cuda():
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(n_workers=n, threads_per_worker=1, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0", silence_logs=level, memory_limit=memory_limit)
    else:
        def env(i):
            if gpu:
                return {"TASKRT_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": str(i % gpus)}
            return {"TASKRT_DEVICE": "cpu"}

        workers = {
            i: {"cls": Nanny, "options": {"nthreads": 1, "resources": {resource_tag(i): 1}, "host": "127.0.0.1",
                                          "memory_limit": memory_limit, "silence_logs": level, "env": env(i)}}
            for i in range(n)
        }
        cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=level, name="taskrt")
    client = Client(cluster, set_as_default=False)
    client.wait_for_workers(n)
    shorten_batching(client)  # this cluster is ours: steps wait on its messages (taskrt.machines.batching)
    return client, cluster, gpus


def outside_main_guard() -> str | None:
    """'file:line' where the main script, run as a file, calls Machine.local at its top level
    outside `if __name__ == "__main__":` (directly, or through functions called from there);
    None otherwise (a guarded call, an interactive session, a notebook, `python -c`, a test
    runner).  Worker processes are spawned, so they import the main script again: such a call
    would run in each of them, and distributed reports only "Nanny failed to start"."""
    import dask

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or dask.config.get(
            "distributed.worker.multiprocessing-method", "spawn") == "fork":
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") in (
            "__main__", "__mp_main__") and frame.f_code.co_filename == path):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= node.end_lineno:
            return None
    return f"{path}:{line}"


def _is_main_test(test) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]).__name__ == "Eq"):
        return False
    sides = [test.left, *test.comparators]
    return any(getattr(s, "id", None) == "__name__" for s in sides) and any(
        getattr(s, "value", None) == "__main__" for s in sides)


def local_gpu_count() -> int:
    """GPUs this host's processes can use; a clear error when there are none."""
    try:
        import cupy
    except ImportError:
        raise MachineError("Machine.local(gpu=True) needs cupy, which is not installed: pip install "
                           "'taskrt[gpu]' (cupy-cuda12x) or cupy-cuda13x, to match the CUDA driver") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (a CUDA runtime error: no driver, no device)
        raise MachineError(f"Machine.local(gpu=True): cupy finds no CUDA device ({e})") from None
    if count < 1:
        raise MachineError("Machine.local(gpu=True): no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    return count


def has_dask_cuda() -> bool:
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None
