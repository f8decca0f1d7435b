"""The order of search.eliminate's node and edge eliminations as data, and exact time bounds from it.

`elimination_plan(names, edges)` replays search.eliminate.minimize's choices (the first node in
node order with at most two neighbours goes next; parallel edges are summed; a layer reading one
tensor twice puts the edge's diagonal into its own cost) on the graph's structure alone.  Every
cost term is a *component*: a layer's own table, an edge's table, the diagonal of a self-edge, or
the message a step leaves behind (on its one neighbour, or on the edge between its two).  Each
step lists the components it sums and minimizes over; what no step eliminates is the residual
(a graph that does not reduce).  search.pareto runs the same steps over time-memory fronts.

`outside_bounds(plan, ...)` runs the steps forward with scalar costs (the min-sum problem
search.eliminate solves), then backward, junction-tree style: for every message, the least cost
of everything outside it given its scope, and for every layer and config, the least cost of any
strategy using that config (its min-marginal).  Both are exact for the time tables, so both are
lower bounds for any search restricted to fewer configs: a config whose min-marginal exceeds a
time bound, and a partial solution whose time plus its outside exceeds it, can be dropped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numba
import numpy as np

from taskrt.search.eliminate import min_plus

UNARY, DIAGONAL, EDGE, MESSAGE = range(4)


@dataclass
class Component:
    kind: int  # UNARY (ref: node), DIAGONAL (ref: edge index), EDGE (ref: edge index), MESSAGE (ref: step)
    ref: object
    scope: tuple  # node names, in the order of the table's axes


@dataclass
class Step:
    kind: str  # "free" (no neighbours), "leaf" (one) or "node" (two)
    v: str
    neighbours: tuple
    own: list  # component ids over (v,)
    left: list = field(default_factory=list)  # over the edge (u, v)
    right: list = field(default_factory=list)  # over the edge (v, w)
    message: int = -1  # the component this step leaves behind


@dataclass
class Plan:
    names: list
    components: list  # Component by id
    steps: list
    residual: list  # nodes left when no node has two neighbours or fewer
    residual_unary: dict  # node -> component ids
    residual_pairs: dict  # (x, y) -> component ids


def elimination_plan(names, edges) -> Plan:
    """`names`: the nodes in order; `edges`: (a, b) per edge, as search.eliminate.minimize takes them."""
    order = {name: i for i, name in enumerate(names)}
    components: list[Component] = []

    def new(kind, ref, scope) -> int:
        components.append(Component(kind, ref, scope))
        return len(components) - 1

    unary = {name: [new(UNARY, name, (name,))] for name in names}
    pairs: dict[tuple, list] = {}
    adj: dict[str, set] = {name: set() for name in names}

    def key(x, y):
        return (x, y) if order[x] < order[y] else (y, x)

    for i, (a, b) in enumerate(edges):
        if a == b:
            unary[a].append(new(DIAGONAL, i, (a,)))
            continue
        pairs.setdefault(key(a, b), []).append(new(EDGE, i, (a, b)))
        adj[a].add(b)
        adj[b].add(a)
    ready = [order[n] for n in names if len(adj[n]) <= 2]
    heapq.heapify(ready)
    queued = set(ready)
    steps = []
    while ready:
        v = names[heapq.heappop(ready)]
        neighbours = tuple(sorted(adj.pop(v), key=order.get))
        own = unary.pop(v)
        for u in neighbours:
            adj[u].discard(v)
        j = len(steps)
        if not neighbours:
            steps.append(Step("free", v, neighbours, own))
        elif len(neighbours) == 1:
            (u,) = neighbours
            message = new(MESSAGE, j, (u,))
            steps.append(Step("leaf", v, neighbours, own, pairs.pop(key(u, v)), [], message))
            unary[u].append(message)
        else:
            u, w = neighbours
            message = new(MESSAGE, j, (u, w))
            steps.append(Step("node", v, neighbours, own, pairs.pop(key(u, v)), pairs.pop(key(v, w)), message))
            pairs.setdefault(key(u, w), []).append(message)
            adj[u].add(w)
            adj[w].add(u)
        for u in neighbours:
            if order[u] not in queued and len(adj[u]) <= 2:
                queued.add(order[u])
                heapq.heappush(ready, order[u])
    residual = [n for n in names if n in unary]
    return Plan(list(names), components, steps, residual, {n: unary[n] for n in residual}, pairs)


def oriented(table: np.ndarray, scope: tuple, wanted: tuple) -> np.ndarray:
    """A component's table with its axes in the order `wanted` (the same names)."""
    return table if scope == wanted or len(scope) < 2 else table.T


@dataclass
class Bounds:
    """Exact lower bounds of the time of any strategy, from outside_bounds."""

    total: float  # the unconstrained optimum
    marginal: dict  # node -> per config: the least time of a strategy using it
    outside: dict  # message component id -> least time of everything else, given its scope
    outside_own: dict  # step -> per config of its node: everything but the node's own components
    outside_left: dict  # step -> over (u, v): everything but the edge's components
    outside_right: dict  # step -> over (v, w)
    pair: dict  # edge index -> over its two layers: the least time of a strategy with those configs


def outside_bounds(plan: Plan, unary: dict, edges: list, log=None) -> Bounds | None:
    """The steps of `plan` forward and backward over scalar costs (`unary`: node -> vector,
    `edges`: matrices in the plan's edge order); None for a plan with a residual.  `log`:
    search.eliminate.minimize's records of the same problem (Result.log), whose sums the forward
    pass takes instead of computing them again."""
    if plan.residual:
        return None
    values: dict[int, np.ndarray] = {}
    made_by = {step.message: j for j, step in enumerate(plan.steps) if step.message >= 0}

    def value(c: int) -> np.ndarray:
        comp = plan.components[c]
        if comp.kind == UNARY:
            return np.asarray(unary[comp.ref], dtype=float)
        if comp.kind == DIAGONAL:
            return np.diag(np.asarray(edges[comp.ref], dtype=float))
        if comp.kind == EDGE:
            return np.asarray(edges[comp.ref], dtype=float)
        if c not in values:  # a message: from its step's sums
            own, left, right = sums[made_by[c]]
            values[c] = ((left + own[None, :]).min(axis=1) if right is None else
                         min_plus(np.ascontiguousarray(left + own[None, :]), np.ascontiguousarray(right)))
        return values[c]

    def summed(ids, scope) -> np.ndarray:
        total = None
        for c in ids:
            t = oriented(value(c), plan.components[c].scope, scope)
            total = t if total is None else total + t
        return total

    sums = []
    constant = 0.0
    if log is not None and len(log) == len(plan.steps) and all(
            r[0] == s.kind and r[1] == s.v for r, s in zip(log, plan.steps)):
        for record in log:  # ("free", v, own), ("leaf", v, u, edge, own), ("node", v, u, w, left, own, right)
            if record[0] == "free":
                sums.append((record[2], None, None))
                constant += float(record[2].min())
            elif record[0] == "leaf":
                sums.append((record[4], record[3], None))
            else:
                sums.append((record[5], record[4], record[6]))
    for step in plan.steps if not sums else ():
        own = summed(step.own, (step.v,))
        if step.kind == "free":
            constant += float(own.min())
            sums.append((own, None, None))
        elif step.kind == "leaf":
            (u,) = step.neighbours
            left = summed(step.left, (u, step.v))
            values[step.message] = (left + own[None, :]).min(axis=1)
            sums.append((own, left, None))
        else:
            u, w = step.neighbours
            left, right = summed(step.left, (u, step.v)), summed(step.right, (step.v, w))
            values[step.message] = min_plus(np.ascontiguousarray(left + own[None, :]), np.ascontiguousarray(right))
            sums.append((own, left, right))
    outside: dict[int, np.ndarray] = {}
    marginal, outside_own, outside_left, outside_right, pair = {}, {}, {}, {}, {}

    def pass_down(ids, scope, out_sum, total=None):
        """Each message among `ids` gets the outside of their sum plus the other components; each
        edge its pair's least time (`total`: the sum's)."""
        for c in ids:
            if plan.components[c].kind == EDGE and total is not None:
                pair[plan.components[c].ref] = oriented(out_sum + total, scope, plan.components[c].scope)
            if plan.components[c].kind != MESSAGE:
                continue
            rest = out_sum
            for d in ids:
                if d != c:
                    rest = rest + oriented(value(d), plan.components[d].scope, scope)
            outside[c] = oriented(rest, scope, plan.components[c].scope)

    for j in range(len(plan.steps) - 1, -1, -1):
        step = plan.steps[j]
        own, left, right = sums[j]
        v = step.v
        if step.kind == "free":
            out_own = np.full(len(own), constant - float(own.min()))
        elif step.kind == "leaf":
            (u,) = step.neighbours
            out_m = outside[step.message]
            out_left = out_m[:, None] + own[None, :]
            out_own = (out_m[:, None] + left).min(axis=0)
            outside_left[j] = out_left
            pass_down(step.left, (u, v), out_left, left)
        else:
            u, w = step.neighbours
            out_m = outside[step.message]
            out_left, out_own, out_right = _node_backward(left, own, right, out_m)
            outside_left[j], outside_right[j] = out_left, out_right
            pass_down(step.left, (u, v), out_left, left)
            pass_down(step.right, (v, w), out_right, right)
        outside_own[j] = out_own
        marginal[v] = out_own + own
        pass_down(step.own, (v,), out_own)
    return Bounds(constant, marginal, outside, outside_own, outside_left, outside_right, pair)


@numba.njit(cache=True, nogil=True)
def _node_backward(left, own, right, out_m):
    """A node step (v between u and w) backward, given the outside of its message over (u, w): the
    outsides of its left sum over (u, v), its own over v and its right sum over (v, w)."""
    through = min_plus(np.ascontiguousarray(out_m), np.ascontiguousarray(right.T))  # (u, v): w minimized
    out_right = min_plus(np.ascontiguousarray(left.T), np.ascontiguousarray(out_m))  # (v, w): u minimized
    rows, inner = left.shape
    out_left = np.empty((rows, inner))
    out_own = np.full(inner, np.inf)
    for u in range(rows):
        for v in range(inner):
            out_left[u, v] = through[u, v] + own[v]
            out_own[v] = min(out_own[v], left[u, v] + through[u, v])
    for v in range(inner):
        out_right[v] += own[v]
    return out_left, out_own, out_right
