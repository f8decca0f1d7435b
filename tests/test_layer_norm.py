"""Layer normalization over channels: PyTorch's values and gradients in float64 (ConvNeXt's LayerNorm2d
on images, `F.layer_norm` on features), tiles that are exact slices of the whole output, backward
contributions of the tiles of any partition over n, c, h and w that sum to the whole gradient, the
search's region logic, the graph API, and a small ConvNeXt-like network that trains the same under
random strategies over 3 devices as on one."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph, GraphError, Tensor
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.ops import OPS, LayerNorm, ShapeError
from taskrt.ops.rect import Rect
from taskrt.search import CostModel
from taskrt.search.regions import Needs, part_table
from taskrt.search.space import layer_configs
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import layer_configs as random_layer_config

IMAGE = (3, 5, 4, 6)
FEATURES = (6, 7)
OPS_UNDER_TEST = [LayerNorm((IMAGE,)), LayerNorm((IMAGE,), eps=1e-3, affine=False), LayerNorm((FEATURES,)),
                  LayerNorm((FEATURES,), eps=0.5, affine=False)]


def whole(op):
    return Rect.full(op.out_shape)


def make_case(op, rng, dtype=np.float64):
    # an offset per sample and position, so the mean's cancellation is exercised
    x = rng.standard_normal(op.out_shape) * 3 + rng.standard_normal((op.out_shape[0], 1) + op.out_shape[2:]) * 5
    params = {k: rng.standard_normal(s) for k, s in op.param_shapes().items()}
    return x.astype(dtype), {k: v.astype(dtype) for k, v in params.items()}, rng.standard_normal(op.out_shape)


def assert_relative(actual, expected, tol=1e-12):
    """Elementwise relative `tol`, with an absolute floor at `tol` times the tensor's largest magnitude."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def torch_layer_norm(torch, op, x, params, dy):
    """torch's output and gradients: images permuted to NHWC, F.layer_norm over the last dim, back."""
    tx = torch.tensor(x, requires_grad=True)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    channels = (op.channels,)
    if x.ndim == 4:
        y = torch.nn.functional.layer_norm(tx.permute(0, 2, 3, 1), channels, tp.get("weight"), tp.get("bias"),
                                           op.eps).permute(0, 3, 1, 2)
    else:
        y = torch.nn.functional.layer_norm(tx, channels, tp.get("weight"), tp.get("bias"), op.eps)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), tx.grad.numpy(), {k: t.grad.numpy() for k, t in tp.items()}


# ---- against PyTorch, float64 ------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS_UNDER_TEST, ids=lambda op: f"{len(op.out_shape)}d-affine{op.affine}")
def test_layer_norm_equals_torch_forward_and_backward(op):
    torch = pytest.importorskip("torch")
    x, params, dy = make_case(op, np.random.default_rng(0))
    y = op.forward([x], params, whole(op))
    (dx,), grads = op.backward(dy, [x], None, params, whole(op), [True])
    y_torch, dx_torch, grads_torch = torch_layer_norm(torch, op, x, params, dy)
    assert_relative(y, y_torch)
    assert_relative(dx, dx_torch)
    assert set(grads) == set(grads_torch) == ({"weight", "bias"} if op.affine else set())
    for k in grads:
        assert_relative(grads[k], grads_torch[k])
    # without the input gradient: the same parameter gradients, no dx
    (none,), again = op.backward(dy, [x], None, params, whole(op), [False])
    assert none is None and set(again) == set(grads)
    for k in grads:
        np.testing.assert_array_equal(again[k], grads[k])


def test_convnext_layer_norm_module_of_torchvision_when_present():
    """The same numbers as torchvision's ConvNeXt LayerNorm2d (eps 1e-6), where torchvision is installed."""
    torch = pytest.importorskip("torch")
    convnext = pytest.importorskip("torchvision.models.convnext")
    op = LayerNorm((IMAGE,), eps=1e-6)
    x, params, dy = make_case(op, np.random.default_rng(1))
    module = convnext.LayerNorm2d(op.channels, eps=1e-6).double()
    with torch.no_grad():
        module.weight.copy_(torch.tensor(params["weight"]))
        module.bias.copy_(torch.tensor(params["bias"]))
    assert_relative(op.forward([x], params, whole(op)), module(torch.tensor(x)).detach().numpy())


def test_float32_stays_float32():
    for op in OPS_UNDER_TEST:
        x, params, dy = make_case(op, np.random.default_rng(2), np.float32)
        y = op.forward([x], params, whole(op))
        (dx,), grads = op.backward(dy.astype(np.float32), [x], None, params, whole(op), [True])
        assert y.dtype == dx.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())


def test_a_constant_channel_vector_normalizes_to_zero_without_dividing_by_zero():
    op = LayerNorm(((2, 4, 1, 1),), affine=False)
    x = np.full((2, 4, 1, 1), 7.0)
    with np.errstate(divide="raise", invalid="raise"):
        y = op.forward([x], {}, whole(op))
        (dx,), _ = op.backward(np.ones_like(x), [x], None, {}, whole(op), [True])
    assert not y.any() and np.isfinite(dx).all()


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


def params_of(op, params, out):
    return {k: tile_of(params[k], r) for k, r in op.param_rects(out).items()}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_tile_is_the_slice_of_the_whole_and_its_contributions_sum_to_the_whole(data):
    op = data.draw(st.sampled_from(OPS_UNDER_TEST), label="op")
    x, params, dy = make_case(op, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")))
    full = whole(op)
    y_full = op.forward([x], params, full)
    (dx_full,), grads_full = op.backward(dy, [x], None, params, full, [True])

    out = random_rect(data.draw, op.out_shape)
    (rect,) = op.input_rects(out)
    assert rect == out.replace(1, 0, op.channels)  # every channel of the part's samples and positions
    y = op.forward([tile_of(x, rect)], params_of(op, params, out), out)
    np.testing.assert_allclose(y, y_full[out.relative_to(full)], rtol=1e-13, atol=1e-13)

    degrees = [data.draw(st.integers(1, size), label="degree") for size in op.out_shape]
    dx_sum = np.zeros_like(x)
    grads_sum = {k: np.zeros_like(v) for k, v in params.items()}
    for out in grid_partition(op.out_shape, degrees):
        (rect,) = op.input_rects(out)
        (dx,), grads = op.backward(dy[out.relative_to(full)], [tile_of(x, rect)], None, params_of(op, params, out),
                                   out, [True])
        assert dx.shape == rect.shape
        dx_sum[rect.relative_to(full)] += dx
        for k, r in op.param_rects(out).items():
            assert grads[k].shape == r.shape
            grads_sum[k][r.relative_to(Rect.full(params[k].shape))] += grads[k]
    np.testing.assert_allclose(dx_sum, dx_full, rtol=1e-11, atol=1e-11 * np.abs(dx_full).max())
    for k in grads_full:
        np.testing.assert_allclose(grads_sum[k], grads_full[k], rtol=1e-11, atol=1e-11 * np.abs(grads_full[k]).max())


def test_a_channel_part_alone_is_not_the_whole_gradient():
    """Why the contributions must be summed: one part's dx already covers every channel."""
    op = LayerNorm((FEATURES,), affine=False)
    x, _, dy = make_case(op, np.random.default_rng(3))
    out = Rect((0, 0), (FEATURES[0], 3))
    (dx,), _ = op.backward(dy[:, :3], [x], None, {}, out, [True])
    assert dx.shape == FEATURES and np.abs(dx[:, 3:]).min() > 0


def test_parameters_and_flops_follow_the_tile():
    op = LayerNorm((IMAGE,))
    out = Rect((1, 2, 0, 3), (3, 4, 2, 6))
    assert op.param_rects(out) == {"weight": Rect((2,), (4,)), "bias": Rect((2,), (4,))}
    plain = LayerNorm((IMAGE,), affine=False)
    assert plain.param_rects(out) == {} and plain.param_shapes() == {}
    unit = Rect((0,) * 4, (1,) * 4)  # the roofline takes the rates from a unit tile
    assert op.flops(out) == out.volume * op.flops(unit)
    assert op.backward_flops(out) == out.volume * op.backward_flops(unit)
    assert op.dims == ("n", "c", "h", "w") and LayerNorm((FEATURES,)).dims == ("n", "c")


@pytest.mark.parametrize("shape, kwargs, message", [
    ((4,), {}, "rank-2 (n, c) or rank-4"), ((2, 3, 4), {}, "rank-2 (n, c) or rank-4"),
    (FEATURES, {"eps": 0.0}, "eps must be a finite number > 0"), (FEATURES, {"eps": float("nan")}, "finite"),
    (FEATURES, {"eps": True}, "eps"), (FEATURES, {"affine": 1}, "affine must be True or False")])
def test_bad_shapes_and_hyper_parameters_are_refused(shape, kwargs, message):
    with pytest.raises(ShapeError, match=re.escape(message)):
        LayerNorm((shape,), **kwargs)


# ---- the search's region logic ---------------------------------------------------------------------


def convnext_block(batch=4, size=6, classes=3, dim=6):
    """A ConvNeXt-like block (stem conv, layer norm, 1x1 expand, gelu, 1x1 project, residual add), then
    a head with a layer norm on features."""
    g = Graph("convnext_block")
    x = g.input("image", (batch, 3, size, size))
    stem = g.conv2d(x, dim, 3, padding=1, name="stem")
    y = g.layer_norm(stem, name="block.ln")
    y = g.gelu(g.conv2d(y, 2 * dim, 1, name="block.expand"), name="block.gelu")
    y = g.add(stem, g.conv2d(y, dim, 1, name="block.project"), name="block.residual")
    y = g.pool2d(y, 2, stride=2, mode="avg", name="pool")
    y = g.linear(g.flatten(y, name="flatten"), 8, name="fc1")
    y = g.layer_norm(y, eps=1e-6, name="head.ln")
    y = g.layer_norm(y, affine=False, name="head.ln_plain")
    y = g.linear(y, classes, name="fc2")
    g.softmax_cross_entropy(y, name="loss")
    return g


@pytest.mark.parametrize("devices", [4, 6])
def test_needs_of_every_part_are_what_the_op_says(devices):
    g = convnext_block()
    for name in ("block.ln", "head.ln"):
        layer = g[name]
        parts = part_table(layer.shape, layer_configs(layer, devices, powers_of_two=devices == 4))
        needs = Needs(layer.op, 0, parts)
        for k, (lo, hi) in enumerate(zip(parts.lo.tolist(), parts.hi.tolist())):
            expected = layer.op.input_rects(Rect(tuple(lo), tuple(hi)))[0]
            assert (tuple(needs.table.lo[k]), tuple(needs.table.hi[k])) == (expected.lo, expected.hi)
        # channels are read whole whatever the split; every other dimension follows its own
        assert needs.constant == {1: (0, layer.shape[1])}
        assert needs.driver == {e: e for e in range(len(layer.shape)) if e != 1}


def test_the_cost_model_prices_a_network_with_layer_norms():
    g = convnext_block()
    cm = CostModel(Machine.simulated(1, 4), cache=False)
    tables = cm.tables(g)
    assert all(len(tables.configs[layer.name]) > 1 for layer in g if layer.kind == "layer_norm")


# ---- training under random strategies ----------------------------------------------------------------

DEVICES = 3
STEPS = 2
TOLERANCE = {"float64": 1e-9, "float32": 1e-5}


@st.composite
def strategies_over(draw, graph, num_devices):
    """A random config for every layer (input layers sometimes left to their default) on `num_devices`."""
    return Strategy({layer.name: draw(random_layer_config(layer, num_devices)) for layer in graph
                     if not (layer.is_input and draw(st.booleans()))})


def relative_error(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def batch_for(graph, seed, dtype):
    rng = np.random.default_rng(seed)
    classes = graph["fc2"].shape[1]
    return rng.standard_normal(graph["image"].shape).astype(dtype), rng.integers(0, classes, graph["labels"].shape)


def check_training(machine, graph, strategy, dtype):
    tol = TOLERANCE[dtype]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "dtype": dtype, "seed": 3}
    reference = SingleDeviceTrainer(graph, **hyper)
    trainer = Trainer(graph, strategy, machine, **hyper)
    x, labels = batch_for(graph, 1, dtype)
    err = relative_error(trainer.predict(x), reference.predict(x))
    assert err < tol, f"forward output: relative error {err:.3g}"
    expected, actual = reference.gradients(x, labels), trainer.gradients(x, labels)
    assert set(actual) == set(expected) and {"block.ln", "head.ln"} <= set(expected)
    for layer in expected:
        for key in expected[layer]:
            err = relative_error(actual[layer][key], expected[layer][key])
            assert err < tol, f"gradient {layer}.{key}: relative error {err:.3g}"
    for step in range(STEPS):
        x, labels = batch_for(graph, 10 + step, dtype)
        expected, loss = reference.step(x, labels), trainer.step(x, labels)
        assert abs(loss - expected) <= tol * max(1.0, abs(expected)), f"loss at step {step}: {loss} vs {expected}"
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes, f"step {step}: bytes differ from the plan"
    expected, actual = reference.parameters(), trainer.parameters()
    assert set(actual) == set(expected)
    for layer in expected:
        for key in expected[layer]:
            err = relative_error(actual[layer][key], expected[layer][key])
            assert err < tol, f"{layer}.{key} after {STEPS} steps: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_train_as_one_device(machine4, dtype, data):
    graph = convnext_block()
    check_training(machine4, graph, data.draw(strategies_over(graph, DEVICES), label="strategy"), dtype)


def test_layer_norms_split_over_channels_and_positions_train_as_one_device(machine4):
    """Spelled out: the layer norms split over c alone, over c with h and w, and the head's over c."""
    from taskrt.graph.config import ParallelConfig

    g = convnext_block()
    configs = {layer.name: ParallelConfig(n=2, devices=(1, 2)) for layer in g if not layer.is_input}
    configs.update({"block.ln": ParallelConfig(c=3, devices=(2, 0, 1)),
                    "block.gelu": ParallelConfig(h=3, devices=(0, 1, 2)),
                    "head.ln": ParallelConfig(c=3, devices=(1, 2, 0)),
                    "head.ln_plain": ParallelConfig(n=1, c=3, devices=(0, 2, 1))})
    configs["stem"] = ParallelConfig(c=1, h=2, w=1, devices=(0, 1))
    configs["block.residual"] = ParallelConfig(c=1, h=1, w=3, devices=(2, 1, 0))
    check_training(machine4, g, Strategy(configs), "float64")


# ---- the graph API ---------------------------------------------------------------------------------


def test_round_trip():
    g = convnext_block()
    g.layer_norm(Tensor(g, "fc2"))
    assert g["ln1"].op == LayerNorm(((4, 3),)) and OPS["layer_norm"] is LayerNorm
    data = g.to_dict()
    h = Graph.from_dict(json.loads(json.dumps(data)))
    assert h.to_dict() == data
    for a, b in zip(g, h):
        assert (a.name, a.kind, a.shape, a.inputs, a.op) == (b.name, b.kind, b.shape, b.inputs, b.op)
    assert h["head.ln"].op.attrs() == {"eps": 1e-6, "affine": True}
    assert h["head.ln_plain"].op.attrs() == {"eps": 1e-5, "affine": False} and h["head.ln_plain"].param_shapes == {}
    assert h["block.ln"].param_shapes == {"weight": (6,), "bias": (6,)}
    assert h.layer_norm(Tensor(h, "fc2")).name == "ln2"  # names continue where they were


def raises(parts, fn, *args, **kwargs):
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"


def test_bad_arguments_name_the_layer_and_what_is_valid():
    g = Graph()
    x = g.input("image", IMAGE)
    raises(["'ln'", "layer_norm", "eps must be a finite number > 0", "-1.0"], g.layer_norm, x, eps=-1, name="ln")
    raises(["'ln'", "eps must be a number", "'small'"], g.layer_norm, x, eps="small", name="ln")
    raises(["'ln'", "affine must be True or False", "'yes'"], g.layer_norm, x, affine="yes", name="ln")
    labels = g.input("labels", (IMAGE[0],), dtype="int64")
    raises(["'ln'", "layer_norm", "rank-2 (n, c) or rank-4", "(3,)"], g.layer_norm, labels, name="ln")
    assert list(g.layers) == ["image", "labels"]  # nothing added by a failed call
    data = convnext_block().to_dict()
    next(s for s in data["layers"] if s["name"] == "head.ln")["eps"] = 0
    raises(["'head.ln'", "eps must be a finite number > 0"], Graph.from_dict, data)
