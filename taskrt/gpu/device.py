"""What a worker process computes on: its CPU (numpy) or a GPU (cupy).  Runs on workers.

A worker is a GPU device when the environment says so: TASKRT_DEVICE=gpu (what
`Machine.local(n, gpu=True)` sets), or, where TASKRT_DEVICE is not set, when CUDA_VISIBLE_DEVICES
names a GPU (as dask-cuda's workers have) and cupy can reach it.  TASKRT_DEVICE=cpu keeps a worker
on its CPU even on a machine with GPUs.

On a GPU worker every array of a step lives on the GPU: data tiles are converted once on arrival
(`to_device`), parameters and velocity are created there, and only what the user asks for comes
back (`to_host`).  cupy is imported only on GPU workers.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def is_gpu() -> bool:
    mode = os.environ.get("TASKRT_DEVICE", "").lower()
    if mode == "cpu":
        return False
    if mode != "gpu" and not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device: a CPU worker, or an error below)
        if mode == "gpu":
            raise RuntimeError("TASKRT_DEVICE=gpu but cupy cannot reach a CUDA device on this worker; "
                               "install cupy for its CUDA version (pip install cupy-cuda12x or cupy-cuda13x)") from None
        return False


def array_module():
    """cupy on a GPU worker, numpy otherwise."""
    if is_gpu():
        import cupy

        return cupy
    return np


def to_device(x):
    """An array (or a tuple of arrays, None kept) on this worker's device."""
    if isinstance(x, tuple):
        return tuple(to_device(v) for v in x)
    if x is None or not is_gpu():
        return x
    import cupy

    return cupy.asarray(x)


def to_host(x):
    """numpy, whatever the array (or tuple of arrays) lives on."""
    if isinstance(x, tuple):
        return tuple(to_host(v) for v in x)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    return x


def synchronize() -> None:
    """Wait for the GPU's queued work (for timing); nothing on a CPU worker."""
    if is_gpu():
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def describe() -> dict:
    """The device kind ("gpu:<model>" or "cpu:<model>") and its memory in bytes (None if unknown)."""
    if is_gpu():
        import cupy

        device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return {"kind": f"gpu:{name}", "memory": float(device.mem_info[1])}
    return {"kind": "cpu:" + _cpu_model(), "memory": None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def pool_bytes() -> int:
    """Bytes of GPU memory in use by arrays on this worker: torch's allocator's count where cupy
    allocates from it (`share_torch_allocator`), else cupy's pool's (0 on a CPU worker)."""
    if not is_gpu():
        return 0
    if _shared[0]:
        import torch

        return int(torch.cuda.memory_allocated())
    import cupy

    return int(cupy.get_default_memory_pool().used_bytes())


_shared = [False]


def shares_torch_allocator() -> bool:
    """Whether this worker's cupy allocates from torch's allocator (`share_torch_allocator` did it)."""
    return _shared[0]


def share_torch_allocator() -> bool:
    """Let cupy allocate from torch's caching allocator, once per process: one pool serves both
    libraries' arrays (two pools each keep what the other could use), and a CUDA graph's capture
    (`taskrt.gpu.cuda_graphs`) gets its cupy arrays from the graph's private pool too.  False where
    there is no GPU or no torch with CUDA."""
    if _shared[0]:
        return True
    if not is_gpu():
        return False
    from taskrt.ops.torch_kernels import load_torch, torch_cuda_available

    if not torch_cuda_available():
        return False
    import cupy

    torch = load_torch()

    def malloc(size, device):  # on cupy's current stream: torch's pool is ordered per stream, as cupy's
        return torch.cuda.caching_allocator_alloc(size, device, cupy.cuda.get_current_stream().ptr)

    def free(pointer, device):
        torch.cuda.caching_allocator_delete(pointer)

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.cuda.set_allocator(cupy.cuda.PythonFunctionAllocator(malloc, free).malloc)
    _shared[0] = True
    return True


async def to_host_async(x, poll_s: float = 0.0005):
    """`to_host`, for the worker's event loop: waits for the GPU to reach the value without blocking
    the loop (an event on the legacy stream, polled), then copies it on a stream of its own."""
    if isinstance(x, tuple):
        return tuple([await to_host_async(v, poll_s) for v in x])
    cupy = sys.modules.get("cupy")
    if cupy is None or not isinstance(x, cupy.ndarray):
        return x
    import asyncio

    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record(cupy.cuda.Stream.null)
    while not event.done:
        await asyncio.sleep(poll_s)
    return x.get(stream=_copy_stream())


_streams: dict = {}


def _copy_stream(name: str = "copy"):
    """A stream of this worker's own for copies ("copy": to the host; "in": to the device,
    `taskrt.gpu.staging`), one that does not wait for the legacy stream the kernels run on."""
    import cupy

    if name not in _streams:
        _streams[name] = cupy.cuda.Stream(non_blocking=True)
    return _streams[name]
