"""Timing parts on a device: what the cost model sends a worker to measure (the forward and
backward kernels of a part's tile, an SGD update or gradient sum of a shard), as the tasks of a
step run them, and the sending (`time_on_devices`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np


def measure_parts(items, repeats, dtype):
    """Median seconds of the forward and of the backward kernel for each (op, output Rect, need_dx),
    on this worker's device: on a GPU worker the arrays live on the GPU and every timing waits for
    the device to finish (taskrt.gpu.device.synchronize).  The backward includes packing the parameter
    gradient into one flat array, as a backward task does (taskrt.planning.tasks.Backward): for a
    fully-connected layer that copy is as large as its weights.  On a CPU each kernel starts with
    its data out of the core's own cache (`evict_core_cache`), as in a step, where other kernels
    run in between: run back to back on the same arrays, small kernels timed 8-9% faster than in
    a step (LeNet-5 one-device plan in one process, against 2-3% with the eviction)."""
    from taskrt.gpu.device import synchronize, to_device
    from taskrt.ops import array_module
    from taskrt.planning.params import pack

    def backward(op, dy, xs, y, params, rect, need_dx):
        _, dparams = op.backward(dy, xs, y, params, rect, need_dx)
        if dparams:
            pack(dparams, array_module(dy))

    rng = np.random.default_rng(0)
    out = []
    for op, rect, need_dx in items:
        xs = []
        for i, r in enumerate(op.input_rects(rect)):
            if r is None:
                xs.append(None)
            elif op.kind == "softmax_cross_entropy" and i == 1:
                xs.append(rng.integers(0, op.in_shapes[0][1], size=r.shape))
            else:
                xs.append(rng.standard_normal(r.shape).astype(dtype))
        params = {k: (rng.standard_normal(r.shape) * 0.01).astype(dtype) for k, r in op.param_rects(rect).items()}
        xs, params = [to_device(x) for x in xs], {k: to_device(v) for k, v in params.items()}
        y = op.forward(xs, params, rect)
        dy = array_module(y).ones_like(y)
        backward(op, dy, xs, y, params, rect, need_dx)  # warm-up
        on_cpu = array_module(y) is np
        fwd, bwd = [], []
        for _ in range(repeats):
            if on_cpu:
                evict_core_cache()
            synchronize()
            start = time.perf_counter()
            y = op.forward(xs, params, rect)
            synchronize()
            forward_s = time.perf_counter() - start
            if on_cpu:
                evict_core_cache()
            start = time.perf_counter()
            backward(op, dy, xs, y, params, rect, need_dx)
            synchronize()
            fwd.append(forward_s)
            bwd.append(time.perf_counter() - start)
        out.append([float(np.median(fwd)), float(np.median(bwd))])
    return out


_EVICTION: list = []  # the buffer evict_core_cache reads, made on first use


def evict_core_cache():
    """Read a buffer twice the size of a core's L2 cache (at least 4 MiB), so that what the next
    kernel touches is no longer in it."""
    if not _EVICTION:
        _EVICTION.append(np.ones(max(2 * _l2_bytes(), 4 << 20) // 8))
    _EVICTION[0].sum()


def _l2_bytes() -> int:
    """A core's L2 cache size as Linux reports it (0 where it does not)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(text[:-1]) << 10 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 0


def measure_synchronization(items, repeats, dtype):
    """Median seconds of an update (or a gradient sum) over `elements` parameters from `grads`
    replicas, for each (phase, elements, grads, optimizer rule), as the Update / ReduceGrads tasks
    run it."""
    from taskrt.gpu.device import synchronize, to_device
    from taskrt.ops.optim import OPTIMIZERS
    from taskrt.planning.tasks import ReduceGrads, Update

    rng = np.random.default_rng(0)
    out = []
    for phase, elements, grads, rule in items:
        optimizer = OPTIMIZERS[rule](1e-3, weight_decay=1e-4, **({"momentum": 0.9} if rule == "sgd" else {}))
        hyper = optimizer.hyper()
        slots = tuple(np.zeros(elements, dtype=dtype) for _ in optimizer.slots)
        state = to_device((rng.standard_normal(elements).astype(dtype), *slots))
        values = [to_device(rng.standard_normal(elements).astype(dtype)) for _ in range(grads)]
        if phase == "update":
            spec, args = Update(tuple((i + 1, None, None) for i in range(grads))), (state, *values, hyper)
        else:
            spec, args = ReduceGrads(tuple((i, None, None) for i in range(grads))), tuple(values)
        spec(*args)
        times = []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            spec(*args)
            synchronize()
            times.append(time.perf_counter() - start)
        out.append(float(np.median(times)))
    return out


def time_on_devices(machine, kind, items: dict, timing, repeats: int, dtype: str, corun: bool = False,
                    progress: bool = True, what: str = "part kernels", cached_in=None) -> dict:
    """Time each item on a device of `kind` (one at a time, as in training) with `timing` (e.g.
    `measure_parts`), 8 items per task; returns {signature: what `timing` gave for it}.  With
    `corun`, devices of the kind time the same items at once, as many as the host's cores run at
    once (more would time the cores' sharing, which the simulator models apart), and each timing
    is their mean.  `cached_in`: where the caller keeps the results, said with the progress."""
    from taskrt.observing.progress import phase

    devices = [d.id for d in machine.devices if d.kind == kind]
    devices = devices[: max(2, os.cpu_count() or 1)] if corun else devices[:1]
    client = machine.client
    sigs = list(items)
    out = {}
    where = f"{len(devices)} {kind} devices at once" if len(devices) > 1 else f"a {kind} device"
    with phase(f"measuring {len(sigs)} {what} on {where}", len(sigs), cached_in, progress) as advance:
        for start in range(0, len(sigs), 8):
            chunk = sigs[start : start + 8]
            futures = [client.submit(timing, [items[s] for s in chunk], repeats, dtype,
                                     pure=False, resources={machine.tag(device): 1}) for device in devices]
            results = client.gather(futures)
            out.update(zip(chunk, np.mean(results, axis=0).tolist() if len(results) > 1 else results[0]))
            advance(len(chunk))
    address = machine.addresses()
    client.run(give_back_memory, workers=[address[d] for d in devices])
    return out


def give_back_memory() -> None:
    """After timing, on a worker: the arrays kept for reuse and glibc's free heap back to the system,
    so that a worker with a memory limit trains from what it held before the timing (VGG-16-32 in
    float64 timed on workers of 1.8 GiB: one was ended at 1762 MiB in its second step, where a
    step needs 624 MiB of values and the worker 146 MiB of its own)."""
    import ctypes
    import gc

    from taskrt.ops import reuse

    reuse.clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass
