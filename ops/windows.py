"""Sliding windows shared by convolution and pooling: halo rule, im2col and its adjoint.

The halo rule is the region rule of every windowed op: output rows [o0, o1) read input rows
[o0*s - p, (o1-1)*s - p + k), clipped to the tensor; the part that falls outside is zero
(or -inf) padding, and only a tile touching the border sees it.
"""

from __future__ import annotations

from taskrt.ops.base import array_module


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


def pad(x, pads, value=0.0, axes=(2, 3)):
    """Pad the two spatial axes (NCHW by default; axes=(1, 2) for NHWC)."""
    (pt, pb), (pl, pr) = pads
    if pt == pb == pl == pr == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axes[0]], widths[axes[1]] = (pt, pb), (pl, pr)
    return array_module(x).pad(x, widths, mode="constant", constant_values=value)


def window_offsets(padded_shape, kernel, stride):
    """For each kernel offset (i, j) in window order, the index of the (N, C, Ho, Wo) strided
    view of a padded NCHW tile holding that element of every window.  A loop of kh*kw whole-tile
    operations over these views is much faster than reducing the small trailing axes of `windows`."""
    ho = (padded_shape[2] - kernel[0]) // stride[0] + 1
    wo = (padded_shape[3] - kernel[1]) // stride[1] + 1
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            yield (slice(None), slice(None), slice(i, i + stride[0] * (ho - 1) + 1, stride[0]),
                   slice(j, j + stride[1] * (wo - 1) + 1, stride[1]))


def window_view_nhwc(x_padded_nhwc, kernel, stride):
    """View (N, Ho, Wo, C, kh, kw) of every window of a padded NHWC tile; no copy."""
    xp = array_module(x_padded_nhwc)
    v = xp.lib.stride_tricks.sliding_window_view(x_padded_nhwc, kernel, axis=(1, 2))
    return v[:, :: stride[0], :: stride[1]]


def row_blocks(n: int, ho: int, wo: int, rows: int = 2048):
    """Blocks (sample slice, output-row slice) of about `rows` output positions each.

    im2col on a block instead of the whole tile keeps the column matrix in cache (it can be
    hundreds of MB for a whole tile) while the GEMM stays large enough to run at full rate.
    """
    if ho * wo >= rows:
        step = max(1, rows // wo)
        for i in range(n):
            for h in range(0, ho, step):
                yield slice(i, i + 1), slice(h, min(ho, h + step))
    else:
        step = max(1, rows // (ho * wo))
        for i in range(0, n, step):
            yield slice(i, min(n, i + step)), slice(0, ho)


def im2col_block(view, block):
    """Columns of one block: rows (n, ho, wo), columns (i, j, c), channels innermost so every
    copied run is contiguous (several times faster than gathering from NCHW)."""
    v = view[block]
    bn, bh, wo, c, kh, kw = v.shape
    return v.transpose(0, 1, 2, 4, 5, 3).reshape(bn * bh * wo, kh * kw * c)


def col2im_block(dx_padded_nhwc, dcols, block, stride):
    """Adjoint of `im2col_block`: add window gradients (bn, bh, Wo, kh, kw, C) into the padded tile."""
    sn, sh = block
    _, bh, wo, kh, kw, _ = dcols.shape
    s0, s1 = stride
    rows = dx_padded_nhwc[sn, sh.start * s0 : (sh.stop - 1) * s0 + kh]
    for i in range(kh):
        for j in range(kw):
            rows[:, i : i + s0 * (bh - 1) + 1 : s0, j : j + s1 * (wo - 1) + 1 : s1, :] += dcols[:, :, :, i, j, :]


def crop(x_padded, pads, axes=(2, 3)):
    (pt, pb), (pl, pr) = pads
    index = [slice(None)] * x_padded.ndim
    index[axes[0]] = slice(pt, x_padded.shape[axes[0]] - pb)
    index[axes[1]] = slice(pl, x_padded.shape[axes[1]] - pr)
    return x_padded[tuple(index)]
