"""Ops whose output element depends on the same element of each input: relu, add, and mul and sub
(which may broadcast one input over h and w)."""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


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


@dataclass(frozen=True)
class BroadcastBinary(Op):
    """Two inputs of one shape, or one (n, c, h, w) and one (n, c, 1, 1) that broadcasts over h and w
    (squeeze-and-excitation's channel scales), either order.  A part reads its own Rect of the full
    input and its samples and channels of the broadcast one; that one's gradient is the tile's sum
    over h and w, and the runtime adds the sums of the parts sharing those samples and channels."""

    kind = "broadcast_binary"

    def __post_init__(self):
        if len(self.in_shapes) != 2:
            raise ShapeError(f"{self.kind} takes two inputs, got {len(self.in_shapes)}")
        a, b = (tuple(s) for s in self.in_shapes)
        if a != b and self.broadcast_input is None:
            raise ShapeError(f"{self.kind} needs inputs of the same shape, or one (n, c, h, w) and one (n, c, 1, 1) "
                             f"that broadcasts over h and w, got {a} and {b}")

    @property
    def broadcast_input(self) -> int | None:
        """Which input is (n, c, 1, 1) against the other's (n, c, h, w); None when the shapes are equal."""
        a, b = (tuple(s) for s in self.in_shapes)
        if a == b or len(a) != 4 or len(b) != 4 or a[:2] != b[:2]:
            return None
        return 0 if a[2:] == (1, 1) else 1 if b[2:] == (1, 1) else None

    @property
    def out_shape(self):
        return tuple(self.in_shapes[1 if self.broadcast_input == 0 else 0])

    def input_rects(self, out):
        k = self.broadcast_input
        if k is None:
            return [out, out]
        channels = Rect(out.lo[:2] + (0, 0), out.hi[:2] + (1, 1))
        return [channels if j == k else out for j in range(2)]

    def _to_input(self, j, grad):
        """`grad`, of the output tile's shape, as input j's gradient: summed over h and w if j broadcasts."""
        return grad.sum(axis=(2, 3), keepdims=True) if j == self.broadcast_input else grad


@dataclass(frozen=True)
class Mul(BroadcastBinary):
    kind = "mul"

    def backward_flops(self, out):
        # a product per input gradient, and the broadcast input's sum
        return (2 if self.broadcast_input is None else 3) * out.volume

    def forward(self, xs, params, out):
        return xs[0] * xs[1]

    def backward(self, dy, xs, y, params, out, need_dx):
        return [self._to_input(j, dy * xs[1 - j]) if need_dx[j] else None for j in range(2)], {}


@dataclass(frozen=True)
class Sub(BroadcastBinary):
    kind = "sub"

    def backward_flops(self, out):
        # the second input's negation, and the broadcast input's sum
        return (1 if self.broadcast_input is None else 2) * out.volume

    def forward(self, xs, params, out):
        return xs[0] - xs[1]

    def backward(self, dy, xs, y, params, out, need_dx):
        grads = [self._to_input(0, dy) if need_dx[0] else None, self._to_input(1, -dy) if need_dx[1] else None]
        return grads, {}
