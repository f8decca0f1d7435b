"""Configuration space: the parallel configs each layer may take (the paper's Table 1).

A config splits the layer's output over the dimensions the op allows (`op.dims`: fully-connected
{n, c}; 2D conv and pool {n, c, h, w}; elementwise, concat and flatten per their region rules;
the loss {n}), with degrees whose product is at most the device count (powers of two by
default, or every divisor of the device count), each no larger than its dimension, on a
contiguous block of devices.  Configs whose parts do not fit in a device's memory are dropped.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

import numba
import numpy as np

from taskrt.graph.config import DIMS, ParallelConfig, blocks
from taskrt.ops.rect import Rect
from taskrt.planning.memory import part_footprint

PLACEMENTS = ("first", "aligned")


def degree_choices(num_devices: int, powers_of_two: bool = True) -> list[int]:
    if powers_of_two:
        return [1 << k for k in range(num_devices.bit_length()) if 1 << k <= num_devices]
    return [d for d in range(1, num_devices + 1) if num_devices % d == 0]


def part_memory(layer, config: ParallelConfig, itemsize: int) -> int:
    """Bytes the largest part holds during a step (taskrt.planning.memory.part_footprint: its input tiles,
    its output and output gradient, and its parameter shard with gradient and velocity).  Blocks
    that do not divide evenly are larger first, so part 0 is the largest."""
    return _block_memory(layer.op, tuple(blocks(size, getattr(config, dim))[0][1]
                                         for size, dim in zip(layer.shape, DIMS)), itemsize)


@lru_cache(maxsize=65536)
def _block_memory(op, extent, itemsize) -> int:
    return part_footprint(op, Rect((0,) * len(extent), extent), itemsize).total


def config_grid(dims, shape, num_devices: int, powers_of_two: bool = True, placement: str = "first"):
    """Every config of a layer that splits `dims` of its output `shape`, as arrays in
    `layer_configs`' order: (configs, 4) degrees over (n, c, h, w) and each config's first device."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    limits = np.array([shape[dims.index(dim)] if dim in dims else 1 for dim in DIMS], dtype=np.int64)  # largest degree
    return _grid(np.array(degree_choices(num_devices, powers_of_two), dtype=np.int64), limits, num_devices,
                 placement == "first")


@numba.njit(cache=True, nogil=True)
def _grid(choices, limits, num_devices, first_only):
    """Degree tuples over (n, c, h, w) in lexicographic order, each degree a choice no larger
    than its limit, the product at most the device count; one row per aligned block of devices
    [k*P, (k+1)*P), or only the first (`first_only`)."""
    rows = []
    for n in choices:
        for c in choices:
            for h in choices:
                for w in choices:
                    degrees = (n, c, h, w)
                    fits = n * c * h * w <= num_devices
                    for d in range(4):
                        fits = fits and degrees[d] <= limits[d]
                    if fits:
                        total = n * c * h * w
                        for start in range(0, num_devices - total + 1, total):
                            rows.append((n, c, h, w, start))
                            if first_only:
                                break
    out = np.empty((len(rows), 4), dtype=np.int64)
    first = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, 0], out[i, 1], out[i, 2], out[i, 3], first[i] = row
    return out, first


def layer_configs(layer, num_devices: int, powers_of_two: bool = True, placement: str = "first",
                  memory: float | None = None, itemsize: int = 4) -> list[ParallelConfig]:
    """Every config of `layer` on `num_devices` devices.

    placement "first": the parts use devices 0..P-1 (under the additive cost model a block
    elsewhere only adds transfers); "aligned": every block [k*P, (k+1)*P).
    """
    degrees, first = config_grid(layer.dims, layer.shape, num_devices, powers_of_two, placement)
    configs = [ParallelConfig(*d, devices=tuple(range(s, s + prod(d))))
               for d, s in zip(degrees.tolist(), first.tolist())]
    if memory is not None:
        fitting = [c for c in configs if part_memory(layer, c, itemsize) <= memory]
        if not fitting:
            raise ValueError(
                f"layer {layer.name!r}: no config fits in {memory / 2**30:.1f} GiB per device "
                f"(smallest needs {min(part_memory(layer, c, itemsize) for c in configs) / 2**30:.1f} GiB)"
            )
        configs = fitting
    return configs


def search_space(graph, machine, powers_of_two=True, placement="first", itemsize=4) -> dict[str, list]:
    memory = min((d.memory for d in machine.devices if d.memory), default=None)
    return {
        layer.name: layer_configs(layer, machine.num_devices, powers_of_two, placement, memory, itemsize)
        for layer in graph
    }
