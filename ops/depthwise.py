"""Depthwise convolution of numpy tiles (groups == input channels): numba loops over NCHW planes.

Output channel co reads input channel co // m alone (m = Cout / C, the channel multiplier), so there
is no sum over channels for a GEMM to do: im2col would copy kh*kw values to multiply each once.
Instead each input plane is copied once, zero-padded and split into its stride phases (sh*sw
planes, phase (a, b) holding padded rows a, a+sh, ... and columns b, b+sw, ...), all of one flat
width Wq.  In a phase every tap (i, j) of a stride-s window is a stride-1 shift, and over the flat
phase the output's Ho rows (Wq wide, the columns past Wo ignored) are ONE contiguous run per tap:

    out[h*Wq + v] += w[i, j] * phase[(i*dh) % sh, (j*dw) % sw][(h + i*dh // sh)*Wq + v + j*dw // sw]

so each tap is a single long vectorized loop, however narrow the image (row-by-row loops of 14
columns spent most of their time outside the vector body).  Backward-data is the same loops read
the other way (the output gradient added into the phases, which are merged back into the tile,
the padding dropped); the weight gradient is one dot product per tap and plane, with the output
gradient spread to the flat width with zeros past Wo.

Tiles arrive as `ops.conv_kernels` takes them: x (N, C, H, W) with its halo, w (C*m, 1, kh, kw),
padding ((top, bottom), (left, right)) from `ops.windows.tile_padding`; only top and left are
read, the output's size says the rest.
"""

from __future__ import annotations

import numba
import numpy

from taskrt.ops.windows import extent


@numba.njit(cache=True, nogil=True)
def _phase_columns(b, sw, pl, width, wq):
    """Columns [lo, hi) of phase column b that fall inside the tile (the others are padding)."""
    lo = max(0, -((b - pl) // sw))
    return lo, max(lo, min(wq, (width - 1 + pl - b) // sw + 1))


@numba.njit(cache=True, nogil=True)
def _split(plane, buf, sh, sw, pt, pl):
    """buf (sh*sw, Hq, Wq) <- the plane zero-padded (pt on top, pl on the left, zeros past its end) and
    split into stride phases: buf[a*sw + b, q, u] = padded[q*sh + a, u*sw + b]."""
    height, width = plane.shape
    _, hq, wq = buf.shape
    for a in range(sh):
        for b in range(sw):
            lo, hi = _phase_columns(b, sw, pl, width, wq)
            for q in range(hq):
                r = q * sh + a - pt
                dst = buf[a * sw + b, q]
                if r < 0 or r >= height or hi == lo:
                    for u in range(wq):
                        dst[u] = 0
                    continue
                for u in range(lo):
                    dst[u] = 0
                src, run = plane[r, lo * sw + b - pl :], dst[lo:hi]
                if sw == 1:
                    for u in range(hi - lo):
                        run[u] = src[u]
                else:
                    for u in range(hi - lo):
                        run[u] = src[u * sw]
                for u in range(hi, wq):
                    dst[u] = 0


@numba.njit(cache=True, nogil=True)
def _merge(buf, plane, sh, sw, pt, pl):
    """plane <- the part of the phases inside the tile (the adjoint of `_split`, padding dropped)."""
    height, width = plane.shape
    _, hq, wq = buf.shape
    for a in range(sh):
        for b in range(sw):
            lo, hi = _phase_columns(b, sw, pl, width, wq)
            for q in range(hq):
                r = q * sh + a - pt
                if r < 0 or r >= height or hi == lo:
                    continue
                dst, run = plane[r, lo * sw + b - pl :], buf[a * sw + b, q, lo:hi]
                if sw == 1:
                    for u in range(hi - lo):
                        dst[u] = run[u]
                else:
                    for u in range(hi - lo):
                        dst[u * sw] = run[u]


@numba.njit(cache=True, nogil=True)
def _taps(kh, kw, sh, sw, dh, dw, wq):
    """Per tap (i*kw + j): its phase, and the flat offset of its first element there."""
    phase = numpy.empty(kh * kw, dtype=numpy.int64)
    offset = numpy.empty(kh * kw, dtype=numpy.int64)
    for i in range(kh):
        for j in range(kw):
            phase[i * kw + j] = ((i * dh) % sh) * sw + (j * dw) % sw
            offset[i * kw + j] = (i * dh // sh) * wq + j * dw // sw
    return phase, offset


def _phases(in_hw, out_hw, kernel, stride, pads, dilation, dtype):
    """The phase buffer (sh*sw, Hq, Wq) a tile needs: every padded row and column a window reads, and
    the whole tile (backward-data merges every element of it back)."""
    (h, w), (ho, wo), (sh, sw), ((pt, _), (pl, _)) = in_hw, out_hw, stride, pads
    hp = max((ho - 1) * sh + extent(kernel[0], dilation[0]), pt + h)
    wp = max((wo - 1) * sw + extent(kernel[1], dilation[1]), pl + w)
    return numpy.empty((sh * sw, -(-hp // sh), -(-wp // sw)), dtype=dtype)


@numba.njit(cache=True, nogil=True)
def _forward(x, w, bias, y, buf, sh, sw, pt, pl, dh, dw, relu):
    n_, c_out, ho, wo = y.shape
    c_in, (kh, kw), wq = x.shape[1], w.shape[2:], buf.shape[2]
    mult = c_out // c_in
    flat = buf.reshape(buf.shape[0], -1)
    phase, offset = _taps(kh, kw, sh, sw, dh, dw, wq)
    span = (ho - 1) * wq + wo
    acc = numpy.empty(span, dtype=y.dtype)
    for n in range(n_):
        for ci in range(c_in):
            _split(x[n, ci], buf, sh, sw, pt, pl)
            for co in range(ci * mult, (ci + 1) * mult):
                taps, b = w[co, 0], bias[co]
                for v in range(span):
                    acc[v] = b
                for k in range(kh * kw):
                    t, src = taps[k // kw, k % kw], flat[phase[k], offset[k] :]
                    for v in range(span):
                        acc[v] += t * src[v]
                for h in range(ho):
                    out, row = y[n, co, h], acc[h * wq :]
                    for v in range(wo):
                        out[v] = 0 if relu and row[v] < 0 else row[v]  # NaN passes, as numpy's maximum


@numba.njit(cache=True, nogil=True)
def _spread(d, wide, wq):
    """wide[h*Wq + v] <- d[h, v] (the columns past Wo stay as they are: zeros)."""
    ho, wo = d.shape
    for h in range(ho):
        src, dst = d[h], wide[h * wq :]
        for v in range(wo):
            dst[v] = src[v]


@numba.njit(cache=True, nogil=True)
def _data_grad(d, w, dx, buf, sh, sw, pt, pl, dh, dw):
    n_, c_out, ho, wo = d.shape
    c_in, (kh, kw), wq = dx.shape[1], w.shape[2:], buf.shape[2]
    mult = c_out // c_in
    flat = buf.reshape(buf.shape[0], -1)
    phase, offset = _taps(kh, kw, sh, sw, dh, dw, wq)
    span = (ho - 1) * wq + wo
    wide = numpy.zeros(span, dtype=d.dtype)
    for n in range(n_):
        for ci in range(c_in):
            buf[:] = 0
            for co in range(ci * mult, (ci + 1) * mult):
                _spread(d[n, co], wide, wq)
                taps = w[co, 0]
                for k in range(kh * kw):
                    t, dst = taps[k // kw, k % kw], flat[phase[k], offset[k] :]
                    for v in range(span):
                        dst[v] += t * wide[v]
            _merge(buf, dx[n, ci], sh, sw, pt, pl)


# Reassociation lets numba vectorize the sum, in the arrays' dtype (float32 sums of float32 products run at
# twice the width); a tile's sum differs from the whole tensor's in rounding only, as every split's
# weight gradient does.  The planes' dot products are summed in float64.
@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _dot(a, b, size):
    s = a.dtype.type(0)
    for v in range(size):
        s += a[v] * b[v]
    return s


@numba.njit(cache=True, nogil=True)
def _weight_grad(d, x, dwt, buf, sh, sw, pt, pl, dh, dw):
    n_, c_out, ho, wo = d.shape
    c_in, (kh, kw), wq = x.shape[1], dwt.shape[2:], buf.shape[2]
    mult = c_out // c_in
    flat = buf.reshape(buf.shape[0], -1)
    phase, offset = _taps(kh, kw, sh, sw, dh, dw, wq)
    span = (ho - 1) * wq + wo
    wide = numpy.zeros(span, dtype=d.dtype)
    acc = numpy.zeros((c_out, kh * kw))
    for n in range(n_):
        for ci in range(c_in):
            _split(x[n, ci], buf, sh, sw, pt, pl)
            for co in range(ci * mult, (ci + 1) * mult):
                _spread(d[n, co], wide, wq)
                for k in range(kh * kw):
                    acc[co, k] += _dot(wide, flat[phase[k], offset[k] :], span)
    for co in range(c_out):
        for k in range(kh * kw):
            dwt[co, 0, k // kw, k % kw] = acc[co, k]


# ---- the kernels --------------------------------------------------------------------------------
def _out_hw(in_hw, kernel, stride, pads, dilation):
    return tuple((size + p0 + p1 - extent(k, dl)) // s + 1
                 for size, k, s, (p0, p1), dl in zip(in_hw, kernel, stride, pads, dilation))


def conv2d(x, w, bias, stride, pads, relu, dilation):
    """relu?(depthwise correlation of x (N, C, H, W) with w (C*m, 1, kh, kw), + bias): (N, C*m, Ho, Wo)."""
    x = numpy.ascontiguousarray(x)
    w = numpy.ascontiguousarray(w, dtype=x.dtype)
    bias = numpy.zeros(w.shape[0], x.dtype) if bias is None else numpy.ascontiguousarray(bias, dtype=x.dtype)
    ho, wo = _out_hw(x.shape[2:], w.shape[2:], stride, pads, dilation)
    y = numpy.empty((x.shape[0], w.shape[0], ho, wo), dtype=x.dtype)
    if y.size:
        buf = _phases(x.shape[2:], (ho, wo), w.shape[2:], stride, pads, dilation, x.dtype)
        _forward(x, w, bias, y, buf, *stride, pads[0][0], pads[1][0], *dilation, bool(relu))
    return y


def data_grad(d, w, in_shape, stride, pads, dilation):
    """dL/dx (N, C, H, W) of a depthwise tile from d = dL/dy (any relu already applied)."""
    d = numpy.ascontiguousarray(d)
    w = numpy.ascontiguousarray(w, dtype=d.dtype)
    dx = numpy.zeros(in_shape, dtype=d.dtype)
    if d.size and dx.size:
        buf = _phases(in_shape[2:], d.shape[2:], w.shape[2:], stride, pads, dilation, d.dtype)
        _data_grad(d, w, dx, buf, *stride, pads[0][0], pads[1][0], *dilation)
    return dx


def weight_grad(d, x, kernel, stride, pads, dilation):
    """dL/dw (C*m, 1, kh, kw) and dL/db (C*m,) of a depthwise tile from d = dL/dy."""
    d, x = numpy.ascontiguousarray(d), numpy.ascontiguousarray(x)
    dw = numpy.zeros((d.shape[1], 1, *kernel), dtype=x.dtype)
    if d.size and x.size:
        buf = _phases(x.shape[2:], d.shape[2:], kernel, stride, pads, dilation, x.dtype)
        _weight_grad(d, x, dw, buf, *stride, pads[0][0], pads[1][0], *dilation)
    return dw, d.sum(axis=(0, 2, 3))
