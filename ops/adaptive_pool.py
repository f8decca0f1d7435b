"""Adaptive pooling to an output size, and the mean over h and w (global average pooling).

Adaptive pooling's bins are PyTorch's: output row i reads input rows [floor(i*H/oh), ceil((i+1)*H/oh)),
so bins overlap where oh does not divide H; columns likewise.  A part owning output rows [i0, i1)
reads input rows [floor(i0*H/oh), ceil(i1*H/oh)): whole bins, and samples and channels as its own.
Each bin's rows and columns are indexed in whole-tensor coordinates, so a tile's bins are the
whole tensor's and a tile computes exactly its slice of the whole output.

The mean over (h, w) is torchvision's `x.mean((2, 3))`: each part reads the whole planes of its
samples and channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect

ADAPTIVE_MODES = ("avg", "max")


def bin_start(i: int, out: int, size: int) -> int:
    return i * size // out


def bin_stop(i: int, out: int, size: int) -> int:
    """End of bin i - 1, ceil(i * size / out): bin i - 1 is [bin_start(i - 1), bin_stop(i))."""
    return -(-i * size // out)


def bins(o0: int, o1: int, out: int, size: int, offset: int = 0) -> list[tuple[int, int]]:
    """Input range of each output o0..o1-1 along one axis, less `offset` (where the tile starts)."""
    return [(bin_start(i, out, size) - offset, bin_stop(i + 1, out, size) - offset) for i in range(o0, o1)]


def _rank4(what, in_shapes):
    if len(in_shapes) != 1:
        raise ShapeError(f"{what} takes one input, got {len(in_shapes)}")
    if len(in_shapes[0]) != 4:
        raise ShapeError(f"{what} needs a rank-4 (n, c, h, w) input, got shape {tuple(in_shapes[0])}")


@dataclass(frozen=True)
class AdaptivePool2d(Op):
    """torch's adaptive_avg_pool2d / adaptive_max_pool2d to `output_size` (oh, ow)."""

    output_size: tuple[int, int]
    mode: str = "avg"

    kind = "adaptive_pool2d"

    def __post_init__(self):
        _rank4("adaptive_pool2d", self.in_shapes)
        if self.mode not in ADAPTIVE_MODES:
            raise ShapeError(f"adaptive_pool2d mode must be one of {', '.join(map(repr, ADAPTIVE_MODES))}, "
                             f"got {self.mode!r}")
        size = tuple(self.output_size)
        if len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size):
            raise ShapeError(f"adaptive_pool2d output_size must be a pair (oh, ow) of ints >= 1, got {size!r}")

    @property
    def out_shape(self):
        n, c, _, _ = self.in_shapes[0]
        return (n, c, *self.output_size)

    def _bins(self, out, tile=None):
        """Row bins and column bins of the tile's outputs, relative to the input tile `tile` if given."""
        _, _, h, w = self.in_shapes[0]
        (oh, ow), lo = self.output_size, (0, 0) if tile is None else tile.lo[2:]
        return (bins(out.lo[2], out.hi[2], oh, h, lo[0]), bins(out.lo[3], out.hi[3], ow, w, lo[1]))

    def input_rects(self, out):
        _, _, h, w = self.in_shapes[0]
        oh, ow = self.output_size
        return [Rect((out.lo[0], out.lo[1], bin_start(out.lo[2], oh, h), bin_start(out.lo[3], ow, w)),
                     (out.hi[0], out.hi[1], bin_stop(out.hi[2], oh, h), bin_stop(out.hi[3], ow, w)))]

    def _areas(self, out):
        rows, cols = self._bins(out)
        return [b - a for a, b in rows], [b - a for a, b in cols]

    def flops(self, out):
        # every element of every bin, once (bins overlap where the size does not divide)
        heights, widths = self._areas(out)
        return out.shape[0] * out.shape[1] * sum(heights) * sum(widths)

    def backward_flops(self, out):
        return self.flops(out)

    def forward(self, xs, params, out):
        x = xs[0]
        xp = array_module(x)
        rows, cols = self._bins(out, self.input_rects(out)[0])
        reduce = xp.max if self.mode == "max" else xp.sum
        # rows first, then columns: a bin's maximum or sum taken in two steps
        by_row = xp.stack([reduce(x[:, :, a:b], axis=2) for a, b in rows], axis=2)
        y = xp.stack([reduce(by_row[..., a:b], axis=3) for a, b in cols], axis=3)
        if self.mode == "avg":
            heights, widths = self._areas(out)
            y /= xp.asarray(numpy.outer(heights, widths), dtype=x.dtype)
        return xp.ascontiguousarray(y)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        xp = array_module(x)
        rows, cols = self._bins(out, self.input_rects(out)[0])
        dx = xp.zeros(x.shape, dtype=x.dtype)
        if self.mode == "avg":
            heights, widths = self._areas(out)
            g = dy / xp.asarray(numpy.outer(heights, widths), dtype=x.dtype)
            by_row = xp.zeros(g.shape[:3] + x.shape[3:], dtype=x.dtype)
            for j, (a, b) in enumerate(cols):
                by_row[..., a:b] += g[..., j : j + 1]
            for i, (a, b) in enumerate(rows):
                dx[:, :, a:b] += by_row[:, :, i : i + 1]
            return [dx], {}
        n, c = x.shape[:2]
        for i, (a, b) in enumerate(rows):
            for j, (e, f) in enumerate(cols):
                # torch's choice among equal maxima: the first in row-major order of the bin
                window = x[:, :, a:b, e:f].reshape(n, c, -1)
                first = window.argmax(axis=2)
                hit = xp.arange(window.shape[2]) == first[..., None]
                dx[:, :, a:b, e:f] += xp.where(hit, dy[:, :, i, j, None], 0).reshape(n, c, b - a, f - e)
        return [dx], {}

    def attrs(self):
        return {"output_size": list(self.output_size), "mode": self.mode}


@dataclass(frozen=True)
class Mean(Op):
    """The mean over h and w of an (n, c, h, w) tensor: (n, c), or (n, c, 1, 1) with keepdim."""

    keepdim: bool = False

    kind = "mean"

    def __post_init__(self):
        _rank4("mean", self.in_shapes)
        if not isinstance(self.keepdim, bool):
            raise ShapeError(f"mean keepdim must be True or False, got {self.keepdim!r}")

    @property
    def out_shape(self):
        n, c, _, _ = self.in_shapes[0]
        return (n, c, 1, 1) if self.keepdim else (n, c)

    @property
    def _plane(self) -> int:
        _, _, h, w = self.in_shapes[0]
        return h * w

    def input_rects(self, out):
        _, _, h, w = self.in_shapes[0]
        return [Rect((out.lo[0], out.lo[1], 0, 0), (out.hi[0], out.hi[1], h, w))]

    def flops(self, out):
        return out.volume * self._plane

    def backward_flops(self, out):
        return out.volume * self._plane

    def forward(self, xs, params, out):
        return xs[0].mean(axis=(2, 3), keepdims=self.keepdim)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        dx = array_module(x).empty(x.shape, dtype=x.dtype)
        dx[...] = (dy / self._plane).reshape(x.shape[0], x.shape[1], 1, 1)
        return [dx], {}

    def attrs(self):
        return {"keepdim": self.keepdim}
