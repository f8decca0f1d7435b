"""Concatenation along the channel axis (dimension 1) of rank-4 or rank-2 tensors."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError


@dataclass(frozen=True)
class Concat(Op):
    kind = "concat"

    def __post_init__(self):
        if len(self.in_shapes) < 2:
            raise ShapeError(f"concat needs at least two inputs, got {len(self.in_shapes)}")
        first = tuple(self.in_shapes[0])
        if len(first) not in (2, 4):
            raise ShapeError(f"concat needs rank-4 (n, c, h, w) or rank-2 (n, c) inputs, got shape {first}")
        for i, s in enumerate(self.in_shapes[1:], start=1):
            if len(s) != len(first) or tuple(s[:1]) + tuple(s[2:]) != first[:1] + first[2:]:
                raise ShapeError(
                    f"concat input {i} has shape {tuple(s)}, which differs from input 0 {first} "
                    "outside the channel axis"
                )

    @property
    def offsets(self) -> list[int]:
        return [0, *accumulate(s[1] for s in self.in_shapes)]

    @property
    def out_shape(self):
        first = self.in_shapes[0]
        return (first[0], self.offsets[-1], *first[2:])

    def input_rects(self, out):
        rects = []
        for lo, hi in zip(self.offsets, self.offsets[1:]):
            c0, c1 = max(out.lo[1], lo), min(out.hi[1], hi)
            rects.append(out.replace(1, c0 - lo, c1 - lo) if c0 < c1 else None)
        return rects

    def flops(self, out):
        return 0

    def backward_flops(self, out):
        return 0

    def forward(self, xs, params, out):
        return array_module(*[x for x in xs if x is not None]).concatenate(
            [x for x in xs if x is not None], axis=1
        )

    def backward(self, dy, xs, y, params, out, need_dx):
        dxs, start = [], 0
        for rect, need in zip(self.input_rects(out), need_dx):
            width = 0 if rect is None else rect.shape[1]
            dxs.append(dy[:, start : start + width] if need and rect is not None else None)
            start += width
        return dxs, {}
