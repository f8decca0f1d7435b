"""Array kernels of 2D convolution on one tile: im2col + GEMM, in the layout that copies least.

Tensors are NCHW, weights (Cout, C, kh, kw), padding ((top, bottom), (left, right)) as the tile
needs it (`ops.windows.tile_padding`).  The column matrix of each block of about `row_blocks`
output positions is built in one of two layouts, whichever copies longer contiguous runs:

- channels last (`ops.windows`): the tile is copied once to a zero-padded NHWC array and each
  window contributes runs of kw*C values; any array module (numpy or cupy);
- planes (`ops.planes`): straight from the NCHW tile, runs of one output row (Wo values); numpy.

Backward-data comes in two forms.  Gathering: for a stride-1 convolution the input gradient is
itself a convolution, of the output gradient (padded by k-1-p) with the kernel flipped and
transposed, so it reuses the forward kernel (no scatter-add, no padded gradient to zero and crop).
Scattering (any stride): window gradients, the output gradient times the kernel, are added into
place (col2im).  `gathers` picks the faster one.

3x3 stride-1 convolutions with enough tiles for their channels (`ops.winograd.applies`) skip the
column matrix: Winograd's F(2x2, 3x3) multiplies 16 instead of 36 times per 2x2 outputs, for the
forward, the gathering backward-data and the weight gradient.

Dilation (taps `dilation` apart) changes only which input element each column entry copies, in both
layouts; Winograd takes undilated kernels only.  Grouped convolutions are `ops.grouped_conv`'s.
"""

from __future__ import annotations

import numpy

from taskrt.ops import planes, winograd
from taskrt.ops.base import array_module
from taskrt.ops.windows import col2im_block, crop, extent, im2col_block, row_blocks, window_view_nhwc

PLANES_MIN_WIDTH = 48


NO_DILATION = (1, 1)


def _out_hw(in_hw, kernel, stride, pads, dilation=NO_DILATION):
    return tuple((size + p0 + p1 - extent(k, d)) // s + 1
                 for size, k, s, (p0, p1), d in zip(in_hw, kernel, stride, pads, dilation))


def _winograd(x, kernel, stride, channels, out_hw, dilation) -> bool:
    return tuple(dilation) == NO_DILATION and winograd.applies(x, kernel, stride, channels, out_hw)


def use_planes(x, channels: int, kernel, stride, out_width: int) -> bool:
    """The planes layout for numpy tiles with contiguous output rows (stride 1) that are long: at least
    a window's channel run, or PLANES_MIN_WIDTH (measured: channels-last is faster at width 32 and
    below with 64 or more channels, planes from width 56 on)."""
    return (array_module(x) is numpy and stride[1] == 1
            and (out_width >= kernel[1] * channels or out_width >= PLANES_MIN_WIDTH))


def _blocks(n, ho, wo):
    for sn, sh in row_blocks(n, ho, wo):
        yield sn.start, sn.stop, sh.start, sh.stop


def _scratch(x, rows, cols):
    """A C-contiguous (rows, cols) matrix on top of a reusable buffer of at least rows*cols values."""
    return x[: rows * cols].reshape(rows, cols)


# ---- channels last ------------------------------------------------------------------------------
def _padded_nhwc(x, pads=((0, 0), (0, 0))):
    """Contiguous zero-padded NHWC copy of an NCHW tile, in one pass (only the border is zeroed)."""
    xp = array_module(x)
    n, c, h, w = x.shape
    (pt, pb), (pl, pr) = pads
    out = xp.empty((n, h + pt + pb, w + pl + pr, c), dtype=x.dtype)
    out[:, :pt] = 0
    out[:, pt + h :] = 0
    out[:, pt : pt + h, :pl] = 0
    out[:, pt : pt + h, pl + w :] = 0
    if xp is numpy and (h * w * x.itemsize) % 4096 == 0:
        # Planes a multiple of 4 KiB apart put a pixel's channels in one cache set, which the
        # element-wise copy below thrashes (3x slower at 32x32); the loop reads whole rows.
        planes.to_nhwc(numpy.ascontiguousarray(x), out, pt, pl)
    else:
        out[:, pt : pt + h, pl : pl + w] = x.transpose(0, 2, 3, 1)
    return out


def _swap_last(a):
    """Contiguous (A, C, B) copy of an (A, B, C) array."""
    xp = array_module(a)
    if xp is not numpy:
        return xp.ascontiguousarray(a.transpose(0, 2, 1))
    out = numpy.empty((a.shape[0], a.shape[2], a.shape[1]), dtype=a.dtype)
    planes.swap_last(numpy.ascontiguousarray(a), out)  # 3x numpy's strided copy on 512x512x3x3
    return out


def _kernel_nhwc(w, flipped):
    """The kernel as a matrix whose rows are im2col_block's columns (i, j, c): (kh*kw*C, Cout) for w;
    for the gradient's kernel (w flipped and transposed: backward-data gathering) (kh*kw*Cout, C)."""
    cout, c, kh, kw = w.shape
    if not flipped:
        return _swap_last(w.reshape(cout, c, kh * kw)).reshape(cout, -1).T
    if array_module(w) is not numpy:
        return w.transpose(2, 3, 0, 1)[::-1, ::-1].reshape(-1, c)
    out = numpy.empty((kh * kw, cout, c), dtype=w.dtype)
    planes.flip_taps(numpy.ascontiguousarray(w).reshape(cout, c, kh * kw), out)
    return out.reshape(-1, c)


def _conv_nhwc(x, wmat, kernel, bias, stride, pads, relu, dilation):
    """Forward of an NCHW tile by a `_kernel_nhwc` matrix; returns y in NHWC."""
    xp = array_module(x)
    cout = wmat.shape[1]
    view = window_view_nhwc(_padded_nhwc(x, pads), kernel, stride, dilation)
    n, ho, wo = view.shape[:3]
    y = xp.empty((n, ho, wo, cout), dtype=x.dtype)
    for block in row_blocks(n, ho, wo):
        yb = y[block].reshape(-1, cout)
        xp.matmul(im2col_block(view, block), wmat, out=yb)
        if bias is not None:
            yb += bias
        if relu:
            xp.maximum(yb, 0, out=yb)
    return y


def _weight_grad_nhwc(d, x, kernel, stride, pads, dilation):
    xp = array_module(x)
    cout = d.shape[1]
    view = window_view_nhwc(_padded_nhwc(x, pads), kernel, stride, dilation)
    d_nhwc = _padded_nhwc(d)
    dw = xp.zeros((cout, kernel[0] * kernel[1] * x.shape[1]), dtype=x.dtype)
    for block in row_blocks(*d_nhwc.shape[:3]):
        dw += d_nhwc[block].reshape(-1, cout).T @ im2col_block(view, block)
    return _swap_last(dw.reshape(cout, kernel[0] * kernel[1], x.shape[1])).reshape(cout, x.shape[1], *kernel)


def _scatter_nhwc(d, w, in_shape, stride, pads, dilation):
    xp = array_module(d)
    n, cout, ho, wo = d.shape
    c, (kh, kw) = in_shape[1], w.shape[2:]
    (pt, pb), (pl, pr) = pads
    d_nhwc = _padded_nhwc(d)
    wm = _kernel_nhwc(w, False).T  # columns (i, j, c)
    dx_pad = xp.zeros((n, in_shape[2] + pt + pb, in_shape[3] + pl + pr, c), dtype=d.dtype)
    for block in row_blocks(n, ho, wo):
        rows = d_nhwc[block]
        dcols = (rows.reshape(-1, cout) @ wm).reshape(*rows.shape[:3], kh, kw, c)
        col2im_block(dx_pad, dcols, block, stride, dilation)
    return xp.ascontiguousarray(crop(dx_pad, pads, axes=(1, 2)).transpose(0, 3, 1, 2))


# ---- planes -------------------------------------------------------------------------------------
def _kernel_planes(w, flipped):
    """The kernel as a matrix whose columns are planes.im2col's rows (c, i, j): (Cout, C*kh*kw) for w,
    (C, Cout*kh*kw) for the gradient's kernel (w flipped and transposed)."""
    cout, c, kh, kw = w.shape
    w = numpy.ascontiguousarray(w).reshape(cout, c, kh * kw)
    if not flipped:
        return w.reshape(cout, -1)
    return numpy.ascontiguousarray(w[:, :, ::-1].transpose(1, 0, 2)).reshape(c, -1)


def _conv_planes(x, wmat, kernel, bias, stride, pads, relu, dilation):
    x = numpy.ascontiguousarray(x)
    n, c, h, wd = x.shape
    cout, (kh, kw) = wmat.shape[0], kernel
    ho, wo = _out_hw((h, wd), (kh, kw), stride, pads, dilation)
    bias = numpy.zeros(cout, x.dtype) if bias is None else numpy.ascontiguousarray(bias, dtype=x.dtype)
    y = numpy.empty((n, cout, ho, wo), dtype=x.dtype)
    most = max((n1 - n0) * (h1 - h0) * wo for n0, n1, h0, h1 in _blocks(n, ho, wo))
    cols_buf = numpy.empty(wmat.shape[1] * most, dtype=x.dtype)
    out_buf = numpy.empty(cout * most, dtype=x.dtype)
    for n0, n1, h0, h1 in _blocks(n, ho, wo):
        positions = (n1 - n0) * (h1 - h0) * wo
        cols = _scratch(cols_buf, wmat.shape[1], positions)
        planes.im2col(x, cols, n0, n1, h0, h1, wo, kh, kw, *stride, pads[0][0], pads[1][0], *dilation)
        out = _scratch(out_buf, cout, positions)
        numpy.matmul(wmat, cols, out=out)
        planes.store(out, y, bias, relu, n0, n1, h0, h1)
    return y


def _weight_grad_planes(d, x, kernel, stride, pads, dilation):
    x, d = numpy.ascontiguousarray(x), numpy.ascontiguousarray(d)
    n, cout, ho, wo = d.shape
    k = x.shape[1] * kernel[0] * kernel[1]
    dw = numpy.zeros((cout, k), dtype=x.dtype)
    most = max((n1 - n0) * (h1 - h0) * wo for n0, n1, h0, h1 in _blocks(n, ho, wo))
    cols_buf = numpy.empty(k * most, dtype=x.dtype)
    d_buf = numpy.empty(cout * most, dtype=x.dtype)
    for n0, n1, h0, h1 in _blocks(n, ho, wo):
        positions = (n1 - n0) * (h1 - h0) * wo
        cols = _scratch(cols_buf, k, positions)
        planes.im2col(x, cols, n0, n1, h0, h1, wo, *kernel, *stride, pads[0][0], pads[1][0], *dilation)
        rows = _scratch(d_buf, cout, positions)
        planes.load(d, rows, n0, n1, h0, h1)
        dw += rows @ cols.T
    return dw.reshape(cout, x.shape[1], *kernel)


def _scatter_planes(d, w, in_shape, stride, pads, dilation):
    d = numpy.ascontiguousarray(d)
    n, cout, ho, wo = d.shape
    kh, kw = w.shape[2:]
    wm = numpy.ascontiguousarray(w).reshape(cout, -1)
    dx = numpy.zeros(in_shape, dtype=d.dtype)
    most = max((n1 - n0) * (h1 - h0) * wo for n0, n1, h0, h1 in _blocks(n, ho, wo))
    d_buf = numpy.empty(cout * most, dtype=d.dtype)
    for n0, n1, h0, h1 in _blocks(n, ho, wo):
        rows = _scratch(d_buf, cout, (n1 - n0) * (h1 - h0) * wo)
        planes.load(d, rows, n0, n1, h0, h1)
        planes.col2im(wm.T @ rows, dx, n0, n1, h0, h1, wo, kh, kw, *stride, pads[0][0], pads[1][0], *dilation)
    return dx


# ---- the kernels --------------------------------------------------------------------------------
def _correlate(x, w, flipped, bias, stride, pads, relu, dilation=NO_DILATION):
    """x correlated with w (Cout, C, kh, kw), or with w flipped and transposed, + bias, through relu."""
    kernel = w.shape[2:]
    ho, wo = _out_hw(x.shape[2:], kernel, stride, pads, dilation)
    out_channels = w.shape[1] if flipped else w.shape[0]
    if _winograd(x, kernel, stride, min(x.shape[1], out_channels), (ho, wo), dilation):
        xp = _padded_nhwc(x, winograd.padding(pads, (ho, wo)))
        return winograd.correlate(xp, winograd.kernels(w, flipped), bias, relu, (ho, wo))
    if use_planes(x, x.shape[1], kernel, stride, wo):
        return _conv_planes(x, _kernel_planes(w, flipped), kernel, bias, stride, pads, relu, dilation)
    y = _conv_nhwc(x, _kernel_nhwc(w, flipped), kernel, bias, stride, pads, relu, dilation)
    return array_module(x).ascontiguousarray(y.transpose(0, 3, 1, 2))


def conv2d(x, w, bias, stride, pads, relu=False, dilation=NO_DILATION):
    """relu?(x correlated with w, + bias) of one tile: x (N, C, H, W) -> (N, Cout, Ho, Wo)."""
    return _correlate(x, w, False, bias, stride, pads, relu, tuple(dilation))


def conv2d_weight_grad(d, x, kernel, stride, pads, dilation=NO_DILATION):
    """dL/dw (Cout, C, kh, kw) and dL/db (Cout,) of one tile from d = dL/dy (any relu already applied)."""
    wo, dilation = d.shape[3], tuple(dilation)
    if _winograd(x, kernel, stride, min(x.shape[1], d.shape[1]), d.shape[2:], dilation):
        xp = _padded_nhwc(x, winograd.padding(pads, d.shape[2:]))
        dw = winograd.weight_grad(xp, _padded_nhwc(d, winograd.padding(((0, 0), (0, 0)), d.shape[2:])))
    elif use_planes(x, x.shape[1], kernel, stride, wo):
        dw = _weight_grad_planes(d, x, kernel, stride, pads, dilation)
    else:
        dw = _weight_grad_nhwc(d, x, kernel, stride, pads, dilation)
    return dw, d.sum(axis=(0, 2, 3))


def gather_padding(kernel, stride, pads, dilation=NO_DILATION):
    """Padding of d in the gather form of backward-data (e-1-p per side, e the kernel's extent), or None
    where it does not apply: a strided convolution, or padding beyond e-1."""
    flipped = tuple((extent(k, dl) - 1 - p0, extent(k, dl) - 1 - p1) for k, (p0, p1), dl in zip(kernel, pads, dilation))
    if tuple(stride) != (1, 1) or min(min(p) for p in flipped) < 0:
        return None
    return flipped


def data_grad_gather(d, w, pads, dilation=NO_DILATION):
    """dL/dx of a stride-1 convolution: d correlated with the flipped, transposed kernel (dilated alike)."""
    dilation = tuple(dilation)
    return _correlate(d, w, True, None, (1, 1), gather_padding(w.shape[2:], (1, 1), pads, dilation), False, dilation)


def scatters_by_planes(d, stride) -> bool:
    """Backward-data scattering takes the planes layout wherever it has contiguous rows (numpy, stride 1),
    however narrow: it reads d and writes dx in place, with no channels-last copies of either
    (measured 5-15% faster than channels last from 2x2 to 28x28, 64 to 512 channels)."""
    return array_module(d) is numpy and stride[1] == 1


def data_grad_scatter(d, w, in_shape, stride, pads, dilation=NO_DILATION):
    """dL/dx of any convolution: window gradients (d times the kernel) added into place (col2im)."""
    if scatters_by_planes(d, stride):
        return _scatter_planes(d, w, in_shape, stride, pads, tuple(dilation))
    return _scatter_nhwc(d, w, in_shape, stride, pads, tuple(dilation))


def gathers(d, w_shape, stride, pads, dilation=NO_DILATION) -> bool:
    """Does backward-data gather?  Where Winograd's F(2x2, 3x3) applies to the gathering correlation,
    always (measured 0.6-0.9x the time of scattering).  Otherwise gathering multiplies by a
    (kh*kw*Cout, C) matrix, scattering by a (Cout, kh*kw*C) one and then adds into dx: gathering is
    faster when C > Cout and the copies are channels-last; at C == Cout scattering by planes is (measured)."""
    cout, cin, kh, kw = w_shape
    flipped = gather_padding((kh, kw), stride, pads, dilation)
    if flipped is None:
        return False
    if _winograd(d, (kh, kw), stride, min(cin, cout), _out_hw(d.shape[2:], (kh, kw), stride, flipped, dilation),
                 dilation):
        return True
    return cin > cout and not use_planes(d, cin, (kh, kw), stride, d.shape[3])


def conv2d_data_grad(d, w, in_shape, stride, pads, dilation=NO_DILATION):
    """dL/dx (N, C, H, W) of one tile from d = dL/dy (any relu already applied)."""
    if gathers(d, w.shape, stride, pads, dilation):
        return data_grad_gather(d, w, pads, dilation)
    return data_grad_scatter(d, w, in_shape, stride, pads, dilation)
