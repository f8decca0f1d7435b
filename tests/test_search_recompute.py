"""Recomputation as a choice of the search under a memory budget (search.recompute_search).

- a budget no strategy keeping every activation meets (by the search's measure) gets a strategy
  recomputing some layers, whose step_memory fits, whose predicted time is the cost model's
  for it, and which trains exactly: float64 gradients equal bit for bit to the same configs
  keeping everything and to one device's;
- without a budget, or with one the unconstrained optimum meets, nothing is recomputed and the
  recomputation search does not run;
- against brute force on a tiny graph: for every set of recomputed layers in the family the
  search tries (nothing, then prefixes of its ranking), every strategy is enumerated with the
  same time and measure tables; the search's result is the fastest strategy over all of them
  whose measure fits, and the measure is at least step_memory's peak of every strategy.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest

from taskrt import Graph, search
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.search import budget as budgeting
from taskrt.search.memory import step_memory
from taskrt.search.memory_tables import UNKNOWN, MemoryTables
from taskrt.search.recompute_search import family_sizes, ranked
from taskrt.search.recompute_tables import RecomputeTables, candidates
from tests.test_recompute import check_recomputation
from tests.test_search_budget import residual_graph

recompute_search = sys.modules["taskrt.search.recompute_search"]


def tiny(batch=4):
    g = Graph("tiny")
    x = g.input("image", (batch, 2, 6, 6))
    y = g.conv2d(x, 4, 3, padding=1, name="conv")
    y = g.relu(y, name="relu")
    y = g.pool2d(y, 2, stride=2, mode="max", name="pool")
    y = g.flatten(y, name="flat")
    y = g.linear(y, 3, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def relu_chain(batch=8, size=16):
    g = Graph("relu_chain")
    x = g.input("image", (batch, 3, size, size))
    y = g.conv2d(x, 8, 3, padding=1, name="conv1")
    y = g.relu(y, name="relu1")
    y = g.conv2d(y, 8, 3, padding=1, name="conv2")
    y = g.relu(y, name="relu2")
    y = g.pool2d(y, 2, stride=2, mode="max", name="pool")
    y = g.flatten(y, name="flat")
    y = g.linear(y, 4, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


class Problem:
    """A graph's tables on a simulated machine, with the recomputation tables and the family."""

    def __init__(self, graph, devices=2):
        self.graph, self.machine = graph, Machine.simulated(1, devices)
        self.cost_model = search.CostModel(self.machine, cache=False, progress=False)
        self.tables = self.cost_model.tables(graph)
        self.memory = MemoryTables(graph, self.cost_model, self.tables)
        self.again = RecomputeTables(graph, self.cost_model, self.tables, self.memory)
        self.names = list(graph.layers)
        self.keep = {n: np.arange(len(self.tables.configs[n])) for n in self.names}
        self.unary = {n: self.tables.unary(n) for n in self.names}
        self.edges = [(u, v, m) for u, v, _, m in self.tables.edges]
        self.free = search.optimize(graph, self.machine, self.cost_model, memory=False)
        optimum = {n: list(self.tables.configs[n]).index(self.free[n]) for n in self.names}
        order = ranked(self.again, optimum)
        self.family = [frozenset()] + [frozenset(order[:size]) for size in family_sizes(len(order))]

    def least_measure(self, recomputed) -> int:
        return budgeting._least_memory_choice(self.graph, self.memory, self.keep, self.edges, self.again,
                                              recomputed)[1]

    def enumerate(self, recomputed):
        """(time, measure) of every strategy with `recomputed` recomputed, over the product of configs."""
        unary, edges, kept, working, edge_working = self.again.problem(
            recomputed, self.keep, self.unary, self.edges, {n: self.memory.kept[n] for n in self.names},
            {n: self.memory.working[n] for n in self.names})
        axis = {n: i for i, n in enumerate(self.names)}

        def at(values, *nodes):
            shape = [1] * len(self.names)
            for n, size in zip(nodes, values.shape):
                shape[axis[n]] = size
            return values.reshape(shape)

        time, summed, largest = 0.0, 0, 0
        for n in self.names:
            time = time + at(np.asarray(unary[n], float), n)
            summed = summed + at(np.asarray(kept[n], np.int64), n)
            largest = np.maximum(largest, at(np.asarray(working[n], np.int64), n))
        for i, (u, v, m) in enumerate(edges):
            time = time + at(np.asarray(m, float), u, v)
            summed = summed + at(self.memory.edge(i), u, v)
            if edge_working[i] is not None:
                largest = np.maximum(largest, at(edge_working[i], u, v))
        return time, summed + largest

    def strategy(self, index, recomputed) -> Strategy:
        choice = dict(zip(self.names, np.unravel_index(index, [len(self.keep[n]) for n in self.names])))
        return budgeting.strategy_of_choice(self.tables, {n: int(i) for n, i in choice.items()}, recomputed)


def peak(graph, strategy) -> int:
    return max(m.total for m in step_memory(graph, strategy, 4).values())


def without_recomputation(strategy) -> Strategy:
    return Strategy({n: replace(c, recompute=False) for n, c in strategy.items()})


@pytest.mark.parametrize("build", [tiny, relu_chain])
def test_a_budget_only_recomputation_meets_trains_exactly(build):
    problem = Problem(build())
    graph, cost_model = problem.graph, problem.cost_model
    keeping = problem.least_measure(frozenset())
    assert problem.least_measure(frozenset(candidates(graph))) < keeping  # recomputing lowers the least measure
    budget = keeping - 1
    with mock.patch.object(recompute_search, "ranked", return_value=[]), pytest.raises(search.MemoryBudgetError):
        search.optimize(graph, problem.machine, cost_model, memory=budget)  # keeping every activation: nothing fits
    strategy = search.optimize(graph, problem.machine, cost_model, memory=budget)
    recomputed = [n for n, c in strategy.items() if c.recompute]
    assert recomputed and strategy.meta["recomputed"] == recomputed
    assert peak(graph, strategy) <= budget
    assert strategy.meta["predicted_step_s"] == pytest.approx(cost_model.breakdown(graph, strategy).total, rel=1e-9)
    assert strategy.meta["predicted_step_s"] > problem.free.meta["predicted_step_s"]
    report = strategy.meta["search"]["budget"]["recompute"]
    assert report["recomputed"] == len(recomputed) and report["seconds"] > 0
    assert any(tried["fits"] for tried in report["tried"])
    check_recomputation(graph, without_recomputation(strategy), strategy)


def test_no_budget_or_one_the_optimum_meets_recomputes_nothing():
    graph, machine = relu_chain(), Machine.simulated(1, 2)
    cost_model = search.CostModel(machine, cache=False, progress=False)
    with mock.patch("taskrt.search.optimize.fit_budget", side_effect=AssertionError("searched with recomputation")):
        free = search.optimize(graph, machine, cost_model, memory=False)
        ample = search.optimize(graph, machine, cost_model,
                                memory=max(m["total"] for m in free.meta["memory_per_device"].values()))
    for strategy in (free, ample):
        assert not any(c.recompute for c in strategy.configs.values())
    assert ample.configs == free.configs and ample.meta["recomputed"] == []
    assert "recomputed" not in free.meta


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.6, 0.9])
def test_the_result_is_the_fastest_over_the_family_by_brute_force(fraction):
    problem = Problem(tiny())
    graph = problem.graph
    enumerated = {r: problem.enumerate(r) for r in problem.family}
    least = min(int(measure.min()) for _, measure in enumerated.values())
    peak0 = max(m["total"] for m in problem.free.meta["memory_per_device"].values())
    budget = int(least + fraction * (peak0 - least))
    best = min((float(time[measure <= budget].min()), len(r)) for r, (time, measure) in enumerated.items()
               if (measure <= budget).any())
    strategy = search.optimize(graph, problem.machine, problem.cost_model, memory=budget)
    recomputed = frozenset(strategy.meta["recomputed"])
    assert recomputed in problem.family
    assert strategy.meta["predicted_step_s"] == pytest.approx(best[0], rel=1e-9)
    assert peak(graph, strategy) <= budget


@pytest.mark.parametrize("build", [tiny, residual_graph])
def test_the_measure_with_recomputed_layers_bounds_the_peak(build):
    problem = Problem(build())
    rng = np.random.default_rng(0)
    sets = problem.family + [frozenset(s) for k in (1, 2) for s in itertools.combinations(candidates(problem.graph), k)]
    for recomputed in sets:
        _, measure = problem.enumerate(recomputed)
        flat = measure.ravel()
        allowed = np.flatnonzero(flat < UNKNOWN)  # not a config recomputation leaves out
        for index in rng.choice(allowed, 25, replace=False):
            assert flat[index] >= peak(problem.graph, problem.strategy(index, recomputed)), sorted(recomputed)
