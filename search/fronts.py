"""Tables of time-memory Pareto fronts, and the one compiled step search.pareto builds them with.

A front table has an entry per assignment of its scope (one or two layers' configs, row-major;
none: one entry) and, per entry, the points no other point of the entry dominates:
(time s, memory summed over layers and edges in bytes, largest working set in bytes).  A point
dominates another when it is no worse in all three.  Each point remembers the points of the (up
to three) tables it was summed from, so a chosen point leads back to a config per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@dataclass
class FrontTable:
    offsets: np.ndarray  # entry e holds points offsets[e]:offsets[e + 1]
    time: np.ndarray
    memory: np.ndarray  # int64: the summed part
    working: np.ndarray  # int64: the largest working set among its layers
    refs: np.ndarray | None  # (points, 3): the point of each parent table it sums (-1: none)
    parents: tuple = ()  # ids of the parent tables (in search.pareto's list)
    scope: tuple = ()  # layer names
    sizes: tuple = ()  # configs per scope layer
    origin: str | None = None  # an original unary table: its layer (point i is config i)
    covered_time: float = 0.0  # the least time and memory its terms can take (lower bounds of the rest)
    covered_memory: int = 0

    @property
    def points(self) -> int:
        return len(self.time)

    def strides(self, axes: tuple) -> tuple:
        """Entry strides along `axes` (names; an axis not in the scope: 0)."""
        stride = {}
        step = 1
        for name, size in zip(reversed(self.scope), reversed(self.sizes)):
            stride[name] = step
            step *= size
        return tuple(stride.get(a, 0) for a in axes)


def single(time, memory, working, scope=(), sizes=(), origin=None) -> FrontTable:
    """A table of one point per entry (an original cost term)."""
    time = np.ascontiguousarray(time, dtype=np.float64).ravel()
    memory = np.ascontiguousarray(memory, dtype=np.int64).ravel()
    working = np.broadcast_to(np.asarray(working, dtype=np.int64), time.shape).ravel().copy()
    offsets = np.arange(len(time) + 1, dtype=np.int64)
    return FrontTable(offsets, time, memory, working, None, (), tuple(scope), tuple(sizes), origin,
                      float(time.min()) if len(time) else 0.0, int(memory.min()) if len(memory) else 0)


ZERO = single(np.zeros(1), np.zeros(1), np.zeros(1))


@numba.njit(cache=True, nogil=True)
def combine(cu, cw, cv, a_off, a_t, a_s, a_x, a_st, b_off, b_t, b_s, b_x, b_st, c_off, c_t, c_s, c_x, c_st,
            outside, x_floor, time_limit, memory_limit):
    """The front table over (u, w) of min over v of A + B + C, in the Pareto sense.

    Each operand's entry for configs (iu, iv, iw) is st[3] + iu*st[0] + iv*st[1] + iw*st[2].  A point of
    result entry r = iu*cw + iw is dropped when its time plus outside[r] exceeds `time_limit`, or
    its memory plus its working set (at least `x_floor`) exceeds `memory_limit` (the caller takes
    the rest's least memory off the budget).  Returns offsets, time, memory, working, refs."""
    entries = cu * cw
    cap = max(64, 2 * entries)
    t_out = np.empty(cap)
    s_out = np.empty(cap, dtype=np.int64)
    x_out = np.empty(cap, dtype=np.int64)
    r_out = np.empty((cap, 3), dtype=np.int64)
    offsets = np.zeros(entries + 1, dtype=np.int64)
    n = 0
    for iu in range(cu):
        for iw in range(cw):
            r = iu * cw + iw
            start = n
            t_max = time_limit - outside[r]
            for iv in range(cv):
                ea = a_st[3] + iu * a_st[0] + iv * a_st[1] + iw * a_st[2]
                eb = b_st[3] + iu * b_st[0] + iv * b_st[1] + iw * b_st[2]
                ec = c_st[3] + iu * c_st[0] + iv * c_st[1] + iw * c_st[2]
                for i in range(a_off[ea], a_off[ea + 1]):
                    if a_t[i] > t_max or a_s[i] + max(a_x[i], x_floor) > memory_limit:
                        continue
                    for j in range(b_off[eb], b_off[eb + 1]):
                        t2 = a_t[i] + b_t[j]
                        s2 = a_s[i] + b_s[j]
                        x2 = max(a_x[i], b_x[j])
                        if t2 > t_max or s2 + max(x2, x_floor) > memory_limit:
                            continue
                        for k in range(c_off[ec], c_off[ec + 1]):
                            t3 = t2 + c_t[k]
                            s3 = s2 + c_s[k]
                            x3 = max(x2, c_x[k], x_floor)  # every strategy's working set is at least x_floor
                            if t3 > t_max or s3 + x3 > memory_limit:
                                continue
                            dominated = False
                            for m in range(start, n):
                                if t_out[m] <= t3 and s_out[m] <= s3 and x_out[m] <= x3:
                                    dominated = True
                                    break
                            if dominated:
                                continue
                            m = start
                            while m < n:  # drop the points the new one dominates
                                if t3 <= t_out[m] and s3 <= s_out[m] and x3 <= x_out[m]:
                                    n -= 1
                                    t_out[m], s_out[m], x_out[m] = t_out[n], s_out[n], x_out[n]
                                    r_out[m, 0], r_out[m, 1], r_out[m, 2] = r_out[n, 0], r_out[n, 1], r_out[n, 2]
                                else:
                                    m += 1
                            if n == cap:
                                cap *= 2
                                t_out = _grow(t_out, cap)
                                s_out = _grow(s_out, cap)
                                x_out = _grow(x_out, cap)
                                r_out = _grow(r_out, cap)
                            t_out[n], s_out[n], x_out[n] = t3, s3, x3
                            r_out[n, 0], r_out[n, 1], r_out[n, 2] = i, j, k
                            n += 1
            offsets[r + 1] = n
    return offsets, t_out[:n].copy(), s_out[:n].copy(), x_out[:n].copy(), r_out[:n].copy()


@numba.njit(cache=True, nogil=True)
def _grow(array, cap):
    out = np.empty((cap,) + array.shape[1:], dtype=array.dtype)
    out[: len(array)] = array
    return out


@numba.njit(cache=True, nogil=True)
def gather(table, rows, cols):
    """table[np.ix_(rows, cols)] without numpy's overhead (the search slices many small tables)."""
    out = np.empty((len(rows), len(cols)), dtype=table.dtype)
    for i in range(len(rows)):
        for k in range(len(cols)):
            out[i, k] = table[rows[i], cols[k]]
    return out
