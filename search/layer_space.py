"""A layer's configs as the cost tables see them: the configs (made when read), their part table
and block grid, and what each input's parts read; shared by every layer with the same op and
configs, and the per-part footprint the search drops configs by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from taskrt.graph.config import ParallelConfig
from taskrt.ops.rect import Rect
from taskrt.search import transfer
from taskrt.search.regions import Needs, PartTable


@dataclass
class Geometry:
    """Configs splitting a layer's output, with their part table and block grid: the same for
    every layer with the same output shape (a convolution, its batch norm and its relu)."""

    configs: Sequence[ParallelConfig]
    parts: PartTable
    grid: transfer.Grid
    index: dict | None = None  # position of each config by its split and devices


class Configs(Sequence):
    """A layer's configs as (configs, 4) degrees over (n, c, h, w) and each one's first device,
    each ParallelConfig made when first read: a search reads only the ones it chooses.
    `allreduce` marks those that synchronize by all-reduce (the others: "ps")."""

    def __init__(self, degrees: np.ndarray, first: np.ndarray, make, allreduce: np.ndarray | None = None):
        self.degrees, self.first, self.allreduce = degrees, first, allreduce
        self._make = make  # (degrees, first device, sync) -> ParallelConfig, shared by every layer

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices; IndexError past the end
        sync = "allreduce" if self.allreduce is not None and self.allreduce[i] else "ps"
        return self._make(tuple(self.degrees[i].tolist()), int(self.first[i]), sync)

    def with_allreduce(self, allreduce: np.ndarray) -> Configs:
        return Configs(self.degrees, self.first, self._make, allreduce)


@dataclass
class LayerSpace:
    """A layer's configs with their geometry and needs (one per input): everything the tables
    need of a layer besides its op, so layers with the same op and configs share it."""

    key: tuple  # (op, the configs given, or None for the search space)
    geometry: Geometry
    needs: list[Needs]
    cheaper: tuple | None = None  # the configs with the cheaper sync method, and its t_s

    @property
    def configs(self) -> Sequence[ParallelConfig]:
        return self.geometry.configs

    @property
    def parts(self) -> PartTable:
        return self.geometry.parts

    @property
    def grid(self) -> transfer.Grid:
        return self.geometry.grid


def read_only(table: np.ndarray) -> np.ndarray:
    """A table the cost model hands out to several layers or searches: nobody may change it."""
    table.setflags(write=False)
    return table


@numba.njit(cache=True, nogil=True)
def first_part_bytes(lo, hi, starts, volumes, per_channel, itemsize):
    """Per config, taskrt.planning.memory.part_footprint of its first part: 3 x its parameters (weights,
    gradient, velocity) and 2 x its input tiles (`volumes`: of each input, per part) and output."""
    configs, rank = len(starts), lo.shape[1]
    out = np.empty(configs, dtype=np.int64)
    for a in range(configs):
        p = starts[a]
        volume = 1
        for e in range(rank):
            volume *= max(hi[p, e] - lo[p, e], 0)
        inputs = 0
        for v in volumes:
            inputs += v[p]
        params = per_channel * (hi[p, 1] - lo[p, 1]) if rank > 1 else per_channel
        out[a] = itemsize * (3 * params + 2 * (inputs + volume))
    return out


def channel_params(op) -> int:
    """Parameters a part reads per channel of its output: every op's parameter Rects span its
    channel range and nothing else varies (tests/test_search.py checks it for every op kind)."""
    rank = len(op.out_shape)
    return sum(r.volume for r in op.param_rects(Rect((0,) * rank, (1,) * rank)).values())
