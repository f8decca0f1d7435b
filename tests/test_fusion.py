"""Fusing a step's tasks per device and stage (taskrt.planning.fusion): the fused graph computes every value
the unfused one gives the client and other devices, under the same keys; groups are convex; one
device's whole step is a single Dask task."""

from __future__ import annotations

from operator import getitem

import dask
import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import models
from taskrt.execution.executor import step_graph, step_key
from taskrt.gpu.device import to_device
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.planning.fusion import (
    FusedRun,
    RunValue,
    fuse,
    fused_plan,
    given_elsewhere,
    groups_of,
    stages,
    step_done_keys,
)
from taskrt.planning.lowering import lower
from tests.strategies import random_strategies


def combine(*values):
    return sum(values) * 3 + 1


@st.composite
def device_graphs(draw):
    """A random DAG in dependency order: key -> (combine, *earlier keys or literals), each on a device."""
    n = draw(st.integers(1, 25))
    devices = draw(st.integers(1, 4))
    dsk, device = {}, {}
    for i in range(n):
        parents = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        dsk[("t", i)] = (combine, *[("t", p) for p in parents], draw(st.integers(-3, 3)))
        device[("t", i)] = draw(st.integers(0, devices - 1))
    outputs = {("t", i) for i in draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True))}
    return dsk, device, outputs


def dependencies(dsk):
    return {key: [a for a in args if isinstance(a, tuple) and a in dsk] for key, (_, *args) in dsk.items()}


@settings(max_examples=100, deadline=None)
@given(device_graphs(), st.data())
def test_fused_graph_gives_the_same_values_under_the_same_keys(case, data):
    """Every value the client or another device reads is there, on its device: under its own key,
    or, for a held output (`fuse`'s `held`), kept in a run that nothing but exports reads."""
    dsk, device, outputs = case
    held = frozenset(data.draw(st.sets(st.sampled_from(sorted(outputs)))))
    fused, where, kept = fuse(dsk, device, outputs, lambda d, s: (f"dev{d}-fused", s), held)
    assert set(kept) <= held
    read_elsewhere = set(outputs) | {a for k, deps in dependencies(dsk).items() for a in deps if device[a] != device[k]}
    keys = sorted(read_elsewhere - set(kept))
    assert not set(kept) & set(fused)
    assert dask.get(fused, keys) == dask.get(dsk, keys)
    for key, (run, index) in kept.items():
        assert dask.get(fused, run)[index] == dask.get(dsk, key)
        assert where[run] == device[key]
        readers = [fn for fn, *args in fused.values() if run in args]
        assert all(fn is getitem for fn in readers)  # holding the run holds nothing another task reads
    assert len(fused) <= len(dsk)  # a group is fused only where that makes fewer tasks
    for key in read_elsewhere - set(kept):
        assert where[key] == device[key]
    # a fused run and its extractions live where their tasks did; nothing crosses devices inside one
    for key, (fn, *args) in fused.items():
        if isinstance(fn, FusedRun):
            assert {device[k] for k, _, _ in fn.steps} == {where[key]}
        if fn is getitem:
            assert where[args[0]] == where[key]


@settings(max_examples=100, deadline=None)
@given(device_graphs(), st.data())
def test_groups_are_convex(case, data):
    """No path of tasks leaves a group and comes back: a group never waits on itself.  A value
    another device reads is in the first half of its (device, stage) group, with all it needs,
    or, for a task standing for data or state (`given`, reading no other task), a task of its
    own (`given_elsewhere`) that raises no stage."""
    dsk, device, _ = case
    dag = nx.DiGraph([(a, k) for k, deps in dependencies(dsk).items() for a in deps])
    dag.add_nodes_from(dsk)
    sources = sorted(k for k in dsk if dag.in_degree(k) == 0)
    standing_for_data = frozenset(data.draw(st.sets(st.sampled_from(sources))) if sources else ())
    stage = stages(dsk, device, standing_for_data)
    group = groups_of(dsk, device, standing_for_data)
    given = given_elsewhere(dsk, device, standing_for_data)
    assert given == {a for a, b in dag.edges if device[a] != device[b] and a in standing_for_data}
    for a, b in dag.edges:
        assert group[a][0] == device[a]
        if a in given:
            assert group[a][1] == -1 and stage[a] == 0 and stage[b] >= 0
            continue
        assert stage[b] >= stage[a] + (device[a] != device[b])
        assert group[a][1] // 2 == stage[a]
        if device[a] != device[b]:
            assert group[a][1] % 2 == 0
        elif group[b][1] % 2 == 0 and stage[a] == stage[b]:
            assert group[a] == group[b]  # the first half holds what it needs of its stage
    quotient = nx.quotient_graph(dag, lambda u, v: group[u] == group[v])
    assert nx.is_directed_acyclic_graph(quotient)


def fake_inputs(plan):
    data = {key: f"data-{key}" for key in plan.data_nbytes}
    state = {key: f"state-{key}" for key in plan.outputs["state"]}
    return state, data, {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}


@pytest.mark.parametrize("mode", ["train", "gradients", "predict"])
def test_one_device_runs_a_whole_step_as_one_task(mode):
    g = models.lenet5(batch=4, image_size=16, width=0.5)
    plan = lower(g, Strategy({layer.name: P(devices=(0,)) for layer in g}), mode)
    state, data, hyper = fake_inputs(plan) if mode == "train" else (*fake_inputs(lower(g, Strategy(
        {layer.name: P(devices=(0,)) for layer in g}), "train"))[:2], None)
    dsk, _, outputs = step_graph(plan, "1-ab", state, data, hyper)
    [run] = [k for k, (fn, *_) in dsk.items() if isinstance(fn, FusedRun)]
    done = outputs.pop("done")
    values = [k for v in outputs.values() for k in (v.values() if isinstance(v, dict) else v)]
    kept = [v for v in values if isinstance(v, RunValue)]
    # the new state and the losses stay in the run; only the values the client gathers are keys
    assert sorted(set(dsk) - {run}) == sorted(v for v in values if not isinstance(v, RunValue))
    assert {v.run for v in kept} <= {run}
    assert sorted(v.index for v in kept) == list(range(len(dsk) - 1, len(dsk[run][0].exports)))  # after the exports
    assert {name for name, v in outputs.items() for k in (v.values() if isinstance(v, dict) else v)
            if isinstance(k, RunValue)} == ({"state", "loss"} if mode == "train" else {"loss"} if mode == "gradients"
                                            else set())
    assert len(dsk[run][0].steps) == len(plan.tasks)
    # the step is done with the values the client reads and the run that keeps the rest
    assert sorted(done) == sorted(set(dsk) - {run} | ({run} if kept else set()))


def test_a_value_read_out_of_an_earlier_run():
    """A RunValue argument (taskrt.planning.fusion): in a fused group, one input for the earlier run and the
    value read out of it; in a group left unfused, the export that names it, added before it."""
    earlier = ("dev0-fused-it1", 1)
    w = RunValue(("w-update-it1", 0), earlier, 2)
    dsk = {("a", 0): (combine, w, 1), ("b", 0): (combine, ("a", 0), w), ("c", 0): (combine, ("b", 0))}
    fused, _, _ = fuse(dsk, dict.fromkeys(dsk, 0), {("c", 0)}, lambda d, s: (f"dev{d}-fused", s))
    [(run, *inputs)] = [v for v in fused.values() if isinstance(v[0], FusedRun)]
    assert inputs.count(earlier) == 1  # once, for both readers
    a = (10 + 1) * 3 + 1  # value 2 of the earlier run, then the literal 1
    assert run(*[("x", "y", 10) if i == earlier else i for i in inputs]) == (((a + 10) * 3 + 1) * 3 + 1,)
    alone, where, _ = fuse({("a", 0): (combine, w, 1)}, {("a", 0): 0}, {("a", 0)}, lambda d, s: (f"dev{d}-fused", s))
    assert alone == {("w-update-it1", 0): (getitem, earlier, 2), ("a", 0): (combine, ("w-update-it1", 0), 1)}
    assert where == {("w-update-it1", 0): 0, ("a", 0): 0}


def test_data_tiles_carried_by_the_graph_are_tasks_on_their_devices():
    """A tile given as an array (taskrt.execution.executor.inline_data_devices) becomes a task on its device
    that gives it: unfused, a '<layer>-data' key there; fused, a literal input of its device's
    run (or of its own task, where the group is not fused), once."""
    from dask.utils import key_split

    g = models.lenet5(batch=4, image_size=16, width=0.5)
    plan = lower(g, Strategy({layer.name: P(n=2, devices=(0, 1)) for layer in g}))
    state, names, hyper = fake_inputs(plan)
    tiles = {key: np.full(1, float(i)) for i, key in enumerate(names)}
    plain, restriction, _ = step_graph(plan, "4-gh", state, tiles, hyper, fused=False)
    given = {k: v for k, v in plain.items() if key_split(k).endswith("-data")}
    assert len(given) == len(tiles)
    for key, (fn, tile) in given.items():
        layer, part = key[0].rsplit("-data-it", 1)[0], key[1]
        assert fn is to_device and tile is tiles[(layer, part)]
        assert restriction[key] == {f"dev{plan.data[layer][part].device}": 1}
    fused, _, _ = step_graph(plan, "4-gh", state, tiles, hyper)
    literal = [a for fn, *args in fused.values() for a in args if isinstance(a, np.ndarray)]
    assert sorted(id(a) for a in literal) == sorted(id(t) for t in tiles.values())  # each once, in a run or alone
    assert any(isinstance(fn, FusedRun) and any(isinstance(a, np.ndarray) for a in args)
               for fn, *args in fused.values())


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_random_strategies_keep_every_travelling_and_output_key(data):
    g = models.alexnet(batch=2, image_size=16, num_classes=5, width=1 / 32)
    _, strategy = data.draw(random_strategies(g, max_devices=4))
    plan = lower(g, strategy.validated(g))
    state, data_, hyper = fake_inputs(plan)
    plain, plain_restriction, outputs = step_graph(plan, "2-cd", state, data_, hyper, fused=False)
    fused, restriction, fused_outputs = step_graph(plan, "2-cd", state, data_, hyper)
    assert outputs.pop("done") == step_done_keys(outputs, lambda key: None)  # unfused: every output itself
    done = fused_outputs.pop("done")
    assert fused_outputs.keys() == outputs.keys()
    named = set()  # outputs under their own keys
    for name, value in outputs.items():
        for n, key in (value.items() if isinstance(value, dict) else enumerate(value)):
            out = fused_outputs[name][n]
            if isinstance(out, RunValue):  # the new state or a loss, kept in the run that computed it
                assert name in ("state", "buffers", "loss")
                assert fused[out.run][0].exports[out.index] == key and out.run in done
            else:
                assert out == key
                named.add(key)
    for key in done:  # the loss, or a run that computed new state
        assert key in outputs["loss"] or isinstance(fused[key][0], FusedRun) or key in outputs["state"].values()
    for key in named & set(outputs["state"].values()):  # each value of the new state is done when its run is
        assert key in done or fused[key][1] in done
    travelling = {(f"{t.dep.key[0]}-it2-cd", *t.dep.key[1:]) for t in plan.transfers() if t.dep.kind == "task"}
    for key in travelling | named:
        assert key in fused and restriction[key] == plain_restriction[key]
    assert len(fused) <= len(plain)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_the_simulators_fused_plan_is_the_graph_the_executor_submits(data):
    """fused_plan (what the simulator schedules) has the executor's fused tasks: one per group,
    one per exported value, the unfused ones; each plan task once; the same bytes move."""
    g = models.alexnet(batch=2, image_size=16, num_classes=5, width=1 / 32)
    _, strategy = data.draw(random_strategies(g, max_devices=4))
    check_fused_plan(g, strategy)


def test_the_simulators_fused_plan_where_only_the_loss_is_elsewhere():
    g = models.alexnet(batch=2, image_size=16, num_classes=5, width=1 / 32)
    strategy = Strategy({layer.name: P(devices=[0]) for layer in g if layer.name != "loss"} | {
        "loss": P(n=2, devices=[1, 2])})
    check_fused_plan(g, strategy)


def check_fused_plan(g, strategy):
    plan = lower(g, strategy.validated(g))
    dsk, restriction, _ = step_graph(plan, "3-ef", *fake_inputs(plan))
    view, members = fused_plan(plan)
    runs = sorted(len(fn.steps) for fn, *_ in dsk.values() if isinstance(fn, FusedRun))
    assert sorted(len(m) for m in members.values()) == runs
    assert len(view.tasks) == len(dsk)
    exports = {t.key for t in view.tasks if t.phase == "export"}
    assert {(k[0].rsplit("-it", 1)[0], *k[1:]) for k, (fn, *_) in dsk.items() if fn is getitem} == exports
    inside = [t.key for m in members.values() for t in m]
    alone = [t.key for t in view.tasks if t.phase not in ("fused", "export")]
    assert sorted(inside + alone, key=repr) == sorted((t.key for t in plan.tasks), key=repr)
    for key in alone + sorted(exports, key=repr):
        assert restriction[(f"{key[0]}-it3-ef", *key[1:])] == {f"dev{view.by_key[key].device}": 1}
    assert view.bytes_moved == plan.bytes_moved
    # State kept in an earlier step's runs and data tiles carried in the graph are read out of
    # tasks standing for the plan's state and data (`given_elsewhere`): the same runs, of the
    # same plan tasks
    state, tiles, hyper = fake_inputs(plan)
    state = {key: RunValue(None, f"run-{key}", 0) for key in state}
    tiles = {key: np.zeros(2) for key in tiles}
    carried, _, _ = step_graph(plan, "4-gh", state, tiles, hyper)
    plan_keys = {step_key(t.key, "4-gh"): t.key for t in plan.tasks}
    ran = {(k[0].rsplit("-it", 1)[0], k[1]): [plan_keys[key] for key, *_ in fn.steps if key in plan_keys]
           for k, (fn, *_) in carried.items() if isinstance(fn, FusedRun)}
    assert ran == {key: [t.key for t in inside] for key, inside in members.items()}


def test_a_carried_tile_read_on_another_device_keeps_the_plans_runs():
    """Model parallelism reads the image on both devices while one device holds it: carried in the
    graph, it is a task there from the step's start (`given_elsewhere`), so the step's runs are
    those the simulator schedules, and the tile's task is not fused into its device's first run."""
    from taskrt.machines.machine import Machine
    from taskrt.search.baselines import model_parallel

    g = models.alexnet(batch=4, image_size=16, num_classes=5, width=1 / 16)
    machine = Machine.simulated(1, 2)
    plan = lower(g, model_parallel(g, machine).validated(g, machine))
    state, tiles, hyper = fake_inputs(plan)
    tiles = {key: np.zeros(2) for key in tiles}
    dsk, _, _ = step_graph(plan, "5-ij", state, tiles, hyper)
    image = [k for k in dsk if k[0].startswith("image-data")]
    assert image and all(dsk[k][0] is to_device for k in image)  # tasks of their own, unfused
    plan_keys = {step_key(t.key, "5-ij"): t.key for t in plan.tasks}
    ran = {(k[0].rsplit("-it", 1)[0], k[1]): [plan_keys[key] for key, *_ in fn.steps if key in plan_keys]
           for k, (fn, *_) in dsk.items() if isinstance(fn, FusedRun)}
    _, members = fused_plan(plan)
    assert ran and ran == {key: [t.key for t in inside] for key, inside in members.items()}


def test_state_the_next_step_reads_as_keys_is_named_where_it_is_computed():
    """Data parallelism: the weight fetches for the replica read the new state as keys of their
    own (they are not fused), so it is named by a getitem at the end of the step that computes
    it (`state_read_as_keys`) rather than kept in the run and named at the start of the next step; on
    one device the state is kept."""
    g = models.lenet5(batch=4, image_size=16, width=0.5)
    for devices, kept in ((2, False), (1, True)):
        plan = lower(g, Strategy({layer.name: P(n=devices) for layer in g if not layer.is_input}).validated(g))
        state, tiles, hyper = fake_inputs(plan)
        dsk, _, outputs = step_graph(plan, "6-kl", state, tiles, hyper)
        assert all(isinstance(v, RunValue) == kept for v in outputs["state"].values())
        nxt, _, _ = step_graph(plan, "7-mn", {k: RunValue(None, f"run-{k}", 0) if kept else f"f-{k}" for k in state},
                               tiles, hyper)
        assert not [k for k in nxt if k[0].split("-it")[0].endswith("-state")]  # nothing named at the start


def test_a_steps_graph_is_timed_without_a_cluster():
    """`graph_seconds` builds, serializes and reads back a step's graph (the simulator's start of
    a step) with stand-ins for every kind of input a step has: state, batch norm statistics,
    data tiles scattered (above INLINE_DATA_BYTES on a device) and carried in the graph."""
    from taskrt.execution.executor import INLINE_DATA_BYTES, data_bytes_by_device, graph_seconds, inline_data_devices
    from taskrt.graph.graph import Graph
    from taskrt.machines.machine import Machine
    from taskrt.planning.plan import BUFFER, STATE
    from taskrt.search.baselines import BASELINES

    g = Graph("bn")
    x = g.input("image", (64, 3, 64, 64))
    y = g.batch_norm(g.conv2d(x, 4, 3, padding=1, name="conv"), name="bn")
    g.softmax_cross_entropy(g.linear(g.flatten(y, name="flat"), 5, name="fc"), name="loss")
    machine = Machine.simulated(1, 2)
    plan = lower(g, BASELINES["data"](g, machine).validated(g, machine))
    kinds = {d.kind for t in plan.tasks for d in t.deps}
    assert {STATE, BUFFER} <= kinds
    assert max(data_bytes_by_device(plan).values()) > INLINE_DATA_BYTES > 0
    assert not inline_data_devices(plan)  # the images go by scatter; a plan with only small data next
    times = graph_seconds(plan)
    assert 0 < times.client_s < 1 and 0 < times.transit_s < 1 and times.devices == 2
    lenet = models.lenet5(batch=8)
    small = lower(lenet, BASELINES["model"](lenet, machine).validated(lenet, machine))
    assert inline_data_devices(small)
    small_times = graph_seconds(small)
    assert 0 < small_times.client_s < 1 and small_times.devices == 2
