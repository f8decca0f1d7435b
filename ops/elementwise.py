"""Ops whose output element depends on the same element of each input: relu and add."""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError


@dataclass(frozen=True)
class Relu(Op):
    kind = "relu"

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    def forward(self, xs, params, out):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.relu_forward(xs[0])
        return array_module(xs[0]).maximum(xs[0], 0)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        if torch_kernels.use_torch(xs[0]):
            return [torch_kernels.relu_backward(dy, xs[0])], {}
        return [dy * (xs[0] > 0)], {}


@dataclass(frozen=True)
class Add(Op):
    kind = "add"

    def __post_init__(self):
        a, b = self.in_shapes
        if tuple(a) != tuple(b):
            raise ShapeError(f"add needs inputs of the same shape, got {tuple(a)} and {tuple(b)}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    def forward(self, xs, params, out):
        return xs[0] + xs[1]

    def backward(self, dy, xs, y, params, out, need_dx):
        return [dy if need else None for need in need_dx], {}
