"""The search under a memory budget: the front elimination against brute force, the memory measure
against search.memory, the budget's forms, the error when nothing fits, the unconstrained path
when the budget does not bind, meta, the checks and the CLI flag.

Expected values come from exhaustive enumeration of every strategy (numpy broadcasting over the
product of the layers' configs) or from search.memory.step_memory."""

from __future__ import annotations

import sys
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import DeviceMemoryError, Graph, models, search
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.search import budget as budgeting
from taskrt.search import edge_memory
from taskrt.search.baselines import data_parallel
from taskrt.search.eliminate import minimize
from taskrt.search.memory import step_memory
from taskrt.search.memory_tables import MemoryTables
from taskrt.search.pareto import FEW, budget_search, least_memory
from taskrt.search.recompute_tables import candidates
from tests.graphs import SHAPES, inception_block

optimize_module = sys.modules["taskrt.search.optimize"]  # the module (the package's `optimize` is the function)

RANDOM = settings(deadline=None, derandomize=True)


# ---- brute force ---------------------------------------------------------------------------------
def enumerate_all(names, time_unary, time_edges, kept, working, memory_edges):
    """(time, measure) of every strategy, as arrays over the product of the layers' configs."""
    axis = {n: i for i, n in enumerate(names)}
    shape = [len(kept[n]) for n in names]

    def at(values, *nodes):
        out = [1] * len(names)
        for n, size in zip(nodes, values.shape):
            out[axis[n]] = size
        return values.reshape(out)

    def edge(m, u, v):
        if u == v:
            return at(np.diag(m), u)
        return at(m, u, v) if axis[u] < axis[v] else at(m.T, v, u)

    time = np.zeros(shape)
    summed = np.zeros(shape, dtype=np.int64)
    largest = np.zeros(shape, dtype=np.int64)
    for n in names:
        time = time + at(np.asarray(time_unary[n], dtype=float), n)
        summed = summed + at(np.asarray(kept[n], dtype=np.int64), n)
        largest = np.maximum(largest, at(np.asarray(working[n], dtype=np.int64), n))
    for (u, v, m), e in zip(time_edges, memory_edges):
        time = time + edge(np.asarray(m, dtype=float), u, v)
        summed = summed + edge(np.asarray(e, dtype=np.int64), u, v)
    return time, summed + largest


def best_under(time, measure, budget):
    """The least time of a strategy whose measure fits `budget` (None: none fits)."""
    fits = measure <= budget
    return float(time[fits].min()) if fits.any() else None


def edge_bytes(memory_edges):
    """search.pareto's edge_bytes over full tables; pairs not `wanted` get a value that must not matter."""
    def lookup(i, rows, cols, wanted=None):
        table = memory_edges[i][np.ix_(rows, cols)]
        return table if wanted is None else np.where(wanted, table, 7)
    return lookup


def measure_of(choice, names, kept, working, time_edges, memory_edges):
    return (sum(int(kept[n][choice[n]]) for n in names) + max(int(working[n][choice[n]]) for n in names)
            + sum(int(e[choice[u], choice[v]]) for (u, v, _), e in zip(time_edges, memory_edges)))


# ---- 1. the front elimination is exact under the measure -----------------------------------------
@st.composite
def problems(draw):
    """Time and memory tables on a graph shape (chains, trees, diamonds, and shapes node elimination
    does not reduce: K4, a 3x3 grid, DenseNet blocks), and a budget between the least and the most
    any strategy takes (sometimes below the least)."""
    name = draw(st.sampled_from(tuple(SHAPES)))
    nodes, pairs = SHAPES[name][0]()
    nodes = draw(st.permutations(nodes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    most = max(2, min(4, int(5_000 ** (1 / len(nodes)))))
    sizes = {n: int(rng.integers(1, most + 1)) for n in nodes}
    ties = draw(st.booleans())

    def times(shape):
        return rng.integers(0, 4, size=shape).astype(float) if ties else rng.uniform(0, 10, size=shape)

    time_unary = {n: times(sizes[n]) for n in nodes}
    kept = {n: rng.integers(0, 100, sizes[n]) for n in nodes}
    working = {n: rng.integers(0, 60, sizes[n]) for n in nodes}
    time_edges, memory_edges = [], []
    for u, v in pairs:
        if rng.random() < 0.5:
            u, v = v, u
        time_edges.append((u, v, times((sizes[u], sizes[v]))))
        memory_edges.append(rng.integers(0, 40, (sizes[u], sizes[v])) * (rng.random((sizes[u], sizes[v])) < 0.6))
    fraction = draw(st.sampled_from([-0.05, 0.0, 0.1, 0.3, 0.6, 1.0]))
    return name, list(nodes), time_unary, time_edges, kept, working, memory_edges, fraction


@settings(RANDOM, max_examples=200)
@given(problems())
def test_front_elimination_equals_brute_force(problem):
    name, names, time_unary, time_edges, kept, working, memory_edges, fraction = problem
    time, measure = enumerate_all(names, time_unary, time_edges, kept, working, memory_edges)
    budget = int(measure.min() + fraction * (measure.max() - measure.min()))
    expected = best_under(time, measure, budget)
    log = minimize(time_unary, time_edges).log
    for few, given_log in [(FEW, None), (0, None), (0, log)]:  # without time bounds, with them, from the log
        found = budget_search(names, time_unary, time_edges, kept, working, edge_bytes(memory_edges), budget,
                              log=given_log, few=few)
        if expected is None:
            assert found is None, name
            continue
        assert found is not None, name
        assert found.time == pytest.approx(expected, rel=1e-9, abs=1e-9), name
        assert set(found.choice) == set(names)
        assert measure_of(found.choice, names, kept, working, time_edges, memory_edges) == found.memory <= budget
    if expected is None:
        return
    least = least_memory(names, time_edges, kept, working, edge_bytes(memory_edges), int(measure.max()) + 1)
    assert least.memory == measure.min()


def test_a_residual_graph_is_solved_by_fixing_a_layer():
    """K5 does not reduce by node elimination: the search fixes layers until it does."""
    names, pairs = SHAPES["k4"][0]()
    rng = np.random.default_rng(5)
    time_unary = {n: rng.uniform(0, 10, 3) for n in names}
    kept = {n: rng.integers(0, 100, 3) for n in names}
    working = {n: rng.integers(0, 60, 3) for n in names}
    time_edges = [(u, v, rng.uniform(0, 10, (3, 3))) for u, v in pairs]
    memory_edges = [rng.integers(0, 40, (3, 3)) for _ in pairs]
    time, measure = enumerate_all(names, time_unary, time_edges, kept, working, memory_edges)
    budget = int(np.median(measure))
    found = budget_search(names, time_unary, time_edges, kept, working, edge_bytes(memory_edges), budget)
    assert found.time == pytest.approx(best_under(time, measure, budget))


# ---- 2. the measure and real graphs --------------------------------------------------------------
def chain_graph(batch=4):
    g = Graph("chain")
    x = g.input("image", (batch, 3, 8, 8))
    y = g.conv2d(x, 4, 3, padding=1, activation="relu", name="conv")
    y = g.pool2d(y, 2, stride=2, mode="max", name="pool")
    y = g.flatten(y, name="flat")
    y = g.linear(y, 6, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def residual_graph(batch=4):
    """A diamond: a conv and the conv after it summed (a residual block)."""
    g = Graph("residual")
    x = g.input("image", (batch, 2, 6, 6))
    a = g.conv2d(x, 4, 3, padding=1, activation="relu", name="a")
    b = g.conv2d(a, 4, 3, padding=1, name="b")
    y = g.add(a, b, name="add")
    y = g.flatten(y, name="flat")
    y = g.linear(y, 3, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def real_problem(graph, machine):
    cost_model = search.CostModel(machine, cache=False, progress=False)
    tables = cost_model.tables(graph)
    memory = MemoryTables(graph, cost_model, tables)
    names = list(graph.layers)
    time_unary = {n: tables.unary(n) for n in names}
    time_edges = [(u, v, m) for u, v, _, m in tables.edges]
    memory_edges = [memory.edge(i) for i in range(len(time_edges))]
    return cost_model, tables, names, time_unary, time_edges, memory, memory_edges


def strategy_of(tables, choice):
    return Strategy({n: tables.configs[n][i] for n, i in choice.items()})


def peak_of(graph, cost_model, strategy):
    return max(m.total for m in step_memory(graph, strategy, cost_model.itemsize).values())


@pytest.mark.parametrize("build, devices", [(chain_graph, 2), (residual_graph, 2), (inception_block, 4)])
def test_the_measure_bounds_the_peak_and_equals_it_for_even_splits(build, devices):
    graph, machine = build(), Machine.simulated(1, devices)
    cost_model, tables, names, _, time_edges, memory, memory_edges = real_problem(graph, machine)
    rng = np.random.default_rng(0)
    for _ in range(40):
        choice = {n: int(rng.integers(len(tables.configs[n]))) for n in names}
        strategy = strategy_of(tables, choice)
        assert measure_of(choice, names, memory.kept, memory.working, time_edges, memory_edges) >= peak_of(
            graph, cost_model, strategy)
    dp = data_parallel(graph, machine).validated(graph, machine)
    choice = {n: list(tables.configs[n]).index(dp[n]) for n in names}
    assert measure_of(choice, names, memory.kept, memory.working, time_edges, memory_edges) == peak_of(
        graph, cost_model, dp)


@pytest.mark.parametrize("build", [chain_graph, residual_graph, inception_block])
def test_edge_tables_count_at_least_what_moves_and_the_fast_ways_agree(build):
    """Every way of counting an edge's table gives at least the exact count (each value once per
    reading device, each slice cut once), and the tabulated way equals the separable one."""
    graph, machine = build(), Machine.simulated(1, 4)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    tables = cost_model.tables(graph)
    memory = MemoryTables(graph, cost_model, tables)
    ways = set()
    for i, (producer, consumer, j, size, _) in enumerate(memory.edges):
        parts, needs = producer.parts, consumer.needs[j].table
        fast = memory._fast_path(producer, consumer, j)
        ways.add(fast[0])
        rows, cols = np.arange(len(parts.starts)), np.arange(len(needs.starts))
        asked = np.ones((len(rows), len(cols)), dtype=bool)
        exact = np.full((len(rows), len(cols)), -1, dtype=np.int64)
        edge_memory.edges_general(parts.lo, parts.hi, parts.device, parts.starts, needs.lo, needs.hi, needs.device,
                                  needs.starts, size, 4, rows, cols, asked, exact)
        counted = memory.edge(i)
        assert (counted >= exact).all(), (producer.key, consumer.key)
        assert (counted[exact == 0] == 0).all()
        if fast[0] in ("tabulated", "separable"):
            reader = edge_memory.local_parts(needs.device, needs.starts, 4)
            classes = edge_memory.need_classes(needs.lo, needs.hi, needs.starts)
            lonely = np.bincount(classes, minlength=len(classes))[classes] == 1
            separable = np.full_like(exact, -1)
            edge_memory.edges_separable(parts.lo, parts.hi, parts.device, parts.starts, parts.hi.max(axis=0),
                                        edge_memory.local_parts(parts.device, parts.starts, 4), needs.lo, needs.hi,
                                        needs.device, needs.starts, needs.degrees, reader, lonely,
                                        np.asarray(consumer.needs[j].driven_by, dtype=np.int64), size, 4, rows, cols,
                                        asked, separable)
            assert (separable == counted).all()
    assert "tabulated" in ways


@pytest.mark.parametrize("build", [chain_graph, residual_graph])
@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("few", [FEW, 0])  # searched in one round, or with time bounds
def test_optimize_under_a_budget_equals_brute_force(build, fraction, few):
    """optimize keeps the unconstrained optimum when its peak fits, otherwise the fastest strategy
    keeping every activation whose measure fits (brute force over every strategy), or one strictly
    faster that recomputes some layers (tests/test_search_recompute.py); either way its peak fits."""
    with mock.patch("taskrt.search.pareto.FEW", few):
        check_optimize_under_a_budget(build, fraction)


def check_optimize_under_a_budget(build, fraction):
    graph, machine = build(), Machine.simulated(1, 2)
    cost_model, tables, names, time_unary, time_edges, memory, memory_edges = real_problem(graph, machine)
    time, measure = enumerate_all(names, time_unary, time_edges, memory.kept, memory.working, memory_edges)
    unconstrained = search.optimize(graph, machine, cost_model, memory=False)
    peak0 = max(m["total"] for m in unconstrained.meta["memory_per_device"].values())
    budget = int(measure.min() + fraction * (peak0 - measure.min()))
    strategy = search.optimize(graph, machine, cost_model, memory=budget)
    assert peak_of(graph, cost_model, strategy) <= budget
    assert strategy.meta["memory_bound"] == (peak0 > budget)
    expected = unconstrained.meta["predicted_step_s"] if peak0 <= budget else best_under(time, measure, budget)
    if strategy.meta.get("recomputed"):
        assert strategy.meta["predicted_step_s"] < expected
    else:
        assert strategy.meta["predicted_step_s"] == pytest.approx(expected, rel=1e-9)


# ---- 3. the budget's forms -----------------------------------------------------------------------
@pytest.mark.parametrize("value, nbytes", [
    ("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 KiB", 1536), ("100", 100),
    (4096, 4096), (np.int64(7), 7), (2.0e9, 2 * 10**9), (None, None), (False, False),
])
def test_budget_forms(value, nbytes):
    assert search.parse_memory(value) == nbytes


@pytest.mark.parametrize("value", ["16 gigabytes", "16Gib", "GiB", "-1GiB", "0", 0, -5, True, "1e9", "", [1], 0.5])
def test_bad_budgets_are_named_with_what_is_valid(value):
    with pytest.raises(ValueError, match=r"memory=.*expected None \(each device's own memory\), False"):
        search.parse_memory(value)


def test_a_bad_budget_fails_before_any_work():
    machine = Machine.simulated(1, 2)
    with mock.patch.object(search.CostModel, "tables", side_effect=AssertionError("worked")), \
            pytest.raises(ValueError, match="memory='lots'"):
        search.optimize(chain_graph(), machine, search.CostModel(machine, cache=False, progress=False), memory="lots")


def test_default_budget_is_each_devices_memory():
    machine = Machine.simulated(1, 2)
    assert budgeting.device_budgets(machine, None) == {0: machine.devices[0].memory, 1: machine.devices[1].memory}
    assert budgeting.device_budgets(machine, False) is None
    assert budgeting.device_budgets(machine, "1GiB") == {0: 2**30, 1: 2**30}


# ---- 4. nothing fits -----------------------------------------------------------------------------
def test_nothing_fits_names_the_smallest_peak_its_device_and_layers_and_the_budget():
    graph, machine = models.vgg16(batch=16, image_size=32, num_classes=10), Machine.simulated(1, 2)
    with pytest.raises(search.MemoryBudgetError) as raised:
        search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory="100MiB")
    assert isinstance(raised.value, MemoryError) and isinstance(raised.value, DeviceMemoryError)
    assert raised.value.devices == (0,)
    text = str(raised.value)
    # recomputing activations lowers it a little (fc2's weights hold most of it)
    assert "the smallest peak found is 335.27 MiB on device 0" in text
    assert "most of it: fc2" in text and "the budget is 100.00 MiB (104857600 bytes)" in text
    assert "recomputing 21 layers' activations in backward" in text
    assert "recomputation was tried for all 21 layers that allow it" in text
    assert "\n" not in text


# ---- 5. the unconstrained path, meta, the checks, replan ----------------------------------------
def test_a_budget_that_does_not_bind_changes_nothing_and_counts_memory_once():
    graph, machine = models.lenet5(batch=32), Machine.simulated(1, 4)
    free = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=False)
    calls = []
    counted = optimize_module.budgeting.memory_of_choice

    def counting(*args):
        calls.append(1)
        return counted(*args)

    with mock.patch.object(optimize_module.budgeting, "memory_of_choice", counting), \
            mock.patch.object(optimize_module, "step_memory", side_effect=AssertionError("counted twice")):
        bounded = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False),
                                  memory="1GiB")
    assert len(calls) == 1
    assert bounded.configs == free.configs
    assert bounded.meta["memory_per_device"] == free.meta["memory_per_device"]
    assert bounded.meta["memory_bound"] is False and bounded.meta["memory_budget"] == 2**30
    assert free.meta["memory_budget"] is None and free.meta["memory_bound"] is False
    assert bounded.meta["search"]["budget_s"] > 0 and "budget" not in bounded.meta["search"]


def test_meta_of_a_budget_that_binds():
    graph, machine = chain_graph(batch=8), Machine.simulated(1, 2)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    free = search.optimize(graph, machine, cost_model, memory=False)
    peak0 = max(m["total"] for m in free.meta["memory_per_device"].values())
    strategy = search.optimize(graph, machine, cost_model, memory=peak0 - 1)
    meta = strategy.meta
    assert meta["memory_bound"] is True and meta["memory_budget"] == peak0 - 1
    assert max(m["total"] for m in meta["memory_per_device"].values()) <= peak0 - 1
    assert meta["predicted_step_s"] >= free.meta["predicted_step_s"]
    assert meta["search"]["budget_s"] > 0
    assert meta["search"]["budget"]["method"].startswith("node and edge elimination over time-memory fronts")
    assert strategy.replan.memory == peak0 - 1


def test_vgg16_on_two_devices_below_data_parallelisms_peak():
    graph, machine = models.vgg16(batch=16, image_size=32, num_classes=10), Machine.simulated(1, 2)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    dp = data_parallel(graph, machine).validated(graph, machine)
    budget = int(0.9 * peak_of(graph, cost_model, dp))
    strategy = search.optimize(graph, machine, cost_model, memory=budget)
    assert peak_of(graph, cost_model, strategy) <= budget
    assert strategy.configs != dp.configs


def test_the_simulation_check_takes_only_candidates_that_fit():
    graph, machine = models.vgg16(batch=16, image_size=32, num_classes=10), Machine.simulated(1, 2)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    dp = data_parallel(graph, machine).validated(graph, machine)
    budget = int(0.9 * peak_of(graph, cost_model, dp))
    strategy = search.optimize(graph, machine, cost_model, check_by_simulation=True, memory=budget)
    assert "data" not in strategy.meta["simulated_step_s"]  # data parallelism does not fit
    assert peak_of(graph, cost_model, strategy) <= budget
    free = search.optimize(graph, machine, cost_model, check_by_simulation=True, memory=False)
    assert "data" in free.meta["simulated_step_s"]


def test_fewer_devices_keeps_only_counts_that_fit():
    graph, machine = chain_graph(batch=8), Machine.simulated(1, 2)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    one = search.optimize(graph, machine.subset([0]), search.CostModel(machine.subset([0]), cache=False,
                                                                        progress=False), memory=False)
    # below one device's least peak, with or without every layer that allows it recomputed
    again = Strategy({n: replace(c, recompute=n in candidates(graph)) for n, c in one.items()})
    budget = min(peak_of(graph, cost_model, one), peak_of(graph, cost_model, again)) - 1
    with pytest.raises(search.MemoryBudgetError):
        search.optimize(graph, machine.subset([0]), search.CostModel(machine.subset([0]), cache=False,
                                                                      progress=False), memory=budget)
    strategy = search.optimize(graph, machine, cost_model, fewer_devices=True, memory=budget)
    assert strategy.meta["device_count"] == 2
    assert max(m["total"] for m in strategy.meta["memory_per_device"].values()) <= budget


def test_replan_searches_again_under_the_same_budget():
    graph, machine = chain_graph(batch=8), Machine.simulated(1, 4)
    free = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=False)
    budget = max(m["total"] for m in free.meta["memory_per_device"].values())
    strategy = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=budget)
    assert strategy.replan.memory == budget
    with mock.patch.object(optimize_module, "optimize", wraps=optimize_module.optimize) as again:
        try:
            replanned = strategy.replan(graph, machine.subset([0, 1]))
            assert max(m["total"] for m in replanned.meta["memory_per_device"].values()) <= budget
        except search.MemoryBudgetError:
            pass
    assert again.call_args.kwargs["memory"] == budget


# ---- 6. the command line -------------------------------------------------------------------------
def test_cli_memory_flag(capsys):
    from taskrt.cli import main

    args = ["search", "--model", "vgg16", "--machine", "simulated:1x2", "--batch-per-device", "8",
            "--image-size", "32", "--classes", "10"]
    assert main([*args, "--memory", "1GiB"]) == 0
    assert "memory budget: 1024.0 MiB per device; the fastest strategy fits" in capsys.readouterr().out
    for value, said in [("lots", "--memory: expected a budget per device such as 16GiB"),
                        ("100MiB", "the smallest peak found is 335.27 MiB")]:
        with pytest.raises(SystemExit) as ended:
            main([*args, "--memory", value])
        text = capsys.readouterr().err + str(ended.value.code)
        assert ended.value.code not in (0, None) and said in text and "Traceback" not in text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "inception_v3"])
def test_large_graphs_fit_their_budget(name):
    machine = Machine.simulated(1, 4)
    graph = models.get(name, batch=16)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    free = search.optimize(graph, machine, cost_model, memory=False)
    peak0 = max(m["total"] for m in free.meta["memory_per_device"].values())
    strategy = search.optimize(graph, machine, cost_model, memory=int(0.995 * peak0))
    assert peak_of(graph, cost_model, strategy) <= int(0.995 * peak0)
    assert strategy.meta["memory_bound"]


def _schedule_case():
    from taskrt.planning.lowering import lower
    from taskrt.planning.peak import peak_memory
    from taskrt.search.optimize import memory_per_device

    graph, machine = models.lenet5(batch=16), Machine.simulated(4, 4)
    strategy = search.model_parallel(graph, machine).validated(graph, machine)
    strategy.meta["memory_per_device"] = memory_per_device(graph, strategy)
    return graph, machine, strategy, peak_memory(lower(graph, strategy), 4, 1)


def test_a_result_whose_schedule_peak_fits_is_kept_with_its_peaks():
    from taskrt.search.optimize import _fit_schedule

    graph, machine, strategy, peaks = _schedule_case()
    budgets = {d: p.needed for d, p in peaks.items()}  # the held peak with the kernels' scratch on top
    assert all(p.scratch > 0 for p in peaks.values())
    kept = _fit_schedule(graph, machine, search.CostModel(machine, cache=False, progress=False), strategy, budgets,
                         lambda tighter: pytest.fail("searched again"))
    assert kept is strategy and kept.meta["schedule_peak_per_device"] == {str(d): p.total for d, p in peaks.items()}
    assert kept.meta["schedule_scratch_per_device"] == {str(d): p.scratch for d, p in peaks.items()}
    with pytest.raises(search.MemoryBudgetError, match="kernels' scratch"):  # the held peaks alone do not fit
        _fit_schedule(graph, machine, search.CostModel(machine, cache=False, progress=False), strategy,
                      {d: p.total for d, p in peaks.items()}, lambda tighter: strategy)


def test_a_result_over_budget_by_the_schedule_is_searched_again_under_a_tighter_budget():
    """The search's sum may count less than the schedule holds (model parallelism's gradient pieces
    from every device at once): then it searches again with each budget scaled down by the excess,
    and says so when no round fits."""
    from taskrt.search.optimize import SCHEDULE_ROUNDS, _fit_schedule

    graph, machine, strategy, peaks = _schedule_case()
    sums = {int(d): m["total"] for d, m in strategy.meta["memory_per_device"].items()}
    assert any(peaks[d].total > sums[d] for d in peaks)  # the case this guards against
    budgets = {d: sums[d] for d in peaks}
    over = max(peaks[d].needed / budgets[d] for d in peaks)
    asked = []

    def search_under(tighter):
        asked.append(tighter)
        return strategy

    with pytest.raises(search.MemoryBudgetError, match="peak under the runtime's schedule") as raised:
        _fit_schedule(graph, machine, search.CostModel(machine, cache=False, progress=False), strategy, budgets,
                      search_under)
    assert len(asked) == SCHEDULE_ROUNDS
    assert asked[0] == {d: int(b / over) for d, b in budgets.items()}
    assert isinstance(raised.value, MemoryError)


def _schedule_search(graph, machine):
    """What optimize does on a Dask cluster (`_within_schedule`), on a simulated machine: the
    searches it asks for, recorded."""
    from taskrt.search.optimize import _optimize

    cost_model = search.CostModel(machine, cache=False, progress=False)
    asked = []

    def search_under(budgets):
        asked.append(budgets)
        return _optimize(graph, machine, cost_model, False, False, False, budgets)

    return cost_model, asked, search_under


def _needed(graph, strategy):
    from taskrt.planning.lowering import lower
    from taskrt.planning.peak import peak_memory

    return max(p.needed for p in peak_memory(lower(graph, strategy), 4, 1).values())


def test_on_a_cluster_the_unconstrained_optimum_is_kept_where_its_schedule_peak_fits_though_its_count_does_not():
    """The search's count holds every value a step ever holds, above the schedule's peak the Trainer
    checks: a budget between them keeps the fastest strategy rather than binding the search."""
    from taskrt.search.optimize import _within_schedule

    graph, machine = models.vgg16(batch=64, image_size=32, num_classes=10), Machine.simulated(1, 2)
    cost_model, asked, search_under = _schedule_search(graph, machine)
    free = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=False)
    counted = max(m["total"] for m in free.meta["memory_per_device"].values())
    needed = _needed(graph, free)
    assert needed < counted  # the case this is about
    budget = (needed + counted) // 2
    by_count = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=budget)
    assert by_count.meta["memory_bound"]  # the count alone binds there
    kept = _within_schedule(graph, machine, cost_model, {0: budget, 1: budget}, search_under)
    assert asked == [None] and kept.configs == free.configs
    assert not kept.meta["memory_bound"] and kept.meta["memory_budget"] == budget
    assert max(kept.meta["schedule_peak_per_device"].values()) <= budget


def test_on_a_cluster_a_binding_budget_is_searched_widened_by_the_counts_looseness_and_its_result_fits():
    from taskrt.search.optimize import _within_schedule

    graph, machine = models.vgg16(batch=64, image_size=32, num_classes=10), Machine.simulated(1, 2)
    cost_model, asked, search_under = _schedule_search(graph, machine)
    free = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=False)
    counted = max(m["total"] for m in free.meta["memory_per_device"].values())
    needed = _needed(graph, free)
    budget = int(needed * 0.97)
    fitted = _within_schedule(graph, machine, cost_model, {0: budget, 1: budget}, search_under)
    assert asked[0] is None and asked[1] == {d: int(budget * counted / needed) for d in (0, 1)}
    assert fitted.meta["memory_bound"] and fitted.configs != free.configs
    assert _needed(graph, fitted) <= budget
    assert fitted.meta["memory_budget"] == budget and fitted.meta["memory_budget_searched"] > budget


def test_on_a_cluster_nothing_fitting_names_the_least_strategys_peak_under_the_schedule():
    from taskrt.search.optimize import _within_schedule

    graph, machine = models.vgg16(batch=64, image_size=32, num_classes=10), Machine.simulated(1, 2)
    cost_model, asked, search_under = _schedule_search(graph, machine)
    with pytest.raises(search.MemoryBudgetError, match=r"Under the runtime's schedule, which a Trainer checks, that "
                       r"strategy needs [\d.]+ MiB on device \d, its kernels' scratch [\d.]+ MiB included; the "
                       r"search.*widened") as raised:
        _within_schedule(graph, machine, cost_model, {0: 2**20, 1: 2**20}, search_under)
    assert raised.value.least is not None and _needed(graph, raised.value.least) > 2**20
    assert asked[0] is None and asked[-1] == {0: 2**20, 1: 2**20}


def test_on_a_cluster_a_binding_budget_measures_once_and_only_what_fits_its_schedule():
    """With check_by_measurement, the searches the scan makes do not train anything: the result and
    the baselines whose schedule's peak fits are measured once at the end."""
    graph, machine = models.vgg16(batch=64, image_size=32, num_classes=10), Machine.simulated(1, 2)
    free = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False), memory=False)
    budget = int(_needed(graph, free) * 0.995)
    pools = []

    def pick(graph, machine, pool):
        pools.append(pool)
        return Strategy({}, meta={"chosen_by_measurement": {"chosen": "layer-wise", "median_step_s": {}}})

    with mock.patch("taskrt.search.measured.pick_by_measurement", pick):
        strategy = search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False),
                                   memory=budget, schedule=True, check_by_measurement=True)
    [pool] = pools
    assert all(_needed(graph, s) <= budget for s in pool.values()) and "data" not in pool  # data: 600 MiB
    assert pool["layer-wise"].configs == strategy.configs and strategy.meta["memory_bound"]
    assert max(strategy.meta["schedule_peak_per_device"].values()) <= budget
