"""Grouped, depthwise and dilated convolution: against PyTorch in float64 (forward and autograd), on
tiles (a tile's output is the slice of the whole, tiles' gradients sum to the whole), the region rule
reading only a group's channels (the op's and the search's array form), the torch kernels against the
array kernels, the graph API, and a MobileNet-like block trained under random strategies on 3 devices
equal to the single-device network, moving exactly the planned bytes."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph, GraphError
from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.ops import conv_kernels, grouped_conv, torch_kernels
from taskrt.ops.conv import Conv2d
from taskrt.ops.rect import Rect
from taskrt.planning.lowering import lower
from taskrt.search import CostModel
from taskrt.search.regions import input_ranges
from tests import test_equivalence
from tests.strategies import layer_configs, random_strategies
from tests.test_ops import grid_partition, make_inputs, random_rect, tile_inputs
from tests.test_search import plan_edge_transfers, region_edge_bytes, timed

try:
    import torch
except ImportError:  # a machine without the CPU wheel: the tests against PyTorch skip, the rest run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install -e '.[torch]')")


def conv(shape, cout, kernel, stride=1, padding=0, dilation=1, groups=1, activation=None, bias=True):
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    return Conv2d((shape,), cout, pair(kernel), pair(stride), pair(padding), activation, bias, pair(dilation), groups)


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def torch_reference(op, x, params, dy):
    """(y, dx, {name: grad}) by torch.nn.functional.conv2d and autograd."""
    xt = torch.from_numpy(x).requires_grad_()
    pt = {k: torch.from_numpy(v).requires_grad_() for k, v in params.items()}
    y = torch.nn.functional.conv2d(xt, pt["weight"], pt.get("bias"), op.stride, op.padding, op.dilation, op.groups)
    if op.activation == "relu":
        y = torch.nn.functional.relu(y)
    y.backward(torch.from_numpy(dy))
    return y.detach().numpy(), xt.grad.numpy(), {k: v.grad.numpy() for k, v in pt.items()}


# ---- against PyTorch ----------------------------------------------------------------------------
SIZES = [(2, 9, 9), (1, 11, 8), (3, 7, 10)]
GROUPS = {"g1": (4, 6, 1), "g2": (4, 6, 2), "g4": (8, 4, 4), "depthwise": (6, 6, 6), "depthwise_x2": (5, 10, 5)}
CASES = [(g, d, s, p, SIZES[i % len(SIZES)]) for i, (g, d, s, p) in
         enumerate(itertools.product(GROUPS, (1, 2), (1, 2), (0, 1, 2)))]


@needs_torch
@pytest.mark.parametrize("groups, dilation, stride, padding, size", CASES,
                         ids=[f"{g}-d{d}-s{s}-p{p}" for g, d, s, p, _ in CASES])
def test_whole_tensor_matches_torch_and_the_torch_path(groups, dilation, stride, padding, size):
    cin, cout, g = GROUPS[groups]
    n, h, w = size
    relu = "relu" if (stride + padding) % 2 else None
    op = conv((n, cin, h, w), cout, 3, stride, padding, dilation, g, relu)
    rng = np.random.default_rng([list(GROUPS).index(groups), dilation, stride, padding])
    x = rng.standard_normal(op.in_shapes[0])
    params = {k: rng.standard_normal(s) for k, s in op.param_shapes().items()}
    dy = rng.standard_normal(op.out_shape)
    y_ref, dx_ref, dp_ref = torch_reference(op, x, params, dy)
    whole = Rect.full(op.out_shape)
    for backend in ("reference", "torch"):  # the array kernels, then the torch kernels on the same tiles
        with torch_kernels.backend(backend):
            y = op.forward([x], params, whole)
            (dx,), dp = op.backward(dy, [x], y, params, whole, [True])
        assert relative(y, y_ref) < 1e-12, backend
        assert relative(dx, dx_ref) < 1e-12, backend
        for k in params:
            assert relative(dp[k], dp_ref[k]) < 1e-12, (backend, k)


@needs_torch
@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", [
    ((2, 5, 12, 11), 3, 1, 2, 2), ((1, 3, 13, 60), (3, 2), (1, 1), (2, 1), (3, 2)), ((2, 6, 9, 9), 3, 2, 1, 2),
    ((2, 16, 8, 8), 3, 1, 2, 2), ((1, 4, 10, 10), 2, 1, 3, 2)])
def test_dilated_single_group_every_layout_and_backward_form(shape, kernel, stride, padding, dilation):
    """Planes or channels-last columns, gathering or scattering backward-data: all equal torch."""
    op = conv(shape, 7, kernel, stride, padding, dilation)
    rng = np.random.default_rng(1)
    x, wt, b = rng.standard_normal(shape), rng.standard_normal(op.param_shapes()["weight"]), rng.standard_normal(7)
    dy = rng.standard_normal(op.out_shape)
    y_ref, dx_ref, dp_ref = torch_reference(op, x, {"weight": wt, "bias": b}, dy)
    pads = op._pads(Rect.full(op.out_shape))
    for planes in (True, False):
        with mock.patch.object(conv_kernels, "use_planes", lambda *args, planes=planes: planes), \
                mock.patch.object(conv_kernels, "scatters_by_planes", lambda *args, planes=planes: planes):
            assert relative(conv_kernels.conv2d(x, wt, b, op.stride, pads, False, op.dilation), y_ref) < 1e-12
            dw, db = conv_kernels.conv2d_weight_grad(dy, x, op.kernel, op.stride, pads, op.dilation)
            assert relative(dw, dp_ref["weight"]) < 1e-12 and relative(db, dp_ref["bias"]) < 1e-12
            dxs = [conv_kernels.data_grad_scatter(dy, wt, x.shape, op.stride, pads, op.dilation)]
            if conv_kernels.gather_padding(op.kernel, op.stride, pads, op.dilation) is not None:
                dxs.append(conv_kernels.data_grad_gather(dy, wt, pads, op.dilation))
            for dx in dxs:
                assert relative(dx, dx_ref) < 1e-12


@pytest.mark.parametrize("cin, cout, stride, dilation", [(6, 6, 1, 1), (4, 12, 2, 2), (3, 6, 1, 2)])
def test_depthwise_loops_equal_the_batched_gemm_path(cin, cout, stride, dilation):
    """cupy tiles take the batched GEMM for depthwise convolutions: it equals the numba loops."""
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal((2, cin, 9, 8)), rng.standard_normal((cout, 1, 3, 3)), rng.standard_normal(cout)
    pads, st_, dl = ((1, 2), (0, 1)), (stride, stride), (dilation, dilation)
    y = grouped_conv.conv2d(x, w, b, st_, pads, True, dl, cin)
    np.testing.assert_allclose(grouped_conv._forward(x, w, b, st_, pads, True, dl, cin), y, rtol=1e-12, atol=1e-12)
    d = rng.standard_normal(y.shape)
    dw, _ = grouped_conv.weight_grad(d, x, (3, 3), st_, pads, dl, cin)
    np.testing.assert_allclose(grouped_conv._weight_grad(d, x, (3, 3), st_, pads, dl, cin), dw, rtol=1e-12, atol=1e-12)
    dx = grouped_conv.data_grad(d, w, x.shape, st_, pads, dl, cin)
    np.testing.assert_allclose(grouped_conv._data_grad(d, w, x.shape, st_, pads, dl, cin), dx, rtol=1e-12, atol=1e-12)


@needs_torch
def test_float32_stays_float32_and_is_close():
    op = conv((2, 8, 10, 10), 16, 3, 2, 1, 1, 8, "relu")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(op.in_shapes[0]).astype(np.float32)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in op.param_shapes().items()}
    whole = Rect.full(op.out_shape)
    y = op.forward([x], params, whole)
    (dx,), dp = op.backward(np.ones_like(y), [x], y, params, whole, [True])
    assert y.dtype == dx.dtype == dp["weight"].dtype == np.float32
    y_ref, dx_ref, dp_ref = torch_reference(op, x.astype(np.float64), {k: v.astype(np.float64) for k, v in
                                                                         params.items()}, np.ones(y.shape))
    assert relative(y, y_ref) < 1e-5 and relative(dx, dx_ref) < 1e-5 and relative(dp["weight"], dp_ref["weight"]) < 1e-5


# ---- tiles --------------------------------------------------------------------------------------
@st.composite
def grouped_ops(draw):
    groups = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["grouped", "depthwise", "single"]))
    if kind == "single":
        groups = 1
    cin = groups if kind == "depthwise" else groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    k, s, d = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    p = draw(st.integers(0, 2))
    span = d * (k - 1) + 1
    h, w = draw(st.integers(max(1, span - 2 * p), 10)), draw(st.integers(max(1, span - 2 * p), 10))
    return conv((draw(st.integers(1, 2)), cin, h, w), cout, k, s, p, d, groups,
                draw(st.sampled_from([None, "relu"])), draw(st.booleans()))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_tile_output_is_the_slice_of_the_whole(data):
    op = data.draw(grouped_ops())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=False)
    whole = Rect.full(op.out_shape)
    y_full = op.forward(xs, params, whole)
    out = random_rect(data.draw, op.out_shape)
    xt, pt = tile_inputs(op, xs, params, out)
    y = op.forward(xt, pt, out)
    assert y.shape == out.shape
    assert np.max(np.abs(y - y_full[out.relative_to(whole)])) < 1e-12


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tile_gradients_sum_to_the_whole(data):
    op = data.draw(grouped_ops())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=True)
    whole = Rect.full(op.out_shape)
    y_full = op.forward(xs, params, whole)
    dy = rng.standard_normal(y_full.shape)
    (dx_full,), dp_full = op.backward(dy, xs, y_full, params, whole, [True])
    degrees = [data.draw(st.integers(1, s)) for s in op.out_shape]
    dx_sum, dp_sum = np.zeros_like(xs[0]), {k: np.zeros_like(v) for k, v in params.items()}
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


@needs_torch
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_torch_kernels_compute_the_array_kernels_tiles(data):
    """Tiles cutting groups (extended to whole groups with zero rows), with and without relu, on the torch
    path (cuDNN's on a GPU, here torch's CPU kernels) equal the array kernels."""
    op = data.draw(grouped_ops())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs, params = make_inputs(op, rng, distinct=True)
    out = random_rect(data.draw, op.out_shape)
    xt, pt = tile_inputs(op, xs, params, out)
    dy = rng.standard_normal(out.shape)
    results = []
    for backend in ("reference", "torch"):
        with torch_kernels.backend(backend):
            y = op.forward(xt, pt, out)
            results.append((y, *op.backward(dy, xt, y, pt, out, [True])))
    (y0, (dx0,), g0), (y1, (dx1,), g1) = results
    np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-12)
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=1e-12, atol=1e-12)


# ---- the region rule ----------------------------------------------------------------------------
def test_a_channel_split_reads_only_its_groups_channels():
    dw = conv((2, 8, 6, 6), 8, 3, 1, 1, groups=8)
    assert dw.input_rects(Rect((0, 2, 0, 0), (2, 4, 6, 6)))[0] == Rect((0, 2, 0, 0), (2, 4, 6, 6))
    mult = conv((2, 4, 6, 6), 8, 3, 1, 1, groups=4)  # 2 output channels per input channel
    assert mult.input_rects(Rect((0, 3, 0, 0), (1, 6, 6, 6)))[0].lo[1:2] == (1,)
    assert mult.input_rects(Rect((0, 3, 0, 0), (1, 6, 6, 6)))[0].hi[1:2] == (3,)
    g2 = conv((2, 4, 6, 6), 6, 3, groups=2)  # outputs 0-2 read inputs 0-1, outputs 3-5 inputs 2-3
    assert [g2.input_rects(Rect((0, a, 0, 0), (2, b, 4, 4)))[0].lo[1] for a, b in ((0, 3), (3, 6), (2, 4))] == [0, 2, 0]
    assert [g2.input_rects(Rect((0, a, 0, 0), (2, b, 4, 4)))[0].hi[1] for a, b in ((0, 3), (3, 6), (2, 4))] == [2, 4, 4]
    assert conv((2, 4, 6, 6), 6, 3).input_rects(Rect((0, 5, 0, 0), (2, 6, 4, 4)))[0].hi[1] == 4
    assert g2.param_rects(Rect((0, 1, 0, 0), (2, 4, 4, 4))) == {"weight": Rect((1, 0, 0, 0), (4, 2, 3, 3)),
                                                                 "bias": Rect((1,), (4,))}
    # the halo of a dilated kernel: 3 taps 2 apart span 5 rows
    assert conv((1, 1, 20, 20), 1, 3, dilation=2).input_rects(Rect((0, 0, 4, 0), (1, 1, 6, 3)))[0] == \
        Rect((0, 0, 4, 0), (1, 1, 10, 7))


@pytest.mark.parametrize("groups", [1, 2, 12])
@pytest.mark.parametrize("dilation", [1, 2])
def test_rule_reads_the_hull_of_the_channels_the_outputs_depend_on(groups, dilation):
    op = conv((2, 12, 9, 9), 24, 3, 2, 1, dilation, groups)
    depends = np.arange(24)[:, None] // (24 // groups) == np.arange(12)[None, :] // (12 // groups)
    rng = np.random.default_rng(5)
    for _ in range(100):
        c0 = int(rng.integers(0, 24))
        c1 = int(rng.integers(c0 + 1, 25))
        r = op.input_rects(Rect((0, c0, 0, 0), (2, c1, 5, 5)))[0]
        read = np.nonzero(depends[c0:c1].any(axis=0))[0]
        assert (r.lo[1], r.hi[1]) == (read.min(), read.max() + 1)


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("mult", [1, 2])
def test_the_searchs_array_rule_equals_the_ops(groups, dilation, mult):
    op = conv((3, 8, 13, 11), 8 * mult, (3, 2), (2, 1), (2, 1), dilation, groups)
    rng = np.random.default_rng(groups * 10 + dilation)
    shape = np.array(op.out_shape)
    a, b = rng.integers(0, shape, (300, 4)), rng.integers(0, shape, (300, 4))
    lo, hi = np.minimum(a, b), np.maximum(a, b) + 1
    reads, in_lo, in_hi = input_ranges(op, 0, lo, hi)
    assert reads.all()
    for k in range(len(lo)):
        expected = op.input_rects(Rect(tuple(lo[k].tolist()), tuple(hi[k].tolist())))[0]
        assert (tuple(in_lo[k]), tuple(in_hi[k])) == (expected.lo, expected.hi)


def test_flops_count_the_grouped_work():
    out = Rect((0, 0, 0, 0), (2, 8, 5, 5))
    assert conv((2, 8, 5, 5), 8, 3, padding=1).flops(out) == 2 * 2 * 8 * 25 * 8 * 9
    assert conv((2, 8, 5, 5), 8, 3, padding=1, groups=4).flops(out) == 2 * 2 * 8 * 25 * 2 * 9
    dw = conv((2, 8, 5, 5), 8, 3, padding=2, dilation=2, groups=8)
    assert dw.flops(out) == 2 * 2 * 8 * 25 * 9 and dw.backward_flops(out) == 2 * dw.flops(out)


# ---- the graph API ------------------------------------------------------------------------------
def test_graph_conv2d_dilation_groups_and_their_description():
    g = Graph("t")
    x = g.input("image", (2, 6, 12, 12))
    a = g.conv2d(x, 12, 3, padding=2, dilation=2, groups=6, name="dw")
    b = g.conv2d(a, 6, (3, 1), name="plain")
    assert a.shape == (2, 12, 12, 12) and g["dw"].param_shapes == {"weight": (12, 1, 3, 3), "bias": (12,)}
    assert b.shape == (2, 6, 10, 12)
    spec = g.to_dict()
    assert spec["layers"][1]["dilation"] == [2, 2] and spec["layers"][1]["groups"] == 6
    assert "dilation" not in spec["layers"][2] and "groups" not in spec["layers"][2]  # as before for plain ones
    again = Graph.from_dict(spec)
    assert again["dw"].op == g["dw"].op and again.to_dict() == spec


def test_graph_conv2d_rejects_bad_groups_and_dilation():
    g = Graph("t")
    x = g.input("image", (2, 6, 8, 8))
    for kwargs, words in [({"groups": 4}, ["'bad'", "groups 4", "[1, 2, 3, 6]"]),
                          ({"groups": 0}, ["'bad'", "groups"]), ({"groups": 2.0}, ["'bad'", "groups"]),
                          ({"dilation": 0}, ["'bad'", "dilation must be >= 1"]),
                          ({"dilation": 5, "kernel": 3}, ["'bad'", "spans 11"])]:
        kernel = kwargs.pop("kernel", 1)
        with pytest.raises(GraphError) as info:
            g.conv2d(x, 6, kernel, name="bad", **kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)
    assert "bad" not in g.layers


# ---- a MobileNet-like block on 3 devices --------------------------------------------------------
def mobilenet_block(batch=4, size=8, classes=3):
    """1x1 expansion, depthwise 3x3, 1x1 projection with batch norms and relus, then a dilated grouped
    convolution and a strided depthwise one with two outputs per channel.  The expansion has no batch
    norm of its own: the depthwise one after it makes that norm's weight gradient a sum that nearly
    cancels, which float32 gets 1e-3 wrong on one device already."""
    g = Graph("mobilenet_block")
    x = g.input("image", (batch, 3, size, size))
    y = g.conv2d(x, 4, 3, padding=1, bias=False, name="stem")
    y = g.relu(g.batch_norm(y, name="stem.bn"), name="stem.relu")
    y = g.conv2d(y, 8, 1, activation="relu", name="expand")
    y = g.conv2d(y, 8, 3, padding=1, groups=8, bias=False, name="dw")
    y = g.relu(g.batch_norm(y, name="dw.bn"), name="dw.relu")
    y = g.batch_norm(g.conv2d(y, 4, 1, bias=False, name="project"), name="project.bn")
    y = g.conv2d(y, 6, 3, padding=2, dilation=2, groups=2, activation="relu", name="dilated")
    y = g.conv2d(y, 12, 3, stride=2, padding=1, groups=6, name="dw2")
    y = g.linear(g.flatten(g.pool2d(y, 2, stride=2, name="pool"), name="flatten"), classes, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_mobilenet_block_under_random_strategies_equals_one_device(machine4, dtype, data):
    graph = mobilenet_block()
    _, strategy = data.draw(random_strategies(graph, max_devices=3))
    with mock.patch.dict(test_equivalence.TOLERANCE, {"float64": 1e-9, "float32": 1e-5}):
        test_equivalence.check_equivalence(graph, strategy, machine4, dtype)


def depthwise_chain(batch=4, size=8, classes=3):
    """Convolutions alone (the lowering's batch-norm statistics are tasks of their own, not edges)."""
    g = Graph("depthwise_chain")
    x = g.input("image", (batch, 4, size, size))
    y = g.conv2d(x, 8, 1, activation="relu", name="expand")
    y = g.conv2d(y, 8, 3, padding=1, groups=8, name="dw")
    y = g.conv2d(y, 6, 3, padding=2, dilation=2, groups=2, name="dilated")
    y = g.conv2d(y, 12, 3, stride=2, padding=1, groups=6, activation="relu", name="dw2")
    g.softmax_cross_entropy(g.linear(g.flatten(y, name="flatten"), classes, name="fc"), name="loss")
    return g


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_cost_tables_price_the_bytes_the_lowering_moves(data):
    """The search's transfer tables read the array rules: a channel-split depthwise part needs only its
    channels, and the bytes they price are the plan's, edge by edge, and its t_x their timing."""
    graph = depthwise_chain()
    devices = data.draw(st.integers(1, 3))
    strategy = Strategy({layer.name: data.draw(layer_configs(layer, devices)) for layer in graph})
    moved = plan_edge_transfers(lower(graph, strategy), graph)
    got = defaultdict(Counter)
    for key, moves in moved.items():
        for s, d, nbytes in moves:
            got[key][(s, d)] += nbytes
    assert {k: dict(v) for k, v in got.items()} == {k: dict(v) for k, v in region_edge_bytes(graph, strategy).items()}
    cm = CostModel(Machine.simulated(1, 3), cache=False)
    for src, dst, j, matrix in cm.tables(graph, {n: [strategy[n]] for n in graph.layers}).edges:
        expected = sum(timed(moved.get(((src, dst, j), direction), []), cm.links) for direction in ("fwd", "bwd"))
        assert matrix[0, 0] == pytest.approx(expected, rel=1e-9, abs=1e-15), (src, dst)


def test_a_depthwise_layer_split_like_its_producer_moves_nothing():
    """Channel splits of the same blocks on the same devices: each depthwise part reads its own channels
    in place (a one-group convolution's parts would each fetch the other half)."""
    graph = depthwise_chain()
    split = ParallelConfig(c=2, devices=(0, 1))
    strategy = Strategy({layer.name: split if layer.name in ("expand", "dw") else ParallelConfig(n=2, devices=(0, 1))
                         for layer in graph})
    moved = plan_edge_transfers(lower(graph, strategy), graph)
    assert not moved.get((("expand", "dw", 0), "fwd")) and not moved.get((("expand", "dw", 0), "bwd"))
    assert moved[(("dw", "dilated", 0), "fwd")]  # n-split after c-split: the other half of the channels moves
    cm = CostModel(Machine.simulated(1, 2), cache=False)
    t_x = {(src, dst): m[0, 0] for src, dst, _, m in cm.tables(graph, {n: [strategy[n]] for n in graph.layers}).edges}
    assert t_x[("expand", "dw")] == 0 and t_x[("dw", "dilated")] > 0
