"""Flatten (n, c, h, w) -> (n, c*h*w), row-major like numpy's reshape."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


@dataclass(frozen=True)
class Flatten(Op):
    kind = "flatten"

    def __post_init__(self):
        if len(self.in_shapes[0]) < 2:
            raise ShapeError(f"flatten needs an input of rank >= 2, got shape {tuple(self.in_shapes[0])}")

    @property
    def out_shape(self):
        shape = self.in_shapes[0]
        return (shape[0], prod(shape[1:]))

    @property
    def _plane(self) -> int:
        return prod(self.in_shapes[0][2:])

    def input_rects(self, out):
        # A range of flat features covers a range of whole channels (its bounding box).
        shape, plane = self.in_shapes[0], self._plane
        c0, c1 = out.lo[1] // plane, -(-out.hi[1] // plane)
        return [Rect((out.lo[0], c0, *(0,) * (len(shape) - 2)), (out.hi[0], c1, *shape[2:]))]

    def flops(self, out):
        return 0

    def backward_flops(self, out):
        return 0

    def _offset(self, out):
        return out.lo[1] - self.input_rects(out)[0].lo[1] * self._plane

    def forward(self, xs, params, out):
        x = xs[0]
        start = self._offset(out)
        return array_module(x).ascontiguousarray(x.reshape(x.shape[0], -1)[:, start : start + out.shape[1]])

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        xp = array_module(dy)
        dx = xp.zeros(x.shape, dtype=dy.dtype)
        start = self._offset(out)
        dx.reshape(x.shape[0], -1)[:, start : start + out.shape[1]] = dy
        return [dx], {}
