"""Configuration space: the parallel configs each layer may take (the paper's Table 1).

A config splits the layer's output over the dimensions the op allows (`op.dims`: fully-connected
{n, c}; 2D conv and pool {n, c, h, w}; elementwise, concat and flatten per their region rules;
the loss {n}), with degrees whose product is at most the device count (powers of two by
default, or every divisor of the device count), each no larger than its dimension, on a
contiguous block of devices.  Configs whose parts do not fit in a device's memory are dropped.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import product
from math import prod

from ops.rect import Rect
from taskrt.config import DIMS, ParallelConfig, blocks
from taskrt.memory import part_footprint

PLACEMENTS = ("first", "aligned")


def degree_choices(num_devices: int, powers_of_two: bool = True) -> list[int]:
    if powers_of_two:
        return [1 << k for k in range(num_devices.bit_length()) if 1 << k <= num_devices]
    return [d for d in range(1, num_devices + 1) if num_devices % d == 0]


def part_memory(layer, config: ParallelConfig, itemsize: int) -> int:
    """Bytes the largest part holds during a step (taskrt.memory.part_footprint: its input tiles,
    its output and output gradient, and its parameter shard with gradient and velocity).  Blocks
    that do not divide evenly are larger first, so part 0 is the largest."""
    return _block_memory(layer.op, tuple(blocks(size, getattr(config, dim))[0][1]
                                         for size, dim in zip(layer.shape, DIMS)), itemsize)


@lru_cache(maxsize=65536)
def _block_memory(op, extent, itemsize) -> int:
    return part_footprint(op, Rect((0,) * len(extent), extent), itemsize).total


def layer_configs(layer, num_devices: int, powers_of_two: bool = True, placement: str = "first",
                  memory: float | None = None, itemsize: int = 4) -> list[ParallelConfig]:
    """Every config of `layer` on `num_devices` devices.

    placement "first": the parts use devices 0..P-1 (under the additive cost model a block
    elsewhere only adds transfers); "aligned": every block [k*P, (k+1)*P).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    choices = degree_choices(num_devices, powers_of_two)
    per_dim = []
    for dim in DIMS:
        if dim in layer.dims:
            size = layer.shape[layer.dims.index(dim)]
            per_dim.append([d for d in choices if d <= size])
        else:
            per_dim.append([1])
    configs = []
    for degrees in product(*per_dim):
        total = prod(degrees)
        if total > num_devices:
            continue
        starts = [0] if placement == "first" else range(0, num_devices - total + 1, total)
        for start in starts:
            configs.append(ParallelConfig(*degrees, devices=tuple(range(start, start + total))))
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
