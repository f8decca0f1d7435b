"""Every parallel configuration computes exactly what the single-device network computes.

Random strategies (every dimension each layer allows, uneven blocks, shuffled devices, 1 to 4
devices) on small networks: forward output, loss, every gradient and the parameters after 3 SGD
steps (and batch norms' running statistics) match the single-device trainer, and the bytes the
plan says move between each pair of devices are exactly the bytes the workers' transfer logs report.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph, models
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import random_strategies

TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


def inception_block(batch=2, size=9, classes=5):
    """Fan-out, asymmetric kernels, pooling branch and channel concat, as in Inception-v3."""
    g = Graph("inception_block")
    x = g.input("image", (batch, 3, size, size))
    stem = g.conv2d(x, 6, 3, padding=1, activation="relu", name="stem")
    b1 = g.conv2d(stem, 3, 1, activation="relu", name="b1x1")
    b2 = g.conv2d(stem, 2, 1, activation="relu", name="b7_reduce")
    b2 = g.conv2d(b2, 3, (1, 7), padding=(0, 3), activation="relu", name="b1x7")
    b2 = g.conv2d(b2, 3, (7, 1), padding=(3, 0), activation="relu", name="b7x1")
    b3 = g.pool2d(stem, 3, stride=1, padding=1, mode="avg", name="bpool")
    b3 = g.conv2d(b3, 2, 1, bias=False, name="bpool_proj")
    y = g.concat([b1, b2, b3], name="concat")
    y = g.add(y, g.conv2d(stem, 8, 1, name="shortcut"), name="residual")
    y = g.relu(y, name="relu")
    y = g.pool2d(y, 3, stride=2, name="pool")
    y = g.linear(g.flatten(y, name="flatten"), classes, bias=False, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def batch_norm_net(batch=4, size=6, classes=3):
    """Batch norms on images and on features: their statistics reduce over every split of n, h and w."""
    g = Graph("batch_norm_net")
    x = g.input("image", (batch, 3, size, size))
    y = g.conv2d(x, 4, 3, padding=1, bias=False, name="conv")
    y = g.relu(g.batch_norm(y, name="conv.bn"), name="conv.relu")
    y = g.pool2d(y, 2, stride=2, name="pool")
    y = g.linear(g.flatten(y, name="flatten"), 6, bias=False, name="fc1")
    y = g.relu(g.batch_norm(y, momentum=0.3, name="fc1.bn"), name="fc1.relu")
    y = g.linear(y, classes, name="fc2")
    g.softmax_cross_entropy(y, name="loss")
    return g


GRAPHS = {
    "lenet5": lambda: models.lenet5(batch=4, image_size=16, width=0.5),
    "alexnet": lambda: models.alexnet(batch=2, image_size=16, num_classes=5, width=1 / 32),
    "vgg16": lambda: models.vgg16(batch=2, image_size=32, num_classes=5, width=1 / 32),
    "inception_block": inception_block,
    "batch_norm_net": batch_norm_net,
}


def relative_error(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def assert_close(actual, expected, tol, what):
    err = relative_error(np.asarray(actual), np.asarray(expected))
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def batch_for(graph, seed):
    rng = np.random.default_rng(seed)
    (image,) = [l for l in graph.inputs if l.op.dtype != "int64"]
    (labels,) = [l for l in graph.inputs if l.op.dtype == "int64"]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(image.shape), rng.integers(0, classes, labels.shape)


def check_equivalence(graph, strategy, machine, dtype):
    tol = TOLERANCE[dtype]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "dtype": dtype, "seed": 3}
    reference = SingleDeviceTrainer(graph, **hyper)
    trainer = Trainer(graph, strategy, machine, **hyper)
    plan = trainer.plan
    plan.check_single_reader()
    x, y = batch_for(graph, seed=1)
    assert_close(trainer.predict(x), reference.predict(x), tol, "forward output")
    expected = reference.gradients(x, y)
    actual = trainer.gradients(x, y)
    assert set(actual) == set(expected)
    for layer in expected:
        for name in expected[layer]:
            assert_close(actual[layer][name], expected[layer][name], tol, f"gradient {layer}.{name}")
    for step in range(3):
        xs, ys = batch_for(graph, seed=10 + step)
        loss_ref, loss = reference.step(xs, ys), trainer.step(xs, ys)
        assert abs(loss - loss_ref) <= tol * max(1.0, abs(loss_ref)), f"loss at step {step}: {loss} vs {loss_ref}"
        stats = trainer.stats
        assert stats.measured_bytes == stats.planned_bytes, f"step {step}: bytes moved differ from the plan"
    expected, actual = reference.parameters(), trainer.parameters()
    for layer in expected:
        for name in expected[layer]:
            assert_close(actual[layer][name], expected[layer][name], tol, f"parameter {layer}.{name} after 3 steps")
    expected, actual = reference.buffers(), trainer.buffers()
    assert set(actual) == set(expected)
    for layer in expected:
        for name in expected[layer]:
            assert_close(actual[layer][name], expected[layer][name], tol, f"{layer}.{name} after 3 steps")
    if expected:  # inference with the running statistics
        assert_close(trainer.predict(x), reference.predict(x), tol, "forward output after 3 steps")


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_match_single_device(machine4, name, dtype, data):
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=machine4.num_devices))
    check_equivalence(graph, strategy, machine4, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_many_random_strategies_match_single_device(machine4, name, data):
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=machine4.num_devices))
    check_equivalence(graph, strategy, machine4, "float64")


def test_a_part_nothing_reads_gets_a_zero_gradient(machine4):
    """A w-split into 3 of a 5-wide tensor that a 2x2 stride-2 pool reads only 4 columns of: the
    last part's output gradient has no contribution at all, and is zero."""
    g = Graph("unread")
    x = g.input("image", (2, 2, 5, 5))
    y = g.pool2d(g.relu(g.conv2d(x, 3, 1, name="conv"), name="relu"), 2, name="pool")
    g.softmax_cross_entropy(g.linear(g.flatten(y, name="flat"), 4, name="fc"), name="loss")
    from taskrt.graph.config import ParallelConfig as P
    from taskrt.graph.strategy import Strategy

    strategy = Strategy({l.name: P(w=3) if l.name == "relu" else P() for l in g if not l.is_input})
    check_equivalence(g, strategy, machine4, "float64")
