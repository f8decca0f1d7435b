"""Kernels: gradient checks against central differences (float64), on whole tensors and on tiles,
and tile exactness: a tile's output is exactly the slice of the whole-tensor output."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt.ops import Add, BatchNorm, Concat, Conv2d, Flatten, Linear, Pool2d, Relu, SoftmaxCrossEntropy
from taskrt.ops.rect import Rect
from taskrt.planning.params import slice_params

RNG = np.random.default_rng(0)


def make_inputs(op, rng, distinct=True):
    xs = []
    for i, shape in enumerate(op.in_shapes):
        if isinstance(op, SoftmaxCrossEntropy) and i == 1:
            xs.append(rng.integers(0, op.in_shapes[0][1], size=shape))
        elif distinct:
            # a permutation keeps max-pool windows free of ties, so finite differences are smooth
            size = int(np.prod(shape))  # offset by 0.5: no exact zero sits on the relu kink
            xs.append((rng.permutation(size).reshape(shape) - size / 2 + 0.5) / size)
        else:
            xs.append(rng.standard_normal(shape))
    params = {k: rng.standard_normal(s) * 0.5 for k, s in op.param_shapes().items()}
    return xs, params


def tile_inputs(op, xs, params, out):
    rects = op.input_rects(out)
    xt = [None if r is None else x[r.relative_to(Rect.full(x.shape))].copy() for x, r in zip(xs, rects)]
    return xt, {k: v.copy() for k, v in slice_params(params, op.param_rects(out)).items()}


def numeric_grad(f, arr, eps=1e-6, max_points=40, rng=RNG):
    """Central differences at up to `max_points` random coordinates of `arr` (modified in place)."""
    flat = arr.reshape(-1)
    idx = rng.choice(flat.size, size=min(max_points, flat.size), replace=False)
    out = np.zeros(len(idx))
    for k, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + eps
        plus = f()
        flat[i] = old - eps
        minus = f()
        flat[i] = old
        out[k] = (plus - minus) / (2 * eps)
    return idx, out


def check_gradients(op, out, rng, tol=1e-6):
    xs, params = make_inputs(op, rng)
    xt, pt = tile_inputs(op, xs, params, out)
    y = op.forward(xt, pt, out)
    dy = rng.standard_normal(y.shape)
    need = [x is not None and x.dtype.kind == "f" for x in xt]
    dxs, dparams = op.backward(dy, xt, y, pt, out, need)

    def f():
        return float((op.forward(xt, pt, out) * dy).sum())

    targets = [(x, dx) for x, dx, n in zip(xt, dxs, need) if n]
    targets += [(pt[k], dparams[k]) for k in pt]
    assert len(targets) > 0
    for arr, analytic in targets:
        assert analytic.shape == arr.shape
        idx, num = numeric_grad(f, arr, rng=rng)
        np.testing.assert_allclose(analytic.reshape(-1)[idx], num, rtol=tol, atol=tol)


def full(op):
    return Rect.full(op.out_shape)


CONVS = [
    Conv2d(((2, 3, 7, 7),), 4, (3, 3), (1, 1), (1, 1)),
    Conv2d(((2, 3, 9, 8),), 5, (3, 3), (2, 2), (1, 1), "relu"),
    Conv2d(((1, 2, 9, 9),), 3, (1, 7), (1, 1), (0, 3)),
    Conv2d(((1, 2, 9, 9),), 3, (7, 1), (1, 1), (3, 0)),
    Conv2d(((2, 2, 11, 10),), 3, (5, 4), (3, 2), (2, 1), "relu"),
    Conv2d(((1, 3, 6, 6),), 2, (6, 6), (1, 1), (0, 0)),
    Conv2d(((2, 5, 6, 7),), 3, (3, 3), (1, 1), (1, 1), "relu"),  # C > Cout: backward-data gathers
    Conv2d(((1, 4, 5, 5),), 2, (3, 2), (1, 1), (3, 2)),  # padding beyond k-1: it scatters
    Conv2d(((2, 1, 6, 9),), 3, (3, 3), (1, 1), (1, 1)),  # rows longer than channel runs: planes
]
POOLS = [
    Pool2d(((2, 3, 8, 8),), (2, 2), (2, 2), (0, 0), "max"),
    Pool2d(((2, 3, 9, 9),), (3, 3), (2, 2), (1, 1), "max"),
    Pool2d(((2, 3, 7, 7),), (3, 3), (1, 1), (1, 1), "avg"),
    Pool2d(((1, 2, 8, 9),), (3, 2), (2, 3), (1, 0), "avg"),
]
OTHERS = [
    Linear(((4, 7),), 5),
    Linear(((4, 7),), 5, "relu"),
    Linear(((6, 7),), 3),  # batch above the output features: x @ W.T
    Relu(((2, 3, 4, 4),)),
    Add(((2, 3, 4, 4), (2, 3, 4, 4))),
    Concat(((2, 3, 4, 4), (2, 2, 4, 4), (2, 4, 4, 4))),
    Flatten(((2, 3, 4, 4),)),
    SoftmaxCrossEntropy(((5, 6), (5,))),
    BatchNorm(((5, 4),)),
    BatchNorm(((2, 3, 4, 5),), eps=1e-3),
]


@pytest.mark.parametrize("op", CONVS + POOLS + OTHERS, ids=lambda op: f"{op.kind}")
def test_whole_tensor_gradients(op):
    check_gradients(op, full(op), np.random.default_rng(1))


def border_tiles(op):
    """A tile at the top-left border, one in the interior, one at the bottom-right border."""
    shape = op.out_shape
    if len(shape) == 4:
        n, c, h, w = shape
        yield Rect((0, 0, 0, 0), (1, max(1, c // 2), max(1, h // 2), max(1, w // 2)))
        yield Rect((0, 0, 1, 1), (n, c, max(2, h - 1), max(2, w - 1)))
        yield Rect((n - 1, c - 1, h // 2, w // 2), (n, c, h, w))
    elif len(shape) == 2:
        yield Rect((0, 1), (max(1, shape[0] - 1), shape[1] - 1))
        yield Rect((0, shape[1] // 2), (shape[0] // 2 + 1, shape[1]))
    else:
        yield Rect((1,), (shape[0] - 1,))


@pytest.mark.parametrize("op", CONVS + POOLS + OTHERS, ids=lambda op: f"{op.kind}")
def test_tile_gradients(op):
    rng = np.random.default_rng(2)
    for out in border_tiles(op):
        check_gradients(op, out, rng)


def random_rect(draw, shape):
    lo, hi = [], []
    for size in shape:
        a = draw(st.integers(0, size - 1))
        b = draw(st.integers(a + 1, size))
        lo.append(a)
        hi.append(b)
    return Rect(tuple(lo), tuple(hi))


@st.composite
def windowed_ops(draw):
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["conv", "conv_relu", "max", "avg"]))
    limit = (kh // 2, kw // 2) if kind in ("max", "avg") else (kh, kw)
    ph, pw = draw(st.integers(0, limit[0])), draw(st.integers(0, limit[1]))
    h = draw(st.integers(max(1, kh - 2 * ph), 12))
    w = draw(st.integers(max(1, kw - 2 * pw), 12))
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = ((n, c, h, w),)
    if kind.startswith("conv"):
        return Conv2d(shape, draw(st.integers(1, 4)), (kh, kw), (sh, sw), (ph, pw),
                      "relu" if kind == "conv_relu" else None)
    return Pool2d(shape, (kh, kw), (sh, sw), (ph, pw), kind)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_tile_output_is_slice_of_full_output(data):
    op = data.draw(windowed_ops())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=False)
    y_full = op.forward(xs, params, full(op))
    out = random_rect(data.draw, op.out_shape)
    xt, pt = tile_inputs(op, xs, params, out)
    y_tile = op.forward(xt, pt, out)
    assert y_tile.shape == out.shape
    assert np.max(np.abs(y_tile - y_full[out.relative_to(full(op))]), initial=0.0) < 1e-12


def grid_partition(shape, degrees):
    """Rects of a grid split of `shape` (blocks as equal as possible, first ones larger)."""
    bounds = []
    for size, d in zip(shape, degrees):
        q, r = divmod(size, d)
        edges = np.cumsum([0] + [q + (i < r) for i in range(d)])
        bounds.append(list(zip(edges[:-1], edges[1:])))
    for combo in np.ndindex(*degrees):
        yield Rect.from_ranges(bounds[dim][i] for dim, i in enumerate(combo))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tile_gradients_sum_to_full_gradients(data):
    """Scatter-adding every tile's input and parameter gradients gives the whole-tensor ones."""
    op = data.draw(windowed_ops())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=True)
    whole = full(op)
    y_full = op.forward(xs, params, whole)
    dy = rng.standard_normal(y_full.shape)
    (dx_full,), dp_full = op.backward(dy, xs, y_full, params, whole, [True])
    degrees = [data.draw(st.integers(1, s)) for s in op.out_shape]
    dx_sum = np.zeros_like(xs[0])
    dp_sum = {k: np.zeros_like(v) for k, v in params.items()}
    for out in grid_partition(op.out_shape, degrees):
        xt, pt = tile_inputs(op, xs, params, out)
        sl = out.relative_to(whole)
        (dx,), dp = op.backward(dy[sl], xt, y_full[sl], pt, out, [True])
        dx_sum[op.input_rects(out)[0].relative_to(Rect.full(xs[0].shape))] += dx
        for k, rect in op.param_rects(out).items():
            dp_sum[k][rect.relative_to(Rect.full(params[k].shape))] += dp[k]
    np.testing.assert_allclose(dx_sum, dx_full, rtol=1e-10, atol=1e-12)
    for k in params:
        np.testing.assert_allclose(dp_sum[k], dp_full[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", [OTHERS[0], OTHERS[1], OTHERS[4], OTHERS[5], OTHERS[6]], ids=lambda op: op.kind)
def test_non_windowed_tiles_are_slices(op):
    rng = np.random.default_rng(3)
    xs, params = make_inputs(op, rng, distinct=False)
    y_full = op.forward(xs, params, full(op))
    for out in border_tiles(op):
        xt, pt = tile_inputs(op, xs, params, out)
        np.testing.assert_array_equal(op.forward(xt, pt, out), y_full[out.relative_to(full(op))])


def test_float32_kernels_keep_float32():
    op = CONVS[1]
    xs, params = make_inputs(op, RNG, distinct=False)
    xs = [x.astype(np.float32) for x in xs]
    params = {k: v.astype(np.float32) for k, v in params.items()}
    y = op.forward(xs, params, full(op))
    assert y.dtype == np.float32
    (dx,), dp = op.backward(np.ones_like(y), xs, y, params, full(op), [True])
    assert dx.dtype == np.float32 and dp["weight"].dtype == np.float32


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_batch_norm_pieces_over_any_split_equal_the_whole(data):
    """Partial statistics combined over a random grid of tiles, then normalize / gradient sums /
    input gradient per tile, equal the whole-tensor batch norm forward and backward (float64)."""
    shape = data.draw(st.sampled_from([(6, 5), (3, 4, 5, 3), (2, 2, 7, 7)]))
    op = BatchNorm((shape,))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape) * 3 + 1
    params = {"weight": rng.standard_normal(shape[1]), "bias": rng.standard_normal(shape[1])}
    whole = full(op)
    y_full = op.forward([x], params, whole)
    dy = rng.standard_normal(shape)
    (dx_full,), dp_full = op.backward(dy, [x], y_full, params, whole, [True])
    degrees = [data.draw(st.integers(1, s)) for s in shape]
    tiles = list(grid_partition(shape, degrees))
    groups = {}
    for out in tiles:
        groups.setdefault((out.lo[1], out.hi[1]), []).append(out)
    for (c0, c1), outs in groups.items():
        cs = slice(c0, c1)
        p = {k: v[cs] for k, v in params.items()}
        stats = op.combine_stats([op.partial_stats(x[o.relative_to(whole)]) for o in outs])
        sums = {k: sum(op.grad_sums(dy[o.relative_to(whole)], x[o.relative_to(whole)], stats)[k] for o in outs)
                for k in ("bias", "weight")}
        for k in params:
            np.testing.assert_allclose(sums[k], dp_full[k][cs], rtol=1e-10, atol=1e-12)
        for o in outs:
            sl = o.relative_to(whole)
            np.testing.assert_allclose(op.normalize(x[sl], stats, p), y_full[sl], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(op.input_grad(dy[sl], x[sl], stats, sums, p), dx_full[sl], rtol=1e-9,
                                       atol=1e-11)


def test_batch_norm_running_statistics_and_inference():
    """PyTorch's rule: running mean and unbiased variance by momentum; inference uses them."""
    op = BatchNorm(((8, 3),), momentum=0.25)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 3)) * 2 + 0.5
    running = np.stack([np.zeros(3), np.ones(3)])
    new = op.update_running(running, op.partial_stats(x))
    np.testing.assert_allclose(new[0], 0.25 * x.mean(axis=0))
    np.testing.assert_allclose(new[1], 0.75 + 0.25 * x.var(axis=0, ddof=1))
    params = {"weight": np.array([1.0, 2.0, 0.5]), "bias": np.array([0.0, 1.0, -1.0])}
    expected = (x - new[0]) / np.sqrt(new[1] + op.eps) * params["weight"] + params["bias"]
    np.testing.assert_allclose(op.infer(x, new, params), expected)
