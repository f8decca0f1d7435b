"""2D max and average pooling (average counts padding, like count_include_pad=True)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.conv import check_window, window_input_rect
from taskrt.ops.errors import ShapeError
from taskrt.ops.pool_kernels import max_pool_grad
from taskrt.ops.windows import crop, out_size, pad, tile_padding, window_offsets


@dataclass(frozen=True)
class Pool2d(Op):
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    mode: str = "max"

    kind = "pool2d"

    def __post_init__(self):
        check_window(f"{self.mode} pool2d", self.in_shapes[0], self.kernel, self.stride, self.padding)
        if self.mode not in ("max", "avg"):
            raise ShapeError(f"pool2d mode must be 'max' or 'avg', got {self.mode!r}")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise ShapeError(f"pool2d padding {self.padding} must be at most half the kernel {self.kernel}")

    @property
    def out_shape(self):
        n, c, h, w = self.in_shapes[0]
        return (
            n,
            c,
            out_size(h, self.kernel[0], self.stride[0], self.padding[0]),
            out_size(w, self.kernel[1], self.stride[1], self.padding[1]),
        )

    def input_rects(self, out):
        channels = (out.lo[1], out.hi[1])
        return [window_input_rect(out, channels, self.kernel, self.stride, self.padding, self.in_shapes[0])]

    def flops(self, out):
        return out.volume * self.kernel[0] * self.kernel[1]

    def _pads(self, out):
        return tile_padding(out, self.kernel, self.stride, self.padding, self.in_shapes[0][2:])

    def _fill(self):
        return -float("inf") if self.mode == "max" else 0.0

    def forward(self, xs, params, out):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.pool_forward(xs[0], self.kernel, self.stride, self._pads(out), self.mode)
        xp = array_module(xs[0])
        xpad = pad(xs[0], self._pads(out), self._fill())
        combine = xp.maximum if self.mode == "max" else xp.add
        y = None
        for index in window_offsets(xpad.shape, self.kernel, self.stride):
            y = xpad[index].copy() if y is None else combine(y, xpad[index], out=y)
        if self.mode == "avg":
            y /= self.kernel[0] * self.kernel[1]
        return xp.ascontiguousarray(y, dtype=xs[0].dtype)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x, pads = xs[0], self._pads(out)
        if torch_kernels.use_torch(x):
            return [torch_kernels.pool_backward(dy, x, self.kernel, self.stride, pads, self.mode)], {}
        if self.mode == "avg":
            return [avg_grad(x, dy, self.kernel, self.stride, pads)], {}
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
        return {"kernel": list(self.kernel), "stride": list(self.stride), "padding": list(self.padding),
                "mode": self.mode}


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


def avg_grad(x, dy, kernel, stride, pads):
    (pt, pb), (pl, pr) = pads
    n, c, h, w = x.shape
    dx = array_module(x).zeros((n, c, h + pt + pb, w + pl + pr), dtype=x.dtype)
    scaled = dy / (kernel[0] * kernel[1])
    for index in window_offsets(dx.shape, kernel, stride):
        dx[index] += scaled
    return crop(dx, pads)
