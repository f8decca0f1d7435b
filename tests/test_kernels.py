"""Array kernels: every column layout and backward-data form of convolution computes the same thing,
the numba max-pool backward gives each gradient to the element the whole-tile form picks, and the
one-pass SGD update rounds as the array operations do.

`ops.conv_kernels` chooses a column layout (planes or channels-last), a backward-data form
(gather or scatter) and, for 3x3 stride-1 tiles, Winograd's F(2x2, 3x3) for speed.  Here each one
is forced in turn on random tiles and compared with direct references (float64), so the choice never
changes what is computed."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt.ops import conv_kernels, optim, winograd
from taskrt.ops.conv import Conv2d
from taskrt.ops.pool import max_grad_whole_tile
from tests.test_ops import make_inputs, random_rect, tile_inputs, windowed_ops


def windows(x, kernel, stride, pads):
    xp = np.pad(x, ((0, 0), (0, 0), *pads))
    return np.lib.stride_tricks.sliding_window_view(xp, kernel, axis=(2, 3))[:, :, :: stride[0], :: stride[1]]


def reference_data_grad(d, w, in_shape, stride, pads):
    (pt, pb), (pl, pr) = pads
    n, _, h, wd = in_shape
    dx = np.zeros((n, in_shape[1], h + pt + pb, wd + pl + pr))
    ho, wo = d.shape[2:]
    for i in range(w.shape[2]):
        for j in range(w.shape[3]):
            rows = slice(i, i + stride[0] * (ho - 1) + 1, stride[0])
            cols = slice(j, j + stride[1] * (wo - 1) + 1, stride[1])
            dx[:, :, rows, cols] += np.einsum("nohw,oc->nchw", d, w[:, :, i, j])
    return dx[:, :, pt : pt + h, pl : pl + wd]


def winograd_forced(on: bool):
    """Winograd on every 3x3 stride-1 tile however small (on), or on none."""
    return mock.patch.multiple(winograd, MIN_TILES=0 if on else 10**9, MIN_CHANNELS=0 if on else 10**9)


def check_every_layout(x, w, b, stride, pads, relu, d):
    win = windows(x, w.shape[2:], stride, pads)
    y_ref = np.einsum("nchwij,ocij->nohw", win, w) + b[None, :, None, None]
    if relu:
        y_ref = np.maximum(y_ref, 0)
    dw_ref = np.einsum("nchwij,nohw->ocij", win, d)
    dx_ref = reference_data_grad(d, w, x.shape, stride, pads)
    for planes, wino in ((True, False), (False, False), (False, True)):
        with mock.patch.object(conv_kernels, "use_planes", lambda *args, planes=planes: planes), \
                mock.patch.object(conv_kernels, "scatters_by_planes", lambda *args, planes=planes: planes), \
                winograd_forced(wino):
            y = conv_kernels.conv2d(x, w, b, stride, pads, relu)
            np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
            dw, db = conv_kernels.conv2d_weight_grad(d, x, w.shape[2:], stride, pads)
            np.testing.assert_allclose(dw, dw_ref, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(db, d.sum(axis=(0, 2, 3)), rtol=1e-12, atol=1e-12)
            dxs = [conv_kernels.data_grad_scatter(d, w, x.shape, stride, pads)]
            if conv_kernels.gather_padding(w.shape[2:], stride, pads) is not None:
                dxs.append(conv_kernels.data_grad_gather(d, w, pads))
            for dx in dxs:
                np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_conv_layouts_and_backward_forms_match_references(data):
    op = data.draw(windowed_ops().filter(lambda op: op.kind == "conv2d"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=False)
    out = random_rect(data.draw, op.out_shape)
    (x,), p = tile_inputs(op, xs, params, out)
    d = rng.standard_normal(out.shape)
    check_every_layout(x, p["weight"], p["bias"], op.stride, op._pads(out), op.activation == "relu", d)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_winograd_tiles_match_references(data):
    """3x3 stride-1 tiles of any size (odd outputs crop a tile row or column), padding 0 to 2 on each
    side as a tile's halo leaves it, with and without relu: F(2x2, 3x3) forward, gathering backward-data
    and weight gradient against the direct sums."""
    n, c, cout = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    h, w = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    pads = tuple((data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))) for _ in range(2))
    if h + sum(pads[0]) < 3 or w + sum(pads[1]) < 3:
        pads = ((1, 1), (1, 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x, wt, b = rng.standard_normal((n, c, h, w)), rng.standard_normal((cout, c, 3, 3)), rng.standard_normal(cout)
    d = rng.standard_normal((n, cout, h + sum(pads[0]) - 2, w + sum(pads[1]) - 2))
    check_every_layout(x, wt, b, (1, 1), pads, data.draw(st.booleans()), d)


def test_winograd_runs_where_it_is_faster():
    """F(2x2, 3x3) takes 3x3 stride-1 tiles with enough tiles and channels: VGG-16-32's and AlexNet-32's
    middle layers, not their 3-channel first layers, strided or larger kernels, or 2x2 images of 16."""
    def used(n, c, cout, hw, kernel=(3, 3), stride=(1, 1)):
        x = np.zeros((n, c, hw, hw), np.float32)
        op = Conv2d((x.shape,), cout, kernel, stride, (kernel[0] // 2, kernel[1] // 2))
        return winograd.applies(x, op.kernel, op.stride, min(c, cout), op.out_shape[2:])

    assert used(16, 64, 64, 32) and used(16, 256, 512, 8) and used(16, 512, 512, 4) and used(8, 192, 384, 13)
    assert not used(16, 3, 64, 32) and not used(16, 512, 512, 2)
    assert not used(16, 64, 64, 32, kernel=(5, 5)) and not used(16, 64, 64, 32, stride=(2, 2))


def test_planes_4k_apart_are_copied_to_channels_last_by_rows():
    """16x32 float64 planes are 4 KiB apart: the channels-last copy takes its row loop there."""
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((2, 3, 16, 32)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    d = rng.standard_normal((2, 4, 15, 32))
    check_every_layout(x, w, b, (1, 1), ((0, 1), (1, 1)), True, d)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_max_pool_loop_matches_whole_tile_form_with_ties(data):
    """Ties (few distinct values) and -inf windows, which the padding equals: the same element gets it.
    Integer gradients add up exactly in any order, so overlapping windows compare exactly too."""
    op = data.draw(windowed_ops().filter(lambda op: op.kind == "pool2d" and op.mode == "max"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    x = rng.integers(-1, 2, op.in_shapes[0]).astype(dtype)
    x[rng.random(x.shape) < 0.2] = -np.inf
    out = random_rect(data.draw, op.out_shape)
    (xt,), _ = tile_inputs(op, [x], {}, out)
    y = op.forward([xt], {}, out)
    dy = rng.integers(1, 100, y.shape).astype(dtype)
    (dx,), _ = op.backward(dy, [xt], y, {}, out, [True])
    expected = max_grad_whole_tile(xt, y, dy, op.kernel, op.stride, op._pads(out))
    assert dx.dtype == xt.dtype
    np.testing.assert_array_equal(dx, expected)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("momentum, weight_decay", [(0.9, 1e-2), (0.9, 0.0), (0.0, 1e-2), (0.0, 0.0)])
def test_sgd_loop_rounds_as_the_array_operations(dtype, momentum, weight_decay):
    """The one-pass update equals PyTorch's formula evaluated step by step in the parameters' precision."""
    rng = np.random.default_rng(6)
    w, v, g = (rng.standard_normal((7, 5)).astype(dtype) for _ in range(3))
    lr = 0.05
    step = g + dtype(weight_decay) * w if weight_decay else g
    v_expected = dtype(momentum) * v + step if momentum else step
    sgd = optim.SGD(lr, momentum=momentum, weight_decay=weight_decay)
    w_new, v_new = (a.reshape(w.shape) for a in sgd.update(sgd.hyper(), w.ravel(), (v.ravel(),), g.ravel()))
    assert w_new.dtype == v_new.dtype == dtype and w_new.shape == w.shape
    np.testing.assert_array_equal(v_new, v_expected)
    np.testing.assert_array_equal(w_new, w - dtype(lr) * v_expected)
