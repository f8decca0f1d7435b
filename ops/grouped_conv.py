"""Array kernels of grouped convolution on one tile, and which kernel takes which tile.

A convolution of G groups splits its C input and Cout output channels into G blocks each: output
channels [g*opg, (g+1)*opg) read input channels [g*ipg, (g+1)*ipg) only (opg = Cout/G, ipg = C/G);
the weight is (Cout, ipg, kh, kw).  Kernels here take a tile of whole groups: x holds the channels
of G' groups, w their G'*opg output channels (`ops.conv.Conv2d` extends a channel split that cuts a
group with zero rows, and keeps the rows it owns).

- one group: `ops.conv_kernels` (im2col + GEMM, Winograd where it applies);
- depthwise (ipg == 1) on numpy: `ops.depthwise`'s direct numba loops;
- otherwise (and depthwise on cupy): one batched GEMM over the groups per block of output positions,
  the columns of `ops.windows` (channels last) regrouped so each group's (i, j, c) columns are
  contiguous: (G, positions, kh*kw*ipg) @ (G, kh*kw*ipg, opg).  Backward is the same product
  transposed: the weight gradient (G, kh*kw*ipg, opg) = columns^T @ d, backward-data scatters
  d @ kernel^T back into place (col2im).
"""

from __future__ import annotations

import numpy

from taskrt.ops import conv_kernels, depthwise
from taskrt.ops.base import array_module
from taskrt.ops.conv_kernels import _padded_nhwc
from taskrt.ops.windows import col2im_block, crop, row_blocks, window_view_nhwc


def _depthwise(in_channels, groups, a) -> bool:
    return in_channels == groups and array_module(a) is numpy


def _kernel_groups(w, groups):
    """(G, kh*kw*ipg, opg): each group's kernel as the matrix its columns multiply."""
    cout, ipg, kh, kw = w.shape
    return array_module(w).ascontiguousarray(
        w.reshape(groups, cout // groups, ipg, kh, kw).transpose(0, 3, 4, 2, 1).reshape(groups, kh * kw * ipg, -1))


def _columns(view, block, groups):
    """(G, positions, kh*kw*ipg) columns of one block of a (N, Ho, Wo, C, kh, kw) window view."""
    v = view[block]
    bn, bh, wo, c, kh, kw = v.shape
    v = v.reshape(bn, bh, wo, groups, c // groups, kh, kw).transpose(3, 0, 1, 2, 5, 6, 4)
    return v.reshape(groups, bn * bh * wo, -1)


def _d_groups(d_nhwc, block, groups):
    """(G, positions, opg) of one block of an NHWC output gradient."""
    rows = d_nhwc[block]
    return rows.reshape(-1, groups, rows.shape[-1] // groups).transpose(1, 0, 2)


def _forward(x, w, bias, stride, pads, relu, dilation, groups):
    xp = array_module(x)
    cout, kernel = w.shape[0], w.shape[2:]
    view = window_view_nhwc(_padded_nhwc(x, pads), kernel, stride, dilation)
    n, ho, wo = view.shape[:3]
    wg = _kernel_groups(w, groups)
    y = xp.empty((n, ho, wo, cout), dtype=x.dtype)
    for block in row_blocks(n, ho, wo):
        yb = y[block]
        products = xp.matmul(_columns(view, block, groups), wg)  # (G, positions, opg)
        out = products.transpose(1, 0, 2).reshape(yb.shape)
        if bias is not None:
            out += bias
        if relu:
            xp.maximum(out, 0, out=out)
        yb[...] = out
    return xp.ascontiguousarray(y.transpose(0, 3, 1, 2))


def _weight_grad(d, x, kernel, stride, pads, dilation, groups):
    xp = array_module(x)
    cout, ipg = d.shape[1], x.shape[1] // groups
    view = window_view_nhwc(_padded_nhwc(x, pads), kernel, stride, dilation)
    d_nhwc = _padded_nhwc(d)
    dwg = xp.zeros((groups, kernel[0] * kernel[1] * ipg, cout // groups), dtype=x.dtype)
    for block in row_blocks(*d_nhwc.shape[:3]):
        dwg += xp.matmul(_columns(view, block, groups).transpose(0, 2, 1), _d_groups(d_nhwc, block, groups))
    dw = dwg.reshape(groups, *kernel, ipg, cout // groups).transpose(0, 4, 3, 1, 2)
    return xp.ascontiguousarray(dw.reshape(cout, ipg, *kernel))


def _data_grad(d, w, in_shape, stride, pads, dilation, groups):
    xp = array_module(d)
    n, _, ho, wo = d.shape
    c, (kh, kw) = in_shape[1], w.shape[2:]
    (pt, pb), (pl, pr) = pads
    d_nhwc = _padded_nhwc(d)
    wt = _kernel_groups(w, groups).transpose(0, 2, 1)  # (G, opg, kh*kw*ipg)
    dx_pad = xp.zeros((n, in_shape[2] + pt + pb, in_shape[3] + pl + pr, c), dtype=d.dtype)
    for block in row_blocks(n, ho, wo):
        g = _d_groups(d_nhwc, block, groups)
        bn, bh = d_nhwc[block].shape[:2]
        dcols = xp.matmul(g, wt).reshape(groups, bn, bh, wo, kh, kw, c // groups)
        col2im_block(dx_pad, dcols.transpose(1, 2, 3, 4, 5, 0, 6).reshape(bn, bh, wo, kh, kw, c), block, stride,
                     dilation)
    return xp.ascontiguousarray(crop(dx_pad, pads, axes=(1, 2)).transpose(0, 3, 1, 2))


# ---- the kernels --------------------------------------------------------------------------------
def _check(channels, w_shape, groups):
    """The numba loops trust their shapes (they index without bounds checks): a mismatch is an error here."""
    if channels != groups * w_shape[1] or w_shape[0] % groups:
        raise ValueError(f"a tile of {groups} whole groups with weight {tuple(w_shape)} needs "
                         f"{groups * w_shape[1]} input channels, got {channels}")


def conv2d(x, w, bias, stride, pads, relu=False, dilation=(1, 1), groups=1):
    """relu?(x correlated with w, + bias) of a tile of `groups` whole groups: (N, C, H, W) -> (N, Cout, Ho, Wo)."""
    _check(x.shape[1], w.shape, groups)
    if groups == 1:
        return conv_kernels.conv2d(x, w, bias, stride, pads, relu, dilation)
    if _depthwise(x.shape[1], groups, x):
        return depthwise.conv2d(x, w, bias, stride, pads, relu, dilation)
    return _forward(x, w, bias, stride, pads, relu, tuple(dilation), groups)


def weight_grad(d, x, kernel, stride, pads, dilation=(1, 1), groups=1):
    """dL/dw (Cout, C/groups, kh, kw) and dL/db (Cout,) from d = dL/dy (any relu already applied)."""
    _check(x.shape[1], (d.shape[1], x.shape[1] // groups), groups)
    if groups == 1:
        return conv_kernels.conv2d_weight_grad(d, x, kernel, stride, pads, dilation)
    if _depthwise(x.shape[1], groups, x):
        return depthwise.weight_grad(d, x, kernel, stride, pads, dilation)
    return _weight_grad(d, x, tuple(kernel), stride, pads, tuple(dilation), groups), d.sum(axis=(0, 2, 3))


def data_grad(d, w, in_shape, stride, pads, dilation=(1, 1), groups=1):
    """dL/dx (N, C, H, W) from d = dL/dy (any relu already applied)."""
    _check(in_shape[1], w.shape, groups)
    if groups == 1:
        return conv_kernels.conv2d_data_grad(d, w, in_shape, stride, pads, dilation)
    if _depthwise(in_shape[1], groups, d):
        return depthwise.data_grad(d, w, in_shape, stride, pads, dilation)
    return _data_grad(d, w, in_shape, stride, pads, tuple(dilation), groups)
