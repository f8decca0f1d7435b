"""Softmax cross-entropy: logits (n, k) and integer labels (n,) -> per-sample loss (n,).

The training loss is the mean of the per-sample losses over the whole batch, so the
gradient arriving at each per-sample loss is 1/N; the caller passes it as `dy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


@dataclass(frozen=True)
class SoftmaxCrossEntropy(Op):
    kind = "softmax_cross_entropy"

    def __post_init__(self):
        logits, labels = self.in_shapes
        if len(logits) != 2:
            raise ShapeError(f"softmax_cross_entropy needs rank-2 (n, classes) logits, got {tuple(logits)}")
        if tuple(labels) != (logits[0],):
            raise ShapeError(f"softmax_cross_entropy labels must have shape ({logits[0]},), got {tuple(labels)}")

    @property
    def out_shape(self):
        return (self.in_shapes[0][0],)

    def input_rects(self, out):
        k = self.in_shapes[0][1]
        return [Rect((out.lo[0], 0), (out.hi[0], k)), out]

    def flops(self, out):
        return 4 * out.volume * self.in_shapes[0][1]

    @staticmethod
    def _log_softmax(z):
        xp = array_module(z)
        z = z - z.max(axis=1, keepdims=True)
        return z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))

    def forward(self, xs, params, out):
        logits, labels = xs
        if torch_kernels.use_torch(logits):
            return torch_kernels.cross_entropy_forward(logits, labels)
        xp = array_module(logits)
        logp = self._log_softmax(logits)
        return -logp[xp.arange(logits.shape[0]), labels]

    def backward(self, dy, xs, y, params, out, need_dx):
        logits, labels = xs
        if torch_kernels.use_torch(logits):
            return [torch_kernels.cross_entropy_backward(dy, logits, labels) if need_dx[0] else None, None], {}
        xp = array_module(logits)
        grad = xp.exp(self._log_softmax(logits))
        grad[xp.arange(logits.shape[0]), labels] -= 1
        grad *= dy[:, None]
        return [grad if need_dx[0] else None, None], {}
