"""Networks built from the new element-wise layers train the same under every split: random
strategies over 3 devices against the single-device trainer (loss every step, parameters after the
steps), with the bytes moved exactly the plan's, in float64 and float32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph
from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer
from tests.strategies import layer_configs

DEVICES = 3
STEPS = 2
EXAMPLES = 8
TOLERANCE = {"float64": 1e-9, "float32": 1e-5}


def activations_net(batch=4, size=6, classes=3):
    """conv -> silu -> conv -> gelu, then every other activation, on images and on features."""
    g = Graph("activations_net")
    x = g.input("image", (batch, 3, size, size))
    y = g.silu(g.conv2d(x, 4, 3, padding=1, name="conv1"), name="silu")
    y = g.gelu(g.conv2d(y, 4, 3, padding=1, name="conv2"), name="gelu")
    y = g.hardswish(y, name="hswish")
    y = g.relu6(g.pool2d(y, 2, stride=2, name="pool"), name="relu6")
    y = g.identity(g.hardtanh(y, -0.5, 2.0, name="htanh"), name="identity")
    y = g.tanh(g.linear(g.flatten(y, name="flatten"), 6, name="fc1"), name="tanh")
    y = g.hardsigmoid(g.gelu(y, approximate="tanh", name="gelu.tanh"), name="hsigmoid")
    y = g.linear(y, classes, name="fc2")
    g.softmax_cross_entropy(y, name="loss")
    return g


def se_net(batch=4, size=6, classes=3):
    """A squeeze-and-excitation block: global average pooling, 1x1 conv, relu, 1x1 conv, sigmoid,
    and the block scaled by the gate; then a broadcasting sub with the broadcast input first."""
    g = Graph("se_net")
    x = g.input("image", (batch, 3, size, size))
    block = g.relu6(g.conv2d(x, 6, 3, padding=1, name="conv"), name="block")
    squeeze = g.pool2d(block, kernel=(size, size), mode="avg", name="squeeze")
    z = g.relu(g.conv2d(squeeze, 2, 1, name="reduce"), name="reduce.relu")
    gate = g.sigmoid(g.conv2d(z, 6, 1, name="expand"), name="gate")
    y = g.mul(block, gate, name="scale")
    y = g.sub(squeeze, y, name="centre")
    y = g.pool2d(y, 2, stride=2, name="pool")
    y = g.linear(g.flatten(y, name="flatten"), classes, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


GRAPHS = {"activations_net": activations_net, "se_net": se_net}


@st.composite
def strategies_over(draw, graph, num_devices):
    """A random config for every layer (input layers sometimes left to their default) on `num_devices`."""
    return Strategy({layer.name: draw(layer_configs(layer, num_devices)) for layer in graph
                     if not (layer.is_input and draw(st.booleans()))})


def relative_error(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def batch_for(graph, seed, dtype):
    rng = np.random.default_rng(seed)
    image = graph["image"].shape
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(image).astype(dtype), rng.integers(0, classes, graph["labels"].shape)


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


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_train_as_one_device(machine4, name, dtype, data):
    graph = GRAPHS[name]()
    check_training(machine4, graph, data.draw(strategies_over(graph, DEVICES), label="strategy"), dtype)


# The broadcast layers split over h and w, apart from their gate (split over samples and channels on
# other devices): each part's sum over its h and w is a piece of the gate's gradient the runtime adds.
SPATIAL_SE = Strategy({
    "conv": ParallelConfig(h=3, devices=(0, 1, 2)), "block": ParallelConfig(w=3, devices=(2, 0, 1)),
    "squeeze": ParallelConfig(c=3, devices=(1, 2, 0)), "reduce": ParallelConfig(n=2, devices=(0, 1)),
    "reduce.relu": ParallelConfig(c=2, devices=(2, 1)), "expand": ParallelConfig(c=3, devices=(0, 1, 2)),
    "gate": ParallelConfig(n=3, devices=(2, 1, 0)), "scale": ParallelConfig(h=3, devices=(1, 0, 2)),
    "centre": ParallelConfig(w=3, devices=(0, 2, 1)), "pool": ParallelConfig(n=2, h=1, devices=(1, 2)),
    "flatten": ParallelConfig(devices=(0,)), "fc": ParallelConfig(c=3, devices=(2, 0, 1)),
    "loss": ParallelConfig(n=2, devices=(1, 0)),
})


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_gate_split_apart_from_the_spatially_split_block_it_scales(machine4, dtype):
    check_training(machine4, se_net(), SPATIAL_SE, dtype)
