"""Fully-connected layer: y = x @ W.T + b, weight (out, in).  Splits over {n, c}."""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from taskrt.ops import reuse, torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


@dataclass(frozen=True)
class Linear(Op):
    out_features: int
    activation: str | None = None
    bias: bool = True

    kind = "linear"

    @property
    def saves_output(self):
        return self.activation == "relu"

    def __post_init__(self):
        if len(self.in_shapes[0]) != 2:
            raise ShapeError(
                f"linear needs a rank-2 (n, c) input, got shape {tuple(self.in_shapes[0])}; flatten it first"
            )
        if self.out_features < 1:
            raise ShapeError(f"linear out_features must be >= 1, got {self.out_features}")
        if self.activation not in (None, "relu"):
            raise ShapeError(f"linear activation must be None or 'relu', got {self.activation!r}")

    @property
    def out_shape(self):
        return (self.in_shapes[0][0], self.out_features)

    def param_shapes(self):
        shapes = {"weight": (self.out_features, self.in_shapes[0][1])}
        return {**shapes, "bias": (self.out_features,)} if self.bias else shapes

    def input_rects(self, out):
        # A channel split still reads every input feature (the paper's Figure 2b).
        return [Rect((out.lo[0], 0), (out.hi[0], self.in_shapes[0][1]))]

    def param_rects(self, out):
        c0, c1 = out.lo[1], out.hi[1]
        rects = {"weight": Rect((c0, 0), (c1, self.in_shapes[0][1]))}
        return {**rects, "bias": Rect((c0,), (c1,))} if self.bias else rects

    def flops(self, out):
        return 2 * out.volume * self.in_shapes[0][1]

    def forward(self, xs, params, out):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.linear_forward(xs[0], params, self.activation)
        x, w = xs[0], params["weight"]
        if array_module(x) is numpy and x.shape[0] < w.shape[0]:
            # OpenBLAS multiplies a small batch 1.1-1.6x faster as W @ x.T (measured, 16-256 rows by 4096x4096)
            y = numpy.ascontiguousarray(numpy.matmul(w, x.T).T)
        else:
            y = x @ w.T
        if self.bias:
            y += params["bias"]
        if self.activation == "relu":
            array_module(y).maximum(y, 0, out=y)
        return y

    def backward(self, dy, xs, y, params, out, need_dx):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.linear_backward(dy, xs[0], y, params, self.activation, need_dx[0])
        if self.activation == "relu":
            dy = dy * (y > 0)
        xp = array_module(dy)
        # the weight gradient is as large as the weights (64 MiB for VGG's fc2): reused memory for numpy
        dw = reuse.empty((dy.shape[1], xs[0].shape[1]), xp.result_type(dy, xs[0])) if xp is numpy else None
        grads = {"weight": xp.matmul(dy.T, xs[0], out=dw)}
        if self.bias:
            grads["bias"] = dy.sum(axis=0)
        return [dy @ params["weight"] if need_dx[0] else None], grads

    def attrs(self):
        return {"out_features": self.out_features, "activation": self.activation, "bias": self.bias}
