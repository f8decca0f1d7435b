"""The bytes a convolution's numpy kernels allocate for themselves while they run (scratch), from the
shapes of a part: what the kernels in `ops.conv_kernels`, `ops.winograd` and `ops.grouped_conv` make
besides their result, taking the same path they take (Winograd, planes or channels-last im2col).

    conv_forward(x_shape, w_shape, stride, pads, dilation, groups, itemsize)
    conv_backward(x_shape, w_shape, stride, pads, dilation, groups, itemsize, relu, need_dx)

Counted, at their largest at once: zero-padded NHWC copies of a tile, the kernel as a matrix (or
Winograd's transformed kernels, 16/9 of its size), the column matrix and product of one block of
output positions (`ops.windows.row_blocks`, `ops.winograd`'s blocks of tiles), an NHWC output before
its NCHW copy; in backward also the output gradient through relu's mask, and the weight gradient
while the data gradient is computed.  Small buffers (bias, a channel's vectors) and the depthwise
loops' are left out, as are non-contiguous inputs' copies.  On GPUs the kernels are torch's and
cupy's: their allocator's peak is measured instead (`taskrt.execution.held`).
"""

from __future__ import annotations

from math import prod

import numpy

from taskrt.ops import conv_kernels, winograd
from taskrt.ops.windows import row_blocks


def _like(shape):
    """A numpy array of `shape` that takes no memory: the kernels' path predicates read shapes only."""
    return numpy.broadcast_to(numpy.empty((), numpy.float32), tuple(shape))


def _most_positions(n, ho, wo) -> int:
    return max((b.stop - b.start) * (h.stop - h.start) * wo for b, h in row_blocks(n, ho, wo))


def _most_tiles(n, ho, wo) -> int:
    th, tw = (ho + 1) // 2, (wo + 1) // 2
    return max((n1 - n0) * (h1 - h0) * tw for n0, n1, h0, h1 in winograd._tile_blocks(n, th, tw))


def _padded(shape, pads) -> int:
    n, c, h, w = shape
    (pt, pb), (pl, pr) = pads
    return n * c * (h + pt + pb) * (w + pl + pr)


def _correlate(x_shape, w_shape, flipped, stride, pads, dilation) -> int:
    """Elements `conv_kernels._correlate` allocates besides its output."""
    n, cin = x_shape[:2]
    kernel = w_shape[2:]
    cout = w_shape[1] if flipped else w_shape[0]
    ho, wo = conv_kernels._out_hw(x_shape[2:], kernel, stride, pads, dilation)
    if conv_kernels._winograd(_like(x_shape), kernel, stride, min(cin, cout), (ho, wo), dilation):
        return (_padded(x_shape, winograd.padding(pads, (ho, wo))) + 16 * cin * cout
                + 16 * (cin + cout) * _most_tiles(n, ho, wo))
    most = _most_positions(n, ho, wo)
    if conv_kernels.use_planes(_like(x_shape), cin, kernel, stride, wo):
        return prod(w_shape) * flipped + (cin * kernel[0] * kernel[1] + cout) * most
    return (_padded(x_shape, pads) + prod(w_shape) + n * cout * ho * wo
            + most * kernel[0] * kernel[1] * cin)


def _grouped_forward(x_shape, w_shape, stride, pads, dilation, groups) -> int:
    n, cin = x_shape[:2]
    cout, kernel = w_shape[0], w_shape[2:]
    ho, wo = conv_kernels._out_hw(x_shape[2:], kernel, stride, pads, dilation)
    most = _most_positions(n, ho, wo)
    return (_padded(x_shape, pads) + prod(w_shape) + n * cout * ho * wo
            + most * (kernel[0] * kernel[1] * cin + 2 * cout))


def conv_forward(x_shape, w_shape, stride, pads, dilation=(1, 1), groups=1, itemsize=4) -> int:
    """Bytes of scratch of a convolution's forward on a numpy tile x of `x_shape` by a weight of
    `w_shape` (whole groups), `pads` ((top, bottom), (left, right)) as the tile needs them."""
    stride, dilation = tuple(stride), tuple(dilation)
    if groups == 1:
        return _correlate(x_shape, w_shape, False, stride, pads, dilation) * itemsize
    if x_shape[1] == groups:  # depthwise: numba loops, nothing large
        return 0
    return _grouped_forward(x_shape, w_shape, stride, pads, dilation, groups) * itemsize


def _weight_grad(x_shape, w_shape, stride, pads, dilation) -> int:
    """Elements `conv_kernels.conv2d_weight_grad` allocates besides dw (and db)."""
    n, cin = x_shape[:2]
    cout, kernel = w_shape[0], w_shape[2:]
    ho, wo = conv_kernels._out_hw(x_shape[2:], kernel, stride, pads, dilation)
    d_shape = (n, cout, ho, wo)
    if conv_kernels._winograd(_like(x_shape), kernel, stride, min(cin, cout), (ho, wo), dilation):
        even = winograd.padding(((0, 0), (0, 0)), (ho, wo))
        return (_padded(x_shape, winograd.padding(pads, (ho, wo))) + _padded(d_shape, even) + 16 * cin * cout
                + 16 * (cin + cout) * _most_tiles(n, ho, wo))
    most = _most_positions(n, ho, wo)
    if conv_kernels.use_planes(_like(x_shape), cin, kernel, stride, wo):
        return (cin * kernel[0] * kernel[1] + cout) * most
    return _padded(x_shape, pads) + prod(d_shape) + 2 * prod(w_shape) + most * kernel[0] * kernel[1] * cin


def _data_grad(x_shape, w_shape, stride, pads, dilation) -> int:
    """Elements `conv_kernels.conv2d_data_grad` allocates besides dx."""
    n, cin = x_shape[:2]
    cout, kernel = w_shape[0], w_shape[2:]
    ho, wo = conv_kernels._out_hw(x_shape[2:], kernel, stride, pads, dilation)
    d_shape = (n, cout, ho, wo)
    if conv_kernels.gathers(_like(d_shape), w_shape, stride, pads, dilation):
        flipped = conv_kernels.gather_padding(kernel, stride, pads, dilation)
        return _correlate(d_shape, w_shape, True, (1, 1), flipped, dilation)
    most = _most_positions(n, ho, wo)
    k = cin * kernel[0] * kernel[1]
    if conv_kernels.scatters_by_planes(_like(d_shape), stride):
        return (cout + k) * most
    return prod(d_shape) + prod(w_shape) + _padded(x_shape, pads) + most * k


def conv_backward(x_shape, w_shape, stride, pads, dilation=(1, 1), groups=1, itemsize=4, relu=False,
                  need_dx=True) -> int:
    """Bytes of scratch of a convolution's backward (weight gradient, then the input gradient when
    `need_dx`) on a numpy tile, as `conv_forward`; `relu`: the output gradient goes through relu's
    mask first (a new array, and the mask's bytes while it is made)."""
    stride, dilation = tuple(stride), tuple(dilation)
    cout, kernel = w_shape[0], w_shape[2:]
    n = x_shape[0]
    ho, wo = conv_kernels._out_hw(x_shape[2:], kernel, stride, pads, dilation)
    out = n * cout * ho * wo
    masked = out * itemsize if relu else 0
    if groups != 1 and x_shape[1] == groups:
        return masked + (out if relu else 0)
    if groups != 1:  # grouped_conv's: padded copies of x and d, columns and products of a block
        most = _most_positions(n, ho, wo)
        grads = _padded(x_shape, pads) + out + 2 * prod(w_shape) + most * (kernel[0] * kernel[1] * x_shape[1] + cout)
        data = (out + prod(w_shape) + _padded(x_shape, pads) + 2 * most * kernel[0] * kernel[1] * x_shape[1]) * need_dx
        return masked + max(grads, prod(w_shape) + data) * itemsize
    grads = _weight_grad(x_shape, w_shape, stride, pads, dilation)
    data = _data_grad(x_shape, w_shape, stride, pads, dilation) if need_dx else 0
    return max(masked + out * relu, masked + max(grads, prod(w_shape) + data) * itemsize)


def conv_part(op, out, x_shape, itemsize: int, backward: bool = False, need_dx: bool = True) -> int:
    """Bytes of scratch of a `Conv2d` part computing output rect `out` from an input tile of
    `x_shape`: its forward, or its backward."""
    groups, before, after = op._whole_groups(out)
    w_shape = (out.shape[1] + before + after, x_shape[1] // groups, *op.kernel)
    pads = op._pads(out)
    if backward:
        return conv_backward(x_shape, w_shape, op.stride, pads, op.dilation, groups, itemsize,
                             op.activation == "relu", need_dx)
    return conv_forward(x_shape, w_shape, op.stride, pads, op.dilation, groups, itemsize)
