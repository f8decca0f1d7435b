"""Memory per device from a plan: parameters, gradients, optimizer state, activations kept for
backward and the largest backward working set, each checked by hand; the search's per-part
filter is the same accounting, and so is its count without the plan (search.memory)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taskrt.search.memory
from taskrt import Graph, models, search
from taskrt.graph.config import SYNC_METHODS
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.planning.memory import DeviceMemory, part_footprint, plan_memory, summary
from taskrt.search.memory import step_memory
from taskrt.search.space import part_memory
from tests.graphs import inception_block, small_lenet
from tests.strategies import random_strategies

F32 = 4


def mlp(batch=8):
    g = Graph("mlp")
    x = g.input("x", shape=(batch, 12))
    y = g.linear(x, 10, activation="relu", bias=False, name="fc1")
    g.softmax_cross_entropy(g.linear(y, 6, bias=False, name="fc2"), name="loss")
    return g


SHARD = (10 * 12 + 6 * 10) * F32  # both layers' weights


@pytest.mark.parametrize("replicas", [2, 4])
def test_parameter_server_holds_the_state_and_receives_whole_gradients(replicas):
    g = mlp()
    memory = plan_memory(lower(g, Strategy({n: P(n=replicas) for n in ("fc1", "fc2", "loss")})))
    server, replica = memory[0], memory[1]
    assert server.parameters == 2 * SHARD and replica.parameters == SHARD  # the server's updated weights too
    assert server.optimizer == 2 * SHARD and replica.optimizer == 0  # the velocity, and its update
    assert server.gradients == replicas * SHARD and replica.gradients == SHARD


@pytest.mark.parametrize("replicas", [2, 4])
def test_allreduce_spreads_the_optimizer_state_and_the_gradient_sums(replicas):
    g = mlp()
    memory = plan_memory(lower(g, Strategy({n: P(n=replicas, sync="allreduce") for n in ("fc1", "fc2", "loss")})))
    chunks = {d: sum((size // replicas + (d < size % replicas)) * F32 for size in (120, 60)) for d in range(replicas)}
    for d, m in memory.items():
        assert m.optimizer == 2 * chunks[d]  # its chunk's velocity and the updated one
        assert m.parameters == SHARD + 2 * chunks[d]  # the gathered copy beside its master chunk and its update
        assert m.gradients == SHARD + (replicas - 1) * chunks[d]
    assert sum(m.optimizer for m in memory.values()) == 2 * SHARD  # one velocity in all, and its update


def test_activations_are_what_forward_keeps_and_transient_is_one_backward_task():
    g = mlp(batch=8)
    s = Strategy({"fc1": P(n=2), "fc2": P(c=2, devices=(1, 0)), "loss": P(devices=(0,))})
    memory = plan_memory(lower(g, s))
    # device 0: x rows 0-4 (data), fc1 rows 0-4 (its output), fc2 channels 0-3 on device 1: so
    # fc2's part on device 0 (channels 3-6) needs fc1 rows 4-8 from device 1, and the loss reads
    # fc2 channels 0-3 from device 1; labels on device 0
    x, h = 4 * 12 * F32, 4 * 10 * F32
    expected0 = x + h + 4 * 10 * F32 + 8 * 3 * F32 + 8 * 3 * F32 + 8 * 8
    assert memory[0].activations == expected0
    # the largest backward working set on device 0: fc2's part reads all of fc1 (8 x 10) and
    # writes 8 x 3; fc1's reads 4 x 12 and writes 4 x 10; the loss reads 8 x 6 logits + labels
    assert memory[0].transient == max(8 * 10 + 8 * 3, 4 * 12 + 4 * 10, 8 * 6 + 8 + 8) * F32


def test_predict_has_no_gradients():
    g = mlp()
    memory = plan_memory(lower(g, Strategy({n: P(n=2) for n in ("fc1", "fc2", "loss")}), mode="predict"))
    assert all(m.gradients == 0 and m.transient == 0 for m in memory.values())
    assert memory[0].parameters == SHARD


def test_splitbrain_parameter_memory_per_device_follows_table_1():
    """Parameters per device under group model parallelism: the convolutions replicated, the
    fully-connected layers divided by mp (fc2 too while it has at least mp outputs)."""
    g = models.splitbrain_vgg(batch=16)
    m = Machine.simulated(1, 16)
    conv, fc01, fc2 = 1_734_336, 4_194_304 + 1_048_576, 10_240
    for mp in (1, 2, 4, 8, 16):
        # the weights a device computes with (no update: its new weights would double the server's)
        memory = plan_memory(lower(g, search.splitbrain(g, m, mp, sync="ps"), mode="gradients"))
        fc2_block = -(-10 // mp) * 1024 if mp <= 10 else fc2  # the first channel block is the largest
        assert memory[0].parameters == (conv + fc01 // mp + fc2_block) * F32, mp
        assert max(x.parameters for x in memory.values()) == memory[0].parameters


def test_the_search_filter_is_the_same_accounting():
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    for layer in g:
        if layer.is_input:
            continue
        cfg = P(n=2, devices=(0, 1))
        part = cfg.parts(layer.shape)[0]
        assert part_memory(layer, cfg, 4) == part_footprint(layer.op, part.rect, 4).total


def test_summary_and_dict():
    m = DeviceMemory(1, 2, 3, 4, 5)
    assert m.total == 15 and m.to_dict()["total"] == 15
    text = summary({0: DeviceMemory(2**20, 0, 0, 0, 0)})
    assert "parameters" in text and "1.00" in text


# ---- the search counts the same memory without lowering the plan (search.memory) -----------------

MEMORY_GRAPHS = {
    "mlp": mlp,
    "lenet5": small_lenet,
    "inception_block": inception_block,
    "resnet50": lambda: models.resnet50(batch=4, image_size=32, width=1 / 16, num_classes=5),
    "inception_v3": lambda: models.inception_v3(batch=2, image_size=75, width=1 / 16, num_classes=5),
}


LARGE = ("resnet50", "inception_v3")  # fewer examples: lowering their plans takes a while
SMALL = [name for name in MEMORY_GRAPHS if name not in LARGE]


def check_any_strategy(graph, data):
    """Any degrees, devices in any order, either sync method (where a part no consumer reads
    makes the plan drop tasks, step_memory lowers the plan itself)."""
    g = MEMORY_GRAPHS[graph]()
    _, strategy = data.draw(random_strategies(g, max_devices=4))
    strategy = strategy.validated(g)
    assert step_memory(g, strategy) == plan_memory(lower(g, strategy))


def check_search_space_strategy(graph, data):
    """Strategies from the search space (with either sync method) are counted without lowering."""
    g = MEMORY_GRAPHS[graph]()
    cm = search.CostModel(Machine.simulated(2, 2), cache=False)
    space = {layer.name: cm.layer_space(layer).configs for layer in g}
    strategy = Strategy({name: dataclasses.replace(data.draw(st.sampled_from(configs), label=name),
                                                   sync=data.draw(st.sampled_from(SYNC_METHODS)))
                         for name, configs in space.items()}).validated(g)
    expected = plan_memory(lower(g, strategy))
    with mock.patch("taskrt.search.memory._lowered", side_effect=AssertionError("lowered the plan")):
        assert step_memory(g, strategy) == expected
        assert step_memory(g, strategy, regions=cm.regions) == expected


@pytest.mark.parametrize("graph", SMALL)
@settings(deadline=None, derandomize=True, max_examples=25)
@given(data=st.data())
def test_step_memory_is_the_plans_memory(graph, data):
    check_any_strategy(graph, data)


@pytest.mark.parametrize("graph", SMALL)
@settings(deadline=None, derandomize=True, max_examples=15)
@given(data=st.data())
def test_step_memory_of_search_space_strategies_counts_without_lowering(graph, data):
    check_search_space_strategy(graph, data)


@pytest.mark.parametrize("graph", LARGE)
@settings(deadline=None, derandomize=True, max_examples=3,
          suppress_health_check=[HealthCheck.large_base_example, HealthCheck.data_too_large, HealthCheck.too_slow])
@given(data=st.data())
def test_step_memory_on_large_graphs(graph, data):
    check_any_strategy(graph, data)
    check_search_space_strategy(graph, data)


def test_optimize_reports_the_plans_memory():
    g = models.inception_v3(batch=8, image_size=75, width=1 / 8, num_classes=10)
    machine = Machine.simulated(2, 2)
    strategy = search.optimize(g, machine, search.CostModel(machine, cache=False))
    expected = plan_memory(lower(g, strategy.validated(g)))
    assert strategy.meta["memory_per_device"] == {str(d): m.to_dict() for d, m in expected.items()}


def test_step_memory_lowers_the_plan_where_it_drops_tasks_or_splits_unevenly():
    g = Graph("strided")
    x = g.input("x", (4, 2, 8, 8))
    y = g.conv2d(x, 4, kernel=3, padding=1, name="conv")
    z = g.conv2d(y, 4, kernel=1, stride=2, name="strided")  # reads even rows only
    g.softmax_cross_entropy(g.linear(g.flatten(z, name="flat"), 3, name="fc"), name="loss")
    rest = {n: P() for n in ("strided", "flat", "fc", "loss")}
    unread = Strategy({"conv": P(h=8, devices=tuple(range(8))), **rest}).validated(g)  # row 1 alone on device 1
    uneven = Strategy({"conv": P(c=2, c_sizes=(3, 1)), **rest})
    for strategy in (unread, uneven.validated(g)):
        with mock.patch("taskrt.search.memory._lowered", wraps=taskrt.search.memory._lowered) as lowered:
            assert step_memory(g, strategy) == plan_memory(lower(g, strategy))
        assert lowered.called
