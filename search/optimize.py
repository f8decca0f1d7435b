"""search.optimize: the strategy with the lowest predicted step time under the cost model."""

from __future__ import annotations

import time

from search.cost import Breakdown, CostModel
from search.eliminate import minimize
from taskrt.strategy import Strategy


def optimize(graph, machine, cost_model: CostModel | None = None) -> Strategy:
    """Node and edge elimination over the cost tables; exact for any graph.

    The returned Strategy's `meta` holds the predicted cost per layer (t_c, t_x, t_s, seconds),
    the total, how far eliminations reduced the graph, and how long the search took.
    """
    cost_model = cost_model or CostModel(machine)
    started = time.perf_counter()
    tables = cost_model.tables(graph)
    built = time.perf_counter()
    unary = {name: tables.unary(name) for name in graph.layers}
    edges = [(u, v, m) for u, v, _, m in tables.edges]
    result = minimize(unary, edges)
    finished = time.perf_counter()
    choice = result.choice
    configs = {name: tables.configs[name][i] for name, i in choice.items()}
    t_x = {name: 0.0 for name in graph.layers}
    for u, v, _, m in tables.edges:
        t_x[v] += float(m[choice[u], choice[v]])
    breakdown = Breakdown({n: float(tables.compute[n][choice[n]]) for n in graph.layers},
                          {n: float(tables.sync[n][choice[n]]) for n in graph.layers}, t_x, tables.estimated)
    meta = {
        "predicted_step_s": breakdown.total,
        "estimated": tables.estimated,
        "per_layer_s": {n: {"t_c": breakdown.t_c[n], "t_x": breakdown.t_x[n], "t_s": breakdown.t_s[n]}
                        for n in graph.layers},
        "search": {"tables_s": built - started, "optimize_s": finished - built, "configs": sum(
            len(c) for c in tables.configs.values()), "reduced_nodes": result.reduced_nodes,
            "reduced_edges": result.reduced_edges, "eliminations": result.eliminations, "method": result.method},
        "machine": machine.description,
    }
    return Strategy(configs, name="layer-wise", meta=meta)
