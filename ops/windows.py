"""Sliding windows shared by convolution and pooling: halo rule, im2col and its adjoint.

The halo rule is the region rule of every windowed op: output rows [o0, o1) read input rows
[o0*s - p, (o1-1)*s - p + e), clipped to the tensor, where e = d*(k-1) + 1 is the extent of a
kernel of k taps d apart (dilation d; 1 for pooling); the part that falls outside is zero (or -inf)
padding, and only a tile touching the border sees it.  A dilated window skips rows inside that
range, which still travel: the halo is one box.
"""

from __future__ import annotations

from taskrt.ops.base import array_module


def extent(kernel: int, dilation: int = 1) -> int:
    """Input rows one window spans: k taps d apart."""
    return dilation * (kernel - 1) + 1


def out_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    return (size + 2 * padding - extent(kernel, dilation)) // stride + 1


def halo(o0: int, o1: int, kernel: int, stride: int, padding: int, size: int, dilation: int = 1):
    """Input range [lo, hi) read by output range [o0, o1), and the padding (before, after) it needs.

    Where padding exceeds the kernel's extent, windows at the border read padding alone: their range
    is empty (at 0 or at `size`) and the padding all of the window."""
    start = o0 * stride - padding
    stop = (o1 - 1) * stride - padding + extent(kernel, dilation)
    lo, hi = min(max(0, start), size), max(min(size, stop), 0)
    before = min(max(lo - start, 0), stop - start)
    return lo, hi, before, stop - start - before - (hi - lo)


def tile_padding(out_rect, kernel, stride, padding, in_hw, dilation=(1, 1)):
    """((top, bottom), (left, right)) padding of the tile producing `out_rect` (rank-4 NCHW)."""
    (_, _, pt, pb) = halo(out_rect.lo[2], out_rect.hi[2], kernel[0], stride[0], padding[0], in_hw[0], dilation[0])
    (_, _, pl, pr) = halo(out_rect.lo[3], out_rect.hi[3], kernel[1], stride[1], padding[1], in_hw[1], dilation[1])
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


def window_view_nhwc(x_padded_nhwc, kernel, stride, dilation=(1, 1)):
    """View (N, Ho, Wo, C, kh, kw) of every window of a padded NHWC tile; no copy.  A dilated
    window is every d-th element of a window of its extent."""
    xp = array_module(x_padded_nhwc)
    spans = tuple(extent(k, d) for k, d in zip(kernel, dilation))
    v = xp.lib.stride_tricks.sliding_window_view(x_padded_nhwc, spans, axis=(1, 2))
    return v[:, :: stride[0], :: stride[1], :, :: dilation[0], :: dilation[1]]


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


def col2im_block(dx_padded_nhwc, dcols, block, stride, dilation=(1, 1)):
    """Adjoint of `im2col_block`: add window gradients (bn, bh, Wo, kh, kw, C) into the padded tile."""
    sn, sh = block
    _, bh, wo, kh, kw, _ = dcols.shape
    (s0, s1), (d0, d1) = stride, dilation
    rows = dx_padded_nhwc[sn, sh.start * s0 : (sh.stop - 1) * s0 + extent(kh, d0)]
    for i in range(kh):
        for j in range(kw):
            a, b = i * d0, j * d1
            rows[:, a : a + s0 * (bh - 1) + 1 : s0, b : b + s1 * (wo - 1) + 1 : s1, :] += dcols[:, :, :, i, j, :]


def crop(x_padded, pads, axes=(2, 3)):
    (pt, pb), (pl, pr) = pads
    index = [slice(None)] * x_padded.ndim
    index[axes[0]] = slice(pt, x_padded.shape[axes[0]] - pb)
    index[axes[1]] = slice(pl, x_padded.shape[axes[1]] - pr)
    return x_padded[tuple(index)]


def pool_out_size(size: int, kernel: int, stride: int, padding: int, ceil_mode: bool = False) -> int:
    """PyTorch's pooling output size: `out_size`, or with ceil_mode the count rounded up so the last
    window may run past the input and the padding, less one that would start in the right padding
    (torch drops it: a window must start inside the input or the left padding)."""
    if not ceil_mode:
        return out_size(size, kernel, stride, padding)
    n = -(-(size + 2 * padding - kernel) // stride) + 1
    return n - 1 if (n - 1) * stride >= size + padding else n
