"""Large device arrays from one GPU worker to another on the same host through CUDA IPC.

Otherwise a cupy array sent between workers is serialized through host memory: measured on an
H200, 0.92 GB/s between two workers sharing the GPU.  Through IPC the bytes stay on the device:
the sender copies the array into a buffer of its own (memory it took from the driver, not from
the caching allocator, so that the driver can name it to another process) on the stream its
kernels run on, records an interprocess event after the copy, and the message carries the
buffer's and the event's IPC handles (`slot`).  The receiver opens both once, makes the stream its
kernels run on wait for the event and copies the array there into memory of its own: after the
kernels it queued before (the caching allocator may have handed that memory back while they still
read it) and before those it queues after, without waiting on the host.

A buffer holds one array at a time, as a shared-memory segment does (`taskrt.transport.shared_memory`): its
byte in the sender's flags file (host shared memory) says whether it is in use; the sender sets it
before copying, the receiver clears it once its copy has run, and the sender copies into it again
only once it is clear.  A sender keeps at most `POOL_BYTES` of buffers; beyond that (receivers
slow to copy) values go through host memory as before.  The flags file is named after its process
(`shared_memory.sweep` removes it once that process is gone).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
from dataclasses import dataclass

from taskrt.transport import shared_memory

MIN_BYTES = shared_memory.MIN_BYTES  # smaller arrays cost less through host memory than an IPC's bookkeeping
POOL_BYTES = 2 * 2**30  # a sender's buffers at most
GRAIN = 2**20  # buffer sizes rounded up to this, so that similar arrays share buffers
FLAGS = 4096  # buffers a sender can have (a byte each in its flags file)


@dataclass(frozen=True)
class Slot:
    """Where a sent array lies: buffer `index` of the sender whose flags file is `flags`, opened
    through the IPC handle `memory`, ready once the event `event` (an IPC handle too) has passed."""

    flags: str
    index: int
    memory: bytes
    event: bytes
    dtype: str
    shape: tuple

    def as_message(self) -> dict:
        return {"flags": self.flags, "index": self.index, "memory": self.memory, "event": self.event,
                "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_message(message: dict) -> Slot:
        return Slot(message["flags"], message["index"], bytes(message["memory"]), bytes(message["event"]),
                    message["dtype"], tuple(message["shape"]))


def eligible(value) -> bool:
    """A cupy array large enough to be worth a buffer."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray) and value.nbytes >= MIN_BYTES


@dataclass
class _Buffer:
    index: int
    size: int
    pointer: int
    memory: bytes  # its IPC handle
    event: int
    event_handle: bytes


class Sender:
    """A process's IPC buffers and the copying of arrays into them.  `device`: the CUDA calls
    (`CupyDevice`; tests give a fake)."""

    def __init__(self, device=None, pool_bytes: int = POOL_BYTES, directory: str = shared_memory.DIRECTORY):
        self.device = device or CupyDevice()
        self.pool_bytes = pool_bytes
        self.buffers: list[_Buffer] = []
        self.lock = threading.Lock()
        # named after this process, for sweeping; no room in /dev/shm: OSError here
        path = shared_memory.Segment.path_for(directory, os.urandom(4).hex(), "gpuflags")
        segment = shared_memory.Segment(path, FLAGS)
        self.path, self.flags = segment.path, segment.map
        atexit.register(self.close)

    def write(self, array) -> Slot | None:
        """`array` (contiguous) copied into a free buffer after the kernels queued before, or None
        when every buffer is in use and the pool is full (send it through host memory)."""
        nbytes = array.nbytes
        with self.lock:
            buffer = self._free(nbytes)
            if buffer is None:
                return None
            self.flags[buffer.index] = 1
        self.device.copy_and_mark(buffer.pointer, self.device.address(array), nbytes, buffer.event)
        return Slot(self.path, buffer.index, buffer.memory, buffer.event_handle, array.dtype.str, tuple(array.shape))

    def _free(self, nbytes: int) -> _Buffer | None:
        fits = [b for b in self.buffers if b.size >= nbytes and self.flags[b.index] == 0]
        if fits:
            return min(fits, key=lambda b: b.size)
        size = -(-nbytes // GRAIN) * GRAIN
        if sum(b.size for b in self.buffers) + size > self.pool_bytes or len(self.buffers) >= FLAGS:
            return None
        try:
            pointer = self.device.malloc(size)
        except Exception:  # noqa: BLE001  (the device's memory is full: through host memory)
            return None
        event = self.device.ipc_event()
        buffer = _Buffer(len(self.buffers), size, pointer, self.device.memory_handle(pointer), event,
                         self.device.event_handle(event))
        self.buffers.append(buffer)
        return buffer

    def close(self) -> None:
        with self.lock:
            if self.path is not None:
                shared_memory.unlink(self.path)
                self.path = None


class Receiver:
    """The senders' buffers and flags this process reads, each opened once.  A copy is queued on the
    stream the kernels run on (after them: its target may be memory the caching allocator handed
    back while kernels queued earlier still read it); a thread of the receiver's own waits for each
    copy and clears its buffer's flag, so that the value is handed on at once."""

    def __init__(self, device=None):
        self.device = device or CupyDevice()
        self.opened: dict = {}  # IPC handle -> pointer or event here
        self.flags: dict = {}  # flags path -> its mapping
        self.lock = threading.Lock()
        self.copies: queue.Queue = queue.Queue()  # (event after a copy, flags, index) to clear once passed
        self.reads = 0
        threading.Thread(target=self._clear_flags, name="taskrt-gpu-ipc", daemon=True).start()

    def read(self, slot: Slot):
        """A copy of the array `slot` names, in this process's memory (queued: kernels queued after
        it read it complete); the sender may copy into its buffer again once the copy is done."""
        with self.lock:
            pointer = self.opened.get(slot.memory)
            if pointer is None:
                pointer = self.opened[slot.memory] = self.device.open_memory(slot.memory)
            event = self.opened.get(slot.event)
            if event is None:
                event = self.opened[slot.event] = self.device.open_event(slot.event)
            flags = self.flags.get(slot.flags)
            if flags is None:
                flags = self.flags[slot.flags] = shared_memory.mapping(slot.flags, FLAGS)
        out = self.device.empty(slot.shape, slot.dtype)
        done = self.device.copy_after(self.device.address(out), pointer, out.nbytes, event)
        self.copies.put((done, flags, slot.index))
        self.reads += 1
        return out

    def _clear_flags(self):
        while True:
            done, flags, index = self.copies.get()
            try:
                self.device.wait(done)
                flags[index] = 0
            except Exception:  # noqa: BLE001  (the process is ending, or the GPU failed: the sender sends otherwise)
                pass
            finally:
                self.copies.task_done()


class CupyDevice:
    """The CUDA calls of an IPC, through cupy's runtime API."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.runtime = cupy.cuda.runtime

    def address(self, array) -> int:
        return array.data.ptr

    def malloc(self, nbytes: int) -> int:
        return self.runtime.malloc(nbytes)

    def memory_handle(self, pointer: int) -> bytes:
        return bytes(self.runtime.ipcGetMemHandle(pointer))

    def ipc_event(self) -> int:
        runtime = self.runtime
        return runtime.eventCreateWithFlags(runtime.eventDisableTiming | runtime.eventInterprocess)

    def event_handle(self, event: int) -> bytes:
        return bytes(self.runtime.ipcGetEventHandle(event))

    def copy_and_mark(self, target: int, source: int, nbytes: int, event: int) -> None:
        """On the stream the kernels run on (the legacy default): after the kernels that made the source."""
        runtime = self.runtime
        runtime.memcpyAsync(target, source, nbytes, runtime.memcpyDeviceToDevice, 0)
        runtime.eventRecord(event, 0)

    def open_memory(self, handle: bytes) -> int:
        return self.runtime.ipcOpenMemHandle(handle)

    def open_event(self, handle: bytes) -> int:
        return self.runtime.ipcOpenEventHandle(handle)

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def copy_after(self, target: int, source: int, nbytes: int, event: int) -> int:
        """The copy on the kernels' stream once the sender's `event` has passed; an event after it."""
        runtime = self.runtime
        runtime.streamWaitEvent(0, event, 0)
        runtime.memcpyAsync(target, source, nbytes, runtime.memcpyDeviceToDevice, 0)
        done = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        runtime.eventRecord(done, 0)
        return done

    def wait(self, event: int) -> None:
        self.runtime.eventSynchronize(event)
        self.runtime.eventDestroy(event)
