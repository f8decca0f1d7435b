"""Large numpy arrays whose memory is used again once nothing references them.

glibc gives every allocation above 32 MiB fresh pages from the kernel and returns them on free,
so a step that makes new 64 MiB arrays (VGG's fc2 weights, velocity and weight gradient) pays a
page fault per page every time, and sometimes far more when the kernel has to find huge pages
(a 64 MiB SGD update took 30 ms on fresh memory and up to 300 ms in a long-lived worker; on
reused memory 12 ms of CPU).  `empty` hands out such memory from a free list instead.

An array from `empty` is an ordinary writable numpy array; its memory returns to the free list
when the last array that reads it (views included) is gone, so results stay pure: nothing that
is still referenced is ever written again.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy

MIN_BYTES = 8 << 20  # smaller arrays come from malloc's heap, which reuses memory already
MAX_FREE_BYTES = 1 << 30  # memory kept for reuse, at most
_free: dict[int, list] = {}
_lock = threading.Lock()
_kept = 0


def empty(shape, dtype) -> numpy.ndarray:
    """numpy.empty(shape, dtype), from reused memory when the array is large."""
    dtype = numpy.dtype(dtype)
    nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return numpy.empty(shape, dtype)
    global _kept
    with _lock:
        blocks = _free.get(nbytes)
        block = blocks.pop() if blocks else None
        if block is not None:
            _kept -= nbytes
    if block is None:
        block = numpy.empty(nbytes, numpy.uint8)
    # A new ctypes view per lease: every numpy view of the result keeps it alive, so its finalizer
    # runs only when the last of them is gone (numpy views of a numpy base would not: they point
    # at the base, and the base outlives them in the free list).
    lease = (ctypes.c_char * nbytes).from_buffer(block)
    weakref.finalize(lease, _release, block)
    return numpy.frombuffer(lease, dtype=dtype).reshape(shape)


def _release(block):
    global _kept
    with _lock:
        if _kept + block.nbytes <= MAX_FREE_BYTES:
            _free.setdefault(block.nbytes, []).append(block)
            _kept += block.nbytes


def kept_bytes() -> int:
    """Bytes held for reuse now."""
    return _kept
