"""Measuring on a worker the memory a step holds: the bytes of the distinct buffers of its values.

    held = Held()
    held.add(value); held.drop(value)      # a value appears, a value is let go
    held.peak                              # the most held at once

A device's program (`taskrt.execution.program_executor`) adds each value as it appears (given to
the step, computed by a task, inside a fused run too, or received from another device) and
drops it where the program or the run lets it go.  A value is counted by its buffer: a view (an
alias, a tuple's element, a slice, a reshape, an array in a received message) is followed by
`.base` to the array that owns the memory, so a buffer is counted once however many values read
it.  This is the sum `taskrt.planning.peak` predicts.  Adding a value costs a type check, the
walk along `.base` and a dictionary operation; letting it go, two dictionary operations on its id
(the value itself is not read again): a few tenths of a microsecond each, some tens of
microseconds per step of a LeNet-5 device (about 130 values).

On a GPU worker whose cupy allocates from torch's allocator (`taskrt.gpu.device`), the step's
peak as the allocator saw it is measured too: kernels' temporaries included.
"""

from __future__ import annotations

import sys

import numpy as np


class Held:
    """Bytes held by distinct buffers: `now`, and `peak` since it was made (one step's)."""

    __slots__ = ("_held", "_of", "_arrays", "now", "peak")

    def __init__(self):
        self._held: dict = {}  # id of the array that owns a buffer -> [references, bytes]
        # id of a value added -> the ids of its buffers' owners (one, or a tuple's): a value is let
        # go without reading it again (after a kernel has run, its header is no longer in the
        # processor's caches).  An id taken again by a later value is written again when it is added.
        self._of: dict = {}
        self._arrays = array_types()
        self.now = 0
        self.peak = 0

    def add(self, value, times: int = 1) -> None:
        """`value` (an array, a tuple of arrays and Nones, or anything else, which holds nothing
        counted here) appears `times` over."""
        if type(value) is tuple:
            owners = []
            for element in value:
                if element is not None:
                    owners.append(self._add(element, times))
            self._of[id(value)] = tuple(owners)
        elif isinstance(value, self._arrays):
            self._of[id(value)] = self._add(value, times)

    def _add(self, value, times: int):
        arrays = self._arrays
        if not isinstance(value, arrays):
            return None
        base = value.base
        while base is not None and isinstance(base, arrays):  # a view: to the array that owns the memory
            value, base = base, base.base
        owner = id(value)
        entry = self._held.get(owner)
        if entry is None:
            self._held[owner] = [times, value.nbytes]
            self.now += value.nbytes
            if self.now > self.peak:
                self.peak = self.now
        else:
            entry[0] += times
        return owner

    def drop(self, value) -> None:
        """`value`, added before, is let go once."""
        owners = self._of.get(id(value))
        if owners is None:
            return
        for owner in owners if type(owners) is tuple else (owners,):
            entry = self._held.get(owner)
            if entry is not None:
                entry[0] -= 1
                if not entry[0]:
                    self.now -= entry[1]
                    del self._held[owner]


def array_types() -> tuple:
    """The array types a step's values may be: numpy's, and cupy's where it is imported (a GPU
    worker imports it as it starts, `taskrt.machines.worker_setup`)."""
    cupy = sys.modules.get("cupy")
    return (np.ndarray,) if cupy is None else (np.ndarray, cupy.ndarray)


def start_allocator_peak(gpu: bool) -> None:
    """On a GPU worker whose cupy allocates from torch's allocator: its peak starts over now."""
    if gpu and _torch_allocator():
        sys.modules["torch"].cuda.reset_peak_memory_stats()


def allocator_peak(gpu: bool) -> int | None:
    """The most torch's allocator held since `start_allocator_peak` (None where it is not the
    allocator of this worker's arrays: a CPU worker, or cupy's own pool)."""
    if gpu and _torch_allocator():
        return int(sys.modules["torch"].cuda.max_memory_allocated())
    return None


def _torch_allocator() -> bool:
    from taskrt.gpu import device

    return device.shares_torch_allocator()


class StepOutOfMemory(MemoryError):
    """A device's program ran out of memory (raised on its worker in place of the allocator's own
    error): `device`, the step's `tag`, the bytes its values held then (`held`) and at most
    before (`peak`), and the allocator's error (`error`, as its repr)."""

    def __init__(self, device: int, tag: str, held: int, peak: int, error: str):
        super().__init__(f"device {device} ran out of memory in step {tag}, holding {held / 2**20:.1f} MiB of "
                         f"the step's values (at most {peak / 2**20:.1f} MiB before): {error}")
        self.device, self.tag, self.held, self.peak, self.error = device, tag, held, peak, error

    def caused_by(self, error: BaseException) -> StepOutOfMemory:
        self.__cause__ = error
        return self

    def __reduce__(self):  # travels to the client as it is (without its cause, which may not unpickle)
        return (StepOutOfMemory, (self.device, self.tag, self.held, self.peak, self.error))


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocator's: MemoryError (numpy's included; cupy's OutOfMemoryError is
    one), or torch's CUDA OutOfMemoryError (a RuntimeError)."""
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom is not None and isinstance(error, oom)
