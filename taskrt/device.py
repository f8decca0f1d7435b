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
    """Bytes held by cupy's memory pool on this worker (0 on a CPU worker)."""
    if not is_gpu():
        return 0
    import cupy

    return int(cupy.get_default_memory_pool().used_bytes())
