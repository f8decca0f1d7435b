"""The runtime's plan against the analytic model of seed 001, layer by layer: every word the plan
moves is the model's volume term or differs from it by a stated reason, exactly."""

from __future__ import annotations

import pytest

from taskrt import Graph, models
from taskrt.search.compare import BACKWARD, FORWARD, SYNC, plan_vs_model


def mlp(batch=64, widths=(256, 128, 128, 16)):
    g = Graph("mlp")
    x = g.input("x", shape=(batch, widths[0]))
    for i, width in enumerate(widths[1:], start=1):
        last = i == len(widths) - 1
        x = g.linear(x, width, activation=None if last else "relu", bias=False, name=f"fc{i}")
    g.softmax_cross_entropy(x, name="loss")
    return g


@pytest.mark.parametrize("pr, pc", [(1, 4), (2, 2), (4, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_mlp_plan_equals_the_model_up_to_the_stated_reasons(pr, pc, sync):
    rows = plan_vs_model(mlp(), pr, pc, sync=sync)
    assert all(r.explained for r in rows), [r for r in rows if not r.explained]
    by = {(r.layer, r.what): r for r in rows}
    # bias-free hidden layers: the all-gather of activations and the weight all-reduce are the model's exactly
    assert by[("fc2", FORWARD)].runtime_words == by[("fc2", FORWARD)].model_words
    assert by[("fc2", SYNC)].runtime_words == by[("fc2", SYNC)].model_words
    # the input gradient: half the model's all-reduce (reduce-scatter)
    assert by[("fc3", BACKWARD)].runtime_words * 2 == by[("fc3", BACKWARD)].model_words
    if pc > 1:
        busiest = by[("fc1", SYNC)]
        if sync == "allreduce":  # every device receives what the ring all-reduce's process receives
            assert busiest.busiest_runtime == busiest.busiest_model
        else:  # the server receives Pc / 2 times as much
            assert busiest.busiest_runtime == pytest.approx(busiest.busiest_model * pc / 2)


@pytest.mark.parametrize("conv", ["grid", "batch"])
def test_alexnet_plan_against_the_model(conv):
    rows = plan_vs_model(models.alexnet(batch=16, image_size=224), 2, 4, conv=conv)
    assert all(r.explained for r in rows), [r for r in rows if not r.explained]
    by = {(r.layer, r.what): r for r in rows}
    if conv == "grid":  # pooling between conv1 and conv2: the runtime moves the pooled maps
        assert by[("conv2", FORWARD)].runtime_words < by[("conv2", FORWARD)].model_words
    else:  # conv layers batch parallel: only the layout change before fc1 moves activations
        assert by[("conv3", FORWARD)].model_words == by[("conv3", FORWARD)].runtime_words == 0
        assert by[("fc1", FORWARD)].runtime_words == by[("fc1", FORWARD)].model_words > 0
    assert by[("fc1", SYNC)].runtime_words > by[("fc1", SYNC)].model_words  # biases
