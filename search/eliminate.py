"""Exact minimization of a sum of per-node and per-edge costs by node and edge elimination.

The problem: choose one config index per node to minimize
    sum_v unary[v][c_v] + sum_(u,v) pair[u,v][c_u, c_v].
- Edge elimination: parallel edges between the same two nodes are summed into one.
- Node elimination (the paper's, on the undirected graph): a node with two neighbours u, w is
  replaced by an edge (u, w) whose cost for (c_u, c_w) is the best over its own configs; the
  argmin table is kept to undo it.  A node with one neighbour folds into that neighbour's
  unary cost the same way; a node with none is decided on its own.
- What is left is enumerated when small; otherwise (a graph that does not reduce, e.g. an
  Inception-style block) exact variable elimination over the remaining factors finishes it,
  while its tables stay under VE_LIMIT entries.  A graph whose treewidth makes them larger (a
  DenseNet block: each layer reads every feature map before it, so eliminating one joins them
  all) is finished approximately, and the result says so: the exact optimum of a spanning tree
  of the reduced graph (its heaviest edges), then local search over every edge (each node in
  turn takes its best config given its neighbours') until nothing improves.
- Undoing the eliminations in reverse order recovers an optimal config for every node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import product

import numba
import numpy as np

ENUMERATE_LIMIT = 10_000  # config combinations of the reduced graph enumerated directly (a Python loop)
VE_LIMIT = 20_000_000  # entries of one variable-elimination table at most (160 MB); past it, approximate


@dataclass
class Result:
    choice: dict[str, int]
    cost: float
    reduced_nodes: int  # size of the graph left after node and edge eliminations
    reduced_edges: int
    eliminations: int
    method: str  # how the reduced graph was solved
    log: list = field(default_factory=list, repr=False)


class _Graph:
    def __init__(self, unary, edges):
        self.unary = {k: np.asarray(v, dtype=float).copy() for k, v in unary.items()}
        self.pair: dict[tuple[str, str], np.ndarray] = {}  # key (u, v) with u < v in node order
        self.order = {name: i for i, name in enumerate(self.unary)}
        self.adj: dict[str, set[str]] = {name: set() for name in self.unary}
        for u, v, matrix in edges:
            self.add_edge(u, v, np.asarray(matrix, dtype=float))

    def key(self, u, v):
        return (u, v) if self.order[u] < self.order[v] else (v, u)

    def matrix(self, u, v) -> np.ndarray:
        """Edge cost oriented (configs of u) x (configs of v)."""
        k = self.key(u, v)
        return self.pair[k] if k == (u, v) else self.pair[k].T

    def add_edge(self, u, v, matrix):
        if u == v:  # a layer reading one tensor twice: only the diagonal is possible
            self.unary[u] += np.diag(matrix)
            return
        k = self.key(u, v)
        oriented = matrix if k == (u, v) else matrix.T
        self.pair[k] = self.pair[k] + oriented if k in self.pair else oriented  # edge elimination
        self.adj[u].add(v)
        self.adj[v].add(u)

    def remove(self, v):
        for u in self.adj.pop(v):
            self.adj[u].discard(v)
            del self.pair[self.key(u, v)]
        del self.unary[v]


def minimize(unary: dict, edges: list) -> Result:
    """`unary`: name -> costs per config; `edges`: (u, v, matrix configs(u) x configs(v))."""
    g = _Graph(unary, edges)
    log = []  # undo records, in elimination order
    # The first node (in node order) with at most two neighbours goes next.  Eliminating a node
    # never adds to a neighbour's degree, so a node that qualifies stays qualified: a heap of
    # the qualified ones by node order finds it without scanning the graph.
    ready = [g.order[n] for n in g.unary if len(g.adj[n]) <= 2]
    heapq.heapify(ready)
    queued = set(ready)
    names = list(g.unary)
    while ready:
        v = names[heapq.heappop(ready)]
        neighbours = sorted(g.adj[v], key=g.order.get)
        own = g.unary[v]
        # Each record keeps the (never modified) arrays it minimized over, so undoing it finds
        # v's best config for its neighbours' choices in O(configs of v), and eliminating
        # needs only the minimum, not the argmin table.
        if len(neighbours) == 0:
            log.append(("free", v, own))
            g.remove(v)
        elif len(neighbours) == 1:
            (u,) = neighbours
            edge = g.matrix(u, v)
            g.unary[u] = g.unary[u] + (edge + own[None, :]).min(axis=1)
            log.append(("leaf", v, u, edge, own))
            g.remove(v)
        else:
            u, w = neighbours
            left, right = g.matrix(u, v), g.matrix(v, w)
            merged = min_plus(left + own[None, :], right)
            g.remove(v)
            log.append(("node", v, u, w, left, own, right))
            g.add_edge(u, w, merged)
        for u in neighbours:  # each lost v (and may have gained the other)
            if g.order[u] not in queued and len(g.adj[u]) <= 2:
                queued.add(g.order[u])
                heapq.heappush(ready, g.order[u])
    reduced_nodes, reduced_edges = len(g.unary), len(g.pair)
    eliminations = len(log)
    if not g.unary:
        choice, method = {}, "eliminations only"
    elif np.prod([len(c) for c in g.unary.values()], dtype=float) <= ENUMERATE_LIMIT:
        choice, method = _enumerate(g), "enumeration"
    else:
        try:
            choice, method = _variable_elimination(g), "variable elimination"
        except TooWide as wide:
            choice = _approximate(g)
            method = (f"approximate: a spanning tree's optimum, then local search (exact elimination would need "
                      f"a table of {wide.entries:.3g} entries)")
    for record in reversed(log):
        kind, v = record[0], record[1]
        if kind == "free":
            choice[v] = int(np.argmin(record[2]))
        elif kind == "leaf":
            _, _, u, edge, own = record
            choice[v] = int(np.argmin(edge[choice[u]] + own))
        else:
            _, _, u, w, left, own, right = record
            choice[v] = int(np.argmin(left[choice[u]] + own + right[:, choice[w]]))
    cost = evaluate(unary, edges, choice)
    return Result(choice, cost, reduced_nodes, reduced_edges, eliminations, method, log)


@numba.njit(cache=True, nogil=True)
def min_plus(a, b):
    """(min, +) matrix product: out[u, w] = min over v of a[u, v] + b[v, w].

    Four rows of out at a time: each row of b, streamed from memory, updates all four, and the
    loop along it vectorizes."""
    rows, inner = a.shape
    cols = b.shape[1]
    out = np.full((rows, cols), np.inf)
    for g in range(rows // 4):
        u = 4 * g
        o0, o1, o2, o3 = out[u], out[u + 1], out[u + 2], out[u + 3]
        for v in range(inner):
            x0, x1, x2, x3 = a[u, v], a[u + 1, v], a[u + 2, v], a[u + 3, v]
            row = b[v]
            for w in range(cols):
                y = row[w]
                if x0 + y < o0[w]:
                    o0[w] = x0 + y
                if x1 + y < o1[w]:
                    o1[w] = x1 + y
                if x2 + y < o2[w]:
                    o2[w] = x2 + y
                if x3 + y < o3[w]:
                    o3[w] = x3 + y
    for u in range(rows - rows % 4, rows):
        o = out[u]
        for v in range(inner):
            x = a[u, v]
            row = b[v]
            for w in range(cols):
                if x + row[w] < o[w]:
                    o[w] = x + row[w]
    return out


def evaluate(unary: dict, edges: list, choice: dict) -> float:
    total = sum(float(np.asarray(costs)[choice[name]]) for name, costs in unary.items())
    return total + sum(float(np.asarray(m)[choice[u], choice[v]]) for u, v, m in edges)


def _enumerate(g: _Graph) -> dict:
    names = list(g.unary)
    best, best_cost = None, np.inf
    for combo in product(*(range(len(g.unary[n])) for n in names)):
        choice = dict(zip(names, combo))
        cost = sum(g.unary[n][c] for n, c in choice.items())
        cost += sum(m[choice[u], choice[v]] for (u, v), m in g.pair.items())
        if best is None or cost < best_cost:  # the first combination stands when every one costs inf
            best, best_cost = choice, cost
    return {n: int(c) for n, c in best.items()}


class TooWide(Exception):
    """Variable elimination would make a table of `entries` entries (more than VE_LIMIT)."""

    def __init__(self, entries: float):
        super().__init__(entries)
        self.entries = entries


def _variable_elimination(g: _Graph) -> dict:
    """Exact min-sum variable elimination (min-degree order) over unary and pairwise factors;
    TooWide before any table past VE_LIMIT entries."""
    factors = [((n,), g.unary[n]) for n in g.unary] + [((u, v), m) for (u, v), m in g.pair.items()]
    remaining = list(g.unary)
    sizes = {n: len(g.unary[n]) for n in g.unary}
    undo = []
    while remaining:
        def degree(n, factors=factors):
            return len({x for vars_, _ in factors if n in vars_ for x in vars_})

        v = min(remaining, key=degree)
        remaining.remove(v)
        touching = [f for f in factors if v in f[0]]
        factors = [f for f in factors if v not in f[0]]
        scope = sorted({x for vars_, _ in touching for x in vars_} - {v}, key=g.order.get)
        axes = [*scope, v]
        entries = float(np.prod([sizes[x] for x in axes], dtype=float))
        if entries > VE_LIMIT:
            raise TooWide(entries)
        total = np.zeros([sizes[x] for x in axes])
        for vars_, table in touching:
            total = total + _expand(table, vars_, axes)
        best = np.argmin(total, axis=-1)
        factors.append((tuple(scope), np.take_along_axis(total, best[..., None], axis=-1)[..., 0]))
        undo.append((v, scope, best))
    choice = {}
    for v, scope, best in reversed(undo):
        choice[v] = int(best[tuple(choice[x] for x in scope)]) if scope else int(best)
    return choice


def _approximate(g: _Graph) -> dict:
    """A good assignment of a graph too wide for exact elimination: the exact optimum over a maximum
    spanning tree of its edges (weighted by how much each edge's cost can vary), then iterated
    conditional modes over all edges until no node improves (each pass lowers the cost, so it ends)."""
    import networkx as nx

    tree = nx.Graph()
    tree.add_nodes_from(g.unary)
    for (u, v), matrix in g.pair.items():
        tree.add_edge(u, v, weight=float(matrix.max() - matrix.min()))
    kept = [(u, v, g.matrix(u, v)) for u, v in nx.maximum_spanning_tree(tree).edges]
    choice = minimize({n: g.unary[n] for n in g.unary}, kept).choice
    for _ in range(100):
        improved = False
        for n in g.unary:
            costs = g.unary[n].copy()
            for m in g.adj[n]:
                costs += g.matrix(n, m)[:, choice[m]]
            best = int(np.argmin(costs))
            if costs[best] < costs[choice[n]] - 1e-12 * max(1.0, abs(costs[choice[n]])):
                choice[n], improved = best, True
        if not improved:
            break
    return choice


def _expand(table, vars_, axes):
    """Broadcast a factor over `vars_` to the axis order `axes`."""
    order = sorted(range(len(vars_)), key=lambda i: axes.index(vars_[i]))
    t = np.transpose(table, order)
    shape = [1] * len(axes)
    for i in order:
        shape[axes.index(vars_[i])] = table.shape[i]
    return t.reshape(shape)
