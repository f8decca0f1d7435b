"""Large numpy arrays whose memory is used again once nothing references them.

glibc gives every allocation above 32 MiB fresh pages from the kernel and returns them on free,
so a step that makes new 64 MiB arrays (VGG's fc2 weights, velocity and weight gradient) pays a
page fault per page every time, and sometimes far more when the kernel has to find huge pages
(a 64 MiB SGD update took 30 ms on fresh memory and up to 300 ms in a long-lived worker; on
reused memory 12 ms of CPU).  `empty` hands out such memory from a free list instead.

An array from `empty` is an ordinary writable numpy array; its memory returns to the free list
when the last array that reads it (views included) is gone, so results stay pure: nothing that
is still referenced is ever written again.

Where the blocks come from can be changed (`set_source`): on a worker, shared memory, so that a
large result sent to another worker on the host is not copied (`taskrt.transport.shared_memory.Blocks`); a
block another process still reads is then not handed out until it is done.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref

import numpy

MIN_BYTES = 8 << 20  # smaller arrays come from malloc's heap, which reuses memory already
MAX_FREE_BYTES = 1 << 30  # memory kept for reuse, at most (workers: `keep_at_most`)
_free: dict[int, list] = {}
_lock = threading.Lock()
_kept = 0
_source = None  # where new blocks come from (None: numpy's heap); see set_source


def set_source(source):
    """Make new large blocks with `source` (None: numpy's heap); returns the previous source.
    `source.new(nbytes)` gives a writable uint8 array of `nbytes` (or None: numpy's heap this
    time); `source.lent(block)` says whether a block of it is still read elsewhere.  The blocks
    kept for reuse are let go: those handed out from now on are the new source's."""
    global _source, _kept
    with _lock:
        previous, _source = _source, source
        _free.clear()
        _kept = 0
    return previous


def empty(shape, dtype) -> numpy.ndarray:
    """numpy.empty(shape, dtype), from reused memory when the array is large."""
    dtype = numpy.dtype(dtype)
    # math.prod: numpy's takes microseconds, and this runs for every kernel's output
    nbytes = (int(shape) if isinstance(shape, (int, numpy.integer)) else math.prod(shape)) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return numpy.empty(shape, dtype)
    global _kept
    block = source = None
    with _lock:
        blocks = _free.get(nbytes, ())
        for i in range(len(blocks) - 1, -1, -1):
            candidate, its_source = blocks[i]
            if its_source is None or not its_source.lent(candidate):
                block, source = blocks.pop(i)
                _kept -= nbytes
                break
    if block is None:
        source = _source
        block = source.new(nbytes) if source is not None else None
        if block is None:
            block, source = numpy.empty(nbytes, numpy.uint8), None
    # A new ctypes view per lease: every numpy view of the result keeps it alive, so its finalizer
    # runs only when the last of them is gone (numpy views of a numpy base would not: they point
    # at the base, and the base outlives them in the free list).
    lease = (ctypes.c_char * nbytes).from_buffer(block)
    weakref.finalize(lease, _release, block, source)
    return numpy.frombuffer(lease, dtype=dtype).reshape(shape)


def _release(block, source):
    global _kept
    with _lock:
        if _kept + block.nbytes <= MAX_FREE_BYTES:
            _free.setdefault(block.nbytes, []).append((block, source))
            _kept += block.nbytes


def keep_at_most(nbytes: int) -> None:
    """Keep at most `nbytes` of free memory for reuse (beyond that, what is freed goes back to
    the system, and what is needed again is new memory, a page fault per page)."""
    global MAX_FREE_BYTES
    MAX_FREE_BYTES = int(nbytes)


def clear() -> None:
    """Let go of every block kept for reuse (e.g. after timing kernels of shapes a step never uses)."""
    global _kept
    with _lock:
        _free.clear()
        _kept = 0


def kept_bytes() -> int:
    """Bytes held for reuse now."""
    return _kept
