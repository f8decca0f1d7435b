"""Layer normalization over channels of an (n, c) or (n, c, h, w) tensor: at every sample and (h, w)
position, xhat = (x - mean) / sqrt(var + eps) with the mean and biased variance over the c channels,
then y = weight * xhat + bias per channel (ConvNeXt's LayerNorm2d; on (n, c), `nn.LayerNorm(c)`).

Region rule: a part reads every channel of its (n, h, w) range, as a linear layer's part reads every
feature, so its statistics are the whole tensor's and no reduction between parts is planned; its
parameters are its own channels.  A split over c is exact in backward too: a part's dx covers every
channel (the statistics depend on all of them), it is J_p^T dy_p with J_p the Jacobian of the part's
own channels, and the runtime sums the parts' contributions into the whole J^T dy:

    g = dy * weight                                        (the part's channels P; 0 elsewhere)
    dx = invstd * (g - sum_P(g) / C - xhat * sum_P(g * xhat) / C)

where g is added only on P, and the sums are over the part's channels while C counts them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


def _per_channel(v, ndim):
    """A (C,) vector shaped to broadcast against an (n, C) or (n, C, h, w) tile."""
    return v if ndim == 2 else v[None, :, None, None]


def _sum_axes(ndim) -> tuple[int, ...]:
    """The axes a per-channel parameter gradient sums over: every one but c."""
    return (0,) if ndim == 2 else (0, 2, 3)


@dataclass(frozen=True)
class LayerNorm(Op):
    eps: float = 1e-5
    affine: bool = True

    kind = "layer_norm"

    def __post_init__(self):
        if len(self.in_shapes) != 1:
            raise ShapeError(f"layer_norm takes one input, got {len(self.in_shapes)}")
        if len(self.in_shapes[0]) not in (2, 4):
            raise ShapeError(f"layer_norm needs a rank-2 (n, c) or rank-4 (n, c, h, w) input, "
                             f"got shape {tuple(self.in_shapes[0])}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (
                self.eps > 0 and math.isfinite(self.eps)):
            raise ShapeError(f"layer_norm eps must be a finite number > 0, got {self.eps!r}")
        if not isinstance(self.affine, bool):
            raise ShapeError(f"layer_norm affine must be True or False, got {self.affine!r}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    @property
    def channels(self) -> int:
        return self.in_shapes[0][1]

    def param_shapes(self):
        return {"weight": (self.channels,), "bias": (self.channels,)} if self.affine else {}

    # ---- region rules -------------------------------------------------------------------------
    def input_rects(self, out):
        # every channel of the part's samples and positions: the statistics reduce over all of them
        return [out.replace(1, 0, self.channels)]

    def param_rects(self, out):
        if not self.affine:
            return {}
        c = Rect((out.lo[1],), (out.hi[1],))
        return {"weight": c, "bias": c}

    # ---- cost -----------------------------------------------------------------------------------
    # Counted per output element as if the part held every channel (statistics 4, normalize and
    # scale 4; backward: statistics again 4, parameter sums 3, dx 7): the search's roofline takes the
    # rates from a unit tile, so they must grow linearly with the tile.  A part of a c split also
    # recomputes its positions' statistics over the other parts' channels, which this leaves out.
    def flops(self, out):
        return 8 * out.volume

    def backward_flops(self, out):
        return 14 * out.volume

    # ---- kernels --------------------------------------------------------------------------------
    def _statistics(self, x):
        """x minus its channel mean, and 1 / sqrt(biased variance + eps), at every position."""
        xp = array_module(x)
        centered = x - x.mean(axis=1, keepdims=True)
        invstd = 1.0 / xp.sqrt((centered * centered).mean(axis=1, keepdims=True) + self.eps)
        return centered, invstd

    def forward(self, xs, params, out):
        x = xs[0]
        c0, c1 = out.lo[1], out.hi[1]
        centered, invstd = self._statistics(x)
        y = centered[:, c0:c1] * invstd
        if self.affine:
            y *= _per_channel(params["weight"], x.ndim)
            y += _per_channel(params["bias"], x.ndim)
        return y

    def backward(self, dy, xs, y, params, out, need_dx):
        x = xs[0]
        c0, c1 = out.lo[1], out.hi[1]
        centered, invstd = self._statistics(x)
        xhat_own = centered[:, c0:c1] * invstd
        grads = {}
        if self.affine:
            axes = _sum_axes(x.ndim)
            grads = {"weight": (dy * xhat_own).sum(axis=axes), "bias": dy.sum(axis=axes)}
            g = dy * _per_channel(params["weight"], x.ndim)
        else:
            g = dy
        if not need_dx[0]:
            return [None], grads
        channels = x.shape[1]
        mean_g = g.sum(axis=1, keepdims=True) / channels
        mean_g_xhat = (g * xhat_own).sum(axis=1, keepdims=True) / channels
        dx = centered * invstd
        dx *= -mean_g_xhat
        dx -= mean_g
        dx[:, c0:c1] += g
        dx *= invstd
        return [dx], grads

    def attrs(self):
        return {"eps": self.eps, "affine": self.affine}
