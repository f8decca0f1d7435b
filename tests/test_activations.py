"""The element-wise activations and the broadcasting mul and sub: PyTorch's values and gradients in
float64 (the kinks included), tiles that are exact slices of the whole tensor, tile gradients that
sum to the whole ones, the search's region logic on the broadcast rule, and the graph API (its
errors and the to_dict/from_dict round trip)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import Graph, GraphError, Tensor
from taskrt.machines.machine import Machine
from taskrt.ops import (
    OPS,
    Gelu,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    Mul,
    Relu6,
    Sigmoid,
    Silu,
    Sub,
    Tanh,
)
from taskrt.ops.rect import Rect
from taskrt.search import CostModel, transfer
from taskrt.search.regions import Needs, part_table
from taskrt.search.space import layer_configs

SHAPE = (2, 3, 5, 6)
KINKS = [0.0, -0.0, 3.0, -3.0, 6.0, -6.0, 1.0, -1.0, -0.5, 2.0, 2.9999999999999996, -2.9999999999999996, 1e-300]

# op, and its torch reference as a function of (torch, tensor)
ACTIVATIONS = {
    "relu6": (Relu6((SHAPE,)), lambda torch, t: torch.nn.functional.relu6(t)),
    "hardtanh": (Hardtanh((SHAPE,)), lambda torch, t: torch.nn.functional.hardtanh(t)),
    "hardtanh(-0.5, 2)": (Hardtanh((SHAPE,), -0.5, 2.0), lambda torch, t: torch.nn.functional.hardtanh(t, -0.5, 2.0)),
    "silu": (Silu((SHAPE,)), lambda torch, t: torch.nn.functional.silu(t)),
    "sigmoid": (Sigmoid((SHAPE,)), lambda torch, t: torch.sigmoid(t)),
    "tanh": (Tanh((SHAPE,)), lambda torch, t: torch.tanh(t)),
    "hardswish": (Hardswish((SHAPE,)), lambda torch, t: torch.nn.functional.hardswish(t)),
    "hardsigmoid": (Hardsigmoid((SHAPE,)), lambda torch, t: torch.nn.functional.hardsigmoid(t)),
    "gelu": (Gelu((SHAPE,)), lambda torch, t: torch.nn.functional.gelu(t)),
    "gelu(tanh)": (Gelu((SHAPE,), "tanh"), lambda torch, t: torch.nn.functional.gelu(t, approximate="tanh")),
    "identity": (Identity((SHAPE,)), lambda torch, t: torch.nn.Identity()(t)),
}


def activation_input(rng, shape=SHAPE):
    """Normal values spread past every kink, with the kinks themselves and far tails at random places."""
    x = rng.standard_normal(shape) * 4
    special = rng.permutation(KINKS + [-40.0, 40.0, -800.0, 800.0])[: x.size]
    x.reshape(-1)[rng.permutation(x.size)[: len(special)]] = special
    return x


def whole(op):
    return Rect.full(op.out_shape)


def assert_relative(actual, expected, tol=1e-12):
    """Elementwise relative `tol`, with an absolute floor at `tol` times the tensor's largest magnitude."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def torch_forward_backward(torch, reference, xs, dy):
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in xs]
    y = reference(torch, *ts)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), [t.grad.numpy() for t in ts]


# ---- against PyTorch, float64 ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_equals_torch_forward_and_backward(name):
    torch = pytest.importorskip("torch")
    op, reference = ACTIVATIONS[name]
    rng = np.random.default_rng(0)
    x, dy = activation_input(rng), rng.standard_normal(SHAPE)
    y = op.forward([x], {}, whole(op))
    (dx,), dparams = op.backward(dy, [x], y if op.saves_output else None, {}, whole(op), [True])
    y_torch, (dx_torch,) = torch_forward_backward(torch, reference, [x], dy)
    if name == "hardsigmoid":
        # torch's CPU kernel multiplies by the float literal 1.0f / 6.0f in every dtype (3e-8 off in
        # float64); ours is the forward's exact slope 1/6
        dx_torch = dx_torch / float(np.float32(1 / 6)) * (1 / 6)
    assert dparams == {}
    assert_relative(y, y_torch)
    assert_relative(dx, dx_torch)
    # a backward called without its saved output computes it
    (again,), _ = op.backward(dy, [x], None, {}, whole(op), [True])
    np.testing.assert_array_equal(again, dx)
    assert op.backward(dy, [x], y, {}, whole(op), [False]) == ([None], {})


def test_the_kinks_take_torchs_gradients():
    """Spelled out: the subgradients at the kinks are torch's, not merely close to them."""
    x = np.array([-6.0, -3.0, -1.0, 0.0, 1.0, 3.0, 6.0])
    ones = np.ones_like(x)
    full = Rect.full(x.shape)

    def grad(op):
        return op.backward(ones, [x], op.forward([x], {}, full), {}, full, [True])[0][0].tolist()

    assert grad(Relu6((x.shape,))) == [0, 0, 0, 0, 1, 1, 0]
    assert grad(Hardtanh((x.shape,))) == [0, 0, 0, 1, 0, 0, 0]
    assert grad(Hardsigmoid((x.shape,))) == [0, 0, 1 / 6, 1 / 6, 1 / 6, 0, 0]
    assert grad(Hardswish((x.shape,))) == [0, 0, -1 / 3 + 0.5, 0.5, 1 / 3 + 0.5, 1, 1]
    assert grad(Gelu((x.shape,)))[3] == 0.5


@pytest.mark.parametrize("a_shape, b_shape", [(SHAPE, SHAPE), (SHAPE, SHAPE[:2] + (1, 1)),
                                              (SHAPE[:2] + (1, 1), SHAPE), ((4, 5), (4, 5))])
@pytest.mark.parametrize("kind", ["mul", "sub"])
def test_mul_and_sub_equal_torch_with_broadcasting_either_way(kind, a_shape, b_shape):
    torch = pytest.importorskip("torch")
    op = OPS[kind]((a_shape, b_shape))
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(a_shape), rng.standard_normal(b_shape)]
    dy = rng.standard_normal(op.out_shape)
    y = op.forward(xs, {}, whole(op))
    dxs, _ = op.backward(dy, xs, None, {}, whole(op), [True, True])
    y_torch, dxs_torch = torch_forward_backward(torch, lambda torch, a, b: getattr(torch, kind)(a, b), xs, dy)
    assert_relative(y, y_torch)
    for dx, expected in zip(dxs, dxs_torch):
        assert_relative(dx, expected)
    assert op.backward(dy, xs, None, {}, whole(op), [False, True])[0][0] is None
    assert op.backward(dy, xs, None, {}, whole(op), [True, False])[0][1] is None


@pytest.mark.parametrize("op", [op for op, _ in ACTIVATIONS.values()] + [Mul(((2, 3, 4, 4), (2, 3, 1, 1)))],
                         ids=lambda op: op.kind)
def test_float32_stays_float32(op):
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype(np.float32) for s in op.in_shapes]
    y = op.forward(xs, {}, whole(op))
    dxs, _ = op.backward(np.ones_like(y), xs, y, {}, whole(op), [True] * len(xs))
    assert y.dtype == np.float32 and all(dx.dtype == np.float32 for dx in dxs)


def test_sigmoid_and_its_neighbours_do_not_overflow():
    x = np.array([-1000.0, -50.0, 50.0, 1000.0])
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        for op in (Sigmoid((x.shape,)), Silu((x.shape,))):
            y = op.forward([x], {}, Rect.full(x.shape))
            op.backward(np.ones_like(x), [x], y, {}, Rect.full(x.shape), [True])
    np.testing.assert_array_equal(Sigmoid((x.shape,)).forward([x], {}, Rect.full(x.shape)), [0, 1.9287498479639178e-22,
                                                                                              1, 1])


def test_flops_grow_with_the_tile():
    unit, tile = Rect((0, 0, 0, 0), (1, 1, 1, 1)), Rect((0, 0, 0, 0), (2, 3, 4, 5))
    for op in [op for op, _ in ACTIVATIONS.values()] + [Mul((SHAPE, SHAPE[:2] + (1, 1))), Sub((SHAPE, SHAPE))]:
        assert op.flops(tile) == 120 * op.flops(unit) and op.backward_flops(tile) == 120 * op.backward_flops(unit)
    assert Identity((SHAPE,)).flops(tile) == 0 and Gelu((SHAPE,)).flops(tile) > Relu6((SHAPE,)).flops(tile)


# ---- tiles -----------------------------------------------------------------------------------------


def random_rect(draw, shape):
    bounds = [sorted(draw(st.lists(st.integers(0, size), min_size=2, max_size=2, unique=True))) for size in shape]
    return Rect(tuple(a for a, _ in bounds), tuple(b for _, b in bounds))


def grid_partition(shape, degrees):
    """The Rects of a grid split of `shape`, blocks as equal as possible (as ParallelConfig's)."""
    edges = [np.cumsum([0] + [size // d + (i < size % d) for i in range(d)]) for size, d in zip(shape, degrees)]
    for block in np.ndindex(*degrees):
        yield Rect.from_ranges((edges[k][i], edges[k][i + 1]) for k, i in enumerate(block))


BINARY = [Mul((SHAPE, SHAPE)), Mul((SHAPE, SHAPE[:2] + (1, 1))), Mul((SHAPE[:2] + (1, 1), SHAPE)),
          Sub((SHAPE, SHAPE[:2] + (1, 1))), Sub((SHAPE[:2] + (1, 1), SHAPE)), Sub(((4, 5), (4, 5)))]
TILED = [op for op, _ in ACTIVATIONS.values()] + BINARY + [Gelu(((7, 9),)), Hardswish(((11,),))]


def tile_of(x, rect):
    return None if rect is None else x[rect.relative_to(Rect.full(x.shape))].copy()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_tile_is_the_slice_of_the_whole_and_its_gradients_sum_to_the_whole(data):
    op = data.draw(st.sampled_from(TILED), label="op")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = [activation_input(rng, s) for s in op.in_shapes]
    full = whole(op)
    y_full = op.forward(xs, {}, full)
    dy = rng.standard_normal(y_full.shape)
    dx_full, _ = op.backward(dy, xs, y_full, {}, full, [True] * len(xs))

    out = random_rect(data.draw, op.out_shape)
    y = op.forward([tile_of(x, r) for x, r in zip(xs, op.input_rects(out))], {}, out)
    np.testing.assert_allclose(y, y_full[out.relative_to(full)], rtol=1e-14, atol=1e-300)

    degrees = [data.draw(st.integers(1, size), label="degree") for size in op.out_shape]
    dx_sum = [np.zeros_like(x) for x in xs]
    for out in grid_partition(op.out_shape, degrees):
        rects = op.input_rects(out)
        tiles = [tile_of(x, r) for x, r in zip(xs, rects)]
        sl = out.relative_to(full)
        y_tile = y_full[sl] if op.saves_output else None
        dxs, _ = op.backward(dy[sl], tiles, y_tile, {}, out, [True] * len(xs))
        for acc, dx, rect in zip(dx_sum, dxs, rects):
            assert dx.shape == rect.shape
            acc[rect.relative_to(Rect.full(acc.shape))] += dx
    for acc, expected in zip(dx_sum, dx_full):
        np.testing.assert_allclose(acc, expected, rtol=1e-12, atol=1e-12)


def test_the_broadcast_input_is_read_for_the_parts_samples_and_channels():
    op = Mul((SHAPE, SHAPE[:2] + (1, 1)))
    out = Rect((1, 1, 2, 3), (2, 3, 4, 6))
    assert op.input_rects(out) == [out, Rect((1, 1, 0, 0), (2, 3, 1, 1))]
    assert Sub((SHAPE[:2] + (1, 1), SHAPE)).input_rects(out) == [Rect((1, 1, 0, 0), (2, 3, 1, 1)), out]
    assert Mul((SHAPE, SHAPE)).input_rects(out) == [out, out]
    assert op.out_shape == Sub((SHAPE[:2] + (1, 1), SHAPE)).out_shape == SHAPE


# ---- the search's region logic ---------------------------------------------------------------------


def se_graph(batch=4, channels=6, size=5):
    """A squeeze-and-excitation block with both orders of the broadcasting mul and sub."""
    g = Graph("se")
    x = g.input("image", (batch, 3, size, size))
    block = g.conv2d(x, channels, 3, padding=1, name="conv")
    squeeze = g.pool2d(block, kernel=(size, size), mode="avg", name="squeeze")
    gate = g.sigmoid(g.conv2d(g.relu(g.conv2d(squeeze, 2, 1, name="reduce")), channels, 1, name="expand"))
    y = g.mul(block, gate, name="scale")
    y = g.sub(squeeze, y, name="centre")
    y = g.mul(g.hardswish(y), g.tanh(squeeze), name="scale2")
    y = g.linear(g.flatten(y), 3, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


@pytest.mark.parametrize("devices", [4, 6])
def test_needs_of_the_broadcast_rule_are_what_the_op_says_for_every_part(devices):
    g = se_graph()
    for name in ("scale", "centre", "scale2"):
        layer = g[name]
        configs = layer_configs(layer, devices, powers_of_two=devices == 4)
        parts = part_table(layer.shape, configs)
        for j in range(2):
            needs = Needs(layer.op, j, parts)
            for k, (lo, hi) in enumerate(zip(parts.lo.tolist(), parts.hi.tolist())):
                expected = layer.op.input_rects(Rect(tuple(lo), tuple(hi)))[j]
                assert (tuple(needs.table.lo[k]), tuple(needs.table.hi[k])) == (expected.lo, expected.hi)
            if j == layer.op.broadcast_input:
                assert needs.constant == {2: (0, 1), 3: (0, 1)} and not needs.reads_own_part


def test_the_cost_models_edges_equal_the_general_transfer_tables():
    g = se_graph()
    cm = CostModel(Machine.simulated(1, 4), cache=False)
    tables, needed = cm.tables(g), g.needs_backward()
    for src, dst, j, matrix in tables.edges:
        u, v = cm.layer_space(g[src]), cm.layer_space(g[dst])
        itemsize = 8 if g[src].is_input and g[src].op.dtype == "int64" else 4
        expected = transfer.general(u.parts, v.needs[j].table, cm.links, itemsize, src in needed)
        np.testing.assert_allclose(matrix, expected, rtol=1e-12, atol=1e-18, err_msg=f"{src} -> {dst}")


# ---- the graph API ---------------------------------------------------------------------------------


def every_new_op(g):
    x = g.input("image", SHAPE)
    y = g.relu6(x)
    y = g.hardtanh(y, -0.5, 2)
    y = g.silu(y)
    y = g.sigmoid(y)
    y = g.tanh(y)
    y = g.hardswish(y)
    y = g.hardsigmoid(y)
    y = g.gelu(y)
    y = g.gelu(y, approximate="tanh", name="gelu.tanh")
    y = g.identity(y)
    s = g.pool2d(y, kernel=SHAPE[2:], mode="avg")
    y = g.mul(y, s)
    y = g.mul(s, y)
    y = g.sub(y, s)
    y = g.sub(s, y)
    y = g.mul(y, g.sub(y, x))
    return g


def test_round_trip_of_every_new_op():
    g = every_new_op(Graph("every"))
    assert [layer.name for layer in g][1:11] == ["relu6_1", "htanh1", "silu1", "sigmoid1", "tanh1", "hswish1",
                                                 "hsigmoid1", "gelu1", "gelu.tanh", "identity1"]
    data = g.to_dict()
    h = Graph.from_dict(json.loads(json.dumps(data)))
    assert h.to_dict() == data
    for a, b in zip(g, h):
        assert (a.name, a.kind, a.shape, a.inputs, a.op) == (b.name, b.kind, b.shape, b.inputs, b.op)
    assert {layer.kind for layer in g} >= {"relu6", "hardtanh", "silu", "sigmoid", "tanh", "hardswish",
                                           "hardsigmoid", "gelu", "identity", "mul", "sub"}
    assert h["htanh1"].op.attrs() == {"min_val": -0.5, "max_val": 2.0}
    assert h["gelu.tanh"].op.attrs() == {"approximate": "tanh"} and h["relu6_1"].op.attrs() == {}
    assert h.relu6(Tensor(h, "image")).name == "relu6_2"  # names continue where they were


def raises(parts, fn, *args, **kwargs):
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"


def test_bad_arguments_name_the_layer_and_what_is_valid():
    g = Graph()
    x = g.input("image", SHAPE)
    raises(["'h'", "hardtanh", "min_val < max_val", "min_val=1.0", "max_val=1.0"], g.hardtanh, x, 1, 1, name="h")
    raises(["'h'", "hardtanh", "min_val < max_val"], g.hardtanh, x, 2.0, -2.0, name="h")
    raises(["'h'", "max_val must be a number", "'6'"], g.hardtanh, x, 0, "6", name="h")
    raises(["'h'", "min_val must be a number", "True"], g.hardtanh, x, True, 6, name="h")
    raises(["'g'", "gelu", "'none', 'tanh'", "'erf'"], g.gelu, x, "erf", name="g")
    raises(["'m'", "mul", "same shape", "(n, c, 1, 1)", str(SHAPE), "(2, 90)"], g.mul, x, g.flatten(x), name="m")
    half = g.pool2d(x, kernel=2)
    raises(["'s'", "sub", "(n, c, 1, 1)", str(SHAPE), "(2, 3, 2, 3)"], g.sub, x, half, name="s")
    other = g.conv2d(g.pool2d(x, kernel=SHAPE[2:]), 4, 1)  # (2, 4, 1, 1): channels differ
    raises(["'m'", "(2, 4, 1, 1)"], g.mul, x, other, name="m")
    assert list(g.layers) == ["image", "flatten1", "pool1", "pool2", "conv1"]  # nothing added by a failed call
    data = every_new_op(Graph()).to_dict()
    spec = next(s for s in data["layers"] if s["kind"] == "hardtanh")
    spec["min_val"] = 5
    raises(["'htanh1'", "min_val < max_val"], Graph.from_dict, data)
