"""The lowering's region logic in array form, for costing thousands of config pairs at once.

Every part of every config of a layer becomes a row: the lo/hi of its output Rect and its
device, built with the same block rule as ParallelConfig.parts.  For a consumer, each part's
*needed* input Rect comes from the op's own region rule (`op.input_rects`), asked once per
distinct 1-D block: the rules of all ops are separable (each input dimension's range depends on
one output dimension), which `NeedTable` checks rather than assumes.  Overlap volumes between
producer parts and consumer needs are then exactly the numbers the lowering moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ops.rect import Rect
from taskrt.config import DIMS, blocks


@dataclass
class PartTable:
    """All parts of a list of configs: one row per part, grouped by config (in order)."""

    lo: np.ndarray  # (parts, rank)
    hi: np.ndarray  # (parts, rank)
    device: np.ndarray  # (parts,)
    starts: np.ndarray  # first row of each config (for np.*.reduceat)
    block: np.ndarray  # (parts, rank): block index of the part along each dimension

    def __post_init__(self):
        # config index of each row
        self.config = np.repeat(np.arange(len(self.starts)), np.diff(np.append(self.starts, len(self.device))))

    @property
    def shape(self) -> np.ndarray:
        return self.hi - self.lo


def part_table(shape, configs) -> PartTable:
    """All parts of all configs, vectorized: the same blocks, order and devices as ParallelConfig.parts."""
    uneven = next((c for c in configs if not c.is_even), None)
    if uneven is not None:
        raise ValueError(f"config {uneven} splits channels unevenly; the cost tables price even splits only "
                         "(time such a strategy by simulating its plan: taskrt.simulate)")
    rank = len(shape)
    degrees = np.array([[getattr(c, dim) for dim in DIMS[:rank]] for c in configs], dtype=np.int64)
    sizes = np.prod(degrees, axis=1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    config = np.repeat(np.arange(len(configs)), sizes)
    index = np.arange(int(sizes.sum())) - starts[config]  # row-major part index within its config
    trailing = np.ones_like(degrees)
    for d in range(rank - 2, -1, -1):
        trailing[:, d] = trailing[:, d + 1] * degrees[:, d + 1]
    deg = degrees[config]
    block = (index[:, None] // trailing[config]) % deg
    size = np.array(shape, dtype=np.int64)[None, :]
    q, r = size // deg, size % deg  # blocks as equal as possible, the first r one larger
    lo = block * q + np.minimum(block, r)
    hi = lo + q + (block < r)
    device = np.concatenate([np.asarray(c.devices, dtype=np.int64) for c in configs])
    return PartTable(lo, hi, device, starts, block)


class NotSeparable(ValueError):
    pass


@lru_cache(maxsize=1 << 16)
def _probe(op, j, d, a, b):
    """The region rule for an output that is whole except for [a, b) along dimension d."""
    return op.input_rects(Rect.full(op.out_shape).replace(d, a, b))[j]


class Needs:
    """What each part of a consumer reads of its input `j`, per part (`table`) and per 1-D block."""

    def __init__(self, op, j: int, parts: PartTable, configs):
        out_shape, rank = op.out_shape, len(op.in_shapes[j])
        self.out_shape = out_shape
        full = Rect.full(out_shape)
        base = op.input_rects(full)[j]
        probes: dict[tuple[int, int, int], Rect | None] = {}
        for d, (size, dim) in enumerate(zip(out_shape, DIMS)):
            for degree in sorted({getattr(c, dim) for c in configs}):
                for a, b in blocks(size, degree):
                    probes[(d, a, b)] = _probe(op, j, d, a, b)
        driver: dict[int, int] = {}
        for (d, _, _), r in probes.items():
            if r is not None:
                for e in range(rank):
                    if (r.lo[e] != base.lo[e] or r.hi[e] != base.hi[e]) and driver.setdefault(e, d) != d:
                        raise NotSeparable(f"{op.kind}: input {j} dimension {e} depends on output dimensions "
                                           f"{driver[e]} and {d}")
        self.probes, self.driver = probes, driver
        self.constant = {e: (base.lo[e], base.hi[e]) for e in range(rank) if e not in driver}
        lo = np.tile(np.array(base.lo), (len(parts.device), 1))
        hi = np.tile(np.array(base.hi), (len(parts.device), 1))
        empty = np.zeros(len(parts.device), dtype=bool)
        degrees = (np.maximum.reduceat(parts.block, parts.starts, axis=0) + 1)[parts.config]
        for d in range(len(out_shape)):
            # the probe answers, indexed by (degree, block): one slot per block of each degree
            slot_of, results = {}, []
            for degree in np.unique(degrees[:, d]).tolist():
                slot_of[degree] = len(results)
                results += [probes[(d, a, b)] for a, b in blocks(out_shape[d], degree)]
            first = np.zeros(int(degrees[:, d].max()) + 1, dtype=np.int64)
            for degree, start in slot_of.items():
                first[degree] = start
            slot = first[degrees[:, d]] + parts.block[:, d]
            empty |= np.array([r is None for r in results])[slot]
            for e in (e for e, dd in driver.items() if dd == d):
                lo[:, e] = np.array([r.lo[e] if r is not None else 0 for r in results])[slot]
                hi[:, e] = np.array([r.hi[e] if r is not None else 0 for r in results])[slot]
        lo[empty] = 0
        hi[empty] = 0
        self.table = PartTable(lo, hi, parts.device, parts.starts, parts.block)

    def block_ranges(self, d: int, groups):
        """For output dimension `d` and slots [(first slot, degree)]: whether each block reads
        anything, and per input dimension `d` drives, the lo and hi arrays over slots."""
        results = [self.probes.get((d, a, z)) for _, degree in groups for a, z in blocks(self.out_shape[d], degree)]
        reads = np.array([r is not None for r in results])
        ranges = {}
        for e in (e for e, dd in self.driver.items() if dd == d):
            ranges[e] = (np.array([r.lo[e] if r is not None else 0 for r in results]),
                         np.array([r.hi[e] if r is not None else 0 for r in results]))
        return reads, ranges


def overlap_volumes(producer: PartTable, consumer: PartTable) -> np.ndarray:
    """(producer parts, consumer parts) volume of each producer tile inside each consumer's need."""
    vol = np.ones((len(producer.device), len(consumer.device)), dtype=np.float64)
    span = np.empty_like(vol)
    for e in range(producer.lo.shape[1]):
        np.minimum(producer.hi[:, e, None], consumer.hi[None, :, e], out=span)
        span -= np.maximum(producer.lo[:, e, None], consumer.lo[None, :, e])
        np.maximum(span, 0, out=span)
        vol *= span
    return vol
