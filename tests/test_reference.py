"""The single-device trainer: input binding errors, float64 gradients against central differences
of loss(), SGD with momentum and weight decay, predict on ragged sample counts, dtypes and seeds."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import Graph
from taskrt.data.arrays import InputError, bind_inputs
from taskrt.training.reference import SingleDeviceTrainer

BATCH, CLASSES = 3, 4


def small_net(batch=BATCH, classes=CLASSES) -> Graph:
    """conv (padding, stride 2) -> max pool, in parallel with a strided conv with fused relu;
    concat, relu, flatten, linear, a residual add of two linears, logits, loss."""
    g = Graph("small")
    x = g.input("image", shape=(batch, 2, 7, 7))
    c1 = g.conv2d(x, 3, kernel=3, stride=2, padding=1, name="conv1")  # (b, 3, 4, 4)
    p1 = g.pool2d(c1, 2, name="pool1")  # max, (b, 3, 2, 2)
    c2 = g.conv2d(x, 2, kernel=(3, 2), stride=(4, 5), padding=(1, 0), activation="relu", name="conv2")
    cat = g.concat([p1, c2], name="cat")  # (b, 5, 2, 2)
    r = g.relu(cat, name="relu1")
    f = g.flatten(r, name="flat")  # (b, 20)
    h = g.linear(f, 6, name="fc1")
    h2 = g.linear(g.relu(h, name="relu2"), 6, name="fc2")
    s = g.add(h, h2, name="res")
    logits = g.linear(s, classes, name="logits")
    g.softmax_cross_entropy(logits, name="loss")
    return g


def batch_data(rng, batch=BATCH, classes=CLASSES):
    return rng.standard_normal((batch, 2, 7, 7)), rng.integers(0, classes, size=batch)


def test_small_net_shapes():
    g = small_net()
    assert g["conv2"].shape == (BATCH, 2, 2, 2)
    assert g["cat"].shape == (BATCH, 5, 2, 2)
    assert g["logits"].shape == (BATCH, CLASSES)


# ---- bind_inputs ------------------------------------------------------------------------------


@pytest.fixture
def trainer():
    return SingleDeviceTrainer(small_net(), lr=0.1, seed=0)


def assert_input_error(trainer, parts, *data):
    """Every public entry point refuses the data with the same InputError, and nothing changes."""
    before = trainer.parameters()
    for fn in (trainer.loss, trainer.gradients, trainer.step):
        with pytest.raises(InputError) as info:
            fn(*data)
        for part in parts:
            assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"
    assert trainer.steps_done == 0
    for name, p in before.items():
        for k, v in p.items():
            np.testing.assert_array_equal(trainer.params[name][k], v)
            assert not trainer.velocity[name][k].any()


def test_bind_inputs_ok():
    g = small_net()
    x, y = batch_data(np.random.default_rng(0))
    bound = bind_inputs(g, (x, y.astype(np.int32)), np.dtype(np.float32))
    assert list(bound) == ["image", "labels"]
    assert bound["image"].dtype == np.float32 and bound["labels"].dtype == np.int64
    same = bind_inputs(g, ({"labels": list(y), "image": x},), np.dtype(np.float64))
    assert same["image"].dtype == np.float64
    np.testing.assert_array_equal(same["labels"], y)
    images = bind_inputs(g, (x,), np.dtype(np.float32), with_labels=False)
    assert list(images) == ["image"]


def test_wrong_number_of_arrays(trainer):
    x, y = batch_data(np.random.default_rng(0))
    assert_input_error(trainer, ["'small'", "2 input arrays", "['image', 'labels']", "got 1"], x)
    assert_input_error(trainer, ["2 input arrays", "got 3"], x, y, y)
    assert_input_error(trainer, ["got 0"])


def test_wrong_shape(trainer):
    x, y = batch_data(np.random.default_rng(0))
    assert_input_error(trainer, ["'image'", "(3, 2, 7, 7)", "(3, 2, 7, 6)"], x[..., :6], y)
    assert_input_error(trainer, ["'image'", "(3, 2, 7, 7)", "(2, 2, 7, 7)"], x[:2], y)
    assert_input_error(trainer, ["'labels'", "(3,)", "(3, 1)"], x, y[:, None])


def test_float_labels(trainer):
    x, y = batch_data(np.random.default_rng(0))
    assert_input_error(trainer, ["'labels'", "integers", "float64"], x, y.astype(np.float64))
    assert_input_error(trainer, ["'labels'", "integers", "bool"], x, np.array([True, False, True]))


@pytest.mark.parametrize("bad, shown", [(CLASSES, f"0 to {CLASSES}"), (-1, "-1 to")])
def test_labels_out_of_range(trainer, bad, shown):
    x, _ = batch_data(np.random.default_rng(0))
    y = np.array([0, bad, 1])
    assert_input_error(trainer, ["'labels'", "'loss'", f"[0, {CLASSES})", shown], x, y)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_images(trainer, value):
    x, y = batch_data(np.random.default_rng(0))
    x[1, 0, 3, 4] = value
    assert_input_error(trainer, ["'image'", "NaN or infinite"], x, y)


def test_non_numeric_images(trainer):
    _, y = batch_data(np.random.default_rng(0))
    x = np.full((BATCH, 2, 7, 7), "a")
    assert_input_error(trainer, ["'image'", "needs numbers"], x, y)


def test_dict_missing_and_extra(trainer):
    x, y = batch_data(np.random.default_rng(0))
    assert_input_error(trainer, ["'small'", "missing ['labels']", "unexpected []"], {"image": x})
    assert_input_error(trainer, ["missing []", "unexpected ['mask']"], {"image": x, "labels": y, "mask": y})
    assert_input_error(trainer, ["missing ['image']", "unexpected ['images']"], {"images": x, "labels": y})


def test_predict_input_errors(trainer):
    with pytest.raises(InputError, match=r"'image'.*\(2, 7, 7\).*\(2, 7, 6\)"):
        trainer.predict(np.zeros((5, 2, 7, 6)))
    with pytest.raises(InputError, match="'image'.*NaN"):
        trainer.predict(np.full((5, 2, 7, 7), np.nan))


# ---- gradients --------------------------------------------------------------------------------


def central_difference(trainer, data, flat, i, eps):
    """d loss / d flat[i] by a central difference (flat: a view of one of the trainer's parameters)."""
    old = flat[i]
    flat[i] = old + eps
    plus = trainer.loss(*data)
    flat[i] = old - eps
    minus = trainer.loss(*data)
    flat[i] = old
    return (plus - minus) / (2 * eps)


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    t = SingleDeviceTrainer(small_net(), dtype="float64", seed=3)
    # non-zero biases so no relu input sits exactly at its kink
    for p in t.params.values():
        p["bias"][...] = rng.standard_normal(p["bias"].shape) * 0.1
    x, y = batch_data(rng)
    grads = t.gradients(x, y)
    assert set(grads) == {"conv1", "conv2", "fc1", "fc2", "logits"}
    eps, points = 1e-5, 6
    for layer, layer_grads in grads.items():
        assert set(layer_grads) == {"weight", "bias"}
        for key, g in layer_grads.items():
            w = t.params[layer][key]
            assert g.shape == w.shape and g.dtype == np.float64
            flat = w.reshape(-1)
            idx = rng.choice(flat.size, size=min(points, flat.size), replace=False)
            for i in idx:
                numeric = central_difference(t, (x, y), flat, i, eps)
                analytic = g.reshape(-1)[i]
                np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-10,
                                           err_msg=f"{layer}.{key}[{i}]")
    # the gradients really are non-trivial (the check above would pass for all-zero nets)
    assert all(np.abs(g["weight"]).max() > 1e-4 for g in grads.values())


def test_bias_free_layers_have_weight_gradients_only():
    g = Graph("nobias")
    x = g.input("image", shape=(2, 2, 5, 5))
    y = g.conv2d(x, 3, kernel=3, padding=1, activation="relu", bias=False, name="conv")
    y = g.linear(g.flatten(y), 4, bias=False, name="fc")
    g.softmax_cross_entropy(y)
    t = SingleDeviceTrainer(g, dtype="float64", seed=2)
    assert {k: set(v) for k, v in t.params.items()} == {"conv": {"weight"}, "fc": {"weight"}}
    rng = np.random.default_rng(4)
    data = (rng.standard_normal((2, 2, 5, 5)), np.array([1, 3]))
    grads = t.gradients(*data)
    assert {k: set(v) for k, v in grads.items()} == {"conv": {"weight"}, "fc": {"weight"}}
    eps = 1e-6
    for layer in ("conv", "fc"):
        flat = t.params[layer]["weight"].reshape(-1)
        for i in rng.choice(flat.size, size=5, replace=False):
            np.testing.assert_allclose(grads[layer]["weight"].reshape(-1)[i], central_difference(t, data, flat, i, eps),
                                       rtol=1e-6, atol=1e-10)


def test_gradients_sum_over_losses():
    """Two losses: the gradient is that of the sum of their means (each loss scaled 1/N)."""
    g = Graph("two")
    x = g.input("image", shape=(2, 3))
    h = g.linear(x, 4, name="fc")
    g.softmax_cross_entropy(h, name="l1")
    g.softmax_cross_entropy(g.linear(h, 2, name="head"), name="l2")
    t = SingleDeviceTrainer(g, dtype="float64")
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((2, 3)), np.array([0, 3]), np.array([1, 0]))
    grads = t.gradients(*data)
    w = t.params["fc"]["bias"]
    eps = 1e-6
    for i in range(w.size):
        np.testing.assert_allclose(grads["fc"]["bias"][i], central_difference(t, data, w, i, eps), rtol=1e-6)


def test_parameter_free_prefix_gets_no_gradient():
    g = Graph("p")
    x = g.input("image", shape=(2, 1, 4, 4))
    logits = g.linear(g.flatten(g.pool2d(x, 2)), 3, name="fc")
    g.softmax_cross_entropy(logits)
    t = SingleDeviceTrainer(g, dtype="float64")
    grads = t.gradients(np.ones((2, 1, 4, 4)), np.array([0, 2]))
    assert set(grads) == {"fc"}


# ---- step -------------------------------------------------------------------------------------


def test_step_is_pytorch_sgd_with_momentum_and_weight_decay():
    lr, momentum, wd = 0.05, 0.9, 0.01
    rng = np.random.default_rng(2)
    t = SingleDeviceTrainer(small_net(), lr=lr, momentum=momentum, weight_decay=wd, dtype="float64", seed=1)
    w = t.parameters()
    v = {name: {k: np.zeros_like(a) for k, a in p.items()} for name, p in w.items()}
    for step in range(2):
        x, y = batch_data(rng)
        expected_loss = t.loss(x, y)
        grads = t.gradients(x, y)
        for name, p in w.items():
            for k in p:
                g = grads[name][k] + wd * p[k]
                v[name][k] = momentum * v[name][k] + g
                p[k] = p[k] - lr * v[name][k]
        assert t.step(x, y) == pytest.approx(expected_loss, rel=1e-12)
        assert t.steps_done == step + 1
        for name, p in w.items():
            for k in p:
                np.testing.assert_allclose(t.params[name][k], p[k], rtol=1e-12, atol=1e-15,
                                           err_msg=f"step {step}: {name}.{k}")
                np.testing.assert_allclose(t.velocity[name][k], v[name][k], rtol=1e-12, atol=1e-15)
    # momentum really mattered: the second update differs from plain SGD's
    assert any(np.abs(v[name]["weight"]).max() > 0 for name in v)


def test_step_plain_sgd_and_parameters_are_copies():
    lr = 0.1
    t = SingleDeviceTrainer(small_net(), lr=lr, dtype="float64")
    x, y = batch_data(np.random.default_rng(4))
    before = t.parameters()
    grads = t.gradients(x, y)
    t.step(x, y)
    for name, p in before.items():
        for k, a in p.items():
            np.testing.assert_allclose(t.params[name][k], a - lr * grads[name][k], rtol=1e-13, atol=1e-16)
    snapshot = t.parameters()
    snapshot["fc1"]["weight"][...] = 0
    assert t.params["fc1"]["weight"].any()


def test_training_reduces_loss():
    rng = np.random.default_rng(5)
    t = SingleDeviceTrainer(small_net(), lr=0.1, momentum=0.9)
    x, y = batch_data(rng)
    first = t.loss(x, y)
    for _ in range(30):
        t.step(x, y)
    assert t.loss(x, y) < 0.5 * first


# ---- predict ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10])
def test_predict_any_number_of_samples(n):
    rng = np.random.default_rng(6)
    t = SingleDeviceTrainer(small_net(), dtype="float64", seed=2)
    x = rng.standard_normal((n, 2, 7, 7))
    out = t.predict(x)
    assert out.shape == (n, CLASSES) and out.dtype == np.float64
    # the same network (same layer names and seed, so the same parameters) with batch n runs
    # every sample in one full batch, with no padding
    full = SingleDeviceTrainer(small_net(batch=n), dtype="float64", seed=2)
    for name, p in t.params.items():
        for k, a in p.items():
            np.testing.assert_array_equal(full.params[name][k], a)
    np.testing.assert_allclose(out, full.predict(x), rtol=1e-12, atol=1e-14)
    # and equals the logits of a full forward (loss included) on the graph's own batches
    for start in range(0, n - BATCH + 1, BATCH):
        chunk = x[start : start + BATCH]
        acts = t._forward(bind_inputs(t.graph, (chunk, np.zeros(BATCH, dtype=int)), t.dtype))
        np.testing.assert_allclose(out[start : start + BATCH], acts["logits"], rtol=1e-12, atol=1e-14)


def test_predict_padding_does_not_leak():
    """The last partial batch's rows do not depend on what else is in the batch."""
    rng = np.random.default_rng(7)
    t = SingleDeviceTrainer(small_net(), seed=0)
    x = rng.standard_normal((4, 2, 7, 7)).astype(np.float32)
    out = t.predict(x)
    np.testing.assert_allclose(out[3:], t.predict(x[3:]), rtol=1e-6)
    np.testing.assert_allclose(out[:3], t.predict(x[:3]), rtol=1e-6)
    assert out.dtype == np.float32


# ---- dtypes and seeds -------------------------------------------------------------------------


def test_default_dtype_is_float32():
    t = SingleDeviceTrainer(small_net())
    x, y = batch_data(np.random.default_rng(8))
    assert t.dtype == np.float32
    assert all(a.dtype == np.float32 for p in t.params.values() for a in p.values())
    assert all(a.dtype == np.float32 for p in t.velocity.values() for a in p.values())
    assert all(g.dtype == np.float32 for p in t.gradients(x, y).values() for g in p.values())
    t.step(x, y)
    assert all(a.dtype == np.float32 for p in t.params.values() for a in p.values())
    assert t.predict(x).dtype == np.float32


@pytest.mark.parametrize("dtype", ["float64", np.float64, np.dtype("float64")])
def test_float64_is_honoured(dtype):
    t = SingleDeviceTrainer(small_net(), dtype=dtype)
    x, y = batch_data(np.random.default_rng(9))
    assert t.dtype == np.float64
    assert all(a.dtype == np.float64 for p in t.params.values() for a in p.values())
    assert all(g.dtype == np.float64 for p in t.gradients(x, y).values() for g in p.values())
    t.step(x, y)
    assert all(a.dtype == np.float64 for p in t.params.values() for a in p.values())
    assert t.predict(x.astype(np.float32)).dtype == np.float64


def test_bad_dtype():
    with pytest.raises(ValueError, match="float16"):
        SingleDeviceTrainer(small_net(), dtype="float16")


def test_seeds():
    a = SingleDeviceTrainer(small_net(), seed=11).parameters()
    b = SingleDeviceTrainer(small_net(), seed=11).parameters()
    c = SingleDeviceTrainer(small_net(), seed=12).parameters()
    assert set(a) == set(b) == set(c) == {"conv1", "conv2", "fc1", "fc2", "logits"}
    for name in a:
        for k in ("weight", "bias"):
            np.testing.assert_array_equal(a[name][k], b[name][k])
        assert not np.array_equal(a[name]["weight"], c[name]["weight"])
        assert not a[name]["bias"].any()  # biases start at zero
    # float64 and float32 draw the same values
    d = SingleDeviceTrainer(small_net(), seed=11, dtype="float64").parameters()
    for name in a:
        np.testing.assert_array_equal(a[name]["weight"], d[name]["weight"].astype(np.float32))


def test_he_init_scale():
    g = Graph("wide")
    x = g.input("x", shape=(2, 400))
    g.linear(x, 300, name="fc")
    w = SingleDeviceTrainer(g, dtype="float64").params["fc"]["weight"]
    assert w.std() == pytest.approx(np.sqrt(2 / 400), rel=0.02)


def test_predict_rejects_no_samples():
    from taskrt import models

    g = models.lenet5(batch=2, image_size=16, width=0.25)
    trainer = SingleDeviceTrainer(g)
    with pytest.raises(InputError, match="at least one sample"):
        trainer.predict(np.zeros((0, 1, 16, 16)))
