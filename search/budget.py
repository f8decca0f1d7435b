"""search.optimize under a memory budget: the budget's forms, the search's checks and its error.

`optimize(..., memory=...)` takes None (each device's own memory, where the machine knows it),
False (no budget), a number of bytes, or a text such as "16GiB", "512MiB", "2GB" or "1.5TB".
The search (search.pareto over search.memory_tables' measure) finds the fastest strategy by
equation 1 whose measure fits the smallest budget of the devices it uses; the result is checked
with search.memory.step_memory, the accounting the rest of the search reports.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import replace

import numpy as np

from taskrt.machines.devices import DeviceMemoryError
from taskrt.search.memory import step_memory
from taskrt.search.memory_tables import MemoryTables
from taskrt.search.pareto import TooWide, budget_search, least_memory

UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TEXT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
VALID = ("None (each device's own memory), False (no budget), a positive number of bytes, or a text such "
         "as '16GiB', '512MiB', '2GB' (units: " + ", ".join(UNITS) + ")")
ALTERNATIVES = 8  # the next fastest fitting strategies of the final front, tried if the check rejects one


class MemoryBudgetError(DeviceMemoryError):
    """No strategy's predicted step fits the memory budget (a taskrt.DeviceMemoryError, so a
    MemoryError); `devices`: the device of the smallest peak found; `least`: the strategy holding it
    (None where not known)."""

    least = None


def parse_memory(value) -> int | bool | None:
    """Bytes from `value` (see the module docstring); None and False pass through."""
    if value is None or value is False:
        return value
    if isinstance(value, bool):
        raise ValueError(f"memory={value!r}: expected {VALID}")
    if isinstance(value, (int, np.integer)):
        if value <= 0:
            raise ValueError(f"memory={value!r}: a budget must be positive; expected {VALID}")
        return int(value)
    if isinstance(value, float):
        if not np.isfinite(value) or value < 1:
            raise ValueError(f"memory={value!r}: expected {VALID}")
        return int(value)
    if isinstance(value, str):
        match = _TEXT.fullmatch(value)
        unit = (match.group(2) or "B") if match else None
        if unit in UNITS:
            nbytes = int(round(float(match.group(1)) * UNITS[unit]))
            if nbytes >= 1:
                return nbytes
        raise ValueError(f"memory={value!r}: expected {VALID}")
    raise ValueError(f"memory={value!r} ({type(value).__name__}): expected {VALID}")


def device_budgets(machine, memory) -> dict[int, int] | None:
    """The budget of each device (bytes), from `memory` as optimize takes it; None: no budget."""
    nbytes = parse_memory(memory)
    if nbytes is False:
        return None
    if nbytes is None:
        known = {d.id: int(d.memory) for d in machine.devices if d.memory}
        return known or None
    return {d.id: nbytes for d in machine.devices}


def smallest(budgets: dict | None, devices: int) -> int | None:
    """The budget the measure must fit on the first `devices` devices (the smallest of theirs)."""
    if not budgets:
        return None
    known = [b for d, b in budgets.items() if d < devices]
    return min(known) if known else None


def peak(memory: dict) -> tuple[int, int]:
    """(device, bytes) of the largest total in step_memory's {device: DeviceMemory}."""
    device = max(memory, key=lambda d: memory[d].total)
    return int(device), int(memory[device].total)


def fits(memory: dict, budgets: dict | None) -> bool:
    """Whether each device's total (step_memory's, or its JSON form) is within its budget."""
    if not budgets:
        return True
    return all(_total(m) <= budgets.get(int(d), np.inf) for d, m in memory.items())


def _total(m) -> int:
    return m["total"] if isinstance(m, dict) else m.total


def search_fitting(graph, cost_model, tables, keep: dict, unary: dict, edges: list, budget: int, log=None,
                   recompute=None, cap: float = np.inf, memory_tables=None, shared=None):
    """The fastest choice (config index per layer in `tables`) among those in `keep` whose measure
    fits `budget`, checked with step_memory: ((choice, its step_memory), report), or (None, report)
    when none fits.  `unary` and `edges` are the time tables restricted to `keep`; `log` the
    unconstrained search's records of them (search.eliminate.Result.log).  `recompute`: (a
    search.recompute_tables.RecomputeTables, the set of layers recomputed), the tables changed
    accordingly; `cap`: only a choice no slower is sought; `shared`: search.pareto.budget_search's (one
    dict for the searches of one graph, the first keeping every activation).  report["time_s"]: the
    result's time."""
    started = time.perf_counter()
    memory_tables = memory_tables or MemoryTables(graph, cost_model, tables)
    names = list(graph.layers)
    kept_bytes = {n: memory_tables.kept[n][keep[n]] for n in names}
    working = {n: memory_tables.working[n][keep[n]] for n in names}
    edge_working, recomputed = None, frozenset()
    if recompute is not None and recompute[1]:
        again, recomputed = recompute[0], frozenset(recompute[1])
        unary, edges, kept_bytes, working, edge_working = again.problem(recomputed, keep, unary, edges, kept_bytes,
                                                                        working)
        log = None  # other time tables than the unconstrained search's

    def edge_bytes(i, rows, cols, wanted=None):
        u, v = edges[i][0], edges[i][1]
        return memory_tables.edge(i, keep[u][rows], keep[v][cols], wanted)

    method = "node and edge elimination over time-memory fronts (exact under the measure)"
    try:
        found = budget_search(names, unary, edges, kept_bytes, working, edge_bytes, budget,
                              alternatives=ALTERNATIVES, log=log, edge_working=edge_working, cap=cap, shared=shared)
    except TooWide:
        found, method = _approximate(names, unary, edges, kept_bytes, _folded(working, edges, edge_working),
                                     edge_bytes, budget), (
            "approximate: the graph is too wide to search exactly under the budget")
        if found is not None and found.time > cap:
            found = None
    report = {"method": method, "budget_bytes": budget, "tables_s": memory_tables.seconds}
    if found is None:
        report["search_s"] = time.perf_counter() - started
        return None, report
    report.update(rounds=found.rounds, points=found.points, measure_bytes=found.memory,
                  pareto_points=len(found.front))
    for k, local in enumerate(itertools.chain([found.choice], found.alternatives)):  # each traced back as needed
        choice = {n: int(keep[n][i]) for n, i in local.items()}
        memory = memory_of_choice(graph, cost_model, tables, choice, recomputed)
        if peak(memory)[1] <= budget:
            report.update(checked=k + 1, search_s=time.perf_counter() - started, time_s=found.front[k][0])
            return (choice, memory), report
    report["search_s"] = time.perf_counter() - started
    report["rejected_by_check"] = True
    return None, report


def _folded(working, edges, edge_working):
    """Per layer working sets bounding the edges' too (each consumer's, over its producer's configs)."""
    if edge_working is None:
        return working
    out = dict(working)
    for (_, v, _), x in zip(edges, edge_working):
        if x is not None:
            out[v] = np.maximum(out[v], x.max(axis=0))
    return out


def memory_of_choice(graph, cost_model, tables, choice: dict, recomputed=frozenset()) -> dict:
    """step_memory of the strategy taking config `choice[layer]` of `tables` per layer, the layers
    in `recomputed` recomputed."""
    strategy = strategy_of_choice(tables, choice, recomputed)
    return step_memory(graph, strategy, cost_model.itemsize,
                       lambda layer, config: cost_model.regions(layer, config, choice[layer.name]),
                       cost_model.channel_params, len(cost_model.optimizer.slots))


def strategy_of_choice(tables, choice: dict, recomputed=frozenset()):
    """The Strategy taking config `choice[layer]` of `tables`, the layers in `recomputed` recomputed."""
    from taskrt.graph.strategy import Strategy

    configs = {n: tables.configs[n][i] for n, i in choice.items()}
    return Strategy({n: replace(c, recompute=True) if n in recomputed else c for n, c in configs.items()})


def _approximate(names, unary, edges, kept_bytes, working, edge_bytes, budget):
    """A graph whose residual is too wide for exact search: the unconstrained search's own method
    (search.eliminate, approximate there too) on time plus a memory weight, the weight doubled
    until the result's measure fits; the fastest fitting one."""
    from taskrt.search.eliminate import minimize
    from taskrt.search.pareto import Found

    memory_edges = [edge_bytes(i, np.arange(len(kept_bytes[u])), np.arange(len(kept_bytes[v])))
                    for i, (u, v, _) in enumerate(edges)]
    scale = max(float(np.mean([np.mean(t) for t in unary.values()])), 1e-12) / max(budget, 1)
    for weight in [0.0] + [scale * 2.0**k for k in range(-4, 40, 2)]:
        result = minimize({n: unary[n] + weight * (kept_bytes[n] + working[n]) for n in names},
                          [(u, v, m + weight * e) for (u, v, m), e in zip(edges, memory_edges)])
        c = result.choice
        measure = (sum(int(kept_bytes[n][c[n]]) for n in names) + max(int(working[n][c[n]]) for n in names)
                   + sum(int(e[c[u], c[v]]) for (u, v, _), e in zip(edges, memory_edges)))
        if measure <= budget:
            t = sum(float(unary[n][c[n]]) for n in names) + sum(float(m[c[u], c[v]]) for u, v, m in edges)
            return Found(c, t, measure, [(t, measure)], 1, 0, 0.0)
    return None


def nothing_fits(graph, machine, cost_model, tables, keep: dict, edges: list, budgets: dict, devices: int,
                 recompute: bool = False):
    """The MemoryBudgetError for a search where no strategy fits: it names the smallest peak found
    (the strategy with the least measure, its peak by step_memory), the device it is on, the
    layers that hold most of it there, and the budget.  With `recompute`, the least measure with
    every layer that can be recomputed recomputed is tried as well, and the message says so."""
    from taskrt.search.recompute_tables import RecomputeTables, candidates

    memory_tables = MemoryTables(graph, cost_model, tables)
    if recompute:
        recompute = (RecomputeTables(graph, cost_model, tables, memory_tables), candidates(graph))
    tried = [frozenset()] + ([frozenset(recompute[1])] if recompute is not None and recompute[1] else [])
    smallest_found = None
    for recomputed in tried:
        choice, measure = _least_memory_choice(graph, memory_tables, keep, edges,
                                               recompute[0] if recomputed else None, recomputed)
        memory = memory_of_choice(graph, cost_model, tables, choice, recomputed)
        if smallest_found is None or peak(memory)[1] < peak(smallest_found[1])[1]:
            smallest_found = (choice, memory, recomputed, measure)
    choice, memory, recomputed, measure = smallest_found
    device, nbytes = peak(memory)
    by_device = {n: memory_tables.by_device[n][choice[n]] for n in graph.layers}
    for n in recomputed:  # their outputs are not kept
        by_device[n] = by_device[n] - recompute[0].outputs(n)[choice[n]]
    holders = sorted(((int(by_device[n][device]), n) for n in graph.layers if device < len(by_device[n])),
                     reverse=True)[:3]
    held = ", ".join(f"{n} {_size(b)}" for b, n in holders if b > 0)
    where = f" of the first {devices}" if devices < machine.num_devices else ""
    budget = smallest(budgets, devices)
    again = ""
    if len(tried) > 1:
        again = (f", recomputing {len(recomputed)} layers' activations in backward" if recomputed else
                 ", keeping every activation (recomputing them in backward does not lower it)")
    if nbytes <= budget and measure is not None:  # the search takes a strategy by its measure, an upper bound
        again += f", though its measure, which the search must fit, is {_size(measure)}"
    if len(tried) > 1:
        again += f"; recomputation was tried for all {len(tried[1])} layers that allow it"
    error = MemoryBudgetError(
        f"no strategy for {graph.name!r} fits in {_size(budget)} per device{where} on {machine.description}: "
        f"the smallest peak found is {_size(nbytes)} on device {device}"
        + (f" (most of it: {held})" if held else "") + again
        + f"; the budget is {_size(budget)} ({budget} bytes). Use more devices, a smaller batch, or a larger budget.",
        devices=(device,))
    error.least = strategy_of_choice(tables, choice, recomputed)
    return error


def _least_memory_choice(graph, memory_tables, keep, edges, again, recomputed) -> tuple:
    """The choice (config index per layer in the tables) of least measure, `recomputed` recomputed,
    and its measure (None where the graph is too wide to search for it)."""
    names = list(graph.layers)
    kept_bytes = {n: memory_tables.kept[n][keep[n]] for n in names}
    working = {n: memory_tables.working[n][keep[n]] for n in names}
    edge_working = None
    if recomputed:
        _, _, kept_bytes, working, edge_working = again.problem(recomputed, keep, {n: np.zeros(len(keep[n]))
                                                                                   for n in names},
                                                                edges, kept_bytes, working)

    def edge_bytes(i, rows, cols):
        return memory_tables.edge(i, keep[edges[i][0]][rows], keep[edges[i][1]][cols])

    # below the measure of the most split strategy (every layer on its least-memory config) plus one
    least = {n: int(np.argmin(kept_bytes[n] + working[n])) for n in names}
    ceiling = (sum(int(kept_bytes[n][least[n]]) for n in names) + max(int(working[n][least[n]]) for n in names)
               + sum(int(edge_bytes(i, [least[u]], [least[v]])[0, 0]) for i, (u, v, _) in enumerate(edges)) + 1)
    if edge_working is not None:
        ceiling += max((int(x[least[u], least[v]]) for (u, v, _), x in zip(edges, edge_working) if x is not None),
                       default=0)
    try:
        found = least_memory(names, edges, kept_bytes, working, edge_bytes, ceiling, edge_working)
    except TooWide:
        found = None
    return {n: int(keep[n][(found.choice if found else least)[n]]) for n in names}, found.memory if found else None


def _size(nbytes) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
