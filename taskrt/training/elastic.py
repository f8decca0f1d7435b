"""What the Trainer needs to survive lost workers: snapshots, the log of steps since, and a
strategy for the devices that are left.

Every strategy computes what the single-device network computes, so after a loss the trainer
may restore the last snapshot under any strategy on the survivors and replay the logged steps:
the run ends with the parameters it would have had (up to float rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from taskrt.graph.config import DIMS, ParallelConfig
from taskrt.graph.strategy import Strategy

# Snapshots by default cost at most this share of the step time (see snapshot_interval).
SNAPSHOT_SHARE = 0.05
MAX_SNAPSHOT_INTERVAL = 100  # steps: bounds the inputs kept for replay and the replay itself
MAX_REPLAY_S = 60.0  # where the log keeps only sample indices: the steps a replay may have to run, in seconds


class DeviceLost(Exception):
    """Internal: a step cannot finish because devices of the current machine have no worker,
    or values it needs were lost with one."""

    def __init__(self, devices, reason: str):
        super().__init__(reason)
        self.devices = tuple(devices)
        self.reason = reason


@dataclass(frozen=True)
class Snapshot:
    """Parameters and the optimizer's state after `step`, as numpy arrays held by the client
    (`slots`: one {layer: {name: array}} per slot of the optimizer, in its order)."""

    step: int
    params: dict
    slots: tuple
    seconds: float = 0.0  # what taking it cost
    running: dict | None = None  # the batch norms' running statistics, {layer: (2, C) array}


@dataclass(frozen=True)
class LoggedStep:
    """What replaying a step needs: its inputs and hyper-parameters.  A step fed from numpy arrays
    keeps them (`arrays`); a step read from a dataset keeps only which samples it read (`batch`:
    a `taskrt.data.datasets.Batch`, the dataset by reference), and its replay reads them again."""

    step: int
    arrays: dict | None
    hyper: dict
    batch: object = None

    @property
    def nbytes(self) -> int:
        """Bytes of sample data (arrays or indices) the log keeps for this step."""
        if self.batch is not None:
            return int(self.batch.indices.nbytes)
        return sum(int(a.nbytes) for a in self.arrays.values())


def snapshot_interval(snapshot_s: float, step_s: float, share: float = SNAPSHOT_SHARE, logs_arrays: bool = True) -> int:
    """Steps between snapshots so that one snapshot costs at most `share` of the steps' time, at most
    MAX_SNAPSHOT_INTERVAL steps where the log keeps each step's arrays (its memory), else at most
    MAX_REPLAY_S of steps (a log of sample indices costs little; a replay costs its steps' time)."""
    if step_s <= 0:
        return 1
    cap = MAX_SNAPSHOT_INTERVAL if logs_arrays else max(MAX_SNAPSHOT_INTERVAL, int(MAX_REPLAY_S / step_s))
    return max(1, min(cap, math.ceil(snapshot_s / (share * step_s))))


def remap(strategy: Strategy, live: list[int]) -> Strategy:
    """`strategy`, written for the whole machine, on the surviving devices `live` (ids of the
    whole machine), numbered as `Machine.subset(live)` numbers them.

    Each layer keeps its split where there are enough devices (parts on surviving devices stay
    there; the parts of lost devices go to survivors the layer does not use yet); otherwise its
    largest degree shrinks one at a time until its parts fit."""
    index = {device: i for i, device in enumerate(live)}
    configs = {}
    for name, cfg in strategy.items():
        configs[name] = remap_config(cfg, index, len(live))
    return Strategy(configs, name=f"{strategy.name or 'strategy'} on {len(live)} devices",
                    meta={"remapped_from": strategy.name, "live_devices": list(live)})


def remap_config(cfg: ParallelConfig, index: dict, count: int) -> ParallelConfig:
    degrees = cfg.degrees
    while math.prod(degrees.values()) > count:
        largest = max(DIMS, key=lambda dim: (degrees[dim], DIMS.index(dim)))
        degrees[largest] -= 1
    total = math.prod(degrees.values())
    alive = [index[d] for d in cfg.devices[:total] if d in index]
    spare = [d for d in range(count) if d not in alive]
    return replace(cfg, **degrees, devices=tuple(index[d] if d in index else spare.pop(0) for d in cfg.devices[:total]))
