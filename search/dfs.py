"""The paper's baseline: depth-first search over all strategies, with a time limit.

Layers are assigned in graph order; a branch is cut as soon as its partial cost (costs are
never negative) reaches the best complete strategy found so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class DFSResult:
    choice: dict[str, int] | None
    cost: float
    visited: int
    seconds: float
    timed_out: bool


def depth_first(unary: dict, edges: list, time_limit: float = 60.0) -> DFSResult:
    names = list(unary)
    position = {n: i for i, n in enumerate(names)}
    # for each node, the edges to nodes assigned before it, oriented (earlier configs) x (its configs)
    back = {n: [] for n in names}
    for u, v, m in edges:
        m = np.asarray(m, dtype=float)
        if position[u] < position[v]:
            back[v].append((u, m))
        elif position[v] < position[u]:
            back[u].append((v, m.T))
        else:
            unary = {**unary, u: np.asarray(unary[u], dtype=float) + np.diag(m)}
    costs = [np.asarray(unary[n], dtype=float) for n in names]
    best = {"cost": np.inf, "choice": None}
    state = {"visited": 0, "timed_out": False}
    choice: dict[str, int] = {}
    start = time.perf_counter()
    deadline = start + time_limit

    def visit(i, partial):
        if i == len(names):
            if partial < best["cost"]:
                best["cost"], best["choice"] = partial, dict(choice)
            return
        state["visited"] += 1
        if state["visited"] % 4096 == 0 and time.perf_counter() > deadline:
            state["timed_out"] = True
        if state["timed_out"]:
            return
        name = names[i]
        total = costs[i].copy()
        for other, m in back[name]:
            total += m[choice[other]]
        for c in np.argsort(total, kind="stable"):
            if partial + total[c] >= best["cost"]:
                break  # sorted: every later config costs at least as much
            choice[name] = int(c)
            visit(i + 1, partial + total[c])
            if state["timed_out"]:
                return
        choice.pop(name, None)

    visit(0, 0.0)
    return DFSResult(best["choice"], float(best["cost"]), state["visited"], time.perf_counter() - start,
                     state["timed_out"])
