"""Large arrays from one worker to another on the same host through shared memory.

Over TCP on loopback a value is serialized into frames, written through the socket, read into a
message buffer and copied again to align it (`taskrt.tasks.Received`): a 64 MB tile took 40-80 ms
(about 1-1.6 GB/s), and data parallelism's weights and gradients are hundreds of megabytes a step.
Through shared memory it is one copy: the sender writes the array into a segment of its own (a
file in /dev/shm, mapped once and reused, so its pages are already there), the message carries
only where it lies (`Slot`), and the receiver maps the segment once and reads the array in place.

A segment holds one array at a time.  Its first byte says whether it is in use: the sender sets
it before writing, the receiver clears it when its array (and every view of it) is collected, and
the sender writes into it again only once it is clear.  A sender keeps at most `POOL_BYTES` of
segments; beyond that (receivers holding many arrays at once) values go over TCP as before.
Segments are the sender's: removed when its process exits, and swept at start-up when the process
that made them is gone (a worker killed by SIGKILL).
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
from distributed.comm import get_address_host

DIRECTORY = "/dev/shm"
PREFIX = "taskrt-"
MIN_BYTES = 256 * 1024  # smaller values cost less over TCP than a copy's bookkeeping
POOL_BYTES = 4 * 2**30  # a sender's segments at most
HEADER = 64  # the in-use byte, and the array aligned for any dtype after it
GRAIN = 2**20  # segment sizes rounded up to this, so that similar values share segments


@dataclass(frozen=True)
class Slot:
    """Where a sent array lies: segment `path` holds it at HEADER, `dtype` and `shape`."""

    path: str
    size: int  # the segment's bytes
    dtype: str
    shape: tuple

    def as_message(self) -> dict:  # plain values: what distributed's messages carry without pickling
        return {"path": self.path, "size": self.size, "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_message(message: dict) -> Slot:
        return Slot(message["path"], message["size"], message["dtype"], tuple(message["shape"]))


def available() -> bool:
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


def same_host(address_a: str, address_b: str) -> bool:
    """Whether two worker addresses (tcp://host:port) are on one host, as far as addresses tell."""
    return get_address_host(address_a) == get_address_host(address_b)


def eligible(value) -> bool:
    return type(value) is np.ndarray and value.nbytes >= MIN_BYTES and not value.dtype.hasobject


class _Segment:
    __slots__ = ("path", "size", "map")

    def __init__(self, path, size):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.path, self.size = path, size

    @property
    def free(self) -> bool:
        return self.map[0] == 0


class Sender:
    """A process's segments and the writing of arrays into them."""

    def __init__(self, pool_bytes: int = POOL_BYTES, directory: str = DIRECTORY):
        self.pool_bytes, self.directory = pool_bytes, directory
        self.segments: list[_Segment] = []
        self.lock = threading.Lock()
        self.count = 0
        self.token = os.urandom(4).hex()  # a later process with the same pid names its segments apart
        atexit.register(self.close)

    def write(self, value: np.ndarray) -> Slot | None:
        """`value` copied into a free segment, or None when the pool is full (send it over TCP)."""
        nbytes = value.nbytes
        with self.lock:
            segment = self._free(nbytes)
            if segment is None:
                return None
            segment.map[0] = 1
        target = np.ndarray(value.shape, value.dtype, buffer=segment.map, offset=HEADER)
        np.copyto(target, value)
        return Slot(segment.path, segment.size, value.dtype.str, value.shape)

    def _free(self, nbytes: int) -> _Segment | None:
        fits = [s for s in self.segments if s.size - HEADER >= nbytes and s.free]
        if fits:
            return min(fits, key=lambda s: s.size)
        size = -(-(nbytes + HEADER) // GRAIN) * GRAIN
        if sum(s.size for s in self.segments) + size > self.pool_bytes:
            return None
        self.count += 1
        segment = _Segment(os.path.join(self.directory, f"{PREFIX}{os.getpid()}-{self.token}-{self.count}"), size)
        self.segments.append(segment)
        return segment

    def close(self) -> None:
        with self.lock:
            for segment in self.segments:
                try:
                    os.unlink(segment.path)
                except FileNotFoundError:
                    pass
            self.segments = []


class Receiver:
    """The segments this process reads from, each mapped once."""

    def __init__(self):
        self.maps: dict = {}
        self.lock = threading.Lock()

    def read(self, slot: Slot) -> np.ndarray:
        """The array `slot` names, in place; its segment is cleared when the array is collected."""
        with self.lock:
            mapped = self.maps.get(slot.path)
            if mapped is None or len(mapped) != slot.size:
                fd = os.open(slot.path, os.O_RDWR)
                try:
                    mapped = mmap.mmap(fd, slot.size, flags=mmap.MAP_SHARED)
                finally:
                    os.close(fd)
                self.maps[slot.path] = mapped
        dtype = np.dtype(slot.dtype)
        nbytes = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
        # The array's memory through an object of its own, which every view of the array keeps alive:
        # the segment is cleared only when the last of them is collected.
        window = (ctypes.c_char * max(nbytes, 1)).from_buffer(mapped, HEADER)
        weakref.finalize(window, _clear, mapped)
        return np.frombuffer(window, dtype, count=nbytes // dtype.itemsize).reshape(slot.shape)


def _clear(mapped) -> None:
    try:
        mapped[0] = 0
    except ValueError:  # unmapped at exit
        pass


def sweep(directory: str = DIRECTORY) -> int:
    """Remove segments whose process is gone (a worker killed before it could); returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
