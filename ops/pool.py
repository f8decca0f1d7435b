"""2D max and average pooling, with PyTorch's options: ceil_mode (the last windows may run past the
input) and, for averages, count_include_pad (divide by the window's elements inside the padded input,
or inside the input only).

A window's divisor depends on where it lies in the whole tensor, not in the tile, so a border tile
divides exactly as the whole tensor does."""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.conv import check_window, window_input_rect
from taskrt.ops.errors import ShapeError
from taskrt.ops.pool_kernels import max_pool_grad
from taskrt.ops.windows import crop, pad, pool_out_size, tile_padding, window_offsets


@dataclass(frozen=True)
class Pool2d(Op):
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    mode: str = "max"
    ceil_mode: bool = False
    count_include_pad: bool = True

    kind = "pool2d"

    def __post_init__(self):
        check_window(f"{self.mode} pool2d", self.in_shapes[0], self.kernel, self.stride, self.padding)
        if self.mode not in ("max", "avg"):
            raise ShapeError(f"pool2d mode must be 'max' or 'avg', got {self.mode!r}")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise ShapeError(f"pool2d padding {self.padding} must be at most half the kernel {self.kernel}")
        for what, value in (("ceil_mode", self.ceil_mode), ("count_include_pad", self.count_include_pad)):
            if not isinstance(value, bool):
                raise ShapeError(f"pool2d {what} must be True or False, got {value!r}")
        if self.mode == "max" and not self.count_include_pad:
            raise ShapeError("pool2d count_include_pad=False applies to mode 'avg' only (a max pool never "
                             "counts padding)")

    @property
    def out_shape(self):
        n, c, h, w = self.in_shapes[0]
        return (
            n,
            c,
            pool_out_size(h, self.kernel[0], self.stride[0], self.padding[0], self.ceil_mode),
            pool_out_size(w, self.kernel[1], self.stride[1], self.padding[1], self.ceil_mode),
        )

    def input_rects(self, out):
        # the halo; with ceil_mode the last windows' rows past the input are padding, not read
        channels = (out.lo[1], out.hi[1])
        return [window_input_rect(out, channels, self.kernel, self.stride, self.padding, self.in_shapes[0])]

    def flops(self, out):
        return out.volume * self.kernel[0] * self.kernel[1]

    def _pads(self, out):
        return tile_padding(out, self.kernel, self.stride, self.padding, self.in_shapes[0][2:])

    def _fill(self):
        return -float("inf") if self.mode == "max" else 0.0

    def divisor(self, out, xp, dtype):
        """An average pool's divisor per window of the tile (Ho, Wo), or None where every window
        divides by the kernel's area (the case without options, and tiles away from the borders)."""
        if self.mode != "avg":
            return None
        counts = [window_counts(out.lo[axis], out.hi[axis], k, s, p, size, self.count_include_pad)
                  for axis, k, s, p, size in zip((2, 3), self.kernel, self.stride, self.padding, self.in_shapes[0][2:])]
        if all((c == k).all() for c, k in zip(counts, self.kernel)):
            return None
        return xp.asarray(numpy.outer(*counts), dtype=dtype)

    def forward(self, xs, params, out):
        x = xs[0]
        xp = array_module(x)
        divisor = self.divisor(out, xp, x.dtype)
        if torch_kernels.use_torch(x):
            y = torch_kernels.pool_forward(x, self.kernel, self.stride, self._pads(out), self.mode)
            # torch's tile has its padding explicit, so it divides every window by the kernel's area
            return y if divisor is None else y * (self.kernel[0] * self.kernel[1] / divisor)
        xpad = pad(x, self._pads(out), self._fill())
        combine = xp.maximum if self.mode == "max" else xp.add
        y = None
        for index in window_offsets(xpad.shape, self.kernel, self.stride):
            y = xpad[index].copy() if y is None else combine(y, xpad[index], out=y)
        if self.mode == "avg":
            y /= (self.kernel[0] * self.kernel[1]) if divisor is None else divisor
        return xp.ascontiguousarray(y, dtype=x.dtype)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x, pads = xs[0], self._pads(out)
        divisor = self.divisor(out, array_module(x), x.dtype)
        if torch_kernels.use_torch(x):
            if divisor is not None:  # torch divides by the kernel's area (see forward)
                dy = dy * (self.kernel[0] * self.kernel[1] / divisor)
            return [torch_kernels.pool_backward(dy, x, self.kernel, self.stride, pads, self.mode)], {}
        if self.mode == "avg":
            return [avg_grad(x, dy, self.kernel, self.stride, pads, divisor)], {}
        if y is None:
            y = self.forward(xs, params, out)
        if array_module(x) is numpy:
            dx = numpy.zeros(x.shape, dtype=x.dtype)
            contiguous = numpy.ascontiguousarray
            max_pool_grad(contiguous(x), contiguous(y), contiguous(dy), dx, *self.kernel, *self.stride, pads[0][0],
                          pads[1][0])
            return [dx], {}
        return [max_grad_whole_tile(x, y, dy, self.kernel, self.stride, pads)], {}

    def attrs(self):
        attrs = {"kernel": list(self.kernel), "stride": list(self.stride), "padding": list(self.padding),
                 "mode": self.mode}
        # the options only where set, so graphs saved before them describe themselves as they did
        if self.ceil_mode:
            attrs["ceil_mode"] = True
        if not self.count_include_pad:
            attrs["count_include_pad"] = False
        return attrs


def window_counts(o0, o1, kernel, stride, padding, size, include_pad):
    """Elements of each window of outputs [o0, o1) along one axis that an average divides by, as
    torch counts them: inside the padded input (a ceil_mode window running past it is cut), or
    inside the input only."""
    start = numpy.arange(o0, o1) * stride - padding
    stop = numpy.minimum(start + kernel, size + padding)
    if not include_pad:
        start, stop = numpy.maximum(start, 0), numpy.minimum(stop, size)
    return stop - start


def max_grad_whole_tile(x, y, dy, kernel, stride, pads):
    """Max-pool backward by kh*kw whole-tile operations (any array module; numpy uses `max_pool_grad`).

    The first maximum in window order gets the gradient: a tile sees the same window contents as
    the whole tensor, so it picks the same element."""
    xp = array_module(x)
    xpad = pad(x, pads, -float("inf"))
    dx = xp.zeros(xpad.shape, dtype=x.dtype)
    taken = xp.zeros(dy.shape, dtype=bool)
    for index in window_offsets(xpad.shape, kernel, stride):
        hit = (xpad[index] == y) & ~taken
        dx[index] += xp.where(hit, dy, 0)
        taken |= hit
    return crop(dx, pads)


def avg_grad(x, dy, kernel, stride, pads, divisor=None):
    """Average-pool backward: dy / divisor (the kernel's area, or one per window) to every window element."""
    (pt, pb), (pl, pr) = pads
    n, c, h, w = x.shape
    dx = array_module(x).zeros((n, c, h + pt + pb, w + pl + pr), dtype=x.dtype)
    scaled = dy / (kernel[0] * kernel[1] if divisor is None else divisor)
    for index in window_offsets(dx.shape, kernel, stride):
        dx[index] += scaled
    return crop(dx, pads)
