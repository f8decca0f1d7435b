"""Copies to a GPU that overlap the kernels queued before them.  Runs on GPU workers.

A tile read ahead for the next step is copied into pinned host memory, then to the device on a
stream of its own (`to_device_async`).  Where it lands matters: memory from the caching
allocator comes in the kernels' stream order, so a block freed in Python while kernels queued
earlier still read it may be handed out again, and a copy on another stream would write under
them.  Waiting for those kernels first would serialize the copy behind the step before, the very
thing read-ahead is for.  So tiles land in device buffers of their own (`Landing`): a buffer is
given back when its array is collected, marked by an event on the kernels' stream at that moment
(every kernel reading it was queued before then), and a later copy into it waits for that event
alone, as torch's `record_stream` does for its allocator.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

MAX_STAGING = 16  # pinned buffers kept for copies to the device (a few steps of reads ahead)


class Landing:
    """Device buffers by size, each reused once the kernels that read it last have been queued
    and the event marking them is waited for.  `alloc(nbytes)` gives a raw buffer; `mark()` an
    event on the kernels' stream now.  The backend is cupy on a GPU worker (`_landing`); tests
    give fakes."""

    def __init__(self, alloc, mark, limit: int = 64):
        self.alloc, self.mark, self.limit = alloc, mark, limit
        self.free: dict = defaultdict(list)  # nbytes -> [(buffer, event of its last readers)]
        self.lock = threading.Lock()  # buffers come back from whichever thread collects their array
        self.allocated = 0

    def take(self, nbytes: int):
        """(buffer, event to wait for before writing into it, or None)."""
        with self.lock:
            free = self.free.get(nbytes)
            if free:
                return free.pop(0)
        self.allocated += 1
        return self.alloc(nbytes), None

    def give_back(self, nbytes: int, buffer) -> None:
        """`buffer`'s array was collected: every kernel reading it was queued before now."""
        event = self.mark()
        with self.lock:
            free = self.free[nbytes]
            if len(free) < self.limit:  # beyond that, the buffer goes back to the driver with `buffer`
                free.append((buffer, event))


class _Lease:
    """Owner of a landed array's memory: gives its buffer back when the array is collected."""

    __slots__ = ("landing", "nbytes", "buffer")

    def __init__(self, landing, nbytes, buffer):
        self.landing, self.nbytes, self.buffer = landing, nbytes, buffer

    def __del__(self):
        try:
            self.landing.give_back(self.nbytes, self.buffer)
        except Exception:  # noqa: BLE001  (at exit, with CUDA gone: the buffer goes with the process)
            pass


_state: dict = {}


def _landing() -> Landing:
    if "landing" not in _state:
        import cupy

        def alloc(nbytes):  # straight from the driver, outside the stream-ordered pool
            return cupy.cuda.Memory(max(nbytes, 1))

        def mark():
            return cupy.cuda.Stream.null.record()

        _state["landing"] = Landing(alloc, mark)
    return _state["landing"]


_staging: list = []  # (pinned memory, event of the copy that last read it)


def to_device_async(tile: np.ndarray):
    """A host array on this worker's GPU without the host waiting for the GPU, the copy running
    while the kernels queued before it run: copied into pinned memory, then on a stream of its own
    into a landing buffer (`Landing`); the kernels queued after it wait for the copy."""
    import cupy

    from taskrt.gpu.device import _copy_stream

    tile = np.ascontiguousarray(tile)
    stream = _copy_stream("in")  # a stream of its own, not the one copies to the host take
    memory = _pinned(max(tile.nbytes, 1))
    host = np.frombuffer(memory, tile.dtype, tile.size).reshape(tile.shape)
    np.copyto(host, tile)
    landing = _landing()
    buffer, readers = landing.take(tile.nbytes)
    if readers is not None:
        stream.wait_event(readers)  # the kernels that read this buffer last, not every kernel queued
    pointer = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buffer.ptr, max(tile.nbytes, 1),
                                                              _Lease(landing, tile.nbytes, buffer)), 0)
    out = cupy.ndarray(tile.shape, tile.dtype, pointer)
    out.set(host, stream=stream)
    event = stream.record()
    cupy.cuda.Stream.null.wait_event(event)
    _staging.append((memory, event))
    return out


def _pinned(nbytes: int):
    import cupy

    for i, (memory, event) in enumerate(_staging):
        if memory.size() >= nbytes and event.done:
            del _staging[i]
            return memory
    while len(_staging) >= MAX_STAGING:  # the oldest copy has surely ended by now; wait if not
        memory, event = _staging.pop(0)
        event.synchronize()
    return cupy.cuda.alloc_pinned_memory(nbytes)
