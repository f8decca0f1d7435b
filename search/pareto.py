"""The fastest strategy under a memory budget: node and edge elimination over time-memory fronts.

The problem: choose a config c_v per layer to minimize the time
    T(S) = sum_v t_v(c_v) + sum_(u,v) t_uv(c_u, c_v)            (equation 1, as search.eliminate)
subject to the memory measure
    M(S) = sum_v a_v(c_v) + sum_(u,v) m_uv(c_u, c_v) + max_v w_v(c_v) <= budget
(search.memory_tables).  Each elimination step of search.eliminate (search.elimination_plan)
runs over fronts instead of numbers: an entry holds every (time, summed memory, largest working
set) that no other partial solution beats in all three, and a step's min over the eliminated
layer's configs becomes the union of the candidates' fronts, pruned to the non-dominated ones.
That is exact: a partial solution dominated in all three cannot do better than the one
dominating it in any completion, since completing adds the same time and memory to both and
takes the max with the same working sets.  Where node elimination leaves a residual graph, one
of its layers is fixed to each of its configs in turn and the rest solved again the same way.

What keeps the fronts small, all exact:
- a partial solution is dropped when its memory plus the least memory the rest of the graph can
  take (each term at its minimum) exceeds the budget, or its time plus a lower bound of the
  rest's time exceeds a time limit: the exact outside time of its entry where search.elimination_plan
  gives one, else the rest's terms at their minima;
- a config is left out when the least time of any strategy using it (its min-marginal) exceeds
  the time limit, or its own memory with the rest's least exceeds the budget;
- the time limit starts just above the unconstrained optimum and grows (ROUNDS) until a
  strategy within it fits: any strategy within a limit survives that round's pruning, so the
  first round that finds one finds the optimum; the last round has no limit.
"""

from __future__ import annotations

import time as clock
from dataclasses import dataclass, field

import numpy as np

from taskrt.search.elimination_plan import DIAGONAL, EDGE, UNARY, elimination_plan, outside_bounds
from taskrt.search.fronts import ZERO, FrontTable, combine
from taskrt.search.fronts import gather as _gather

ROUNDS = (1 / 64, 1 / 8, 1.0, np.inf)  # time limits: the unconstrained optimum times 1 + these
FEW = 8  # layers with at most this many configs each: one round without time bounds (cheaper than them)
CONDITION_LIMIT = 4096  # sub-problems solved for a residual graph at most (past it: TooWide)
SETTLE_POINTS = 4096  # a round keeping this many points that finds nothing: settle whether anything fits
TOLERANCE = 1e-9  # relative slack of the time limits and min-marginals (rounding)


class TooWide(Exception):
    """The residual graph would need more than CONDITION_LIMIT sub-problems."""


@dataclass
class Found:
    choice: dict  # layer -> config index
    time: float
    memory: int  # M(S): the summed part plus the largest working set
    front: list  # the final front's feasible points as (time, M), fastest first
    rounds: int  # time limits tried
    points: int  # points kept in all tables
    seconds: float
    alternatives: list = field(default_factory=list)  # the next feasible choices, fastest first


def budget_search(names, time_unary: dict, time_edges: list, kept_bytes: dict, working: dict, edge_bytes,
                  budget: float, rounds=ROUNDS, alternatives: int = 0, log=None,
                  few: int | None = None, edge_working=None, cap: float = np.inf, shared=None) -> Found | None:
    """The fastest choice with M(S) <= `budget`, or None when none fits.

    `time_unary`: layer -> seconds per config; `time_edges`: (u, v, seconds matrix); `kept_bytes`
    and `working`: layer -> a_v and w_v per config; `edge_bytes(i, rows, cols[, wanted])`: m_uv of
    edge i for those configs (computed as needed), or only where the boolean matrix `wanted` says
    (any value elsewhere: no strategy within the round's time limit takes those pairs).  With
    `alternatives`, the next fastest feasible choices of the final front come along (for a check
    that rejects the first).  `log`: search.eliminate.minimize's records of the time tables (saves
    the bounds' forward pass).  `few`: the most configs of a layer searched without time bounds (FEW).
    `edge_working`: per edge, a working set per config pair (a matrix over all configs) or None
    (search.recompute_tables: a recomputed layer's copy at a consumer's backward).  `cap`: only
    strategies no slower are sought (a time limit for every round).  `shared`: a dict kept across searches
    of one graph whose times only grow from the first's (search.recompute_search's sets): the first
    search's plan and bounds, lower bounds of the later ones' (so their pruning stays exact).  Times must
    be finite."""
    started = clock.perf_counter()
    shared = {} if shared is None else shared
    if "plan" not in shared:
        shared["plan"] = elimination_plan(names, [(u, v) for u, v, _ in time_edges])
    plan = shared["plan"]
    small = max(len(kept_bytes[n]) for n in names) <= (FEW if few is None else few)  # no bounds: one round
    if not small and "bounds" not in shared:
        shared["bounds"] = outside_bounds(plan, time_unary, [m for _, _, m in time_edges], log)
    bounds = None if small else shared["bounds"]
    optimum = bounds.total if bounds is not None else None
    flat = _flat(names, kept_bytes, working)
    points = 0
    limits = [np.inf] if optimum is None else [optimum * (1 + slack) + 1e-12 for slack in rounds]
    if cap < np.inf:  # the rounds below the cap, then the cap itself
        limits = [limit for limit in limits if limit < cap] + [cap]
    r, settled = 0, False
    while r < len(limits):  # no bounds to prune by: one round without a limit
        limit = limits[r]
        search = _Search(names, time_unary, time_edges, kept_bytes, working, edge_bytes, budget, limit, bounds, plan,
                         flat=flat, edge_working=edge_working)
        result = search.run()
        points += search.points
        r += 1
        if result is not None:
            choice, t, m, front, others = result(alternatives)
            return Found(choice, t, m, front, r, points, clock.perf_counter() - started, others)
        if np.isinf(limit):
            break
        if not settled and r < len(limits) and (search.points >= SETTLE_POINTS or np.isinf(limits[r])):
            # a costly round found nothing (or no limit is next): does anything fit at all?
            settled = True
            least_s = _least_time_bound(names, time_unary, time_edges, kept_bytes, working, edge_bytes, budget,
                                        edge_working, flat)
            if least_s is None:
                return None
            rest = [x for x in limits[r:] if x < least_s]  # then that time, if below the last limit
            limits = limits[:r] + rest + ([] if rest and rest[-1] == limits[-1] else [min(least_s, limits[-1])])
    return None


def _least_time_bound(names, time_unary, time_edges, kept_bytes, working, edge_bytes, budget, edge_working, flat):
    """None when no choice's measure fits `budget`; else the time of one that fits (the fastest fitting
    one is no slower: a time limit keeping it), or inf where that is not known cheaply."""
    from taskrt.search.eliminate import minimize

    kept = _fitting_configs(names, flat, budget, np.ones(len(flat[0]), dtype=bool))
    if kept is None:
        return None
    every = [edge_bytes(i, kept[u], kept[v]) for i, (u, v, _) in enumerate(time_edges)]
    # the least summed memory (search.eliminate's min-plus over byte counts, exact in float64 below 2**53)
    least = minimize({n: kept_bytes[n][kept[n]].astype(np.float64) for n in names},
                     [(u, v, m.astype(np.float64)) for (u, v, _), m in zip(time_edges, every)])
    floor = max(int(np.min(working[n][kept[n]])) for n in names)  # every choice's working set is at least this
    if not least.method.startswith("approximate") and least.cost + floor > budget:
        return None
    c = {n: int(kept[n][i]) for n, i in least.choice.items()}
    measure = (sum(int(kept_bytes[n][c[n]]) for n in names)
               + sum(int(m[least.choice[u], least.choice[v]]) for (u, v, _), m in zip(time_edges, every))
               + max([int(working[n][c[n]]) for n in names]
                     + [int(x[c[u], c[v]]) for (u, v, _), x in zip(time_edges, edge_working or ()) if x is not None]))
    if measure > budget:  # the least sum's choice does not fit: the exact least measure decides
        try:
            found = least_memory(names, time_edges, kept_bytes, working, edge_bytes, budget, edge_working)
        except TooWide:
            return np.inf
        if found is None:
            return None
        c = found.choice
    return (sum(float(time_unary[n][c[n]]) for n in names)
            + sum(float(m[c[u], c[v]]) for u, v, m in time_edges))


def least_memory(names, time_edges: list, kept_bytes: dict, working: dict, edge_bytes, ceiling: float,
                 edge_working=None) -> Found | None:
    """The choice with the least M(S) (time ignored), searched below `ceiling` (e.g. the M of a
    known strategy, plus one); `edge_working` as budget_search's."""
    zero_unary = {n: np.zeros(len(kept_bytes[n])) for n in names}
    zero_edges = [(u, v, np.zeros((len(kept_bytes[u]), len(kept_bytes[v])))) for u, v, _ in time_edges]
    plan = elimination_plan(names, [(u, v) for u, v, _ in time_edges])
    search = _Search(names, zero_unary, zero_edges, kept_bytes, working, edge_bytes, ceiling, np.inf, None, plan,
                     by_memory=True, edge_working=edge_working)
    result = search.run()
    if result is None:
        return None
    choice, t, m, front, _ = result(0)
    return Found(choice, t, m, front, 1, search.points, 0.0)


class _Search:
    def __init__(self, names, time_unary, time_edges, kept_bytes, working, edge_bytes, budget, limit, bounds, plan,
                 by_memory=False, flat=None, edge_working=None):
        self.names, self.plan, self.bounds = names, plan, bounds
        self.budget, self.limit, self.by_memory = budget, limit, by_memory
        self.tables: list[FrontTable] = [ZERO]
        self.points = 0
        self.conditioned = 0
        self.kept = kept = self._kept(kept_bytes, working, flat or _flat(names, kept_bytes, working))
        if kept is None:
            return
        self.sizes = {n: len(kept[n]) for n in names}
        self.full = {n: len(kept[n]) == len(kept_bytes[n]) for n in names}
        self.unary = {}
        for n in names:
            k, full = kept[n], self.full[n]
            t = np.asarray(time_unary[n], dtype=np.float64)
            self.unary[n] = self._single((n,), t if full else t[k], kept_bytes[n] if full else kept_bytes[n][k],
                                         working[n] if full else working[n][k], origin=n)
        self.edges = []
        for i, (u, v, matrix) in enumerate(time_edges):
            full = self.full[u] and self.full[v]
            t = np.asarray(matrix, dtype=np.float64)
            t = t if full else _gather(t, kept[u], kept[v])
            if u != v and bounds is not None and np.isfinite(limit) and i in bounds.pair:
                # only the config pairs some strategy within the time limit takes
                wanted = self._slice(bounds.pair[i], (u, v)) <= limit * (1 + TOLERANCE)
                memory = edge_bytes(i, kept[u], kept[v], wanted)
            else:
                memory = edge_bytes(i, kept[u], kept[v])
            x = None if edge_working is None else edge_working[i]
            if x is not None and not full:
                x = _gather(np.ascontiguousarray(x), kept[u], kept[v])
            if u == v:  # a layer reading one tensor twice: both ends take the same config
                self.edges.append(self._single((u,), np.diag(t).copy(), np.diag(memory).copy(),
                                               None if x is None else np.diag(x).copy()))
            else:
                self.edges.append(self._single((u, v), t, memory, x))
        tables = [self.tables[t] for t in [*self.unary.values(), *self.edges]]
        self.time_floor = sum(t.covered_time for t in tables)
        self.memory_floor = sum(t.covered_memory for t in tables)
        self.x_floor = max(int(self.tables[self.unary[n]].working.min()) for n in names)

    def _single(self, scope, time, memory, working, origin=None) -> int:
        """An original cost term's table: one point per entry."""
        time = np.ascontiguousarray(time).ravel()
        memory = np.ascontiguousarray(memory, dtype=np.int64).ravel()
        working = np.zeros(len(time), dtype=np.int64) if working is None else np.ascontiguousarray(working).ravel()
        sizes = tuple(self.sizes[n] for n in scope)
        return self._add(FrontTable(_range(len(time)), time, memory, working, None, (), scope, sizes, origin,
                                    float(time.min()), int(memory.min())))

    def _kept(self, kept_bytes, working, flat):
        """Per layer, the configs that may appear in a strategy within the limits (indices)."""
        ok = np.ones(len(flat[0]), dtype=bool)
        if self.bounds is not None and np.isfinite(self.limit):
            ok &= np.concatenate([self.bounds.marginal[n] for n in self.names]) <= self.limit * (1 + TOLERANCE)
        return _fitting_configs(self.names, flat, self.budget, ok)

    def _add(self, table: FrontTable) -> int:
        self.tables.append(table)
        self.points += table.points
        return len(self.tables) - 1

    # ---- the elimination ------------------------------------------------------------------------
    def run(self):
        """A function giving (choice, time, M, feasible front, alternatives), or None if nothing fits."""
        if self.kept is None:
            return None
        final = self._solve(self.plan, self._components(self.plan, self.unary, self.edges), top=True)
        if final is None:
            return None
        table = self.tables[final]
        total = table.memory + table.working
        feasible = np.flatnonzero(total <= self.budget)
        if not len(feasible):
            return None
        key = total[feasible] if self.by_memory else table.time[feasible]
        order = feasible[np.lexsort((total[feasible], key))]

        def result(alternatives: int):
            best = int(order[0])
            others = _Lazy([int(p) for p in order[1:1 + alternatives]], lambda p: self._choice(final, p))
            front = [(float(table.time[p]), int(total[p])) for p in order]
            return self._choice(final, best), float(table.time[best]), int(total[best]), front, others

        return result

    @staticmethod
    def _components(plan, unary: dict, edges: list) -> dict:
        """Table id of each of the plan's components but the messages (made as the steps run)."""
        out = {}
        for c, comp in enumerate(plan.components):
            if comp.kind == UNARY:
                out[c] = unary[comp.ref]
            elif comp.kind in (DIAGONAL, EDGE):
                out[c] = edges[comp.ref]
        return out

    def _solve(self, plan, tables: dict, top: bool) -> int | None:
        """Run `plan`'s steps; the id of the final front (scope ()), None when a table is empty."""
        finals = []
        for j, step in enumerate(plan.steps):
            v = step.v
            groups = [[tables[c] for c in step.own], [tables[c] for c in step.left], [tables[c] for c in step.right]]
            n = step.neighbours
            scopes = [(v,), (n[0], v) if step.left else (), (v, n[-1]) if step.right else ()]
            while sum(map(len, groups)) > 3:  # sum the components of one term first
                g = max(range(3), key=lambda k: len(groups[k]))
                a, b = groups[g][:2]
                groups[g][:2] = [self._combine(scopes[g], None, [a, b], self._outside(j, step, top, g))]
            operands = [t for group in groups for t in group]
            scope = step.neighbours
            result = self._combine(scope, v, operands, self._outside(j, step, top, 3))
            if self.tables[result].points == 0:
                return None
            if step.kind == "free":
                finals.append(result)
            else:
                tables[step.message] = result
        if plan.residual:
            finals.append(self._residual(plan, tables))
            if finals[-1] is None:
                return None
        while len(finals) > 1:
            finals[:2] = [self._combine((), None, finals[:2], None)]
        return finals[0]

    def _outside(self, j, step, top, which):
        """The outside time bound (full config space) of step j's own (which 0), left (1) or right
        (2) sum or its message (3), at the kept configs; None where unknown."""
        if not top or self.bounds is None:
            return None
        b, n, v = self.bounds, step.neighbours, step.v
        if which == 0:
            return self._slice(b.outside_own[j], (v,))
        if which == 1:
            return self._slice(b.outside_left[j], (n[0], v)) if j in b.outside_left else None
        if which == 2:
            return self._slice(b.outside_right[j], (v, n[1])) if j in b.outside_right else None
        return None if step.kind == "free" else self._slice(b.outside[step.message], n)

    def _slice(self, table, scope):
        """A full-space table over `scope` at the kept configs."""
        if all(self.full[n] for n in scope):
            return table
        if len(scope) == 1:
            return table[self.kept[scope[0]]]
        return _gather(table, self.kept[scope[0]], self.kept[scope[1]])

    def _combine(self, scope: tuple, over, operands: list, outside, bases=None) -> int:
        """The table over `scope` of the min over layer `over` (None: no layer) of the operands' sum."""
        sizes = self.sizes
        u = scope[0] if scope else None
        w = scope[1] if len(scope) > 1 else None
        cu, cv, cw = sizes[u] if u else 1, sizes[over] if over else 1, sizes[w] if w else 1
        tables = [self.tables[t] for t in operands] + [ZERO] * (3 - len(operands))
        ids = tuple(operands) + (0,) * (3 - len(operands))
        strides = np.zeros((3, 4), dtype=np.int64)
        for k, table in enumerate(tables):  # entry strides along (u, over, w), and the base entry
            names = table.scope
            if len(names) == 2:
                for name, stride in ((names[0], table.sizes[1]), (names[1], 1)):
                    strides[k, 0 if name == u else 1 if name == over else 2] = stride
            elif names:
                strides[k, 0 if names[0] == u else 1 if names[0] == over else 2] = 1
            if bases:
                strides[k, 3] = bases[k]
        a, b, c = tables
        covered_time = a.covered_time + b.covered_time + c.covered_time
        covered_memory = a.covered_memory + b.covered_memory + c.covered_memory
        rest = self.time_floor - covered_time
        bound = np.full(cu * cw, rest) if outside is None else np.maximum(np.asarray(outside, float).ravel(), rest)
        offsets, t, s, x, refs = combine(cu, cw, cv, a.offsets, a.time, a.memory, a.working, strides[0],
                                         b.offsets, b.time, b.memory, b.working, strides[1],
                                         c.offsets, c.time, c.memory, c.working, strides[2],
                                         bound, self.x_floor, self.limit * (1 + TOLERANCE),
                                         self.budget - (self.memory_floor - covered_memory))
        sizes = tuple(sizes[n] for n in scope)
        return self._add(FrontTable(offsets, t, s, x, refs, tuple(ids), tuple(scope), sizes, None, covered_time,
                                    covered_memory))

    # ---- a residual graph: one layer fixed at a time -------------------------------------------
    def _residual(self, plan, tables) -> int | None:
        order = {n: i for i, n in enumerate(plan.residual)}
        unary = {}
        for n in plan.residual:
            ids = [tables[c] for c in plan.residual_unary[n]]
            while len(ids) > 1:
                ids[:2] = [self._combine((n,), None, ids[:2], None)]
            unary[n] = ids[0]
        pairs = {}
        for key, comps in plan.residual_pairs.items():
            ids = [tables[c] for c in comps]
            while len(ids) > 1:
                ids[:2] = [self._combine(key, None, ids[:2], None)]
            pairs[key] = ids[0]
        degree = {n: sum(n in key for key in pairs) for n in plan.residual}
        z = max(plan.residual, key=lambda n: (degree[n], -order[n]))
        rest = [n for n in plan.residual if n != z]
        solved = []
        for iz in range(self.sizes[z]):
            self.conditioned += 1
            if self.conditioned > CONDITION_LIMIT:
                raise TooWide(f"more than {CONDITION_LIMIT} sub-problems")
            sub_unary = dict(unary)
            edges = []
            for (x, y), t in pairs.items():
                if z not in (x, y):
                    edges.append(((x, y), t))
                    continue
                other = y if x == z else x
                stride = self.tables[t].strides((z,))[0]
                base = [0, iz * stride, 0]
                sub_unary[other] = self._combine((other,), None, [sub_unary[other], t], None, bases=base)
            sub = elimination_plan(rest, [key for key, _ in edges])
            sub_tables = self._components(sub, sub_unary, [t for _, t in edges])
            final = self._solve(sub, sub_tables, top=False) if rest else 0
            if final is None:
                continue
            mine = self._combine((), None, [final, unary[z]], None, bases=[0, iz, 0])
            if self.tables[mine].points:
                solved.append(mine)
        if not solved:
            return None
        return self._stack(solved)

    def _stack(self, finals: list) -> int:
        """One final table from several (the residual's fixed configs): every point of them,
        pruned to the non-dominated."""
        t = np.concatenate([self.tables[f].time for f in finals])
        s = np.concatenate([self.tables[f].memory for f in finals])
        x = np.concatenate([self.tables[f].working for f in finals])
        source = np.concatenate([np.full(self.tables[f].points, k) for k, f in enumerate(finals)])
        index = np.concatenate([np.arange(self.tables[f].points) for f in finals])
        keep = _non_dominated(t, s, x)
        table = FrontTable(np.array([0, len(keep)]), t[keep], s[keep], x[keep],
                           np.stack([source[keep], index[keep]], axis=1), tuple(finals), (), (), "stack",
                           self.tables[finals[0]].covered_time, self.tables[finals[0]].covered_memory)
        return self._add(table)

    # ---- back to configs --------------------------------------------------------------------------
    def _choice(self, table: int, point: int) -> dict:
        choice = {}
        todo = [(table, point)]
        while todo:
            t, p = todo.pop()
            front = self.tables[t]
            if front.origin == "stack":
                todo.append((front.parents[int(front.refs[p, 0])], int(front.refs[p, 1])))
            elif front.origin is not None:
                choice[front.origin] = int(self.kept[front.origin][p])
            elif front.refs is not None:
                for k, parent in enumerate(front.parents):
                    if parent and front.refs[p, k] >= 0:
                        todo.append((parent, int(front.refs[p, k])))
        missing = set(self.names) - set(choice)
        assert not missing, f"no config traced back for {sorted(missing)}"
        return choice


class _Lazy(list):
    """The alternatives' choices, each traced back when first read (most are never needed)."""

    def __init__(self, points, trace):
        super().__init__(points)
        self._trace, self._done = trace, {}

    def __getitem__(self, i):
        if i not in self._done:
            self._done[i] = self._trace(super().__getitem__(i))
        return self._done[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _fitting_configs(names, flat, budget, ok):
    """Per layer, the configs among `ok` (a mask over _flat's order) whose own memory with the rest's
    least fits `budget` (indices); None when some layer has none."""
    values, works, starts, lengths = flat
    big = np.iinfo(np.int64).max // 4
    for _ in range(2):  # each layer's memory against the rest's least (edges at least 0)
        if not np.add.reduceat(ok, starts).all():
            return None
        least = np.minimum.reduceat(np.where(ok, values, big), starts)
        floor = np.minimum.reduceat(np.where(ok, works, big), starts).max()
        rest = int(least.sum()) - np.repeat(least, lengths)
        ok &= values + rest + np.maximum(works, floor) <= budget
    if not np.add.reduceat(ok, starts).all():
        return None
    return {n: np.flatnonzero(ok[start:start + length]) for n, start, length in zip(names, starts, lengths)}


def _flat(names, kept_bytes, working):
    """Every layer's a and w in one array each, with each layer's start and length."""
    lengths = np.array([len(kept_bytes[n]) for n in names], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return (np.concatenate([kept_bytes[n] for n in names]).astype(np.int64),
            np.concatenate([working[n] for n in names]).astype(np.int64), starts, lengths)


_RANGES: dict[int, np.ndarray] = {}


def _range(n: int) -> np.ndarray:
    """offsets of a table of one point per entry (shared, read-only)."""
    out = _RANGES.get(n)
    if out is None:
        out = _RANGES[n] = np.arange(n + 1, dtype=np.int64)
        out.setflags(write=False)
    return out


def _non_dominated(t, s, x) -> np.ndarray:
    order = np.lexsort((x, s, t))
    kept = []
    for i in order:
        if not any(s[j] <= s[i] and x[j] <= x[i] for j in kept):
            kept.append(i)
    return np.array(kept, dtype=np.int64)
