"""Dropout and stochastic depth in training: every split draws the masks one device draws (the
step's seed and number reach every forward and backward task), masks change from step to step,
and prediction is the identity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taskrt as tr
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import random_strategies

TOLERANCE = {"float64": 1e-9, "float32": 1e-5}


def net(batch=4) -> tr.Graph:
    g = tr.Graph("dropout_net")
    x = g.input("image", (batch, 3, 8, 8))
    y = g.conv2d(x, 6, 3, padding=1, activation="relu", name="conv1")
    y = g.dropout(y, 0.5, name="drop1")
    branch = g.conv2d(y, 6, 3, padding=1, name="conv2")
    y = g.add(y, g.drop_path(branch, 0.3, name="path"), name="residual")
    y = g.pool2d(y, 2, name="pool")
    y = g.linear(g.flatten(y, name="flat"), 16, activation="relu", name="fc1")
    y = g.dropout(y, 0.5, name="drop2")
    g.softmax_cross_entropy(g.linear(y, 5, name="fc2"), name="loss")
    return g


def batches(graph, count, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape).astype(dtype), rng.integers(0, 5, shape[0])) for _ in range(count)]


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_over_three_devices_draw_the_masks_one_device_draws(machine4, dtype, data):
    graph = net()
    _, strategy = data.draw(random_strategies(graph, max_devices=3))
    tol = TOLERANCE[dtype]
    options = {"lr": 0.05, "momentum": 0.9, "dtype": dtype, "seed": 5}
    reference = SingleDeviceTrainer(graph, **options)
    trainer = Trainer(graph, strategy, machine4, snapshot_every=None, **options)
    x, y = batches(graph, 1, seed=1)[0]
    expected = reference.gradients(x, y)
    actual = trainer.gradients(x, y)
    for layer in expected:
        for name in expected[layer]:
            assert relative(actual[layer][name], expected[layer][name]) < tol, f"gradient {layer}.{name}"
    for x, y in batches(graph, 3, seed=2):
        assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=tol)
    for layer, values in reference.parameters().items():
        for name, value in values.items():
            assert relative(trainer.parameters()[layer][name], value) < tol, f"{layer}.{name}"
    assert relative(trainer.predict(x), reference.predict(x)) < tol
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


def test_masks_drop_in_training_change_every_step_and_prediction_keeps_everything():
    graph = net(batch=8)
    trainer = SingleDeviceTrainer(graph, dtype="float64", seed=3)
    x, y = batches(graph, 1)[0]
    first = trainer._forward(dict(zip(("image", "labels"), (x, y))), mode="train")
    trainer.steps_done += 1
    second = trainer._forward(dict(zip(("image", "labels"), (x, y))), mode="train")
    relu = first["conv1"]
    dropped = (first["drop1"] == 0) & (relu != 0)
    assert 0.4 < dropped.sum() / (relu != 0).sum() < 0.6  # p = 0.5 of what the relu let through
    assert not np.array_equal(first["drop1"], second["drop1"])  # another step, other masks
    kept = first["drop1"][first["drop1"] != 0]
    np.testing.assert_allclose(kept, 2 * relu[first["drop1"] != 0])  # scaled by 1 / (1 - p)
    whole = first["path"].reshape(8, -1)
    assert all(np.all(row == 0) or np.all(row != 0) or np.allclose(row, first["conv2"].reshape(8, -1)[i] / 0.7)
               for i, row in enumerate(whole))  # stochastic depth keeps or drops whole samples
    predicted = trainer._forward({"image": x}, stop_at="fc2", mode="predict")
    np.testing.assert_array_equal(predicted["drop1"], predicted["conv1"])
