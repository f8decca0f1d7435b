"""Batch normalization over (n, c) or (n, c, h, w): per channel, y = (x - mean) / sqrt(var + eps) * weight
+ bias, with the batch's mean and (biased) variance while training and running statistics for
inference (PyTorch's: momentum 0.1, running variance unbiased).

A channel's statistics reduce over every dimension but `c`, so a split over `n`, `h` or `w` needs
the parts' partial statistics combined.  The kernels come in the pieces the lowering makes tasks
of, and the whole-tile `forward` / `backward` are the same pieces applied to one part:

    partial_stats(x)            -> (3, C) count, mean, M2 of one part   (forward, per part)
    combine_stats([partials])   -> (3, C) the same of their union      (forward, per channel group)
    normalize(x, stats, params) -> y                                   (forward, per part)
    grad_sums(dy, x, stats)     -> {"bias": sum dy, "weight": sum dy * xhat}   (backward, per part; summed
                                   over a group they are also the parameter gradients)
    input_grad(dy, x, stats, sums, params) -> dx                       (backward, per part)

Partial statistics are combined with Chan et al.'s pairwise formula (count, mean, sum of squared
deviations), so a split computes the single-device mean and variance to rounding, without the
cancellation of sum-of-squares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taskrt.ops import batchnorm_kernels as loops
from taskrt.ops import torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


def _axes(x) -> tuple[int, ...]:
    return (0,) if x.ndim == 2 else (0, 2, 3)


def _per_channel(v, ndim):
    """A (C,) vector shaped to broadcast against an (n, C) or (n, C, h, w) tile."""
    return v if ndim == 2 else v[None, :, None, None]


def partial_stats(x):
    """(count, mean, M2) per channel of one tile, as a (3, C) array."""
    if torch_kernels.use_torch(x):
        return torch_kernels.bn_partial_stats(x)
    if loops.usable(x):  # numpy NCHW: one numba pass per statistic (ops.batchnorm_kernels)
        out = np.empty((3, x.shape[1]), dtype=x.dtype)
        loops.stats(x, out)
        return out
    xp, axes = array_module(x), _axes(x)
    count = x.size // x.shape[1]
    mean = x.mean(axis=axes)
    centered = x - _per_channel(mean, x.ndim)
    m2 = (centered * centered).sum(axis=axes)
    return xp.stack([xp.full_like(mean, count), mean, m2])


def combine_stats(partials):
    """(count, mean, M2) of the union of parts from theirs (Chan, Golub and LeVeque)."""
    if len(partials) == 1:
        return partials[0]
    xp = array_module(partials[0])
    stacked = xp.stack(partials)  # (parts, 3, C)
    counts, means, m2s = stacked[:, 0], stacked[:, 1], stacked[:, 2]
    count = counts.sum(axis=0)
    mean = (counts * means).sum(axis=0) / count
    m2 = m2s.sum(axis=0) + (counts * (means - mean) ** 2).sum(axis=0)
    return xp.stack([count, mean, m2])


def _invstd(stats, eps):
    return 1.0 / array_module(stats).sqrt(stats[2] / stats[0] + eps)


def _xhat(x, stats, eps):
    xp = array_module(x)
    count, mean, m2 = stats
    invstd = 1.0 / xp.sqrt(m2 / count + eps)
    return (x - _per_channel(mean, x.ndim)) * _per_channel(invstd, x.ndim), invstd


@dataclass(frozen=True)
class BatchNorm(Op):
    eps: float = 1e-5
    momentum: float = 0.1

    kind = "batch_norm"
    #: the statistics of a channel reduce over all of its parts (see taskrt.planning.lowering)
    reduces_statistics = True
    #: dependent tasks added to each direction by that reduction (partial, combine, then the part)
    statistics_hops = 2

    def __post_init__(self):
        if len(self.in_shapes[0]) not in (2, 4):
            raise ShapeError(f"batch_norm needs a rank-2 (n, c) or rank-4 (n, c, h, w) input, "
                             f"got shape {tuple(self.in_shapes[0])}")
        if not self.eps > 0:
            raise ShapeError(f"batch_norm eps must be > 0, got {self.eps}")
        if not 0 <= self.momentum <= 1:
            raise ShapeError(f"batch_norm momentum must be in [0, 1], got {self.momentum}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    @property
    def channels(self) -> int:
        return self.in_shapes[0][1]

    def param_shapes(self):
        return {"weight": (self.channels,), "bias": (self.channels,)}

    def buffer_shapes(self):
        return {"running_mean": (self.channels,), "running_var": (self.channels,)}

    def param_rects(self, out):
        c = Rect((out.lo[1],), (out.hi[1],))
        return {"weight": c, "bias": c}

    def flops(self, out):
        return 7 * out.volume  # statistics (3 per element), then subtract, scale, multiply, add

    def backward_flops(self, out):
        return 11 * out.volume

    # ---- kernels in pieces ------------------------------------------------------------------
    partial_stats = staticmethod(partial_stats)
    combine_stats = staticmethod(combine_stats)

    def normalize(self, x, stats, params):
        if torch_kernels.use_torch(x):
            return torch_kernels.bn_normalize(x, stats, params["weight"], params["bias"], self.eps)
        if loops.usable(x):
            out = np.empty_like(x)
            loops.normalize(x, stats[1], _invstd(stats, self.eps), params["weight"], params["bias"], out)
            return out
        xhat, _ = _xhat(x, stats, self.eps)
        return xhat * _per_channel(params["weight"], x.ndim) + _per_channel(params["bias"], x.ndim)

    def grad_sums(self, dy, x, stats) -> dict:
        if torch_kernels.use_torch(x):
            return torch_kernels.bn_grad_sums(dy, x, stats, self.eps)
        if loops.usable(dy, x):
            sum_dy, sum_dy_xhat = np.empty(x.shape[1]), np.empty(x.shape[1])
            loops.grad_sums(dy, x, stats[1], _invstd(stats, self.eps), sum_dy, sum_dy_xhat)
            return {"bias": sum_dy.astype(x.dtype), "weight": sum_dy_xhat.astype(x.dtype)}
        xhat, _ = _xhat(x, stats, self.eps)
        axes = _axes(x)
        return {"bias": dy.sum(axis=axes), "weight": (dy * xhat).sum(axis=axes)}

    def input_grad(self, dy, x, stats, sums, params):
        """dx = weight * invstd / N * (N dy - sum dy - xhat sum(dy xhat)), sums over the whole group."""
        if torch_kernels.use_torch(x):
            return torch_kernels.bn_input_grad(dy, x, stats, sums, params["weight"], self.eps)
        if loops.usable(dy, x):
            invstd = _invstd(stats, self.eps)
            out = np.empty_like(x)
            loops.input_grad(dy, x, stats[1], invstd, params["weight"] * invstd / stats[0], stats[0], sums["bias"],
                             sums["weight"], out)
            return out
        xhat, invstd = _xhat(x, stats, self.eps)
        count = stats[0]
        scale = params["weight"] * invstd / count
        ndim = x.ndim
        return _per_channel(scale, ndim) * (dy * _per_channel(count, ndim) - _per_channel(sums["bias"], ndim)
                                            - xhat * _per_channel(sums["weight"], ndim))

    def infer(self, x, running, params):
        """Inference: normalize with the running statistics, `running` = (2, C) mean and variance."""
        xp = array_module(x)
        invstd = 1.0 / xp.sqrt(running[1] + self.eps)
        scale = params["weight"] * invstd
        return x * _per_channel(scale, x.ndim) + _per_channel(params["bias"] - running[0] * scale, x.ndim)

    def update_running(self, running, stats):
        """New (2, C) running mean and (unbiased) variance after a batch with statistics `stats`."""
        xp = array_module(running)
        count, mean, m2 = stats
        var = m2 / xp.maximum(count - 1, 1)
        m = self.momentum
        return xp.stack([(1 - m) * running[0] + m * mean, (1 - m) * running[1] + m * var])

    # ---- whole tile (one part holds every value of its channels) ------------------------------
    def forward(self, xs, params, out):
        return self.normalize(xs[0], partial_stats(xs[0]), params)

    def backward(self, dy, xs, y, params, out, need_dx):
        stats = partial_stats(xs[0])
        sums = self.grad_sums(dy, xs[0], stats)
        dx = self.input_grad(dy, xs[0], stats, sums, params) if need_dx[0] else None
        return [dx], sums

    def attrs(self):
        return {"eps": self.eps, "momentum": self.momentum}
