"""Sliding windows shared by convolution and pooling: halo rule, im2col and its adjoint.

The halo rule is the region rule of every windowed op: output rows [o0, o1) read input rows
[o0*s - p, (o1-1)*s - p + k), clipped to the tensor; the part that falls outside is zero
(or -inf) padding, and only a tile touching the border sees it.
"""

from __future__ import annotations

from ops.base import array_module


def out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def halo(o0: int, o1: int, kernel: int, stride: int, padding: int, size: int):
    """Input range [lo, hi) read by output range [o0, o1), and the padding (before, after) it needs."""
    start = o0 * stride - padding
    stop = (o1 - 1) * stride - padding + kernel
    lo, hi = max(0, start), min(size, stop)
    return lo, hi, lo - start, stop - hi


def tile_padding(out_rect, kernel, stride, padding, in_hw):
    """((top, bottom), (left, right)) padding of the tile producing `out_rect` (rank-4 NCHW)."""
    (_, _, pt, pb) = halo(out_rect.lo[2], out_rect.hi[2], kernel[0], stride[0], padding[0], in_hw[0])
    (_, _, pl, pr) = halo(out_rect.lo[3], out_rect.hi[3], kernel[1], stride[1], padding[1], in_hw[1])
    return (pt, pb), (pl, pr)


def pad(x, pads, value=0.0):
    (pt, pb), (pl, pr) = pads
    if pt == pb == pl == pr == 0:
        return x
    xp = array_module(x)
    return xp.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), mode="constant", constant_values=value)


def windows(xp_padded, kernel, stride):
    """View (N, C, Ho, Wo, kh, kw) of every window of a padded NCHW tile; no copy."""
    xp = array_module(xp_padded)
    v = xp.lib.stride_tricks.sliding_window_view(xp_padded, kernel, axis=(2, 3))
    return v[:, :, :: stride[0], :: stride[1]]


def im2col(xp_padded, kernel, stride):
    """Rows are output positions (n, ho, wo), columns are (c, i, j): shape (N*Ho*Wo, C*kh*kw)."""
    v = windows(xp_padded, kernel, stride)
    n, c, ho, wo, kh, kw = v.shape
    return v.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kh * kw)


def col2im(cols6, padded_shape, stride, dtype):
    """Adjoint of `windows`: sum window gradients (N, C, Ho, Wo, kh, kw) into the padded tile."""
    xp = array_module(cols6)
    n, c, ho, wo, kh, kw = cols6.shape
    dx = xp.zeros(padded_shape, dtype=dtype)
    sh, sw = stride
    for i in range(kh):
        for j in range(kw):
            dx[:, :, i : i + sh * (ho - 1) + 1 : sh, j : j + sw * (wo - 1) + 1 : sw] += cols6[:, :, :, :, i, j]
    return dx


def crop(x_padded, pads):
    (pt, pb), (pl, pr) = pads
    h, w = x_padded.shape[2], x_padded.shape[3]
    return x_padded[:, :, pt : h - pb, pl : w - pr]
