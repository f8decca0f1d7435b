"""Dropout at the op level: the counter-based mask (keep rate, independence between steps, seeds and
layers, the same mask from every tile of every partition, the bits against a pure-Python computation),
the forward and backward scaling, the identity in prediction and at p = 0, PyTorch's values and
gradients in float64 given the same mask, and the graph API."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import Graph, GraphError, Tensor
from taskrt.ops import OPS, Dropout, ShapeError
from taskrt.ops.dropout import dropout_bits, dropout_keep
from taskrt.ops.rect import Rect

SHAPE = (3, 4, 5, 6)
DRAW = (11, 4)


def whole(shape):
    return Rect.full(shape)


def keep_of(shape, p, seed=11, step=4, layer="drop", rect=None):
    return dropout_keep(np, seed, step, layer, shape, whole(shape) if rect is None else rect, p)


# ---- the hash, spelled out in pure Python from the module's description -------------------------------

M32 = 2**32 - 1


def fmix(v):
    v ^= v >> 16
    v = (v * 0x85EBCA6B) & M32
    v ^= v >> 13
    v = (v * 0xC2B2AE35) & M32
    return v ^ (v >> 16)


def python_bits(seed, step, layer, shape, index):
    """The hash of the element at multi-index `index` of a tensor of `shape`, one element at a time."""
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    seed, step = seed % 2**64, step % 2**64
    key = 0x3C6EF372
    for word in (seed & M32, seed >> 32, step & M32, step >> 32, zlib.crc32(layer.encode())):
        key = fmix(key ^ word)
    key2 = fmix(key ^ 0xA54FF53A)
    h = fmix(((flat & M32) * 0x9E3779B9 & M32) ^ key)
    return fmix(h ^ (flat >> 32) ^ key2)


@pytest.mark.parametrize("seed, step, layer, shape, rect", [
    (0, 0, "", (7,), Rect((0,), (7,))),
    (11, 4, "drop", SHAPE, Rect((1, 2, 0, 3), (3, 4, 5, 6))),
    (2**40 + 5, 2**33 + 1, "block.dropout", (5, 9), Rect((2, 1), (5, 9))),
    (-3, 7, "fc1.drop", (2, 3, 2, 2), Rect((0, 0, 0, 0), (2, 3, 2, 2))),
    # more than 2**32 elements: the index's high word enters the second round (the tensor is never made)
    (5, 1, "huge", (3, 2**31 + 7), Rect((1, 2**31 - 2), (3, 2**31 + 7))),
    (5, 1, "huge", (70000, 70000, 2, 2), Rect((69999, 69990, 0, 0), (70000, 70000, 2, 2))),
])
def test_the_bits_are_the_hash_computed_element_by_element_in_pure_python(seed, step, layer, shape, rect):
    bits = dropout_bits(np, seed, step, layer, shape, rect)
    assert bits.dtype == np.uint32 and bits.shape == rect.shape
    for local in np.ndindex(*rect.shape):
        index = tuple(lo + i for lo, i in zip(rect.lo, local))
        assert int(bits[local]) == python_bits(seed, step, layer, shape, index), index
    p = 0.3
    expected = bits >= round(p * 2**32)
    np.testing.assert_array_equal(dropout_keep(np, seed, step, layer, shape, rect, p), expected)


def test_a_rect_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="not inside"):
        dropout_bits(np, 0, 0, "d", (4, 5), Rect((0, 3), (4, 6)))
    with pytest.raises(ValueError, match="not inside"):
        dropout_bits(np, 0, 0, "d", (4, 5), Rect((0,), (4,)))


# ---- its statistics ---------------------------------------------------------------------------------

BIG = (1000, 1000)  # 1e6 elements: 5 sigma of a rate is at most 0.0025
SIGMAS = 5


def assert_rate(observed, expected, count):
    sigma = np.sqrt(expected * (1 - expected) / count)
    assert abs(observed - expected) < SIGMAS * sigma, f"rate {observed} vs {expected} ({SIGMAS} sigma: {sigma:.2g})"


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    keep = keep_of(BIG, p)
    assert_rate(keep.mean(), 1 - p, keep.size)
    # and along every stretch of the index: rows, and the first elements of every row
    assert_rate(keep[:, :10].mean(), 1 - p, keep[:, :10].size)
    assert_rate(keep[:10].mean(), 1 - p, keep[:10].size)


@pytest.mark.parametrize("other", [
    {"step": 5}, {"step": 4 + 2**32}, {"seed": 12}, {"seed": 11 + 2**32}, {"layer": "drop2"}, {"layer": "Drop"}])
def test_masks_of_other_steps_seeds_and_layers_are_independent(other):
    p = 0.5
    keep = keep_of(BIG, p)
    again = keep_of(BIG, p, **other)
    assert not np.array_equal(keep, again)
    # two independent masks agree on a fraction p^2 + (1-p)^2 of the elements, and are both kept on (1-p)^2
    assert_rate((keep == again).mean(), p * p + (1 - p) * (1 - p), keep.size)
    assert_rate((keep & again).mean(), (1 - p) ** 2, keep.size)


def test_neighbouring_elements_are_independent():
    p = 0.3
    keep = keep_of(BIG, p).reshape(-1)
    for lag in (1, 2, 1000):  # the next element, and the next row
        assert_rate((keep[lag:] & keep[:-lag]).mean(), (1 - p) ** 2, keep.size - lag)
    # each of the 32 bits is a fair coin
    bits = dropout_bits(np, 11, 4, "drop", BIG, whole(BIG)).reshape(-1)
    for b in range(32):
        assert_rate(((bits >> np.uint32(b)) & np.uint32(1)).mean(), 0.5, bits.size)


def test_the_mask_is_the_same_every_time_it_is_drawn():
    np.testing.assert_array_equal(keep_of(SHAPE, 0.4), keep_of(SHAPE, 0.4))
    assert keep_of(SHAPE, 0.0).all()
    # a larger p drops a superset of the elements (one threshold on the same bits)
    assert not (keep_of(SHAPE, 0.6) & ~keep_of(SHAPE, 0.4)).any()


# ---- tiles -----------------------------------------------------------------------------------------


def grid_partition(shape, degrees):
    """The Rects of a grid split of `shape`, blocks as equal as possible (as ParallelConfig's)."""
    edges = [np.cumsum([0] + [size // d + (i < size % d) for i in range(d)]) for size, d in zip(shape, degrees)]
    for block in np.ndindex(*degrees):
        yield Rect.from_ranges((edges[k][i], edges[k][i + 1]) for k, i in enumerate(block))


def random_partition(draw, shape):
    """A partition of `shape` into boxes by random cuts along every dimension, the boxes then
    split again at random (not a grid: a part's neighbours need not line up)."""
    boxes = [whole(shape)]
    for _ in range(draw(st.integers(0, 6))):
        k = draw(st.integers(0, len(boxes) - 1))
        box = boxes[k]
        d = draw(st.integers(0, len(shape) - 1))
        if box.hi[d] - box.lo[d] < 2:
            continue
        cut = draw(st.integers(box.lo[d] + 1, box.hi[d] - 1))
        boxes[k: k + 1] = [box.replace(d, box.lo[d], cut), box.replace(d, cut, box.hi[d])]
    return boxes


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_tiles_of_any_partition_draw_the_mask_of_the_whole(data):
    rank = data.draw(st.sampled_from([1, 2, 4]), label="rank")
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank), label="shape"))
    seed, step = data.draw(st.integers(0, 2**64), label="seed"), data.draw(st.integers(0, 2**40), label="step")
    p = data.draw(st.sampled_from([0.1, 0.5, 0.8]), label="p")
    expected = keep_of(shape, p, seed, step, "layer.x")
    if data.draw(st.booleans(), label="grid"):
        rects = list(grid_partition(shape, [data.draw(st.integers(1, s), label="degree") for s in shape]))
    else:
        rects = random_partition(data.draw, shape)
    assembled = np.zeros(shape, dtype=np.int64)
    for rect in rects:
        tile = keep_of(shape, p, seed, step, "layer.x", rect=rect)
        assert tile.shape == rect.shape
        sl = rect.relative_to(whole(shape))
        np.testing.assert_array_equal(tile, expected[sl])
        assembled[sl] += 1 + tile
    np.testing.assert_array_equal(assembled, 1 + expected)  # every element drawn once, as the whole draws it

    # and the op's tiles: forward and backward of each part are the slices of the whole ones
    op = Dropout((shape,), p, "layer.x")
    rng = np.random.default_rng(seed % 2**32)
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    y = op.forward([x], {}, whole(shape), draw=(seed, step))
    (dx,), _ = op.backward(dy, [x], y, {}, whole(shape), [True], draw=(seed, step))
    for rect in rects:
        sl = rect.relative_to(whole(shape))
        np.testing.assert_array_equal(op.forward([x[sl]], {}, rect, draw=(seed, step)), y[sl])
        np.testing.assert_array_equal(op.backward(dy[sl], [x[sl]], y[sl], {}, rect, [True], draw=(seed, step))[0][0],
                                      dx[sl])


# ---- the op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.2, 0.5, 0.75])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forward_and_backward_scale_the_kept_and_zero_the_dropped(p, dtype):
    op = Dropout((SHAPE,), p, "drop")
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal(SHAPE).astype(dtype), rng.standard_normal(SHAPE).astype(dtype)
    keep = keep_of(SHAPE, p, *DRAW, "drop")
    assert 0 < keep.mean() < 1
    y = op.forward([x], {}, whole(SHAPE), draw=DRAW)
    (dx,), grads = op.backward(dy, [x], y, {}, whole(SHAPE), [True], draw=DRAW)
    assert y.dtype == dx.dtype == dtype and grads == {}
    tol = 1e-15 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(y[keep], x[keep] / (1 - p), rtol=tol)
    np.testing.assert_allclose(dx[keep], dy[keep] / (1 - p), rtol=tol)
    assert not y[~keep].any() and not dx[~keep].any()
    assert op.backward(dy, [x], y, {}, whole(SHAPE), [False], draw=DRAW) == ([None], {})


def test_the_identity_in_prediction_and_at_p_zero():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    for op, draw in ((Dropout((SHAPE,), 0.5, "drop"), None), (Dropout((SHAPE,), 0.0, "drop"), DRAW),
                     (Dropout((SHAPE,), 0, "drop"), DRAW)):
        np.testing.assert_array_equal(op.forward([x], {}, whole(SHAPE), draw=draw), x)
        (dx,), grads = op.backward(dy, [x], None, {}, whole(SHAPE), [True], draw=draw)
        np.testing.assert_array_equal(dx, dy)
        assert grads == {}
    # the positional form the runtime calls today (no draw): the identity too
    np.testing.assert_array_equal(Dropout((SHAPE,), 0.5).forward([x], {}, whole(SHAPE)), x)


def test_a_bad_draw_is_refused():
    op = Dropout((SHAPE,), 0.5, "drop")
    x = np.ones(SHAPE)
    for bad in ((1,), (1, 2, 3), 7, "seed"):
        with pytest.raises(ValueError, match="draw must be None"):
            op.forward([x], {}, whole(SHAPE), draw=bad)
    # a (seed, step) pair that became a list on its way (msgpack) is the same draw
    np.testing.assert_array_equal(op.forward([x], {}, whole(SHAPE), draw=list(DRAW)),
                                  op.forward([x], {}, whole(SHAPE), draw=DRAW))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_equals_torch_given_the_same_mask(p):
    torch = pytest.importorskip("torch")
    op = Dropout((SHAPE,), p, "drop")
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    y = op.forward([x], {}, whole(SHAPE), draw=DRAW)
    (dx,), _ = op.backward(dy, [x], y, {}, whole(SHAPE), [True], draw=DRAW)
    mask = torch.tensor(keep_of(SHAPE, p, *DRAW, "drop"), dtype=torch.float64)
    tx = torch.tensor(x, requires_grad=True)
    ty = tx * mask / (1 - p)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=0)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=0)


def test_rules_flops_and_attributes():
    op = Dropout((SHAPE,), 0.25, "drop")
    out = Rect((1, 0, 2, 3), (3, 4, 5, 6))
    assert op.input_rects(out) == [out] and op.param_rects(out) == {} and op.param_shapes() == {}
    assert op.random is True and op.kind == "dropout" and OPS["dropout"] is Dropout
    assert op.dims == ("n", "c", "h", "w") and op.out_shape == SHAPE
    unit = Rect((0,) * 4, (1,) * 4)
    assert op.flops(out) == out.volume * op.flops(unit) > 0
    assert op.attrs() == {"p": 0.25, "layer": "drop"}


@pytest.mark.parametrize("p", [1.0, 1, -0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_bad_p_is_refused(p):
    with pytest.raises(ShapeError, match=r"0 <= p < 1"):
        Dropout((SHAPE,), p)


# ---- the graph API ---------------------------------------------------------------------------------


def test_round_trip_keeps_the_layer_that_keys_the_mask():
    g = Graph("net")
    x = g.input("image", SHAPE)
    y = g.dropout(x)
    y = g.dropout(g.flatten(y), p=0.2, name="head.drop")
    assert g["dropout1"].op == Dropout((SHAPE,), 0.5, "dropout1") and g["head.drop"].op.layer == "head.drop"
    data = g.to_dict()
    h = Graph.from_dict(json.loads(json.dumps(data)))
    assert h.to_dict() == data
    for a, b in zip(g, h):
        assert (a.name, a.kind, a.shape, a.inputs, a.op) == (b.name, b.kind, b.shape, b.inputs, b.op)
    x = np.random.default_rng(3).standard_normal(SHAPE)
    np.testing.assert_array_equal(h["dropout1"].op.forward([x], {}, whole(SHAPE), draw=DRAW),
                                  g["dropout1"].op.forward([x], {}, whole(SHAPE), draw=DRAW))
    # two dropout layers of one shape draw different masks
    other = g.dropout(Tensor(g, "image"))
    assert other.name == "dropout2"
    assert not np.array_equal(g["dropout2"].op.forward([x], {}, whole(SHAPE), draw=DRAW),
                              g["dropout1"].op.forward([x], {}, whole(SHAPE), draw=DRAW))
    assert h.dropout(Tensor(h, "image")).name == "dropout2"  # names continue where they were
    assert g.needs_backward() == set()  # no parameters


def test_bad_arguments_name_the_layer_and_what_is_valid():
    g = Graph()
    x = g.input("image", SHAPE)
    for p in (1, 1.0, -0.5):
        with pytest.raises(GraphError, match=r"layer 'd' \(dropout\): dropout p must be a number with 0 <= p < 1"):
            g.dropout(x, p=p, name="d")
    with pytest.raises(GraphError, match="layer 'd': p must be a number, got '0.5'"):
        g.dropout(x, p="0.5", name="d")
    assert list(g.layers) == ["image"]  # nothing added by a failed call
