"""Memory per device from a plan: parameters, gradients, optimizer state, activations kept for
backward and the largest backward working set, each checked by hand; the search's per-part
filter is the same accounting."""

from __future__ import annotations

import pytest

import search
from search.space import part_memory
from taskrt import Graph, models
from taskrt.config import ParallelConfig as P
from taskrt.lowering import lower
from taskrt.machine import Machine
from taskrt.memory import DeviceMemory, part_footprint, plan_memory, summary
from taskrt.strategy import Strategy

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
    assert server.parameters == replica.parameters == SHARD
    assert server.optimizer == SHARD and replica.optimizer == 0
    assert server.gradients == replicas * SHARD and replica.gradients == SHARD


@pytest.mark.parametrize("replicas", [2, 4])
def test_allreduce_spreads_the_optimizer_state_and_the_gradient_sums(replicas):
    g = mlp()
    memory = plan_memory(lower(g, Strategy({n: P(n=replicas, sync="allreduce") for n in ("fc1", "fc2", "loss")})))
    chunks = {d: sum((size // replicas + (d < size % replicas)) * F32 for size in (120, 60)) for d in range(replicas)}
    for d, m in memory.items():
        assert m.optimizer == chunks[d]
        assert m.parameters == SHARD + chunks[d]  # the gathered copy beside its master chunk
        assert m.gradients == SHARD + (replicas - 1) * chunks[d]
    assert sum(m.optimizer for m in memory.values()) == SHARD  # one velocity in all


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
        memory = plan_memory(lower(g, search.splitbrain(g, m, mp, sync="ps")))
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
