"""Im2col over NCHW tiles in channel-major order: numba loops that copy whole image rows.

The column matrix of a block of output positions has rows (c, i, j), the weight's own order (so
`w.reshape(Cout, -1)` multiplies it with no copy), and columns (n, h, w).  Every copied run is one
output row of one window offset: Wo values, contiguous in the input when the stride is 1.  The
channels-last copy of `ops.windows` moves runs of kw*C values instead, so this layout is the faster
one where images are wide and channels few (first layers, large images).  Padding is never
materialized: positions outside the tile are written as zeros (im2col) or skipped (col2im).

A block is (n0, n1, h0, h1): samples [n0, n1) and output rows [h0, h1), all output columns.

The other copies of `ops.conv_kernels` that numpy does slowly element by element live here too:
NCHW to NHWC (`to_nhwc`) and the permutations of kernels and their gradients.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def _inside(offset, pad, stride, size, count):
    """Output indices [lo, hi) of [0, count) whose input index o*stride + offset - pad is in [0, size)."""
    lo = max(0, -((offset - pad) // stride))
    hi = min(count, (size - 1 + pad - offset) // stride + 1)
    return lo, max(lo, hi)


# Loops run over local slices indexed from 0: that is the form numba vectorizes (several times
# faster than indexing the whole row with an offset).
@numba.njit(cache=True, nogil=True)
def im2col(x, cols, n0, n1, h0, h1, wo, kh, kw, sh, sw, pt, pl, dh, dw):
    """cols (C*kh*kw, (n1-n0)*(h1-h0)*wo) <- the windows of x (N, C, H, W) over the block; taps dh, dw apart."""
    _, c_in, height, width = x.shape
    for c in range(c_in):
        for i in range(kh):
            hlo, hhi = _inside(i * dh, pt, sh, height, h1)
            for j in range(kw):
                row = cols[(c * kh + i) * kw + j]
                wlo, whi = _inside(j * dw, pl, sw, width, wo)
                first = wlo * sw + j * dw - pl  # input column of output column wlo
                col = 0
                for n in range(n0, n1):
                    for h in range(h0, h1):
                        dst = row[col : col + wo]
                        if h < hlo or h >= hhi:
                            for w in range(wo):
                                dst[w] = 0
                        else:
                            for w in range(wlo):
                                dst[w] = 0
                            src = x[n, c, h * sh + i * dh - pt, first:]
                            run = dst[wlo:whi]
                            if sw == 1:
                                for w in range(whi - wlo):
                                    run[w] = src[w]
                            else:
                                for w in range(whi - wlo):
                                    run[w] = src[w * sw]
                            for w in range(whi, wo):
                                dst[w] = 0
                        col += wo


@numba.njit(cache=True, nogil=True)
def col2im(cols, dx, n0, n1, h0, h1, wo, kh, kw, sh, sw, pt, pl, dh, dw):
    """Adjoint of `im2col`: add the window gradients cols into dx (N, C, H, W)."""
    _, c_in, height, width = dx.shape
    for c in range(c_in):
        for i in range(kh):
            hlo, hhi = _inside(i * dh, pt, sh, height, h1)
            for j in range(kw):
                row = cols[(c * kh + i) * kw + j]
                wlo, whi = _inside(j * dw, pl, sw, width, wo)
                first = wlo * sw + j * dw - pl
                col = 0
                for n in range(n0, n1):
                    for h in range(h0, h1):
                        if hlo <= h < hhi:
                            dst = dx[n, c, h * sh + i * dh - pt, first:]
                            src = row[col + wlo : col + whi]
                            if sw == 1:
                                for w in range(whi - wlo):
                                    dst[w] += src[w]
                            else:
                                for w in range(whi - wlo):
                                    dst[w * sw] += src[w]
                        col += wo


@numba.njit(cache=True, nogil=True)
def store(block, y, bias, relu, n0, n1, h0, h1):
    """y[n0:n1, :, h0:h1] <- block (Cout, positions) + bias, through relu if asked."""
    _, c_out, _, wo = y.shape
    for co in range(c_out):
        b = bias[co]
        col = 0
        for n in range(n0, n1):
            for h in range(h0, h1):
                src = block[co, col : col + wo]
                dst = y[n, co, h]
                for w in range(wo):
                    v = src[w] + b
                    if relu and v < 0:
                        dst[w] = 0
                    else:
                        dst[w] = v
                col += wo


@numba.njit(cache=True, nogil=True)
def load(d, block, n0, n1, h0, h1):
    """block (Cout, positions) <- d[n0:n1, :, h0:h1] of an NCHW array."""
    _, c_out, _, wo = d.shape
    for co in range(c_out):
        col = 0
        for n in range(n0, n1):
            for h in range(h0, h1):
                src = d[n, co, h]
                dst = block[co, col : col + wo]
                for w in range(wo):
                    dst[w] = src[w]
                col += wo


@numba.njit(cache=True, nogil=True)
def to_nhwc(x, out, top, left):
    """out[n, top + h, left + w, c] <- x[n, c, h, w]: reads whole rows of each channel."""
    n_, c_, height, width = x.shape
    for n in range(n_):
        for h in range(height):
            dst = out[n, top + h, left:]
            for c in range(c_):
                src = x[n, c, h]
                for w in range(width):
                    dst[w, c] = src[w]


@numba.njit(cache=True, nogil=True)
def swap_last(a, out):
    """out[i, k, j] <- a[i, j, k]."""
    n0, n1, n2 = a.shape
    for i in range(n0):
        src, dst = a[i], out[i]
        for j in range(n1):
            row = src[j]
            for k in range(n2):
                dst[k, j] = row[k]


@numba.njit(cache=True, nogil=True)
def flip_taps(w, out):
    """out[t, co, c] <- w[co, c, taps - 1 - t]: a (Cout, C, taps) kernel flipped and transposed."""
    c_out, c_in, taps = w.shape
    for co in range(c_out):
        src = w[co]
        for t in range(taps):
            dst = out[taps - 1 - t, co]
            for c in range(c_in):
                dst[c] = src[c, t]
