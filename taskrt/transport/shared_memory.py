"""Large arrays from one worker to another on the same host through shared memory.

Over TCP on loopback a value is serialized into frames, written through the socket, read into a
message buffer and copied again to align it (`taskrt.planning.tasks.Received`): a 64 MB tile took 40-80 ms
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

Without the copy (`Blocks`): on a worker, the large arrays kernels make on reused memory
(`ops.reuse`: weights and velocities from the update, packed and summed gradients, fully-connected
layers' weight gradients) are made in segments in the first place, so sending one to a worker on
the host copies nothing: the message says where it lies (`Blocks.lend`), the receiver reads it in
place, read-only.  Such a segment is read by many receivers at once: per receiving worker, a byte
the sender counts up for each array it lends and one the receiver counts up as each is collected;
`ops.reuse` hands the block out again only when every pair is equal.
"""

from __future__ import annotations

import atexit
import bisect
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
HEADER = 64  # the in-use byte (or Blocks' pairs of counts), and the array aligned for any dtype after it
READERS = HEADER // 2 - 1  # receiving workers a Blocks segment counts lends for (bytes 2..63, a pair each)
GRAIN = 2**20  # segment sizes rounded up to this, so that similar values share segments


@dataclass(frozen=True)
class Slot:
    """Where a sent array lies: segment `path` holds it at HEADER, `dtype` and `shape`."""

    path: str
    size: int  # the segment's bytes
    dtype: str
    shape: tuple
    offset: int = HEADER  # where the array starts in the segment
    done: int = 0  # the byte the receiver marks the array's collection in (0: clears the in-use byte)

    def as_message(self) -> dict:  # plain values: what distributed's messages carry without pickling
        return {"path": self.path, "size": self.size, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "done": self.done}

    @staticmethod
    def from_message(message: dict) -> Slot:
        return Slot(message["path"], message["size"], message["dtype"], tuple(message["shape"]),
                    message.get("offset", HEADER), message.get("done", 0))


def available() -> bool:
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


def same_host(address_a: str, address_b: str) -> bool:
    """Whether two worker addresses (tcp://host:port) are on one host, as far as addresses tell."""
    return get_address_host(address_a) == get_address_host(address_b)


def eligible(value) -> bool:
    return type(value) is np.ndarray and value.nbytes >= MIN_BYTES and not value.dtype.hasobject


class Segment:
    __slots__ = ("path", "size", "map")

    def __init__(self, path, size):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # the pages taken now: a /dev/shm too small (a container's 64 MB) fails here with
            # ENOSPC, where a mapping of a truncated file would kill the process at its first write
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.size = path, size

    @staticmethod
    def size_for(nbytes: int) -> int:
        """A segment's bytes for an array of `nbytes`: rounded up to GRAIN, so similar ones share."""
        return -(-(nbytes + HEADER) // GRAIN) * GRAIN

    @staticmethod
    def path_for(directory: str, token: str, name) -> str:
        """Segments are named after their process (`sweep`), and `token` within it."""
        return os.path.join(directory, f"{PREFIX}{os.getpid()}-{token}-{name}")

    @property
    def free(self) -> bool:
        return self.map[0] == 0


class Sender:
    """A process's segments and the writing of arrays into them."""

    def __init__(self, pool_bytes: int = POOL_BYTES, directory: str = DIRECTORY):
        self.pool_bytes, self.directory = pool_bytes, directory
        self.segments: list[Segment] = []
        self.lock = threading.Lock()
        self.count = 0
        self.token = os.urandom(4).hex()  # a later process with the same pid names its segments apart
        atexit.register(self.close)

    def write(self, value: np.ndarray) -> Slot | None:
        """`value` copied into a free segment, or None when the pool is full or /dev/shm has no
        room (send it over TCP)."""
        nbytes = value.nbytes
        with self.lock:
            try:
                segment = self._free(nbytes)
            except OSError:
                segment = None
            if segment is None:
                return None
            segment.map[0] = 1
        target = np.ndarray(value.shape, value.dtype, buffer=segment.map, offset=HEADER)
        np.copyto(target, value)
        return Slot(segment.path, segment.size, value.dtype.str, value.shape)

    def _free(self, nbytes: int) -> Segment | None:
        fits = [s for s in self.segments if s.size - HEADER >= nbytes and s.free]
        if fits:
            return min(fits, key=lambda s: s.size)
        size = Segment.size_for(nbytes)
        if sum(s.size for s in self.segments) + size > self.pool_bytes:
            return None
        self.count += 1
        segment = Segment(Segment.path_for(self.directory, self.token, self.count), size)
        self.segments.append(segment)
        return segment

    def close(self) -> None:
        with self.lock:
            for segment in self.segments:
                unlink(segment.path)
            self.segments = []


class Blocks:
    """Shared memory as `ops.reuse`'s source of large blocks (`ops.reuse.set_source`), and the
    lending of arrays that lie in it to workers on this host (see the module's docstring)."""

    def __init__(self, pool_bytes: int = POOL_BYTES, directory: str = DIRECTORY):
        self.pool_bytes, self.directory = pool_bytes, directory
        self.lock = threading.Lock()
        self.starts: list[int] = []  # sorted addresses of the blocks' first bytes
        self.blocks: dict[int, tuple] = {}  # address -> (segment, block's bytes)
        self.readers: dict[str, int] = {}  # receiving worker -> its pair of bytes (2 r, 2 r + 1)
        self.bytes, self.count = 0, 0
        self.token = os.urandom(4).hex()
        atexit.register(self.close)

    def new(self, nbytes: int) -> np.ndarray | None:
        """A writable block of `nbytes` in a segment of its own; None when the pool is full or
        /dev/shm has no room (ops.reuse then takes the heap)."""
        size = Segment.size_for(nbytes)
        with self.lock:
            if self.bytes + size > self.pool_bytes:
                return None
            self.count += 1
            try:
                segment = Segment(Segment.path_for(self.directory, self.token, f"b{self.count}"), size)
            except OSError:
                return None
            block = np.frombuffer(segment.map, np.uint8, count=nbytes, offset=HEADER)
            start = block.ctypes.data
            bisect.insort(self.starts, start)
            self.blocks[start] = (segment, nbytes)
            self.bytes += size
        # ops.reuse let the block go: its file goes (a receiver's mapping of it stays valid)
        weakref.finalize(block, self._dropped, start)
        return block

    def _dropped(self, start: int) -> None:
        with self.lock:
            segment, _ = self.blocks.pop(start)
            self.starts.remove(start)
            self.bytes -= segment.size
        unlink(segment.path)

    def lent(self, block: np.ndarray) -> bool:
        """Whether a receiver still reads an array it was lent from `block`."""
        found = self.blocks.get(block.ctypes.data)
        if found is None:
            return False
        header = found[0].map[2:HEADER]
        return header[0::2] != header[1::2]

    def lend(self, value, reader: str) -> Slot | None:
        """Where `value` lies, for worker `reader` to read in place, when it lies in one of these
        blocks (C-contiguous); None otherwise, or when `reader` would be more than READERS."""
        if type(value) is not np.ndarray or not value.flags.c_contiguous or value.nbytes == 0:
            return None
        address = value.ctypes.data
        with self.lock:
            i = bisect.bisect_right(self.starts, address) - 1
            if i < 0:
                return None
            start = self.starts[i]
            segment, nbytes = self.blocks[start]
            if address + value.nbytes > start + nbytes:
                return None
            index = self.readers.get(reader)
            if index is None:
                if len(self.readers) >= READERS:
                    return None
                index = self.readers[reader] = 2 * (len(self.readers) + 1)
            # counts modulo 256: up to 255 arrays of one block lent to one worker at a time
            segment.map[index] = (segment.map[index] + 1) % 256
        return Slot(segment.path, segment.size, value.dtype.str, value.shape, HEADER + address - start, index + 1)

    def forget(self, reader: str) -> None:
        """Worker `reader` is gone: what it was lent is read by no one now.  (Its counts of what it
        is done with will not move again: the sender's own counts are set to them.)"""
        with self.lock:
            index = self.readers.pop(reader, None)
            if index is None:
                return
            for segment, _ in self.blocks.values():
                segment.map[index] = segment.map[index + 1]
            # the pair is given to no other worker: a late count from this one would free its arrays
            self.readers[f"(gone) {reader}"] = index

    def close(self) -> None:
        with self.lock:
            for segment, _ in self.blocks.values():
                unlink(segment.path)


def mapping(path: str, size: int) -> mmap.mmap:
    """Another process's segment `path` of `size` bytes, mapped here."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Receiver:
    """The segments this process reads from, each mapped once."""

    def __init__(self):
        self.maps: dict = {}
        self.lock = threading.Lock()

    def read(self, slot: Slot) -> np.ndarray:
        """The array `slot` names, in place; the sender learns it may write there again when the
        array is collected.  A lent array (`Blocks.lend`) is read-only: it is the sender's value."""
        with self.lock:
            mapped = self.maps.get(slot.path)
            if mapped is None or len(mapped) != slot.size:
                self._forget_removed()
                mapped = self.maps[slot.path] = mapping(slot.path, slot.size)
        dtype = np.dtype(slot.dtype)
        nbytes = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
        # The array's memory through an object of its own, which every view of the array keeps alive:
        # the segment is marked only when the last of them is collected.
        window = (ctypes.c_char * max(nbytes, 1)).from_buffer(mapped, slot.offset)
        weakref.finalize(window, self._done, mapped, slot.done)
        array = np.frombuffer(window, dtype, count=nbytes // dtype.itemsize).reshape(slot.shape)
        if slot.done:
            array.flags.writeable = False
        return array

    def _done(self, mapped, done: int) -> None:
        try:
            if done == 0:
                mapped[0] = 0
            else:
                with self.lock:  # collections on two threads must not lose a count
                    mapped[done] = (mapped[done] + 1) % 256
        except ValueError:  # unmapped at exit
            pass

    def _forget_removed(self) -> None:
        """Unmap the segments their senders have removed and nothing here reads any more."""
        for path in [p for p in self.maps if not os.path.exists(p)]:
            try:
                self.maps[path].close()
            except BufferError:  # an array here still reads it
                continue
            del self.maps[path]


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
