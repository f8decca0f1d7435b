"""Pooling options (ceil_mode, count_include_pad), adaptive pooling, the mean over h and w, channel
slices, channel shuffle, per-channel scale and reshape-as-flatten: PyTorch's values and gradients in
float64, tiles that are exact slices of the whole tensor with gradients summing to the whole ones,
the region rules (and the search's array forms of them), the graph API, and training under random
strategies over 3 devices equal to one device, with exactly the planned bytes moved."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph, GraphError
from taskrt.graph.config import ParallelConfig
from taskrt.graph.graph import Layer
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.ops import OPS, AdaptivePool2d, ChannelShuffle, ChannelSlice, Flatten, Mean, Pool2d, Scale, torch_kernels
from taskrt.ops.rect import Rect
from taskrt.ops.windows import pool_out_size
from taskrt.search import CostModel, transfer
from taskrt.search.families import integrated
from taskrt.search.regions import Needs, input_ranges, part_table
from taskrt.search.space import layer_configs
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import layer_configs as random_layer_configs

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (input shape, kernel, stride, padding, mode, ceil_mode, count_include_pad)
POOL_CASES = [
    ((2, 3, 8, 7), 3, 2, 0, "max", True, True),  # the last window along h runs past the input
    ((2, 3, 7, 6), 3, 2, 1, "avg", True, True),  # along w past the padding: torch divides by what is inside it
    ((2, 3, 7, 6), 3, 2, 1, "avg", True, False),
    ((2, 3, 6, 7), 3, 2, 1, "avg", False, False),  # border windows divide by their elements inside the input
    ((2, 3, 5, 5), 3, 3, 1, "max", True, True),  # torch drops a last window that would start in the padding
    ((2, 3, 5, 5), 3, 3, 1, "avg", True, False),
    ((2, 2, 9, 6), (2, 3), (2, 2), (1, 1), "avg", True, True),
    ((1, 2, 10, 9), (3, 2), (2, 3), (1, 0), "max", True, True),
]


def pair(v):
    return (v, v) if isinstance(v, int) else v


def pool_op(shape, kernel, stride, padding, mode, ceil_mode, count_include_pad):
    return Pool2d((shape,), pair(kernel), pair(stride), pair(padding), mode, ceil_mode, count_include_pad)


def torch_pool(shape, kernel, stride, padding, mode, ceil_mode, count_include_pad):
    if mode == "max":
        return lambda t: F.max_pool2d(t, kernel, stride, padding, ceil_mode=ceil_mode)
    return lambda t: F.avg_pool2d(t, kernel, stride, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad)


ADAPTIVE_CASES = [((2, 3, 7, 5), (3, 2)), ((2, 2, 5, 7), (2, 3)), ((2, 3, 6, 6), (4, 4)), ((2, 2, 3, 4), (5, 6)),
                  ((2, 3, 5, 5), (1, 1))]


def torch_adaptive(size, mode):
    return (lambda t: F.adaptive_max_pool2d(t, size)) if mode == "max" else (lambda t: F.adaptive_avg_pool2d(t, size))


SHUFFLED = (2, 12, 3, 4)


def torch_shuffle(groups):
    def shuffle(t):
        n, c, *rest = t.shape
        return t.view(n, groups, c // groups, *rest).transpose(1, 2).reshape(n, c, *rest)
    return shuffle


# op, its torch reference (a function of the input tensor and, for scale, the weight), and its weight's shape
REFERENCES = {
    **{f"pool{case}": (pool_op(*case), torch_pool(*case), None) for case in POOL_CASES},
    **{f"adaptive_{mode}{shape}->{size}": (AdaptivePool2d((shape,), size, mode), torch_adaptive(size, mode), None)
       for shape, size in ADAPTIVE_CASES for mode in ("avg", "max")},
    "mean": (Mean(((2, 3, 4, 5),)), lambda t: t.mean((2, 3)), None),
    "mean(keepdim)": (Mean(((2, 3, 4, 5),), True), lambda t: t.mean((2, 3), keepdim=True), None),
    "channel_slice": (ChannelSlice(((2, 8, 3, 4),), 2, 7), lambda t: t[:, 2:7], None),
    "channel_slice(n, c)": (ChannelSlice(((3, 8),), 0, 4), lambda t: torch.chunk(t, 2, dim=1)[0], None),
    "channel_shuffle": (ChannelShuffle((SHUFFLED,), 3), torch_shuffle(3), None),
    "channel_shuffle(n, c)": (ChannelShuffle(((3, 6),), 2), torch_shuffle(2), None),
    "scale(c, 1, 1)": (Scale(((2, 5, 3, 4),), (5, 1, 1)), lambda t, w: w * t, (5, 1, 1)),
    "scale(c)": (Scale(((2, 5, 3, 4),), (5,)), lambda t, w: t * w.view(1, -1, 1, 1), (5,)),
    "scale(n, c)": (Scale(((3, 5),), (5,)), lambda t, w: t * w, (5,)),
    "flatten(n, c)": (Flatten(((3, 5),)), lambda t: t.reshape(3, -1), None),
    "flatten(n, c, 1, 1)": (Flatten(((3, 5, 1, 1),)), lambda t: t.reshape(3, -1), None),
}


def whole(op):
    return Rect.full(op.out_shape)


def params_of(op, rng):
    return {k: rng.standard_normal(s) for k, s in op.param_shapes().items()}


def run_whole(op, x, params, dy, need=True):
    """The whole output and its gradients; the input gradient over the whole input (a channel slice
    reads only its channels: the others get 0)."""
    (read,) = op.input_rects(whole(op))
    tile = x[read.relative_to(Rect.full(x.shape))]
    y = op.forward([tile], params, whole(op))
    (dx,), dparams = op.backward(dy, [tile], y, params, whole(op), [need])
    if dx is not None:
        dx_whole = np.zeros_like(x)
        dx_whole[read.relative_to(Rect.full(x.shape))] = dx
        dx = dx_whole
    return y, dx, dparams


def assert_relative(actual, expected, tol=1e-12):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


# ---- against PyTorch, float64 ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("name", list(REFERENCES))
def test_forward_and_backward_equal_torch(name, backend):
    op, reference, weight_shape = REFERENCES[name]
    rng = np.random.default_rng(0)
    x, params = rng.standard_normal(op.in_shapes[0]), params_of(op, rng)
    t = torch.tensor(x, requires_grad=True)
    w = torch.tensor(params["weight"], requires_grad=True) if weight_shape else None
    y_torch = reference(t) if w is None else reference(t, w)
    assert tuple(y_torch.shape) == op.out_shape
    dy = rng.standard_normal(op.out_shape)
    y_torch.backward(torch.tensor(dy))
    with torch_kernels.backend(backend):  # pooling runs through torch on GPU tiles: its path is checked too
        y, dx, dparams = run_whole(op, x, params, dy)
    assert_relative(y, y_torch.detach().numpy())
    assert_relative(dx, t.grad.numpy())
    if w is not None:
        assert_relative(dparams["weight"], w.grad.numpy())
    else:
        assert dparams == {}
    assert run_whole(op, x, params, dy, need=False)[1] is None


def test_the_pool_output_sizes_are_torchs_and_the_ceil_rule_is_exercised():
    for size in range(1, 12):
        for k in range(1, 6):
            for s in range(1, 5):
                for p in range(k // 2 + 1):
                    if k > size + 2 * p:
                        continue
                    for ceil in (False, True):
                        expected = F.max_pool2d(torch.zeros(1, 1, size, 1), (k, 1), (s, 1), (p, 0), ceil_mode=ceil)
                        assert pool_out_size(size, k, s, p, ceil) == expected.shape[2], (size, k, s, p, ceil)
    assert pool_out_size(8, 3, 2, 0) == 3 and pool_out_size(8, 3, 2, 0, ceil_mode=True) == 4
    assert pool_out_size(5, 3, 3, 1, ceil_mode=True) == 2  # rounding up gives 3, whose last window starts at 6 - 1


def test_float32_stays_float32():
    rng = np.random.default_rng(2)
    for op, _, _ in REFERENCES.values():
        x = rng.standard_normal(op.in_shapes[0]).astype(np.float32)
        params = {k: v.astype(np.float32) for k, v in params_of(op, rng).items()}
        y, dx, dparams = run_whole(op, x, params, np.ones(op.out_shape, np.float32))
        assert y.dtype == dx.dtype == np.float32 and all(v.dtype == np.float32 for v in dparams.values()), op


def test_a_channel_slice_given_its_whole_input_takes_its_channels():
    """Whole-tensor runs (the single-device reference) pass an op its whole inputs."""
    op = ChannelSlice(((2, 8, 3, 4),), 2, 7)
    x, dy = np.random.default_rng(5).standard_normal((2, 8, 3, 4)), np.ones((2, 5, 3, 4))
    np.testing.assert_array_equal(op.forward([x], {}, whole(op)), x[:, 2:7])
    (dx,), _ = op.backward(dy, [x], None, {}, whole(op), [True])
    assert dx.shape == x.shape and dx[:, 2:7].sum() == dy.sum() and dx.sum() == dy.sum()


def test_adaptive_average_to_one_by_one_is_the_mean():
    x = np.random.default_rng(3).standard_normal((2, 3, 5, 6))
    pooled = AdaptivePool2d((x.shape,), (1, 1)).forward([x], {}, Rect.full((2, 3, 1, 1)))
    np.testing.assert_allclose(pooled, Mean((x.shape,), True).forward([x], {}, Rect.full((2, 3, 1, 1))), rtol=1e-14)


def test_flops():
    pool = AdaptivePool2d(((2, 3, 7, 7),), (3, 3))
    # bins [0, 3), [2, 5), [4, 7): 9 rows and 9 columns read per sample and channel
    assert pool.flops(whole(pool)) == 2 * 3 * 9 * 9
    assert pool.flops(Rect((0, 0, 1, 0), (1, 1, 2, 1))) == 9
    mean = Mean(((2, 3, 4, 5),))
    assert mean.flops(Rect((0, 0), (1, 2))) == 2 * 20
    scale = Scale(((2, 5, 3, 4),), (5,))
    assert scale.flops(whole(scale)) == 120 and scale.backward_flops(whole(scale)) == 360
    assert ChannelSlice(((2, 8, 3, 4),), 2, 7).flops(Rect((0, 0, 0, 0), (2, 5, 3, 4))) == 0
    ceil = pool_op(*POOL_CASES[0])
    assert ceil.flops(whole(ceil)) == whole(ceil).volume * 9


# ---- region rules ----------------------------------------------------------------------------------


def test_region_rules():
    ceil = pool_op((2, 3, 8, 7), 3, 2, 0, "max", True, True)
    assert ceil.out_shape == (2, 3, 4, 3)
    # the last output row's window is rows 6..8: rows 6 and 7 are read, row 8 is padding the tile adds itself
    assert ceil.input_rects(Rect((0, 1, 3, 0), (2, 2, 4, 3))) == [Rect((0, 1, 6, 0), (2, 2, 8, 7))]
    assert ceil.input_rects(Rect((0, 0, 0, 0), (1, 3, 2, 1))) == [Rect((0, 0, 0, 0), (1, 3, 5, 3))]
    adaptive = AdaptivePool2d(((2, 3, 7, 5),), (3, 2))
    # rows: bins [0, 3), [2, 5), [4, 7); columns: [0, 3), [2, 5)
    assert adaptive.input_rects(Rect((1, 1, 1, 1), (2, 3, 2, 2))) == [Rect((1, 1, 2, 2), (2, 3, 5, 5))]
    assert adaptive.input_rects(Rect((0, 0, 0, 0), (2, 3, 2, 1))) == [Rect((0, 0, 0, 0), (2, 3, 5, 3))]
    assert Mean(((2, 3, 4, 5),)).input_rects(Rect((1, 1), (2, 3))) == [Rect((1, 1, 0, 0), (2, 3, 4, 5))]
    assert Mean(((2, 3, 4, 5),), True).input_rects(Rect((1, 1, 0, 0), (2, 3, 1, 1))) == [
        Rect((1, 1, 0, 0), (2, 3, 4, 5))]
    assert ChannelSlice(((2, 8, 3, 4),), 2, 7).input_rects(Rect((0, 1, 1, 0), (2, 3, 3, 2))) == [
        Rect((0, 3, 1, 0), (2, 5, 3, 2))]
    shuffle = ChannelShuffle((SHUFFLED,), 3)  # output channel o from input (o % 3) * 4 + o // 3
    assert shuffle.sources(0, 12).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    # channels 3..4 come from 1 and 5: the box [1, 6) holds 2, 3 and 4 too (more than needed, never less)
    assert shuffle.input_rects(Rect((0, 3, 0, 1), (1, 5, 2, 3))) == [Rect((0, 1, 0, 1), (1, 6, 2, 3))]
    scale = Scale(((2, 5, 3, 4),), (5, 1, 1))
    out = Rect((1, 2, 1, 0), (2, 4, 3, 4))
    assert scale.input_rects(out) == [out]
    assert scale.param_rects(out) == {"weight": Rect((2, 0, 0), (4, 1, 1))}
    assert Scale(((2, 5, 3, 4),), (5,)).param_rects(out) == {"weight": Rect((2,), (4,))}
    assert Flatten(((3, 5, 1, 1),)).input_rects(Rect((1, 2), (3, 4))) == [Rect((1, 2, 0, 0), (3, 4, 1, 1))]
    assert Flatten(((3, 5),)).input_rects(Rect((1, 2), (3, 4))) == [Rect((1, 2), (3, 4))]


REGION_OPS = [op for op, _, _ in REFERENCES.values()]


@pytest.mark.parametrize("op", REGION_OPS, ids=lambda op: f"{op.kind}{op.in_shapes[0]}")
def test_the_searchs_array_rules_and_needs_equal_the_ops_rule(op):
    rng = np.random.default_rng(4)
    shape = np.array(op.out_shape)
    a, b = rng.integers(0, shape, (200, len(shape))), rng.integers(0, shape, (200, len(shape)))
    lo, hi = np.minimum(a, b), np.maximum(a, b) + 1
    reads, in_lo, in_hi = input_ranges(op, 0, lo, hi)
    for k in range(len(lo)):
        expected = op.input_rects(Rect(tuple(lo[k].tolist()), tuple(hi[k].tolist())))[0]
        assert reads[k] and (tuple(in_lo[k]), tuple(in_hi[k])) == (expected.lo, expected.hi)
    layer = Layer("layer", op, ("x",))
    for devices in (4, 6):  # every input dimension follows one output dimension (Needs checks it)
        configs = layer_configs(layer, devices, powers_of_two=devices == 4)
        parts = part_table(layer.shape, configs)
        needs = Needs(op, 0, parts)
        for k, (a, b) in enumerate(zip(parts.lo.tolist(), parts.hi.tolist())):
            expected = op.input_rects(Rect(tuple(a), tuple(b)))[0]
            assert (tuple(needs.table.lo[k]), tuple(needs.table.hi[k])) == (expected.lo, expected.hi)


# ---- tiles -----------------------------------------------------------------------------------------


def random_rect(draw, shape):
    bounds = [sorted(draw(st.lists(st.integers(0, size), min_size=2, max_size=2, unique=True))) for size in shape]
    return Rect(tuple(a for a, _ in bounds), tuple(b for _, b in bounds))


def grid_partition(shape, degrees):
    """The Rects of a grid split of `shape`, blocks as equal as possible (as ParallelConfig's)."""
    edges = [np.cumsum([0] + [size // d + (i < size % d) for i in range(d)]) for size, d in zip(shape, degrees)]
    for block in np.ndindex(*degrees):
        yield Rect.from_ranges((edges[k][i], edges[k][i + 1]) for k, i in enumerate(block))


def tile_of(x, rect):
    return x[rect.relative_to(Rect.full(x.shape))].copy()


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_a_tile_is_the_slice_of_the_whole_and_its_gradients_sum_to_the_whole(data):
    op = data.draw(st.sampled_from(REGION_OPS), label="op")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x, params = rng.standard_normal(op.in_shapes[0]), params_of(op, rng)
    full = whole(op)
    dy = rng.standard_normal(op.out_shape)
    y_full, dx_full, dparams_full = run_whole(op, x, params, dy)

    out = random_rect(data.draw, op.out_shape)
    (read,) = op.input_rects(out)
    assert Rect.full(x.shape).contains(read)
    tile_params = {k: tile_of(params[k], r) for k, r in op.param_rects(out).items()}
    y = op.forward([tile_of(x, read)], tile_params, out)
    np.testing.assert_allclose(y, y_full[out.relative_to(full)], rtol=1e-13, atol=1e-300)

    degrees = [data.draw(st.integers(1, size), label="degree") for size in op.out_shape]
    dx_sum = np.zeros_like(x)
    dparams_sum = {k: np.zeros_like(v) for k, v in params.items()}
    for out in grid_partition(op.out_shape, degrees):
        (read,) = op.input_rects(out)
        rects = op.param_rects(out)
        sl = out.relative_to(full)
        (dx,), dparams = op.backward(dy[sl], [tile_of(x, read)], y_full[sl], {k: tile_of(params[k], r)
                                     for k, r in rects.items()}, out, [True])
        assert dx.shape == read.shape
        dx_sum[read.relative_to(Rect.full(x.shape))] += dx
        for k, r in rects.items():
            dparams_sum[k][r.relative_to(Rect.full(params[k].shape))] += dparams[k]
    np.testing.assert_allclose(dx_sum, dx_full, rtol=1e-12, atol=1e-12)
    for k in params:
        np.testing.assert_allclose(dparams_sum[k], dparams_full[k], rtol=1e-12, atol=1e-12)


# ---- the graph API ---------------------------------------------------------------------------------


def every_new_op(g):
    x = g.input("image", (2, 8, 6, 6))
    a, b = g.channel_slice(x, 0, 4), g.channel_slice(x, 4, 8)
    b = g.pool2d(b, 3, stride=1, padding=1, mode="avg", count_include_pad=False)
    y = g.channel_shuffle(g.concat([a, b]), 2)
    y = g.scale(y, (8, 1, 1))
    y = g.pool2d(y, 3, stride=2, ceil_mode=True)
    p = g.adaptive_pool2d(y, (3, None), mode="max")
    m = g.mean(y, keepdim=True)
    f = g.concat([g.reshape(p, (2, -1)), g.reshape(m, (-1, 8))])
    g.scale(f, (f.shape[1],))
    g.mean(y, dims=(-1, -2))
    g.adaptive_pool2d(y, 1)
    return g


def test_round_trip_of_every_new_op_and_old_pool_descriptions_unchanged():
    g = every_new_op(Graph("every"))
    assert [layer.name for layer in g] == ["image", "chslice1", "chslice2", "pool1", "concat1", "shuffle1", "scale1",
                                           "pool2", "apool1", "mean1", "flatten1", "flatten2", "concat2", "scale2",
                                           "mean2", "apool2"]
    assert g["pool2"].shape == (2, 8, 3, 3) and g["apool1"].shape == (2, 8, 3, 3) and g["apool2"].shape == (2, 8, 1, 1)
    assert g["mean1"].shape == (2, 8, 1, 1) and g["mean2"].shape == (2, 8) and g["mean2"].dims == ("n", "c")
    assert g["concat2"].shape == (2, 80) and g["scale2"].param_shapes == {"weight": (80,)}
    data = g.to_dict()
    h = Graph.from_dict(json.loads(json.dumps(data)))
    assert h.to_dict() == data
    for a, b in zip(g, h):
        assert (a.name, a.kind, a.shape, a.inputs, a.op, a.dims) == (b.name, b.kind, b.shape, b.inputs, b.op, b.dims)
    assert h["pool1"].op.attrs() == {"kernel": [3, 3], "stride": [1, 1], "padding": [1, 1], "mode": "avg",
                                     "count_include_pad": False}
    assert h["pool2"].op.attrs()["ceil_mode"] is True and h["apool1"].op.attrs() == {"output_size": [3, 3],
                                                                                      "mode": "max"}
    assert h["scale1"].op.attrs() == {"weight_shape": [8, 1, 1]} and h["chslice2"].op.attrs() == {"start": 4, "stop": 8}
    assert h["shuffle1"].op.attrs() == {"groups": 2} and h["mean1"].op.attrs() == {"keepdim": True}
    assert h["flatten1"].kind == "flatten" and {"adaptive_pool2d", "mean", "channel_slice", "channel_shuffle",
                                                "scale"} <= set(OPS)
    # a pool without the options describes itself as before them, and such descriptions still load
    plain = Graph("plain")
    plain.pool2d(plain.input("image", (2, 3, 6, 6)), 2, mode="avg")
    old = {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "mode": "avg"}
    assert plain.to_dict()["layers"][1] == {"name": "pool1", "kind": "pool2d", "inputs": ["image"], **old}
    op = Graph.from_dict(plain.to_dict())["pool1"].op
    assert (op.ceil_mode, op.count_include_pad) == (False, True)


def raises(parts, fn, *args, **kwargs):
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"


def test_bad_arguments_name_the_layer_and_what_is_valid():
    g = Graph()
    x = g.input("image", (2, 8, 6, 6))
    flat = g.flatten(x)
    raises(["'p'", "ceil_mode must be True or False", "'yes'"], g.pool2d, x, 2, ceil_mode="yes", name="p")
    raises(["'p'", "count_include_pad=False applies to mode 'avg' only"], g.pool2d, x, 2, count_include_pad=False,
           name="p")
    raises(["'p'", "count_include_pad must be True or False"], g.pool2d, x, 2, mode="avg", count_include_pad=0,
           name="p")
    for size in (0, (2,), "3", (2, 0), (2.5, 2), True):
        raises(["'a'", "output_size must be an int >= 1 or a pair (oh, ow)"], g.adaptive_pool2d, x, size, name="a")
    raises(["'a'", "'avg', 'max'", "'min'"], g.adaptive_pool2d, x, 2, mode="min", name="a")
    raises(["'a'", "rank-4"], g.adaptive_pool2d, flat, 2, name="a")
    for dims in ((1, 2), (2,), 2, (2, 3, 3), "23"):
        raises(["'m'", "dims must be (2, 3)"], g.mean, x, dims=dims, name="m")
    raises(["'m'", "keepdim must be True or False"], g.mean, x, keepdim=1, name="m")
    raises(["'m'", "rank-4 (n, c, h, w)", "(2, 288)"], g.mean, flat, name="m")
    for start, stop in ((4, 2), (0, 9), (-1, 3), (2, 2), (0.5, 3)):
        raises(["'s'", "0 <= start < stop <= 8"], g.channel_slice, x, start, stop, name="s")
    raises(["'c'", "dividing the input's 8 channels", "3"], g.channel_shuffle, x, 3, name="c")
    raises(["'c'", "groups"], g.channel_shuffle, x, 0, name="c")
    raises(["'w'", "(8,) or (8, 1, 1)", "(4,)"], g.scale, x, (4,), name="w")
    raises(["'w'", "(288,)", "(288, 1, 1)"], g.scale, flat, (288, 1, 1), name="w")
    raises(["'r'", "(2, -1), (2, 288), (-1, 288)", "(2, 8, -1)"], g.reshape, x, (2, 8, -1), name="r")
    raises(["'r'", "(2, -1)"], g.reshape, x, (1, -1), name="r")
    assert list(g.layers) == ["image", "flatten1"]  # nothing added by a failed call
    data = every_new_op(Graph()).to_dict()
    spec = next(s for s in data["layers"] if s["kind"] == "channel_shuffle")
    spec["groups"] = 5
    raises(["'shuffle1'", "channel_shuffle", "dividing"], Graph.from_dict, data)


# ---- the search ------------------------------------------------------------------------------------


def test_the_cost_models_edges_equal_the_general_transfer_tables():
    g = shuffle_net(batch=4)
    cm = CostModel(Machine.simulated(1, 4), cache=False)
    tables, needed = cm.tables(g), g.needs_backward()
    for src, dst, j, matrix in tables.edges:
        u, v = cm.layer_space(g[src]), cm.layer_space(g[dst])
        itemsize = 8 if g[src].is_input and g[src].op.dtype == "int64" else 4
        expected = transfer.general(u.parts, v.needs[j].table, cm.links, itemsize, src in needed)
        np.testing.assert_allclose(matrix, expected, rtol=1e-12, atol=1e-18, err_msg=f"{src} -> {dst}")


def test_the_grid_family_keeps_splits_where_the_new_layers_follow_them():
    machine, devices = Machine.simulated(1, 4), (0, 1, 2, 3)
    spatial, grid = ParallelConfig(n=2, h=2, devices=devices), ParallelConfig(n=2, c=2, devices=devices)
    batch = ParallelConfig(n=4, devices=devices)
    s = integrated(shuffle_net(batch=4), machine, pr=2, pc=2, conv="grid", domain=["conv"], sync="ps")
    # channel slices and the shuffle read their own rows and columns of a split that keeps channels whole
    for name in ("conv", "left", "right", "concat", "shuffle", "pool"):
        assert s[name] == spatial, name
    assert s["branch"] == s["branch.relu"] == s["branch.pool"] == grid and s["mean"] == batch
    s = integrated(convnext_net(batch=4), machine, pr=2, pc=2, conv="grid", sync="ps")
    for name in ("conv", "layer_scale", "apool", "scale", "apool.max", "mean", "flatten.mean", "features", "fc"):
        assert s[name] == grid, name


# ---- training under random strategies ---------------------------------------------------------------

DEVICES = 3
STEPS = 2
TOLERANCE = {"float64": 1e-9, "float32": 1e-5}


def shuffle_net(batch=4, size=6, classes=3):
    """A ShuffleNet-like unit: the channels halved, one half through a 1x1 conv and an average pool that
    leaves padding out, both halves concatenated and shuffled; a max pool with ceil_mode whose last
    windows run past the input; the mean over h and w; a linear classifier."""
    g = Graph("shuffle_net")
    x = g.input("image", (batch, 3, size, size))
    y = g.conv2d(x, 8, 3, padding=1, name="conv")
    left, right = g.channel_slice(y, 0, 4, name="left"), g.channel_slice(y, 4, 8, name="right")
    right = g.relu(g.conv2d(right, 4, 1, name="branch"), name="branch.relu")
    right = g.pool2d(right, 3, stride=1, padding=1, mode="avg", count_include_pad=False, name="branch.pool")
    y = g.channel_shuffle(g.concat([left, right], name="concat"), 2, name="shuffle")
    y = g.pool2d(y, 3, stride=2, padding=1, ceil_mode=True, name="pool")  # 6 -> 4, the last window from 5 to 8
    y = g.mean(y, name="mean")
    y = g.linear(y, classes, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def convnext_net(batch=4, size=7, classes=3):
    """A conv with ConvNeXt's layer scale, adaptive pooling that does not divide (7 -> 5 average,
    then 5 -> 3 max), another scale per feature, and the mean kept as (n, c, 1, 1) reshaped into the
    classifier's features beside the flattened 3x3 map."""
    g = Graph("convnext_net")
    x = g.input("image", (batch, 3, size, size))
    y = g.scale(g.conv2d(x, 6, 3, padding=1, name="conv"), (6, 1, 1), name="layer_scale")
    y = g.adaptive_pool2d(y, 5, name="apool")
    y = g.scale(y, (6,), name="scale")
    p = g.reshape(g.adaptive_pool2d(y, (3, 3), mode="max", name="apool.max"), (batch, -1), name="flatten")
    m = g.reshape(g.mean(y, keepdim=True, name="mean"), (batch, -1), name="flatten.mean")
    y = g.linear(g.concat([p, m], name="features"), classes, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


GRAPHS = {"shuffle_net": shuffle_net, "convnext_net": convnext_net}


def batch_for(graph, seed, dtype):
    rng = np.random.default_rng(seed)
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(graph["image"].shape).astype(dtype), rng.integers(0, classes, graph["labels"].shape)


def relative_error(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_training(machine, graph, strategy, dtype):
    tol = TOLERANCE[dtype]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "dtype": dtype, "seed": 3}
    reference = SingleDeviceTrainer(graph, **hyper)
    trainer = Trainer(graph, strategy, machine, **hyper)
    for step in range(STEPS):
        x, y = batch_for(graph, 10 + step, dtype)
        expected, loss = reference.step(x, y), trainer.step(x, y)
        assert abs(loss - expected) <= tol * max(1.0, abs(expected)), f"loss at step {step}: {loss} vs {expected}"
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes, f"step {step}: bytes differ from the plan"
    expected, actual = reference.parameters(), trainer.parameters()
    assert set(actual) == set(expected)
    for layer in expected:
        for key in expected[layer]:
            err = relative_error(actual[layer][key], expected[layer][key])
            assert err < tol, f"{layer}.{key} after {STEPS} steps: relative error {err:.3g}"


@st.composite
def strategies_over(draw, graph, num_devices):
    return Strategy({layer.name: draw(random_layer_configs(layer, num_devices)) for layer in graph
                     if not (layer.is_input and draw(st.booleans()))})


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_train_as_one_device(machine4, name, dtype, data):
    graph = GRAPHS[name]()
    check_training(machine4, graph, data.draw(strategies_over(graph, DEVICES), label="strategy"), dtype)


# Splits chosen to cross: the halves and the shuffle split over channels the conv splits otherwise, the
# ceil_mode pool over w (its last part's windows run past the input), the adaptive pools over rows whose
# bins overlap the neighbouring part's, the scales' weights split over channels and replicated over h.
CROSSED = {
    "shuffle_net": {
        "conv": ParallelConfig(c=3, devices=(0, 1, 2)), "left": ParallelConfig(c=2, devices=(2, 0)),
        "right": ParallelConfig(h=3, devices=(1, 2, 0)), "branch": ParallelConfig(c=2, devices=(0, 1)),
        "branch.relu": ParallelConfig(w=3, devices=(2, 1, 0)), "branch.pool": ParallelConfig(h=2, w=1, devices=(1, 2)),
        "concat": ParallelConfig(c=3, devices=(0, 2, 1)), "shuffle": ParallelConfig(c=3, devices=(1, 0, 2)),
        "pool": ParallelConfig(w=3, devices=(2, 0, 1)), "mean": ParallelConfig(c=3, devices=(0, 1, 2)),
        "fc": ParallelConfig(n=2, devices=(1, 2)), "loss": ParallelConfig(n=3, devices=(0, 1, 2)),
    },
    "convnext_net": {
        "conv": ParallelConfig(w=3, devices=(0, 1, 2)), "layer_scale": ParallelConfig(c=3, devices=(2, 0, 1)),
        "apool": ParallelConfig(h=3, devices=(1, 2, 0)), "scale": ParallelConfig(h=2, c=1, devices=(0, 2)),
        "apool.max": ParallelConfig(w=3, devices=(2, 1, 0)), "mean": ParallelConfig(c=2, devices=(1, 0)),
        "flatten": ParallelConfig(c=3, devices=(0, 1, 2)), "flatten.mean": ParallelConfig(n=2, devices=(2, 1)),
        "features": ParallelConfig(c=2, devices=(1, 2)), "fc": ParallelConfig(c=3, devices=(0, 1, 2)),
        "loss": ParallelConfig(n=2, devices=(1, 0)),
    },
}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_crossed_splits_train_as_one_device(machine4, name, dtype):
    check_training(machine4, GRAPHS[name](), Strategy(CROSSED[name]), dtype)
