"""The graph-building API: shape inference, generated names, build-time errors (GraphError naming
the layer and the mismatch), needs_backward, the to_dict/from_dict round trip and the edges."""

from __future__ import annotations

import json
import re

import pytest

from taskrt import Graph, GraphError, Tensor


def image(shape=(4, 3, 16, 16), name="image"):
    g = Graph("t")
    return g, g.input(name, shape=shape)


def raises(match_parts, fn, *args, **kwargs):
    """Call fn, expect a GraphError whose message contains every string in `match_parts`."""
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# ---- shape inference --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, out",
    [
        (dict(kernel=3), (4, 8, 14, 14)),
        (dict(kernel=3, padding=1), (4, 8, 16, 16)),
        (dict(kernel=3, stride=2, padding=1), (4, 8, 8, 8)),
        (dict(kernel=5, stride=3), (4, 8, 4, 4)),
        (dict(kernel=(3, 1), padding=(1, 0)), (4, 8, 16, 16)),
        (dict(kernel=(1, 7), stride=(1, 2), padding=(0, 3)), (4, 8, 16, 8)),
        (dict(kernel=(5, 3), stride=(2, 1), padding=(0, 2)), (4, 8, 6, 18)),
        (dict(kernel=16), (4, 8, 1, 1)),
        (dict(kernel=(2, 2), stride=(4, 4)), (4, 8, 4, 4)),
    ],
)
def test_conv2d_shapes(kwargs, out):
    g, x = image()
    y = g.conv2d(x, 8, **kwargs)
    assert y.shape == out
    layer = g[y.name]
    assert layer.kind == "conv2d"
    kh, kw = (kwargs["kernel"],) * 2 if isinstance(kwargs["kernel"], int) else kwargs["kernel"]
    assert layer.param_shapes == {"weight": (8, 3, kh, kw), "bias": (8,)}
    assert layer.dims == ("n", "c", "h", "w")


def test_conv2d_int_and_pair_arguments_are_equivalent():
    g, x = image()
    a = g.conv2d(x, 4, kernel=3, stride=2, padding=1)
    b = g.conv2d(x, 4, kernel=(3, 3), stride=(2, 2), padding=(1, 1))
    assert g[a.name].op.attrs() == g[b.name].op.attrs()
    assert g[a.name].op.attrs() == {"out_channels": 4, "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1],
                                    "activation": None, "bias": True}


def test_bias_free_layers():
    g, x = image()
    y = g.conv2d(x, 8, kernel=3, bias=False, name="conv")
    z = g.linear(g.flatten(y), 5, bias=False, name="fc")
    assert g["conv"].param_shapes == {"weight": (8, 3, 3, 3)}
    assert g[z.name].param_shapes == {"weight": (5, 8 * 14 * 14)}
    assert g.num_params() == 8 * 27 + 5 * 8 * 14 * 14
    again = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again["conv"].param_shapes == g["conv"].param_shapes and not again["fc"].op.bias
    raises(["'bad'", "bias", "True or False", "'no'"], g.conv2d, x, 8, kernel=3, bias="no", name="bad")
    raises(["'bad2'", "bias", "None"], g.linear, g.flatten(y), 3, bias=None, name="bad2")


def test_conv2d_fused_relu():
    g, x = image()
    y = g.conv2d(x, 6, kernel=5, padding=2, activation="relu")
    assert y.shape == (4, 6, 16, 16)
    assert g[y.name].op.activation == "relu" and g[y.name].op.saves_output
    z = g.conv2d(x, 6, kernel=5)
    assert g[z.name].op.activation is None and not g[z.name].op.saves_output


@pytest.mark.parametrize(
    "kwargs, out",
    [
        (dict(kernel=2), (4, 3, 8, 8)),  # stride defaults to the kernel
        (dict(kernel=3), (4, 3, 5, 5)),
        (dict(kernel=(2, 4)), (4, 3, 8, 4)),
        (dict(kernel=3, stride=1), (4, 3, 14, 14)),
        (dict(kernel=3, stride=2, padding=1), (4, 3, 8, 8)),
        (dict(kernel=(3, 2), stride=(1, 2), padding=(1, 1)), (4, 3, 16, 9)),
    ],
)
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool2d_shapes(kwargs, out, mode):
    g, x = image()
    y = g.pool2d(x, mode=mode, **kwargs)
    assert y.shape == out
    layer = g[y.name]
    assert layer.kind == "pool2d" and layer.op.mode == mode and layer.param_shapes == {}


def test_pool2d_default_stride_equals_kernel():
    g, x = image()
    assert g[g.pool2d(x, 3).name].op.stride == (3, 3)
    assert g[g.pool2d(x, (2, 4)).name].op.stride == (2, 4)
    assert g[g.pool2d(x, 2).name].op.mode == "max"


def test_linear_relu_flatten_shapes():
    g, x = image((5, 3, 4, 6))
    f = g.flatten(x)
    assert f.shape == (5, 72) and g[f.name].dims == ("n", "c")
    r4 = g.relu(x)
    assert r4.shape == (5, 3, 4, 6)
    fc = g.linear(f, 10)
    assert fc.shape == (5, 10)
    assert g[fc.name].param_shapes == {"weight": (10, 72), "bias": (10,)}
    r2 = g.relu(fc)
    assert r2.shape == (5, 10)
    f2 = g.flatten(fc)  # flatten of a rank-2 tensor is the identity on shapes
    assert f2.shape == (5, 10)


def test_concat_rank4_and_rank2():
    g, x = image((2, 3, 8, 8))
    a = g.conv2d(x, 4, kernel=3, padding=1)
    b = g.conv2d(x, 5, kernel=1)
    c = g.concat([a, b, x])
    assert c.shape == (2, 12, 8, 8)
    assert g[c.name].inputs == (a.name, b.name, "image")
    fa, fb = g.linear(g.flatten(a), 7), g.linear(g.flatten(b), 2)
    c2 = g.concat((fa, fb))
    assert c2.shape == (2, 9)


def test_add_shape():
    g, x = image((2, 3, 8, 8))
    a = g.conv2d(x, 3, kernel=3, padding=1)
    s = g.add(a, x)
    assert s.shape == (2, 3, 8, 8) and g[s.name].inputs == (a.name, "image")


def test_softmax_cross_entropy_adds_int64_labels():
    g, x = image((6, 3, 4, 4))
    logits = g.linear(g.flatten(x), 10)
    loss = g.softmax_cross_entropy(logits)
    assert loss.shape == (6,)
    labels = g["labels"]
    assert labels.is_input and labels.op.dtype == "int64" and labels.shape == (6,)
    assert g[loss.name].inputs == (logits.name, "labels")
    assert [l.name for l in g.losses] == [loss.name]
    assert [l.name for l in g.inputs] == ["image", "labels"]


def test_second_loss_gets_distinct_labels():
    g, x = image((6, 3, 4, 4))
    f = g.flatten(x)
    l1 = g.softmax_cross_entropy(g.linear(f, 10))
    l2 = g.softmax_cross_entropy(g.linear(f, 4))
    l3 = g.softmax_cross_entropy(g.linear(f, 3), name="aux")
    labels = [g[l.name].inputs[1] for l in (l1, l2, l3)]
    assert len(set(labels)) == 3
    assert labels[0] == "labels"
    assert all(g[n].op.dtype == "int64" and g[n].shape == (6,) for n in labels)
    # the extra label inputs are named after their loss layer
    assert labels[1].startswith(l2.name) and labels[2].startswith("aux")
    assert [l.name for l in g.losses] == [l1.name, l2.name, "aux"]


def test_softmax_cross_entropy_with_explicit_labels():
    g, x = image((6, 3, 4, 4))
    y = g.input("y", shape=(6,), dtype="int64")
    loss = g.softmax_cross_entropy(g.linear(g.flatten(x), 10), labels=y)
    assert g[loss.name].inputs[1] == "y" and "labels" not in g.layers


def test_input_ranks_and_dtypes():
    g = Graph()
    assert g.input("a", shape=(2, 3, 4, 5)).shape == (2, 3, 4, 5)
    assert g.input("b", shape=[2, 3]).shape == (2, 3)
    assert g.input("c", shape=(2,), dtype="int64").shape == (2,)
    assert g["a"].op.dtype == "float" and g["c"].op.dtype == "int64"
    assert g["a"].param_shapes == {}


# ---- names --------------------------------------------------------------------------------------


def build_mixed(g: Graph) -> Graph:
    x = g.input("image", shape=(2, 3, 16, 16))
    a = g.conv2d(x, 4, kernel=3, padding=1)
    b = g.conv2d(a, 4, kernel=3, padding=1, activation="relu")
    p = g.pool2d(b, 2)
    q = g.pool2d(p, 2, mode="avg")
    r = g.relu(q)
    c = g.concat([r, q])
    f = g.flatten(c)
    h = g.linear(f, 8)
    h2 = g.linear(g.relu(h), 8)
    s = g.add(h, h2)
    g.softmax_cross_entropy(g.linear(s, 5))
    return g


GENERATED = ["image", "conv1", "conv2", "pool1", "pool2", "relu1", "concat1", "flatten1", "fc1",
             "relu2", "fc2", "add1", "fc3", "labels", "loss1"]


def test_generated_names_are_stable():
    first = build_mixed(Graph("a"))
    second = build_mixed(Graph("b"))
    assert list(first.layers) == GENERATED
    assert list(second.layers) == GENERATED


def test_explicit_names_kept_and_generated_names_skip_them():
    g, x = image()
    a = g.conv2d(x, 4, kernel=3, name="conv1")  # explicit name that a generated one would also use
    b = g.conv2d(a, 4, kernel=3)
    c = g.conv2d(b, 4, kernel=3, name="stem.conv_a")
    d = g.conv2d(c, 4, kernel=3)
    assert (a.name, b.name, c.name, d.name) == ("conv1", "conv2", "stem.conv_a", "conv3")
    assert list(g.layers) == ["image", "conv1", "conv2", "stem.conv_a", "conv3"]
    fc = g.linear(g.flatten(d), 3, name="fc2")
    assert g.linear(fc, 3).name == "fc1" and g.linear(fc, 3).name == "fc3"


def test_tensor_and_layer_access():
    g = build_mixed(Graph("net"))
    t = Tensor(g, "conv1")
    assert t.shape == (2, 4, 16, 16) and "conv1" in repr(t)
    assert len(g) == len(GENERATED) and [l.name for l in g] == GENERATED
    assert g["concat1"].shape == (2, 8, 4, 4) and g["flatten1"].shape == (2, 128)
    conv1, conv2 = 4 * 3 * 9 + 4, 4 * 4 * 9 + 4
    fc1, fc2, fc3 = 8 * 128 + 8, 8 * 8 + 8, 5 * 8 + 5
    assert g.num_params() == conv1 + conv2 + fc1 + fc2 + fc3
    assert "Graph('net'" in repr(g)


# ---- build-time errors --------------------------------------------------------------------------


def test_duplicate_name():
    g, x = image()
    g.conv2d(x, 4, kernel=3, name="c")
    raises(["'c'", "already exists", "conv2d"], g.pool2d, x, 2, name="c")
    raises(["'image'", "already exists", "input"], g.input, "image", shape=(1, 1, 2, 2))
    assert list(g.layers) == ["image", "c"]


@pytest.mark.parametrize("bad", ["conv-1", "a b", "", "x/y", "é", 3])
def test_invalid_name(bad):
    g, x = image()
    raises([repr(bad), "not valid"], g.conv2d, x, 4, kernel=3, name=bad)
    raises([repr(bad), "not valid"], g.input, bad, shape=(1, 2))
    assert list(g.layers) == ["image"]


def test_conv2d_on_rank2():
    g = Graph()
    v = g.input("v", shape=(4, 10))
    raises(["'c1'", "conv2d", "rank-4", "(4, 10)"], g.conv2d, v, 3, kernel=1, name="c1")


def test_linear_on_rank4():
    g, x = image((4, 3, 5, 5))
    raises(["'head'", "linear", "rank-2", "(4, 3, 5, 5)", "flatten"], g.linear, x, 10, name="head")


def test_pool_on_rank2():
    g = Graph()
    v = g.input("v", shape=(4, 10))
    raises(["'p'", "pool2d", "rank-4", "(4, 10)"], g.pool2d, v, 2, name="p")


def test_add_channel_mismatch():
    g, x = image((2, 3, 8, 8))
    a = g.conv2d(x, 4, kernel=3, padding=1)
    raises(["'res'", "add", "(2, 4, 8, 8)", "(2, 3, 8, 8)"], g.add, a, x, name="res")


def test_add_rank_mismatch():
    g, x = image((2, 3, 8, 8))
    f = g.flatten(x)
    raises(["'s'", "(2, 3, 8, 8)", "(2, 192)"], g.add, x, f, name="s")


def test_concat_mismatch_outside_channel_axis():
    g, x = image((2, 3, 8, 8))
    a = g.conv2d(x, 4, kernel=3)  # (2, 4, 6, 6)
    raises(["'cat'", "concat", "input 1", "(2, 4, 6, 6)", "(2, 3, 8, 8)", "outside the channel axis"],
           g.concat, [x, a], name="cat")
    f = g.flatten(x)
    raises(["'cat'", "input 1", "(2, 192)"], g.concat, [x, f], name="cat")
    other = g.input("other", shape=(3, 3, 8, 8))  # batch differs
    raises(["'cat'", "(3, 3, 8, 8)"], g.concat, [x, other], name="cat")


def test_concat_needs_two_inputs():
    g, x = image()
    raises(["'cat'", "at least two inputs", "got 1"], g.concat, [x], name="cat")
    raises(["'cat'", "at least two inputs", "got 0"], g.concat, [], name="cat")


def test_concat_rank1_rejected():
    g = Graph()
    v = g.input("v", shape=(4,))
    raises(["'cat'", "rank", "(4,)"], g.concat, [v, v], name="cat")
    assert "cat" not in g.layers


def test_kernel_larger_than_padded_input():
    g, x = image((2, 3, 5, 7))
    msg = raises(["'big'", "conv2d", "(6, 3)", "larger than the padded input", "along h", "5 + 2*0 = 5 < 6"],
                 g.conv2d, x, 4, kernel=(6, 3), name="big")
    assert "along w" not in msg
    raises(["'big'", "along w", "7 + 2*1 = 9 < 10"], g.conv2d, x, 4, kernel=(3, 10), padding=1, name="big")
    raises(["'bigpool'", "max pool2d", "along h", "5 + 2*0 = 5 < 6"], g.pool2d, x, 6, name="bigpool")
    raises(["'bigpool'", "avg pool2d", "7 + 2*0 = 7 < 8"], g.pool2d, x, (2, 8), mode="avg", name="bigpool")
    # exactly the padded size is fine
    assert g.conv2d(x, 4, kernel=(7, 9), padding=1).shape == (2, 4, 1, 1)


@pytest.mark.parametrize(
    "kwargs, parts",
    [
        (dict(kernel=0), ["kernel must be >= 1", "(0, 0)"]),
        (dict(kernel=(3, -1)), ["kernel must be >= 1", "(3, -1)"]),
        (dict(kernel=3, stride=0), ["stride must be >= 1", "(0, 0)"]),
        (dict(kernel=3, stride=(1, -2)), ["stride must be >= 1", "(1, -2)"]),
        (dict(kernel=3, padding=-1), ["padding must be >= 0", "(-1, -1)"]),
        (dict(kernel=3, padding=(0, -2)), ["padding must be >= 0", "(0, -2)"]),
    ],
)
def test_bad_window_hyperparameters(kwargs, parts):
    g, x = image()
    raises(["'w1'", "conv2d", *parts], g.conv2d, x, 4, name="w1", **kwargs)
    raises(["'w2'", "pool2d", *parts], g.pool2d, x, name="w2", **kwargs)


def test_bad_out_sizes():
    g, x = image()
    raises(["'c'", "out_channels must be >= 1", "got 0"], g.conv2d, x, 0, kernel=3, name="c")
    f = g.flatten(x)
    raises(["'fc'", "out_features must be >= 1", "got -3"], g.linear, f, -3, name="fc")


def test_bad_activation():
    g, x = image()
    raises(["'c'", "activation", "'tanh'"], g.conv2d, x, 4, kernel=3, activation="tanh", name="c")


def test_bad_pool_mode():
    g, x = image()
    raises(["'p'", "mode", "'min'"], g.pool2d, x, 2, mode="min", name="p")


def test_pool_padding_more_than_half_kernel():
    g, x = image()
    raises(["'p'", "padding (2, 2)", "half the kernel (3, 3)"], g.pool2d, x, 3, stride=1, padding=2, name="p")
    raises(["'p'", "padding (0, 2)", "(3, 3)"], g.pool2d, x, 3, padding=(0, 2), name="p")
    assert g.pool2d(x, 3, stride=1, padding=1).shape == (4, 3, 16, 16)  # half or less is fine
    assert g.pool2d(x, 2, padding=1).shape == (4, 3, 9, 9)


@pytest.mark.parametrize("bad", [(3, 3, 3), "33", "3", 2.5, None, (3,)])
@pytest.mark.parametrize("what", ["kernel", "stride", "padding"])
def test_window_argument_not_int_or_pair(bad, what):
    g, x = image()
    kwargs = {"kernel": 3, what: bad}
    raises(["'c'", what, "an int or a pair", repr(bad)], g.conv2d, x, 4, name="c", **kwargs)
    if bad is not None:  # stride=None is pool2d's default (stride = kernel); kernel=None is covered by conv
        raises(["'p'", what, "an int or a pair", repr(bad)], g.pool2d, x, name="p", **kwargs)
    assert list(g.layers) == ["image"]


def test_tensor_from_another_graph():
    g1, x1 = image()
    g2, x2 = image()
    raises(["'c'", "'image'", "another graph"], g2.conv2d, x1, 4, kernel=3, name="c")
    y2 = g2.conv2d(x2, 3, kernel=1)
    raises(["'s'", "another graph"], g2.add, y2, x1, name="s")
    raises(["'cat'", "another graph"], g2.concat, [x2, x1], name="cat")
    assert "c" not in g2.layers and "s" not in g2.layers


def test_non_tensor_input():
    g, x = image()
    raises(["'c'", "expected a Tensor", "str"], g.conv2d, "image", 4, kernel=3, name="c")
    raises(["'r'", "expected a Tensor", "tuple"], g.relu, (4, 3, 16, 16), name="r")
    raises(["'cat'", "expected a Tensor", "NoneType"], g.concat, [x, None], name="cat")
    raises(["'loss'", "expected a Tensor", "list"], g.softmax_cross_entropy, [1, 2], name="loss")


def test_softmax_cross_entropy_label_shape_mismatch():
    g, x = image((6, 3, 4, 4))
    logits = g.linear(g.flatten(x), 10)
    y = g.input("y", shape=(5,), dtype="int64")
    raises(["'loss'", "softmax_cross_entropy", "labels must have shape (6,)", "(5,)"],
           g.softmax_cross_entropy, logits, labels=y, name="loss")
    y2 = g.input("y2", shape=(6, 1), dtype="int64")
    raises(["'loss'", "(6, 1)"], g.softmax_cross_entropy, logits, labels=y2, name="loss")


def test_softmax_cross_entropy_float_labels_rejected():
    g, x = image((6, 3, 4, 4))
    logits = g.linear(g.flatten(x), 10)
    y = g.input("y", shape=(6,))
    raises(["'loss'", "labels", "int64", "'y'", "'float'"], g.softmax_cross_entropy, logits, labels=y, name="loss")
    z = g.relu(g.input("z", shape=(6,), dtype="int64"), name="zr")
    raises(["'loss'", "int64 input", "'zr'", "relu"], g.softmax_cross_entropy, logits, labels=z, name="loss")
    assert "loss" not in g.layers


def test_softmax_cross_entropy_bad_logits_leaves_no_stray_labels():
    g, x = image((6, 3, 4, 4))
    raises(["'loss'", "rank-2", "(6, 3, 4, 4)"], g.softmax_cross_entropy, x, name="loss")
    assert list(g.layers) == ["image"]
    logits = g.linear(g.flatten(x), 10)
    raises(["'conv-1'", "not valid"], g.softmax_cross_entropy, logits, name="conv-1")
    raises(["'image'", "already exists"], g.softmax_cross_entropy, logits, name="image")
    assert "labels" not in g.layers


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 4, 5, 6), ()])
def test_input_bad_rank(shape):
    g = Graph()
    raises(["'x'", "rank 4", str(shape)], g.input, "x", shape=shape)


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 3, 0, 4), (2, -1)])
def test_input_zero_dimension(shape):
    g = Graph()
    raises(["'x'", "dimensions must be >= 1", str(shape)], g.input, "x", shape=shape)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool", None])
def test_input_bad_dtype(dtype):
    g = Graph()
    raises(["'x'", "dtype", repr(dtype)], g.input, "x", shape=(2, 3), dtype=dtype)


def test_failed_build_leaves_graph_unchanged():
    g = build_mixed(Graph())
    before = g.to_dict()
    for fn in (
        lambda: g.conv2d(Tensor(g, "fc1"), 3, kernel=1),
        lambda: g.add(Tensor(g, "conv1"), Tensor(g, "pool1")),
        lambda: g.softmax_cross_entropy(Tensor(g, "conv1")),
    ):
        with pytest.raises(GraphError):
            fn()
    assert g.to_dict() == before


# ---- needs_backward -----------------------------------------------------------------------------


def test_needs_backward():
    g, x = image((2, 3, 16, 16))
    p = g.pool2d(x, 2, name="pool_in")  # no parameters upstream
    r = g.relu(p, name="relu_in")
    c = g.conv2d(r, 4, kernel=3, padding=1, name="conv")
    q = g.pool2d(c, 2, name="pool_after")
    side = g.pool2d(x, 4, name="side")  # parameter-free branch joining later
    j = g.concat([q, side], name="join")
    logits = g.linear(g.flatten(j, name="flat"), 5, name="fc")
    g.softmax_cross_entropy(logits, name="loss")
    needed = g.needs_backward()
    assert needed == {"conv", "pool_after", "join", "flat", "fc", "loss"}
    assert not needed & {"image", "labels", "pool_in", "relu_in", "side"}


def test_needs_backward_param_free_graph_is_empty():
    g, x = image((2, 3, 4, 4))
    g.softmax_cross_entropy(g.flatten(g.pool2d(x, 2)))
    assert g.needs_backward() == set()


# ---- to_dict / from_dict ------------------------------------------------------------------------


def test_round_trip():
    g = build_mixed(Graph("mixed"))
    g.conv2d(Tensor(g, "image"), 2, kernel=(3, 1), stride=(2, 1), padding=(1, 0), activation="relu",
             name="extra.conv")
    data = g.to_dict()
    h = Graph.from_dict(json.loads(json.dumps(data)))  # survives JSON (tuples become lists)
    assert h.name == "mixed"
    assert list(h.layers) == list(g.layers)
    for a, b in zip(g, h):
        assert (a.name, a.kind, a.shape, a.inputs, a.param_shapes, a.dims) == (
            b.name, b.kind, b.shape, b.inputs, b.param_shapes, b.dims)
        assert a.op == b.op
    assert h.summary() == g.summary()
    assert h.to_dict() == data
    assert h.needs_backward() == g.needs_backward()
    assert h.num_params() == g.num_params()
    # the rebuilt graph can be extended, and names continue from where they were
    assert h.conv2d(Tensor(h, "image"), 2, kernel=1).name == "conv3"


def test_summary_lists_every_layer():
    g = build_mixed(Graph())
    text = g.summary()
    for layer in g:
        assert re.search(rf"^{re.escape(layer.name)}\s+{layer.kind}\s", text, re.M)
    assert f"total parameters: {g.num_params():,}" in text


def test_from_dict_unknown_kind():
    data = build_mixed(Graph()).to_dict()
    data["layers"][2]["kind"] = "batchnorm"
    raises(["'conv2'", "unknown kind", "'batchnorm'"], Graph.from_dict, data)


def test_from_dict_bad_shapes_and_sources():
    data = build_mixed(Graph()).to_dict()
    data["layers"][1]["kernel"] = [20, 20]
    raises(["'conv1'", "conv2d", "larger than the padded input"], Graph.from_dict, data)
    data = build_mixed(Graph()).to_dict()
    data["layers"][2]["inputs"] = ["nowhere"]
    raises(["'conv2'", "nowhere"], Graph.from_dict, data)


# ---- edges --------------------------------------------------------------------------------------


def test_consumers():
    g, x = image((2, 3, 8, 8))
    a = g.conv2d(x, 3, kernel=3, padding=1, name="a")
    s = g.add(a, x, name="s")
    g.concat([x, s, x], name="cat")
    assert g.consumers("image") == [("a", 0), ("s", 1), ("cat", 0), ("cat", 2)]
    assert g.consumers("a") == [("s", 0)]
    assert g.consumers("s") == [("cat", 1)]
    assert g.consumers("cat") == []


def test_to_networkx():
    g = build_mixed(Graph())
    nxg = g.to_networkx()
    assert set(nxg.nodes) == set(g.layers)
    expected = {(src, layer.name) for layer in g for src in layer.inputs}
    assert set(nxg.edges) == expected
    assert ("pool2", "relu1") in expected and ("pool2", "concat1") in expected
    assert ("labels", "loss1") in expected and ("fc3", "loss1") in expected
    import networkx as nx

    assert nx.is_directed_acyclic_graph(nxg)
    order = list(g.layers)
    assert all(order.index(u) < order.index(v) for u, v in nxg.edges)


def test_input_shape_must_be_ints():
    g = Graph("g")
    for bad in (5, "64", (2, 1.5, 3, 3), (2, True)):
        with pytest.raises(GraphError, match="shape must be a tuple of ints"):
            g.input("x", bad)


def test_from_dict_rejects_duplicate_names():
    g = Graph("g")
    x = g.input("x", (2, 3))
    g.linear(x, 4, name="fc")
    data = g.to_dict()
    data["layers"].append(dict(data["layers"][-1]))
    with pytest.raises(GraphError, match="'fc' is defined twice"):
        Graph.from_dict(data)
