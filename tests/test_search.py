"""The configuration search: exactness of node/edge elimination, the transfer tables, agreement of
the cost model with the lowering's bytes, synchronization costs, the choices on VGG-16, the
measurement cache, the baseline strategies and the search space.

Expected values are computed independently: by brute-force enumeration, by hand, from the ops'
region rules, or from the Plan the executor runs."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter, defaultdict
from itertools import product
from math import prod
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from taskrt import Graph, models, search
from taskrt.graph.config import DIMS, ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import NVLINK, Machine
from taskrt.ops.rect import Rect
from taskrt.planning.lowering import lower
from taskrt.planning.plan import TASK
from taskrt.search import eliminate, transfer
from taskrt.search.dfs import depth_first
from taskrt.search.eliminate import evaluate, minimize
from taskrt.search.regions import Needs, overlap_volumes, part_table
from taskrt.search.space import degree_choices, layer_configs, part_memory, search_space
from tests.graphs import SHAPES, inception_block

RANDOM = settings(deadline=None, derandomize=True)

# ---- 1. node and edge elimination is exact ------------------------------------------------------


@st.composite
def problems(draw, shapes=tuple(SHAPES)):
    """(shape name, series-parallel?, unary, edges): random costs, some infinite, on a graph shape."""
    name = draw(st.sampled_from(shapes))
    build, series_parallel = SHAPES[name]
    nodes, pairs = build()
    nodes = draw(st.permutations(nodes))  # the node order drives the elimination order
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p_inf = draw(st.sampled_from([0.0, 0.1, 0.3]))
    ties = draw(st.booleans())  # small integers: many equal costs
    most = max(2, min(5, int(20_000 ** (1 / len(nodes)))))  # keep brute force small
    sizes = {n: int(rng.integers(2, most + 1)) for n in nodes}

    def costs(shape):
        values = rng.integers(0, 4, size=shape).astype(float) if ties else rng.uniform(0, 10, size=shape)
        return np.where(rng.random(shape) < p_inf, np.inf, values)

    unary = {n: costs(sizes[n]) for n in nodes}
    edges = []
    for u, v in pairs:
        if rng.random() < 0.5:  # either orientation
            u, v = v, u
        edges.append((u, v, costs((sizes[u], sizes[v]))))
    return name, series_parallel, unary, edges


def brute_force(unary, edges) -> float:
    """The minimum over every combination of configs, as one broadcast sum."""
    names = list(unary)
    axis = {n: i for i, n in enumerate(names)}
    total = np.zeros([len(unary[n]) for n in names])

    def at(values, *nodes):
        shape = [1] * len(names)
        for n, size in zip(nodes, values.shape):
            shape[axis[n]] = size
        return values.reshape(shape)

    for n in names:
        total = total + at(np.asarray(unary[n]), n)
    for u, v, m in edges:
        if u == v:
            total = total + at(np.diag(m), u)
        else:
            total = total + (at(m, u, v) if axis[u] < axis[v] else at(m.T, v, u))
    return float(total.min())


def same_cost(a, b) -> bool:
    return (np.isinf(a) and np.isinf(b)) or bool(np.isclose(a, b, rtol=1e-9, atol=1e-9))


def check_exact(unary, edges):
    result = minimize(unary, edges)
    best = brute_force(unary, edges)
    assert same_cost(result.cost, best), (result.cost, best, result.method)
    assert set(result.choice) == set(unary)
    assert all(0 <= result.choice[n] < len(unary[n]) for n in unary)
    assert evaluate(unary, edges, result.choice) == result.cost
    return result, best


@settings(RANDOM, max_examples=150)
@given(problems())
def test_minimize_equals_brute_force_and_depth_first(problem):
    name, series_parallel, unary, edges = problem
    result, best = check_exact(unary, edges)
    if series_parallel:
        assert result.reduced_nodes == 0 and result.reduced_edges == 0, name
        assert result.method == "eliminations only"
    else:
        assert result.reduced_nodes > 0, name
        assert result.method in ("enumeration", "variable elimination")
    dfs = depth_first(unary, edges, time_limit=30.0)
    assert not dfs.timed_out
    assert same_cost(dfs.cost, best)
    if np.isfinite(best):
        assert same_cost(evaluate(unary, edges, dfs.choice), best)


def scan_order(unary, edges) -> list[str]:
    """The elimination order by definition: again and again, the first node in node order with
    at most two neighbours (a node with two is replaced by an edge between them)."""
    adj = {n: set() for n in unary}
    for u, v, _ in edges:
        if u != v:
            adj[u].add(v)
            adj[v].add(u)
    order = []
    while (v := next((n for n in adj if len(adj[n]) <= 2), None)) is not None:
        neighbours = adj.pop(v)
        for u in neighbours:
            adj[u].discard(v)
            adj[u] |= neighbours - {u}
        order.append(v)
    return order


@settings(RANDOM, max_examples=150)
@given(problems())
def test_elimination_order_is_the_first_reducible_node_each_time(problem):
    _, _, unary, edges = problem
    assert [record[1] for record in minimize(unary, edges).log] == scan_order(unary, edges)


@pytest.mark.parametrize("rows, inner, cols", [(1, 1, 1), (3, 5, 7), (4, 4, 4), (9, 2, 13), (70, 70, 69)])
def test_min_plus_is_the_min_plus_product(rows, inner, cols):
    rng = np.random.default_rng(rows * 100 + cols)
    a, b = rng.uniform(0, 10, (rows, inner)), rng.integers(0, 4, (inner, cols)).astype(float)  # ties too
    a[rng.random(a.shape) < 0.2] = np.inf
    expected = (a[:, :, None] + b[None, :, :]).min(axis=1)
    np.testing.assert_array_equal(eliminate.min_plus(a, b), expected)


@settings(RANDOM, max_examples=60)
@given(problems(shapes=tuple(name for name, (_, sp) in SHAPES.items() if not sp)))
def test_variable_elimination_is_exact(problem):
    name, _, unary, edges = problem
    with mock.patch.object(eliminate, "ENUMERATE_LIMIT", 0):
        result, _ = check_exact(unary, edges)
    assert result.method == "variable elimination", name
    assert result.reduced_nodes > 0


@pytest.mark.parametrize("shape, left", [("k4", 4), ("grid3x3", 5), ("densenet4", 4), ("densenet5", 5)])
def test_graphs_that_do_not_reduce(shape, left):
    nodes, pairs = SHAPES[shape][0]()
    rng = np.random.default_rng(1)
    unary = {n: rng.uniform(0, 1, 3) for n in nodes}
    edges = [(u, v, rng.uniform(0, 1, (3, 3))) for u, v in pairs]
    result, _ = check_exact(unary, edges)
    assert (result.reduced_nodes, result.method) == (left, "enumeration")


def test_everything_infinite_still_chooses_every_node():
    """Regression: enumeration of the reduced graph found no combination below inf and failed."""
    nodes, pairs = SHAPES["k4"][0]()
    unary = {n: np.array([1.0, 2.0]) for n in nodes}
    unary[nodes[0]] = np.array([np.inf, np.inf])
    edges = [(u, v, np.zeros((2, 2))) for u, v in pairs]
    for limit in (eliminate.ENUMERATE_LIMIT, 0):
        with mock.patch.object(eliminate, "ENUMERATE_LIMIT", limit):
            result, _ = check_exact(unary, edges)
        assert np.isinf(result.cost)


# ---- 2. transfer tables: the separable shortcut equals the general computation --------------------


def edge_inputs(graph, cost_model):
    """Per edge, what CostModel.tables hands to search.transfer (mirrors it)."""
    configs = cost_model.space(graph)
    needed = graph.needs_backward()
    parts = {layer.name: part_table(layer.shape, configs[layer.name]) for layer in graph}
    grids = {name: transfer.Grid(table, graph[name].shape, cost_model.links.node)
             for name, table in parts.items()}
    for layer in graph:
        for j, src in enumerate(layer.inputs):
            needs = Needs(layer.op, j, parts[layer.name], configs[layer.name])
            itemsize = 8 if graph[src].is_input and graph[src].op.dtype == "int64" else cost_model.itemsize
            yield dict(src=src, dst=layer.name, parts=parts, grids=grids, needs=needs, itemsize=itemsize,
                       backward=src in needed, configs=configs)


GRAPHS = {
    "lenet5": lambda: models.lenet5(batch=8),
    "vgg16": lambda: models.vgg16(batch=4, image_size=32, num_classes=5, width=1 / 16),
    "inception": inception_block,
}


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("nodes, placement", [(2, "first"), (1, "first"), (2, "aligned")])
def test_separable_equals_general(graph, nodes, placement):
    g = GRAPHS[graph]()
    cm = search.CostModel(Machine.simulated(nodes, 4), cache=False, placement=placement)
    count = 0
    for e in edge_inputs(g, cm):
        fast = transfer.separable(e["grids"][e["src"]], e["grids"][e["dst"]], e["needs"].table, e["needs"], cm.links,
                                  e["itemsize"], e["backward"])
        slow = transfer.general(e["parts"][e["src"]], e["needs"].table, cm.links, e["itemsize"], e["backward"])
        assert fast is not None, (e["src"], e["dst"])
        assert fast.shape == slow.shape == (len(e["configs"][e["src"]]), len(e["configs"][e["dst"]]))
        np.testing.assert_allclose(fast, slow, rtol=1e-9, atol=1e-15, err_msg=f"{e['src']} -> {e['dst']}")
        count += 1
    assert count == sum(len(layer.inputs) for layer in g)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       rows=st.lists(st.tuples(st.lists(st.sampled_from([1, 2, 4]), min_size=4, max_size=4), st.integers(0, 7)),
                     min_size=1, max_size=6),
       nodes=st.sampled_from([1, 2, 4]))
def test_grid_slot_tuples(shape, rows, nodes):
    """What each config looks like from each device along each dimension (Grid's five slot
    positions), against the definition worked out part by part; the one-call layout a search
    uses (Grid.of_blocks) gives the same part table, slots and grid as building each in turn,
    also where a config's parts on a node are no box of blocks (ok False)."""
    from taskrt.search.regions import grid_parts

    shape = tuple(shape)
    num_devices, node = 8, np.repeat(np.arange(nodes), 8 // nodes)
    degrees = np.array([[min(d, size) for d, size in zip(ds, shape)] for ds, _ in rows], dtype=np.int64)
    assume(all(np.prod(d) <= num_devices for d in degrees))
    first = np.array([min(f, num_devices - int(np.prod(d))) for d, (_, f) in zip(degrees, rows)], dtype=np.int64)
    table = grid_parts(shape, degrees, first=first)
    expected = transfer.Grid(table, shape, node)
    got = transfer.Grid.of_blocks(shape, degrees, first, node)
    for name in ("lo", "hi", "device", "starts", "block", "degrees", "config"):
        np.testing.assert_array_equal(getattr(got.table, name), getattr(table, name), err_msg=name)
    want, have = table.slots(shape), got.table.slots(shape)
    for name in ("first", "lo", "hi", "part"):
        np.testing.assert_array_equal(getattr(have, name), getattr(want, name), err_msg=name)
    assert have.count == want.count
    np.testing.assert_array_equal(got.part_slot, want.part)
    boxes = {}  # (config, node) -> per dimension (lowest block, highest block + 1) of its parts there
    for row in range(len(table.device)):
        a, k = int(table.config[row]), int(node[table.device[row]])
        box = boxes.setdefault((a, k), [[9, -1] for _ in shape])
        for e, b in enumerate(table.block[row]):
            box[e] = [min(box[e][0], b), max(box[e][1], b + 1)]
    is_box = all(np.prod([hi - lo for lo, hi in box]) == np.sum((table.config == a) & (node[table.device] == k))
                 for (a, k), box in boxes.items())
    assert got.ok == expected.ok == is_box
    if not is_box:
        return
    none = want.lo.shape[1]
    for grid in (got, expected):
        for a in range(len(degrees)):
            rows_of = np.flatnonzero(table.config == a)
            for r in range(num_devices):
                mine = [row for row in rows_of if table.device[row] == r]
                box = boxes.get((a, int(node[r])), [[0, 0] for _ in shape])
                for e in range(len(shape)):
                    f = want.first[a, e]
                    slots = (f, f + box[e][0], f + box[e][1], f + degrees[a, e],
                             f + table.block[mine[0], e] if mine else none)
                    assert tuple(grid.tuples[e, grid.tuple_of[r, e, a]]) == slots, (a, r, e)


def test_box_sums_float32_cannot_hold_take_the_general_path():
    """The kernels gather box sums in float32; where a layer's sums could reach FLOAT32_EXACT
    (patched far down here), separable declines and the cost model's tables are the general ones."""
    g = GRAPHS["lenet5"]()
    cm = search.CostModel(Machine.simulated(2, 4), cache=False)
    with mock.patch.object(transfer, "FLOAT32_EXACT", 2 * cm.machine.num_devices):
        for e in edge_inputs(g, cm):
            assert transfer.separable(e["grids"][e["src"]], e["grids"][e["dst"]], e["needs"].table, e["needs"],
                                      cm.links, e["itemsize"], e["backward"]) is None, (e["src"], e["dst"])
        tables, needed = cm.tables(g), g.needs_backward()
    for src, dst, j, matrix in tables.edges:
        u, v = cm.layer_space(g[src]), cm.layer_space(g[dst])
        itemsize = 8 if g[src].is_input and g[src].op.dtype == "int64" else cm.itemsize
        expected = transfer.general(u.parts, v.needs[j].table, cm.links, itemsize, src in needed)
        np.testing.assert_allclose(matrix, expected, rtol=1e-12, atol=1e-18, err_msg=f"{src} -> {dst}")


def timed(moves, links) -> float:
    """The model's time for one direction of an edge, [(src, dst, bytes)] between devices: each
    receiver takes its pieces one after another (bytes over the link plus its latency); with a
    shared network interface per node, a node's bytes from other nodes also pass it one after
    another; the slowest receiver or interface."""
    nic = getattr(links, "nic_inv_bandwidth", 0.0)
    per_receiver, per_node = Counter(), Counter()
    for src, dst, nbytes in moves:
        if src == dst or not nbytes:
            continue
        per_receiver[dst] += nbytes * links.inv_bandwidth[src, dst] + links.latency[src, dst]
        if links.node[src] != links.node[dst]:
            per_node[links.node[dst]] += nbytes * nic
    return max([*per_receiver.values(), *per_node.values()], default=0.0)


def reference_tx(graph, src, dst, j, cu, cv, links, itemsize, backward):
    """t_x of one config pair straight from ParallelConfig.parts and the op's region rule."""
    forward, back = [], []
    for p in cu.parts(graph[src].shape):
        for q in cv.parts(graph[dst].shape):
            need = graph[dst].op.input_rects(q.rect)[j]
            inter = None if need is None else p.rect.intersect(need)
            if inter is not None and not inter.empty:
                forward.append((p.device, q.device, inter.volume * itemsize))
                back.append((q.device, p.device, inter.volume * itemsize))
    return timed(forward, links) + (timed(back, links) if backward else 0.0)


def test_links_that_are_not_node_structured_use_the_general_path():
    g = models.lenet5(batch=8)
    machine = Machine.simulated(2, 2)
    machine.bandwidth[1, 2] /= 3  # one slow link: no longer "same node or not"
    cm = search.CostModel(machine, cache=False)
    assert cm.links.node_classes() is None
    for e in edge_inputs(g, cm):
        grids, needs = e["grids"], e["needs"]
        assert transfer.separable(grids[e["src"]], grids[e["dst"]], needs.table, needs, cm.links, e["itemsize"],
                                  e["backward"]) is None
        table = transfer.general(e["parts"][e["src"]], needs.table, cm.links, e["itemsize"], e["backward"])
        j = g[e["dst"]].inputs.index(e["src"])
        for a, cu in enumerate(e["configs"][e["src"]]):
            for b, cv in enumerate(e["configs"][e["dst"]]):
                expected = reference_tx(g, e["src"], e["dst"], j, cu, cv, cm.links, e["itemsize"], e["backward"])
                assert table[a, b] == pytest.approx(expected, rel=1e-9, abs=1e-15), (e["src"], e["dst"], cu, cv)
    # and the cost model falls back to it
    tables = cm.tables(g)
    assert all(np.isfinite(m).all() for *_, m in tables.edges)


# ---- 3. the cost model moves the bytes the lowering moves -----------------------------------------

PARAMETER_PHASES = ("wfetch", "grad", "rslice")


def origin(plan, dep):
    """(layer, phase, input element) of the value behind a travelling key, through sends and slices."""
    element = None
    while dep.kind == TASK:
        task = plan.by_key[dep.key]
        if task.phase not in ("send", "slice", "gslice"):
            return task.layer, task.phase, element
        if task.phase != "send" and element is None:
            element = task.spec.piece.element
        dep = task.deps[0]
    return dep.key[0], "data", element


def plan_edge_transfers(plan, graph):
    """Activation and gradient transfers of the plan, attributed to the edge (producer, consumer, input)
    they serve: (edge, direction) -> [(src, dst, nbytes)].  A value read by two consumer layers on one
    device counts for each (the cost model prices edges one by one); parameter sync is left out."""
    out, seen = defaultdict(list), set()
    for task in plan.tasks:
        for dep in task.deps:
            src = plan.device_of(dep)
            if src is None or src == task.device:
                continue
            layer, phase, element = origin(plan, dep)
            if phase in PARAMETER_PHASES:
                continue
            if phase in ("fwd", "data"):  # layer's output, read by a consumer's forward or backward
                assert task.phase in ("fwd", "bwd", "loss"), task.key
                inputs = graph[task.layer].inputs
                assert inputs.count(layer) == 1
                key = ((layer, task.layer, inputs.index(layer)), "fwd")
            else:  # a consumer's input gradient, read by the producer's backward
                assert phase in ("bwd", "loss") and task.phase == "bwd", (phase, task.key)
                key = ((graph[layer].inputs[element], layer, element), "bwd")
                assert task.layer == key[0][0]
            if (dep, task.device, key) not in seen:
                seen.add((dep, task.device, key))
                out[key].append((src, task.device, plan.nbytes_of(dep)))
    return out


def region_edge_bytes(graph, strategy, itemsize=4):
    """(edge, direction) -> bytes per (src, dst): overlaps of producer parts with consumer needs."""
    needed = graph.needs_backward()
    out = defaultdict(Counter)
    for layer in graph:
        for j, src in enumerate(layer.inputs):
            producer = part_table(graph[src].shape, [strategy[src]])
            needs = Needs(layer.op, j, part_table(layer.shape, [strategy[layer.name]]), [strategy[layer.name]]).table
            volume = overlap_volumes(producer, needs)
            size = 8 if graph[src].is_input and graph[src].op.dtype == "int64" else itemsize
            for p, q in zip(*np.nonzero(volume)):
                a, b = int(producer.device[p]), int(needs.device[q])
                if a != b:
                    out[((src, layer.name, j), "fwd")][(a, b)] += int(volume[p, q]) * size
                    if src in needed:
                        out[((src, layer.name, j), "bwd")][(b, a)] += int(volume[p, q]) * size
    return out


def draw_strategy(data, configs):
    return Strategy({name: options[data.draw(st.integers(0, len(options) - 1), label=name)]
                     for name, options in configs.items()})


@functools.cache
def plan_setup(graph):
    """(graph, cost model, search space) on 2 nodes x 2 devices: intra- and inter-node links differ."""
    g = GRAPHS[graph]()
    cm = search.CostModel(Machine.simulated(2, 2), cache=False, placement="aligned")
    return g, cm, cm.space(g)


@pytest.mark.parametrize("graph", list(GRAPHS))
@settings(RANDOM, max_examples=15)
@given(data=st.data())
def test_cost_model_and_lowering_move_the_same_bytes(graph, data):
    g, cm, space = plan_setup(graph)
    strategy = draw_strategy(data, space)
    plan = lower(g, strategy)
    moved = plan_edge_transfers(plan, g)
    expected = region_edge_bytes(g, strategy)
    got = defaultdict(Counter)
    for key, moves in moved.items():
        for s, d, nbytes in moves:
            got[key][(s, d)] += nbytes
    assert {k: dict(v) for k, v in got.items()} == {k: dict(v) for k, v in expected.items()}

    # over the whole step, per device pair: equal when no two consumers share a producer's output,
    # otherwise the lowering sends a piece two consumers on one device need only once
    activations = Counter()
    for t in plan.transfers():
        if origin(plan, t.dep)[1] not in PARAMETER_PHASES:
            activations[(t.src, t.dst)] += t.nbytes
    priced = sum(expected.values(), Counter())
    fan_out = any(len(g.consumers(layer.name)) > 1 for layer in g)
    if fan_out:
        assert all(activations[pair] <= priced[pair] for pair in priced) and set(activations) <= set(priced)
    else:
        assert activations == priced

    # and t_x of every edge is the model's timing of exactly these transfers
    tables = cm.tables(g, {name: [strategy[name]] for name in g.layers})
    for src, dst, j, matrix in tables.edges:
        expected_t = sum(timed(moved.get(((src, dst, j), direction), []), cm.links) for direction in ("fwd", "bwd"))
        assert matrix[0, 0] == pytest.approx(expected_t, rel=1e-9, abs=1e-15), (src, dst)


# ---- 4. synchronization cost by hand ------------------------------------------------------------


def one_linear(batch=8, features=16, out=32):
    g = Graph("one_linear")
    x = g.input("x", (batch, features))
    y = g.linear(x, out, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


@pytest.mark.parametrize("hop", [0.0, 1e-3])
def test_sync_cost_by_hand(hop):
    g = one_linear()
    machine = Machine.simulated(1, 4)
    cm = search.CostModel(machine, cache=False, overhead=hop)
    latency = 5e-6
    shard = (16 * 32 + 32) * 4  # weight and bias, float32

    def t_s(cfg):
        return cm.breakdown(g, Strategy({"fc": cfg, "loss": ParallelConfig()})).t_s["fc"]

    # data parallel: three replicas each send a gradient to the server and fetch the weights back;
    # the server receives three gradients while it sends three copies of the weights
    data = ParallelConfig(n=4, devices=(0, 1, 2, 3))
    assert t_s(data) == pytest.approx(3 * shard / NVLINK + 3 * latency + 3 * hop, rel=1e-12)
    # the plan moves exactly those bytes
    plan = lower(g, Strategy({"fc": data, "loss": data}))
    sync = [t for t in plan.transfers() if origin(plan, t.dep)[1] in PARAMETER_PHASES]
    assert sorted((t.src, t.dst, t.nbytes) for t in sync) == sorted(
        [(0, d, shard) for d in (1, 2, 3)] + [(d, 0, shard) for d in (1, 2, 3)])
    # channel split: every shard has one reader, its server: no transfer, only the update task
    assert t_s(ParallelConfig(c=4, devices=(0, 1, 2, 3))) == pytest.approx(hop, abs=1e-15)
    # two shards of two replicas each, synchronized in parallel
    half = (16 * 16 + 16) * 4
    assert t_s(ParallelConfig(n=2, c=2, devices=(0, 1, 2, 3))) == pytest.approx(
        half / NVLINK + latency + 3 * hop, rel=1e-12)


def test_sync_cost_across_nodes():
    g = one_linear()
    machine = Machine.simulated(2, 2, intra_bandwidth=20e9, inter_bandwidth=5e9, latency=1e-5)
    cm = search.CostModel(machine, cache=False, overhead=0.0)
    data = ParallelConfig(n=4, devices=(0, 1, 2, 3))
    shard = (16 * 32 + 32) * 4
    # server on device 0: one replica on its node, two on the other, one after another
    expected = shard / 20e9 + 2 * shard / 5e9 + 3 * 1e-5
    assert cm.breakdown(g, Strategy({"fc": data, "loss": data})).t_s["fc"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("hop", [0.0, 1e-3])
def test_allreduce_sync_cost_by_hand(hop):
    g = one_linear(features=1024, out=1024)
    cm = search.CostModel(Machine.simulated(1, 4), cache=False, overhead=hop)
    latency, shard = 5e-6, (1024 * 1024 + 1024) * 4
    data = ParallelConfig(n=4, devices=(0, 1, 2, 3))
    ring = dataclasses.replace(data, sync="allreduce")
    t_s = {c.sync: cm.breakdown(g, Strategy({"fc": c, "loss": ParallelConfig()})).t_s["fc"] for c in (data, ring)}
    # every device receives its chunk's gradients from 3 replicas and their 3 chunks of the
    # weights (and sends as much at the same time)
    assert t_s["allreduce"] == pytest.approx(2 * 3 * (shard // 4) / NVLINK + 2 * 3 * latency + 4 * hop, rel=1e-12)
    assert t_s["ps"] == pytest.approx(3 * shard / NVLINK + 3 * latency + 3 * hop, rel=1e-12)
    # the search's tables price each config at its cheaper method and say which: the collective
    # halves the bytes of the busiest device, at the cost of one more dependent task
    tables = cm.tables(g)
    index = next(i for i, c in enumerate(tables.configs["fc"]) if (c.n, c.c) == (4, 1))
    best = min(t_s, key=t_s.get)
    assert best == ("allreduce" if hop == 0 else "ps")
    assert tables.configs["fc"][index].sync == best and tables.sync["fc"][index] == pytest.approx(t_s[best], rel=1e-12)
    single = next(i for i, c in enumerate(tables.configs["fc"]) if (c.n, c.c) == (1, 4))
    assert tables.configs["fc"][single].sync == "ps"  # nothing replicated: no collective


def two_nodes_one_interface(link=20e9, nic=5e9):
    """2 nodes x 2 devices, every link `link`, each node's shared network interface `nic` bytes/s."""
    from taskrt.machines.machine import Device

    devices = [Device(i, i // 2, "P100", 16e9) for i in range(4)]
    bandwidth = np.full((4, 4), link)
    np.fill_diagonal(bandwidth, np.inf)
    return Machine(devices, bandwidth, np.zeros((4, 4)), description="2x2, shared interfaces", nic_bandwidth=nic)


@pytest.mark.parametrize("sync", ["ps", "allreduce"])
def test_sync_cost_counts_the_nodes_shared_interface(sync):
    g = one_linear()
    cm = search.CostModel(two_nodes_one_interface(), cache=False, overhead=0.0)
    shard = (16 * 32 + 32) * 4
    data = ParallelConfig(n=4, devices=(0, 1, 2, 3), sync=sync)
    # node 1's interface carries the weights for devices 2 and 3 (ps: the whole shard each; allreduce:
    # each of them gets both node-0 chunks and sends them its own, 4 pairs x (S/4 + S/4)); the
    # devices' own links are 4 times faster, so the interface is what limits
    assert cm.breakdown(g, Strategy({"fc": data, "loss": data})).t_s["fc"] == pytest.approx(2 * shard / 5e9,
                                                                                            rel=1e-12)


def sync_busy_bytes(plan, layer):
    """Per device: the larger of the bytes of `layer`'s parameter synchronization it sends and receives."""
    sent, received = Counter(), Counter()
    for t in plan.transfers():
        if origin(plan, t.dep)[:2] in {(layer, phase) for phase in PARAMETER_PHASES}:
            sent[t.src] += t.nbytes
            received[t.dst] += t.nbytes
    return {d: max(sent[d], received[d]) for d in set(sent) | set(received)}


@pytest.mark.parametrize("sync", ["ps", "allreduce"])
@settings(RANDOM, max_examples=25)
@given(data=st.data())
def test_sync_cost_is_the_busiest_interface_of_the_plans_sync_traffic(sync, data):
    """Where nodes share a slower interface: t_s is the larger of the busiest device's bytes over
    its links and the busiest node interface's cross-node bytes over the interface."""
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    machine = two_nodes_one_interface()
    cm = search.CostModel(machine, cache=False, overhead=0.0)
    strategy = draw_strategy(data, cm.space(g))
    strategy = Strategy({n: dataclasses.replace(c, sync=sync) for n, c in strategy.items()})
    plan = lower(g, strategy)
    t_s = cm.breakdown(g, strategy).t_s
    node = [d.node for d in machine.devices]
    for layer in g:
        if not layer.param_shapes:
            continue
        interface = Counter()
        for t in plan.transfers():
            if origin(plan, t.dep)[:2] in {(layer.name, p) for p in PARAMETER_PHASES} and node[t.src] != node[t.dst]:
                interface[node[t.dst]] += t.nbytes
        busiest = max(sync_busy_bytes(plan, layer.name).values(), default=0)
        expected = max(busiest / 20e9, max(interface.values(), default=0) / 5e9)
        assert t_s[layer.name] == pytest.approx(expected, rel=1e-9, abs=1e-15), layer.name


@pytest.mark.parametrize("sync", ["ps", "allreduce"])
@settings(RANDOM, max_examples=25)
@given(data=st.data())
def test_sync_cost_is_the_busiest_device_of_the_plans_sync_traffic(sync, data):
    """With uniform links and no latency or overhead, t_s times the bandwidth is the largest number
    of bytes one device sends or receives for the layer's synchronization in the plan."""
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    machine = Machine.simulated(1, 8, latency=0.0)
    cm = search.CostModel(machine, cache=False, overhead=0.0)
    space = cm.space(g)
    strategy = draw_strategy(data, space)
    strategy = Strategy({n: dataclasses.replace(c, sync=sync) for n, c in strategy.items()})
    plan = lower(g, strategy)
    t_s = cm.breakdown(g, strategy).t_s
    for layer in g:
        if layer.param_shapes:
            busiest = max(sync_busy_bytes(plan, layer.name).values(), default=0)
            assert t_s[layer.name] * NVLINK == pytest.approx(busiest, rel=1e-9, abs=1e-6), layer.name


# ---- 5. choices on VGG-16 (4 nodes x 4 P100) -----------------------------------------------------


@pytest.fixture(scope="module")
def vgg_search():
    machine = Machine.simulated(4, 4)
    g = models.vgg16(batch=512)
    cm = search.CostModel(machine, cache=False)
    return g, machine, cm, search.optimize(g, machine, cm)


def test_vgg16_strategy_is_sensible_and_beats_the_baselines(vgg_search):
    g, machine, cm, strategy = vgg_search
    for name in ("conv1_1", "conv1_2", "conv2_1", "conv2_2"):
        assert (strategy[name].n, strategy[name].total) == (16, 16), (name, strategy[name])
    for name in ("fc1", "fc2", "fc3"):  # mostly model parallel: channels split more than samples (Pr > Pc)
        cfg = strategy[name]
        assert cfg.c > 1 and cfg.c >= cfg.n and cfg.h == cfg.w == 1, (name, cfg)

    predicted = strategy.meta["predicted_step_s"]
    breakdown = cm.breakdown(g, strategy)
    assert breakdown.total == pytest.approx(predicted, rel=1e-9)
    for name, per in strategy.meta["per_layer_s"].items():
        assert per["t_c"] == pytest.approx(breakdown.t_c[name], rel=1e-9, abs=1e-15)
        assert per["t_x"] == pytest.approx(breakdown.t_x[name], rel=1e-9, abs=1e-15)
        assert per["t_s"] == pytest.approx(breakdown.t_s[name], rel=1e-9, abs=1e-15)
    assert strategy.meta["estimated"] and strategy.meta["search"]["reduced_nodes"] == 0
    for baseline in (search.data_parallel, search.model_parallel, search.owt):
        assert predicted <= cm.breakdown(g, baseline(g, machine)).total, baseline.__name__


def test_a_searched_strategy_replans_by_searching_again_and_survives_validation():
    """The trainer re-plans after a lost worker with the strategy's `replan`: the search's is the
    search again, for the machine it is given (the runtime itself never imports the search)."""
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    strategy = search.optimize(g, Machine.simulated(1, 4))
    assert strategy.replan == search.SearchAgain(check_by_simulation=False)
    assert strategy.validated(g).replan is strategy.replan
    smaller = strategy.replan(g, Machine.simulated(1, 2))
    assert max(d for config in smaller.configs.values() for d in config.devices) <= 1
    assert isinstance(smaller.replan, search.SearchAgain)
    assert "replan" not in json.dumps(strategy.to_dict())


# ---- 6. measurement cache ------------------------------------------------------------------------


def test_second_search_measures_nothing(machine4, cost_cache4):
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    path = cost_cache4
    first = search.CostModel(machine4, cache=path, repeats=1, progress=False)
    s1 = search.optimize(g, machine4, first)
    assert first.measurements > 0 and path.exists()
    assert not first.estimated and not s1.meta["estimated"]
    second = search.CostModel(machine4, cache=path, repeats=1, progress=False)
    assert second.hop == first.hop  # the runtime overhead is cached too
    s2 = search.optimize(g, machine4, second)
    assert second.measurements == 0
    assert s2 == s1
    assert s2.meta["predicted_step_s"] == pytest.approx(s1.meta["predicted_step_s"], rel=1e-12)


def test_where_devices_share_the_cores_parts_are_timed_alone_and_with_every_device_at_once(machine4, cost_cache4):
    from taskrt.search.cost_cache import corun_kind

    g = models.lenet5(batch=8, image_size=16, width=0.5)
    model = search.CostModel(machine4, cache=cost_cache4, repeats=1, progress=False)
    assert model.corun and not search.CostModel(Machine.simulated(1, 2), cache=False).corun
    op, tile = g["conv1"].op, Rect((0, 0, 0, 0), g["conv1"].shape)
    alone = model.part_time(op, tile, (False,))
    beside = model.part_time(op, tile, (False,), corun=True)
    assert min(alone) > 0 and min(beside) > 0 and beside != alone  # two timings, not one
    kind, sig = machine4.devices[0].kind, model.signature(op, tile, (False,))
    assert model.cache.get(kind, sig) == list(alone) and model.cache.get(corun_kind(kind), sig) == list(beside)
    again = search.CostModel(machine4, cache=cost_cache4, repeats=1, progress=False)
    assert again.part_time(op, tile, (False,), corun=True) == beside and again.measurements == 0


def test_with_parts_timed_beside_each_other_the_simulator_gets_the_hosts_own_cores(machine4, cost_cache4):
    """The effective cores `Machine.calibrate` measures are lowered by a reference kernel's slow-down
    beside another, which the parts' own timings beside each other carry already."""
    import json
    import os

    data = json.loads(cost_cache4.read_text())
    [calibration] = data["overhead"].values()
    calibration["cores"] = 1.5
    cost_cache4.write_text(json.dumps(data))
    model = search.CostModel(machine4, cache=cost_cache4, repeats=1, progress=False)
    g = models.lenet5(batch=8, image_size=16, width=0.5)
    plan = lower(g, search.data_parallel(g, machine4).validated(g, machine4))
    assert model.calibration["cores"] == 1.5 and model.runtime(plan).cores == os.cpu_count()


def test_parts_of_different_layers_with_equal_tiles_are_measured_once_and_both_timed(machine4, cost_cache4):
    """Two pools of different shapes whose parts have equal tiles share one signature: measured once,
    each layer gets the time (once a KeyError on a GPU machine, VGG-16 on 4 workers)."""
    g = Graph("two-pools")
    x = g.input("image", (4, 3, 8, 8))
    labels = g.input("labels", (4,), dtype="int64")
    a = g.pool2d(g.conv2d(x, 4, 1, name="conv_a"), 2, name="pool_a")  # (4, 4, 4, 4)
    b = g.pool2d(g.conv2d(a, 8, 1, name="conv_b"), 2, name="pool_b")  # (4, 8, 2, 2)
    g.softmax_cross_entropy(g.linear(g.flatten(b), 3, name="fc"), labels, name="loss")
    configs = {layer.name: [ParallelConfig(devices=(0,))] for layer in g}
    configs["pool_a"] = [ParallelConfig(h=2, w=2, devices=(0, 1, 2, 3))]  # tiles (4, 4, 2, 2)
    configs["pool_b"] = [ParallelConfig(c=2, devices=(0, 1))]  # tiles (4, 4, 2, 2)
    model = search.CostModel(machine4, cache=cost_cache4, repeats=1, progress=False)
    tile = Rect((0, 0, 0, 0), (4, 4, 2, 2))
    assert model.signature(g["pool_a"].op, tile, (True,)) == model.signature(g["pool_b"].op, tile, (True,))
    tables = model.tables(g, configs)
    assert tables.compute["pool_a"][0] > 0 and tables.compute["pool_b"][0] > 0


# ---- 7. baseline strategies ----------------------------------------------------------------------


def only(cfg, dim, degree):
    return all(getattr(cfg, d) == (degree if d == dim else 1) for d in DIMS) and cfg.devices == tuple(range(degree))


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("nodes", [1, 2])
def test_baselines(graph, nodes):
    g, machine = GRAPHS[graph](), Machine.simulated(nodes, 4)
    d = machine.num_devices
    strategies = {f.__name__: f(g, machine) for f in (search.data_parallel, search.model_parallel, search.owt)}
    for strategy in strategies.values():
        strategy.validated(g, machine)
        assert not any(layer.is_input for layer in g if layer.name in strategy)

    def split(layer, dim):
        dim = dim if dim in layer.dims else "n"
        return dim, min(d, layer.shape[layer.dims.index(dim)])

    first_fc = next(i for i, layer in enumerate(g) if layer.kind == "linear")
    for i, layer in enumerate(g):
        if layer.is_input:
            continue
        assert only(strategies["data_parallel"][layer.name], *split(layer, "n")), layer.name
        assert only(strategies["model_parallel"][layer.name], *split(layer, "c")), layer.name
        owt = strategies["owt"][layer.name]
        if layer.kind in ("conv2d", "pool2d"):
            assert only(owt, *split(layer, "n")), layer.name
        if layer.kind == "linear":
            assert only(owt, *split(layer, "c")) and owt.c > 1, layer.name
        assert only(owt, *split(layer, "c" if i >= first_fc else "n")), layer.name


# ---- 8. search space -----------------------------------------------------------------------------


def space_layers():
    g = models.vgg16(batch=4, image_size=32, num_classes=5, width=1 / 16)
    return [g["image"], g["conv1_1"], g["pool5"], g["flatten"], g["fc1"], g["fc3"], g["loss"], g["labels"]]


def expected_degrees(layer, choices, devices):
    per_dim = [[x for x in choices if x <= layer.shape[layer.dims.index(dim)]] if dim in layer.dims else [1]
               for dim in DIMS]
    return {combo for combo in product(*per_dim) if prod(combo) <= devices}


@pytest.mark.parametrize("devices", [1, 4, 6, 8])
def test_space_powers_of_two(devices):
    assert degree_choices(devices) == [x for x in (1, 2, 4, 8) if x <= devices]
    for layer in space_layers():
        configs = layer_configs(layer, devices)
        degrees = [tuple(getattr(c, dim) for dim in DIMS) for c in configs]
        assert len(set(degrees)) == len(degrees)
        for cfg, combo in zip(configs, degrees):
            assert all(x & (x - 1) == 0 for x in combo)
            assert prod(combo) <= devices and cfg.devices == tuple(range(prod(combo)))
            for dim, x in zip(DIMS, combo):
                assert x == 1 or (dim in layer.dims and x <= layer.shape[layer.dims.index(dim)])
        assert set(degrees) == expected_degrees(layer, degree_choices(devices), devices)


def test_space_divisors_and_aligned_placement():
    assert degree_choices(6, powers_of_two=False) == [1, 2, 3, 6]
    assert degree_choices(12, powers_of_two=False) == [1, 2, 3, 4, 6, 12]
    layer = space_layers()[1]  # conv1_1: (4, 4, 32, 32)
    configs = layer_configs(layer, 6, powers_of_two=False)
    degrees = {tuple(getattr(c, dim) for dim in DIMS) for c in configs}
    assert all(6 % x == 0 for combo in degrees for x in combo)
    assert (1, 3, 2, 1) in degrees and (1, 1, 6, 1) in degrees and (4, 1, 1, 1) not in degrees
    assert degrees == expected_degrees(layer, [1, 2, 3, 6], 6)
    aligned = layer_configs(layer, 8, placement="aligned")
    for cfg in aligned:
        p = cfg.total
        assert cfg.devices[0] % p == 0 and cfg.devices == tuple(range(cfg.devices[0], cfg.devices[0] + p))
    assert len([c for c in aligned if c.total == 2]) == 4 * len([c for c in layer_configs(layer, 8) if c.total == 2])
    with pytest.raises(ValueError, match="placement"):
        layer_configs(layer, 8, placement="anywhere")


def test_space_drops_configs_that_do_not_fit():
    layer = space_layers()[4]  # fc1
    everything = layer_configs(layer, 8)
    sizes = sorted({part_memory(layer, c, 4) for c in everything})
    memory = sizes[len(sizes) // 2]
    kept = layer_configs(layer, 8, memory=memory)
    assert 0 < len(kept) < len(everything)
    assert set(kept) == {c for c in everything if part_memory(layer, c, 4) <= memory}


def test_layer_that_fits_nowhere_is_named():
    g = Graph("big")
    x = g.input("x", (8, 4096))
    y = g.linear(x, 4096, name="big_fc")
    g.softmax_cross_entropy(y, name="loss")
    machine = Machine.simulated(1, 4)
    machine.devices = [dataclasses.replace(d, memory=2**20) for d in machine.devices]
    with pytest.raises(ValueError, match="big_fc"):
        search_space(g, machine)
    with pytest.raises(ValueError, match="big_fc"):
        search.optimize(g, machine, search.CostModel(machine, cache=False))
    roomy = Machine.simulated(1, 4)
    assert len(search_space(g, roomy)["big_fc"]) == len(layer_configs(g["big_fc"], 4))
