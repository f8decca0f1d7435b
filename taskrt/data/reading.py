"""Reading a data tile on its device: the tasks that stand for a step's DATA dependencies when
its batch comes from a dataset (`taskrt.data.datasets`).  Runs on workers.

A read task is ('<input layer>-read-it<step>', part) on the part's device; it is given the step's
sample indices (the same small array for every part: each part takes the rows its Rect selects)
and reads exactly the part's Rect: those samples' values in the Rect's window of the other
dimensions.  It is a Dask task of its own, not fused into the device's run, so the reads of the
next step run as soon as they are submitted, while the current step still computes (read-ahead);
a plain function, so a per-device program can call it as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taskrt.data.datasets import DataReadError
from taskrt.gpu.device import to_device
from taskrt.ops.rect import Rect


@dataclass(frozen=True)
class TileRead:
    """What a step's graph needs to read one data tile on its device: the arguments of `read_tile`.
    `source`: the dataset, or, for a dataset whose arrays were placed on the device, the future
    of the field's copy there."""

    source: object
    field: str
    indices: np.ndarray  # the step's samples (the whole batch)
    rect: Rect  # the part of the input tensor this device reads
    dtype: str
    layer: str  # the input layer, for errors

    @property
    def args(self) -> tuple:
        return (self.source, self.field, self.indices, self.rect, self.dtype, self.layer)


def read_tile(source, field: str, indices, rect: Rect, dtype: str, layer: str = "") -> np.ndarray:
    """The part `rect` of input `layer` whose rows are samples `indices` of `field`: rows
    rect.lo[0]:rect.hi[0] of `indices`, each cut to the window of `rect`'s other dimensions, as
    `dtype`.  `source`: a dataset, or the placed array of the field (samples first)."""
    rows = np.asarray(indices)[rect.lo[0]:rect.hi[0]]
    window = tuple(slice(lo, hi) for lo, hi in zip(rect.lo[1:], rect.hi[1:]))
    if isinstance(source, np.ndarray):
        tile = source[(rows,) + window]
    else:
        try:
            tile = source.read(field, rows, window)
        except DataReadError as error:
            raise DataReadError(f"input {layer!r}, samples {rows.tolist()}: {error}") from None
    return np.ascontiguousarray(tile, dtype=dtype)


def tile_on_device(source, field: str, indices, rect: Rect, dtype: str, layer: str = ""):
    """A GPU worker's read, without waiting for the GPU: a source that generates its values
    (`Synthetic`, `taskrt.data.synthetic`) computes the window on the device from the step's indices;
    any other is read in host memory and copied through pinned memory on a stream of its own
    (`taskrt.gpu.staging.to_device_async`), so the copy overlaps the kernels of the step before."""
    from taskrt.gpu.device import is_gpu
    from taskrt.gpu.staging import to_device_async

    if not is_gpu():  # a CPU worker standing in for a GPU device (tests): the host read
        return to_device(read_tile(source, field, indices, rect, dtype, layer))
    if getattr(source, "generated", False):
        import cupy

        rows = to_device_async(np.asarray(indices, dtype=np.int64)[rect.lo[0]:rect.hi[0]])
        window = tuple(slice(lo, hi) for lo, hi in zip(rect.lo[1:], rect.hi[1:]))
        return cupy.ascontiguousarray(source.read(field, rows, window, xp=cupy, dtype=dtype).astype(dtype, copy=False))
    return to_device_async(read_tile(source, field, indices, rect, dtype, layer))
