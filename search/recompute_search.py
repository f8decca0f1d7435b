"""The search under a memory budget with recomputation as a per-layer choice.

Recomputing a layer only costs time, so it is considered only where the budget binds: when the
fastest strategy keeping every activation (search.budget.search_fitting) does not exist, or
when recomputing some layers could let faster configs fit.  For a fixed set R of recomputed
layers the search is the exact one over configs (search.recompute_tables gives its tables);
the sets tried are a small family:

- the layers that can be recomputed (search.recompute_tables.candidates) ranked by the bytes
  recomputing them saves (a(L, c) with and without the output, at the unconstrained optimum's
  config) per second it costs (the forward again, and the forward transfers again): layers
  cheap for their output first (pools, activations, a convolution with few input channels),
  the costly convolutions later;
- the prefixes of that ranking of sizes 1, 2, 4, ... and all of them, in order.

A set is searched only for strategies faster than the best fitting one so far, and the sets
stop once a lower bound of a set's time (the unconstrained optimum plus each recomputed
layer's cheapest forward) reaches it: the prefixes grow, and so does the bound.  The result is
the fastest fitting strategy over the sets tried: exact over configs for each set, a heuristic
over the sets (copies' lifetimes span layers, so a joint exact front would need terms that are
not local to a layer or an edge).
"""

from __future__ import annotations

import time

import numpy as np

from taskrt.search.budget import search_fitting
from taskrt.search.memory_tables import MemoryTables
from taskrt.search.recompute_tables import RecomputeTables, candidates


def fit_budget(graph, cost_model, tables, keep: dict, unary: dict, edges: list, budget: int, optimum: dict,
               optimum_s: float):
    """The fastest fitting choice under `budget` with recomputation: ((choice, step_memory) or None,
    the layers recomputed, report, the RecomputeTables that priced them).  `unary`, `edges`: the time
    tables restricted to `keep`; `optimum`: the unconstrained optimum's config index per layer in
    `tables`, `optimum_s` its time."""
    memory_tables = MemoryTables(graph, cost_model, tables)
    shared = {}  # the plan and time bounds of the search keeping everything: lower bounds for every set's
    fitting, report = search_fitting(graph, cost_model, tables, keep, unary, edges, budget,
                                     memory_tables=memory_tables, shared=shared)
    started = time.perf_counter()
    again = RecomputeTables(graph, cost_model, tables, memory_tables)
    best = fitting, frozenset(), report
    best_s = report["time_s"] if fitting is not None else np.inf
    ranking = ranked(again, optimum)
    tried = []
    for size in family_sizes(len(ranking)):
        recomputed = frozenset(ranking[:size])
        least_s = optimum_s + sum(float(again.forward(n)[keep[n]].min()) for n in recomputed)
        if least_s >= best_s * (1 - 1e-9):  # no set from here on can be faster
            break
        found, found_report = search_fitting(graph, cost_model, tables, keep, unary, edges, budget,
                                             recompute=(again, recomputed), cap=best_s * (1 - 1e-9),
                                             memory_tables=memory_tables, shared=shared)
        tried.append({"layers": size, "fits": found is not None, "time_s": found_report.get("time_s"),
                      "search_s": found_report["search_s"]})
        if found is not None:
            best, best_s = (found, recomputed, found_report), found_report["time_s"]
    fitting, recomputed, report = best
    report = dict(report, recompute={"candidates": len(ranking), "tried": tried, "recomputed": len(recomputed),
                                     "seconds": time.perf_counter() - started})
    return fitting, recomputed, report, again


def family_sizes(count: int) -> list[int]:
    """The prefix sizes tried: 1, 2, 4, ... below `count`, and `count`."""
    return [1 << i for i in range(count.bit_length()) if 1 << i < count] + ([count] if count else [])


def ranked(again: RecomputeTables, optimum: dict) -> list[str]:
    """The layers that can be recomputed and save bytes at `optimum`'s configs, the most bytes
    saved per second recomputed first."""
    rate = {}
    for name in candidates(again.graph):
        c = optimum[name]
        saved = int(again.memory.kept[name][c] - again.kept_without_output(name)[c])
        if saved <= 0:
            continue
        forward, resent = again.seconds_again(name, optimum)
        rate[name] = saved / max(forward + sum(resent.values()), 1e-12)
    return sorted(rate, key=lambda n: (-rate[n], again.position[n]))
