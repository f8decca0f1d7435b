"""A step's data to workers on this host through shared memory instead of a Dask message.

A Dask message of a large array crawls over the loopback: 77 MB took 94 ms here (0.8 GB/s) and
112-121 ms on the GPU machine, where its copies into fresh pages cost more than the kernels of a
whole AlexNet step.  A worker whose address is a loopback address runs on this host, so the
client copies each tile into a slot of shared memory (a file in /dev/shm that both processes
map), and the step's graph carries only the slot's name: a task on the tile's device copies it
out (onto the GPU, on a GPU worker).  Slots are kept and reused, their pages already faulted in,
so a step pays two copies at memory speed.

Each slot's first 8 bytes hold a token: the client writes a fresh one with the tile, the worker
sets it back to 0 once it has copied the tile out, and only then may the client write the slot
again.  A tile whose token is no longer in its slot (its step was abandoned and the slot written
since) is refused, never read.  A slot never read stays taken; past SLOTS_PER_WORKER taken slots
a tile goes by Dask message as before.  Slots are removed when the process exits.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from math import prod

import numpy as np

SHARED_DIR = "/dev/shm"  # memory-backed on Linux; without it, tiles go by Dask message
HEADER = 64  # bytes before the tile: the token, and alignment for the tile
SLOTS_PER_WORKER = 6  # steps in flight (taskrt.trainer.MAX_IN_FLIGHT) and two more
_LOOPBACK = ("127.", "localhost", "[::1]")


class StagingError(RuntimeError):
    """A staged tile that is no longer in its slot."""


@dataclass(frozen=True)
class StagedTile:
    """Where a tile waits for its worker: the slot's file, the token written with it, its array."""

    path: str
    token: int
    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


def on_this_host(address: str) -> bool:
    """Whether a worker at `address` ('tcp://127.0.0.1:4321') surely runs on this host."""
    host = address.split("://", 1)[-1]
    return host.startswith(_LOOPBACK)


def available() -> bool:
    return os.path.isdir(SHARED_DIR) and os.access(SHARED_DIR, os.W_OK)


class _Slot:
    def __init__(self, path: str, capacity: int):
        self.path, self.capacity = path, capacity
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER + capacity)
            self.map = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        self.token = np.frombuffer(self.map, dtype=np.uint64, count=1)

    def free(self) -> bool:
        return int(self.token[0]) == 0

    def close(self):
        self.token = None
        self.map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Staging:
    """This process's slots, per worker address."""

    def __init__(self):
        self._slots: dict[str, list[_Slot]] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._names = itertools.count()

    def put(self, address: str, tile: np.ndarray) -> StagedTile | None:
        """Copy `tile` into a free slot for the worker at `address`; None when none is free and
        no more may be made (the caller sends it by Dask message)."""
        tile = np.ascontiguousarray(tile)
        with self._lock:
            slots = self._slots.setdefault(address, [])
            slot = next((s for s in slots if s.free() and s.capacity >= tile.nbytes), None)
            if slot is None:
                spare = next((s for s in slots if s.free()), None)
                if spare is not None:  # too small: replaced by one that fits
                    slots.remove(spare)
                    spare.close()
                elif len(slots) >= SLOTS_PER_WORKER:
                    return None
                slot = _Slot(os.path.join(SHARED_DIR, f"taskrt-{os.getpid()}-{next(self._names)}"),
                             max(tile.nbytes, 1))
                slots.append(slot)
            token = next(self._tokens)
            view = np.frombuffer(slot.map, dtype=tile.dtype, count=tile.size, offset=HEADER)
            np.copyto(view.reshape(tile.shape), tile)
            slot.token[0] = token  # after the tile: a worker that sees the token sees the tile
            return StagedTile(slot.path, token, tile.shape, tile.dtype.str)

    def close(self):
        with self._lock:
            for slots in self._slots.values():
                for slot in slots:
                    slot.close()
            self._slots.clear()


_STAGING: Staging | None = None


def staging() -> Staging:
    """The slots of this process (one set, whichever machines and trainers send through it)."""
    global _STAGING
    if _STAGING is None:
        _STAGING = Staging()
        atexit.register(_STAGING.close)
    return _STAGING


# ---- on the worker ------------------------------------------------------------------------------
_MAPS: OrderedDict = OrderedDict()  # slot path -> its mapping in this worker, most recent last
_MAPS_KEPT = 4 * SLOTS_PER_WORKER


def _mapping(path: str) -> mmap.mmap:
    found = _MAPS.get(path)
    if found is not None:
        _MAPS.move_to_end(path)
        return found
    fd = os.open(path, os.O_RDWR)
    try:
        found = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    for gone in [p for p in _MAPS if not os.path.exists(p)]:  # slots replaced, clients departed: their memory
        _unmap(_MAPS.pop(gone))
    _MAPS[path] = found
    while len(_MAPS) > _MAPS_KEPT:
        _unmap(_MAPS.popitem(last=False)[1])
    return found


def _unmap(mapped: mmap.mmap):
    try:
        mapped.close()
    except BufferError:
        pass  # an array still views it: unmapped when that goes


def read_staged(tile: StagedTile):
    """The tile as an array of this worker's device (taskrt.device), copied out of its slot; the
    slot is then free for the client to write again."""
    from taskrt.device import is_gpu, to_device

    try:
        mapped = _mapping(tile.path)
    except FileNotFoundError:
        raise StagingError(f"the data staged in {tile.path} is gone (its slot was replaced, or its client "
                           "exited): this task belongs to an abandoned step") from None
    token = np.frombuffer(mapped, dtype=np.uint64, count=1)
    if int(token[0]) != tile.token:
        raise StagingError(f"the data staged in {tile.path} was overwritten: this task belongs to an abandoned step")
    view = np.frombuffer(mapped, dtype=np.dtype(tile.dtype), count=prod(tile.shape), offset=HEADER)
    view = view.reshape(tile.shape)
    # (from pageable memory a copy to the GPU returns once the host bytes are read: the slot is
    # free then, with no wait for the device's queued work)
    out = to_device(view) if is_gpu() else view.copy()
    token[0] = 0
    return out
