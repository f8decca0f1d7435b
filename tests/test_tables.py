"""The fast paths of the cost tables against the slow ones they replace: region rules in array
form against each op's own `input_rects`, the search space built from arrays against
`layer_configs`, and the parameter volume per channel against `param_rects`."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from unittest import mock

import numpy as np
import pytest

from taskrt import models
from taskrt.graph.config import ParallelConfig
from taskrt.machines.machine import Machine
from taskrt.ops.rect import Rect
from taskrt.search import CostModel, regions, transfer
from taskrt.search.helper_thread import Kernels
from taskrt.search.layer_space import channel_params
from taskrt.search.regions import Needs, input_ranges, part_table
from taskrt.search.space import layer_configs, part_memory
from tests.graphs import inception_block

GRAPHS = {
    "lenet5": lambda: models.lenet5(batch=8),
    "alexnet": lambda: models.alexnet(batch=4, image_size=67, width=1 / 8, num_classes=10),
    "inception_v3": lambda: models.inception_v3(batch=4, image_size=75, width=1 / 8, num_classes=10),
    "resnet50": lambda: models.resnet50(batch=4, image_size=32, width=1 / 8, num_classes=10),
    "inception_block": inception_block,
}


def random_rects(shape, count, rng):
    """`count` random non-empty output Rects of a tensor of `shape`, as (lo, hi) rows."""
    size = np.array(shape)
    a, b = rng.integers(0, size, size=(count, len(shape))), rng.integers(0, size, size=(count, len(shape)))
    return np.minimum(a, b), np.maximum(a, b) + 1


@pytest.mark.parametrize("graph", list(GRAPHS))
def test_array_rules_equal_the_ops_own_rules(graph):
    rng = np.random.default_rng(0)
    for layer in GRAPHS[graph]():
        lo, hi = random_rects(layer.shape, 200, rng)
        for j in range(len(layer.inputs)):
            reads, in_lo, in_hi = input_ranges(layer.op, j, lo, hi)
            for k in range(len(lo)):
                expected = layer.op.input_rects(Rect(tuple(lo[k].tolist()), tuple(hi[k].tolist())))[j]
                assert reads[k] == (expected is not None), (layer.name, j, lo[k], hi[k])
                if expected is not None:
                    assert (tuple(in_lo[k]), tuple(in_hi[k])) == (expected.lo, expected.hi), (layer.name, j)
    # every op of the zoo has its rule in array form
    assert {type(layer.op).input_rects for layer in GRAPHS[graph]()} <= set(regions.RULES)


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("devices", [4, 6])
def test_needs_from_array_rules_equal_asking_the_op_block_by_block(graph, devices):
    for layer in GRAPHS[graph]():
        configs = layer_configs(layer, devices, powers_of_two=devices == 4)
        parts = part_table(layer.shape, configs)
        for j in range(len(layer.inputs)):
            fast = Needs(layer.op, j, parts)
            with mock.patch.dict(regions.RULES, clear=True):  # every op asked through input_rects
                slow = Needs(layer.op, j, parts)
            np.testing.assert_array_equal(fast.table.lo, slow.table.lo)
            np.testing.assert_array_equal(fast.table.hi, slow.table.hi)
            assert (fast.driver, fast.constant) == (slow.driver, slow.constant)
            # and each part's need is what the op's rule says for the part
            for k, (a, b) in enumerate(zip(parts.lo.tolist(), parts.hi.tolist())):
                need = layer.op.input_rects(Rect(tuple(a), tuple(b)))[j]
                got = (tuple(fast.table.lo[k]), tuple(fast.table.hi[k]))
                assert got == ((need.lo, need.hi) if need is not None else ((0,) * len(got[0]),) * 2)


def test_a_rule_that_is_not_separable_is_refused():
    layer = models.lenet5(batch=8)["conv1"]

    def diagonal(op, out):  # input rows follow output columns and rows: not separable
        return [Rect((out.lo[0], 0, out.lo[2], out.lo[2]), (out.hi[0], 1, out.hi[3], out.hi[3]))]

    parts = part_table(layer.shape, layer_configs(layer, 4))
    with mock.patch.dict(regions.RULES, clear=True), mock.patch.object(type(layer.op), "input_rects", diagonal):
        with pytest.raises(regions.NotSeparable, match="depends on output dimensions"):
            Needs(layer.op, 0, parts)


@pytest.mark.parametrize("graph", list(GRAPHS))
def test_parameters_grow_with_the_channel_range_alone(graph):
    """What `channel_params` (t_s, the memory filter, the roofline) rests on."""
    rng = np.random.default_rng(1)
    for layer in GRAPHS[graph]():
        lo, hi = random_rects(layer.shape, 50, rng)
        for a, b in zip(lo.tolist(), hi.tolist()):
            volume = sum(r.volume for r in layer.op.param_rects(Rect(tuple(a), tuple(b))).values())
            channels = b[1] - a[1] if len(a) > 1 else 1
            assert volume == channel_params(layer.op) * channels, layer.name


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("nodes, per_node, powers_of_two, placement", [
    (1, 4, True, "first"), (2, 4, True, "aligned"), (1, 6, False, "first"), (2, 3, False, "aligned")])
def test_space_from_arrays_is_layer_configs(graph, nodes, per_node, powers_of_two, placement):
    g = GRAPHS[graph]()
    machine = Machine.simulated(nodes, per_node)
    cm = CostModel(machine, cache=False, powers_of_two=powers_of_two, placement=placement)
    space = cm.space(g)
    tables = cm.tables(g)
    for layer in g:
        assert list(cm.layer_space(layer).configs) == space[layer.name], layer.name
        assert [ParallelConfig(c.n, c.c, c.h, c.w, c.devices) for c in tables.configs[layer.name]] == space[layer.name]


def test_space_from_arrays_drops_what_does_not_fit():
    g = models.vgg16(batch=64, image_size=64, width=1 / 4, num_classes=10)
    machine = Machine.simulated(1, 4)
    full = {layer.name: len(layer_configs(layer, 4)) for layer in g}
    # memory such that some configs of the largest layers fit and some do not
    needs = {layer.name: [part_memory(layer, c, 4) for c in layer_configs(layer, 4)] for layer in g}
    floor = max(min(v) for v in needs.values())  # every layer fits somewhere
    limits = sorted({b for v in needs.values() for b in v if b >= floor})
    for memory in limits[: len(limits) - 1 : max(1, len(limits) // 6)]:
        machine.devices = [dataclasses.replace(d, memory=memory) for d in machine.devices]
        cm = CostModel(machine, cache=False)
        space = cm.space(g)
        assert any(len(space[name]) < full[name] for name in full)
        for layer in g:
            assert list(cm.layer_space(layer).configs) == space[layer.name], (memory, layer.name)
    machine.devices = [dataclasses.replace(d, memory=floor - 1) for d in machine.devices]
    with pytest.raises(ValueError, match="no config fits"):
        CostModel(machine, cache=False).tables(g)


@pytest.mark.parametrize("graph", ["inception_block", "resnet50", "lenet5"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_cost_model_edges_equal_the_general_transfer_tables(graph, nodes):
    """Whatever shortcut the cost model takes for an edge (the separable kernels, one table
    shared by equal edges, backward as forward transposed where each part reads its own Rect),
    the table is what search.transfer.general computes from the part tables."""
    g = GRAPHS[graph]()
    cm = CostModel(Machine.simulated(nodes, 4), cache=False)
    tables, needed = cm.tables(g), g.needs_backward()
    shortcuts = 0
    for src, dst, j, matrix in tables.edges:
        u, v = cm.layer_space(g[src]), cm.layer_space(g[dst])
        itemsize = 8 if g[src].is_input and g[src].op.dtype == "int64" else 4
        expected = transfer.general(u.parts, v.needs[j].table, cm.links, itemsize, src in needed)
        np.testing.assert_allclose(matrix, expected, rtol=1e-12, atol=1e-18, err_msg=f"{src} -> {dst}")
        shortcuts += u.grid is v.grid and v.needs[j].reads_own_part and src in needed
    assert shortcuts > 0 or graph != "resnet50"  # its batch norms and relus take the transposed shortcut


def test_an_output_dimension_driving_two_input_dimensions_takes_the_general_path():
    g = models.lenet5(batch=8)
    layer = g["conv1"]  # input (8, 1, 32, 32), output (8, 6, 28, 28)

    def both(op, out):  # input rows and columns both follow the output's rows
        return [Rect((out.lo[0], 0, out.lo[2], out.lo[2]), (out.hi[0], 1, out.hi[2] + 4, out.hi[2] + 4))]

    cm = CostModel(Machine.simulated(2, 2), cache=False)
    with mock.patch.dict(regions.RULES, clear=True), mock.patch.object(type(layer.op), "input_rects", both):
        space, image = cm.layer_space(layer), cm.layer_space(g["image"])
        assert space.needs[0].driver == {0: 0, 2: 2, 3: 2}
        assert transfer.separable(image.grid, space.grid, space.needs[0].table, space.needs[0], cm.links, 4,
                                  False) is None
        edge = next(m for src, dst, _, m in cm.tables(g).edges if dst == "conv1")
        np.testing.assert_allclose(edge, transfer.general(image.parts, space.needs[0].table, cm.links, 4, False),
                                   rtol=1e-12)


def test_kernels_run_on_the_helper_and_restore_the_switch_interval():
    before = sys.getswitchinterval()
    ran_on = []

    def job(value):
        def run():
            ran_on.append(threading.current_thread().name)
            return np.full(2, float(value))
        return run

    with Kernels() as kernels:
        assert sys.getswitchinterval() <= Kernels.SWITCH_INTERVAL_S or (os.cpu_count() or 1) < 2
        for key in range(40):
            kernels.start(key, job(key))
        assert 3 in kernels and 40 not in kernels
        tables = kernels.tables()
    assert sys.getswitchinterval() == before
    assert {k: t.tolist() for k, t in tables.items()} == {k: [float(k), float(k)] for k in range(40)}
    assert len(ran_on) == 40


def test_kernels_stop_the_helper_on_an_error():
    before = sys.getswitchinterval()

    def fails():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        with Kernels() as kernels:
            kernels.start("a", fails)
            kernels.tables()
    assert sys.getswitchinterval() == before
    with pytest.raises(KeyError):  # an error while preparing: queued kernels are dropped
        with Kernels() as kernels:
            for key in range(50):
                kernels.start(("b", key), lambda: np.zeros(1))
            raise KeyError("while preparing")
    assert sys.getswitchinterval() == before
    with Kernels() as kernels:  # the helper is free again
        kernels.start("c", lambda: np.ones(1))
        assert kernels.tables()["c"].tolist() == [1.0]


def test_configs_made_when_read_index_like_a_list():
    cm = CostModel(Machine.simulated(1, 4), cache=False)
    layer = models.lenet5(batch=8)["conv1"]
    configs = cm.layer_space(layer).configs
    listed = list(configs)
    assert len(listed) == len(configs) and listed == layer_configs(layer, 4)
    assert configs[-1] == listed[-1] and configs[1:3] == listed[1:3] and configs[2] is configs[2]
    with pytest.raises(IndexError):
        configs[len(configs)]
    mask = np.arange(len(configs)) % 2 == 1
    both = configs.with_allreduce(mask)
    assert [c.sync for c in both] == ["allreduce" if m else "ps" for m in mask]
    assert [dataclasses.replace(c, sync="ps") for c in both] == listed


def test_part_timing_packs_the_parameter_gradient_as_a_backward_task_does():
    """A backward task packs its parameter gradient into one flat array (taskrt.planning.tasks.Backward), a
    copy as large as a fully-connected layer's weights; the part timings the simulator adds up
    include it, for ops with parameters only."""
    from taskrt.planning import params as taskrt_params
    from taskrt.search.part_timing import measure_parts

    g = models.lenet5(batch=8)
    packed = []
    real = taskrt_params.pack

    def counting(arrays, xp=np):
        packed.append(sorted(arrays))
        return real(arrays, xp)

    with mock.patch.object(taskrt_params, "pack", counting):
        out = measure_parts([(g["fc1"].op, Rect.full(g["fc1"].shape), (True,)),
                             (g["pool1"].op, Rect.full(g["pool1"].shape), (True,))], 2, "float32")
    assert len(out) == 2 and all(f > 0 and b > 0 for f, b in out)
    assert packed and all(names == ["bias", "weight"] for names in packed)
    assert len(packed) == 3  # fc1's warm-up and two timed backwards; none for the pool


def test_part_timing_starts_each_cpu_kernel_with_the_core_cache_evicted():
    """In a step other kernels run between two of one layer's: each timed forward and backward
    on a CPU starts after reading a buffer larger than a core's cache, not after its own run."""
    import taskrt.search.part_timing as part_timing

    g = models.lenet5(batch=8)
    calls = []
    real = part_timing.evict_core_cache
    with mock.patch.object(part_timing, "evict_core_cache", lambda: (calls.append(1), real())):
        part_timing.measure_parts([(g["conv1"].op, Rect.full(g["conv1"].shape), (False,))], 3, "float32")
    assert len(calls) == 6  # before each of three forwards and three backwards
    assert part_timing._EVICTION[0].nbytes >= max(2 * part_timing._l2_bytes(), 4 << 20)
