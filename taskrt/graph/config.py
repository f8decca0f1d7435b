"""ParallelConfig: how one layer's output tensor is split, and which device computes each part."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from math import prod

from taskrt.ops.rect import Rect

DIMS = ("n", "c", "h", "w")
# How the replicas of a replicated parameter shard synchronize (see taskrt.planning.lowering):
#   "ps": a parameter server, the shard's first device, sums the gradients and sends weights back;
#   "allreduce": reduce-scatter then all-gather, each replica keeping a chunk of the master copy.
SYNC_METHODS = ("ps", "allreduce")


@lru_cache(maxsize=4096)
def blocks(size: int, degree: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of `degree` blocks as equal as possible over `size`; the first ones get one more."""
    q, r = divmod(size, degree)
    edges = [0]
    for i in range(degree):
        edges.append(edges[-1] + q + (1 if i < r else 0))
    return tuple(zip(edges[:-1], edges[1:]))


@dataclass(frozen=True)
class Part:
    index: int
    rect: Rect
    device: int


@dataclass(frozen=True)
class ParallelConfig:
    """A degree per dimension (n, c, h, w) and the device of each part, parts numbered row-major
    over the grid of degrees.  Devices default to 0 .. P-1.  `sync` says how replicated weights
    (a split over n, h or w) synchronize: one of SYNC_METHODS.  `c_sizes` makes the channel split
    uneven: the size of each of the `c` channel blocks, in order (default: as equal as possible);
    a layer's filters are interchangeable, so an uneven split is how a partition that gives each
    device its own number of filters is expressed.  `recompute`: training keeps none of the layer's
    output for backward; each part is computed again, on its device, just before the first backward
    task that reads it (taskrt.planning.recompute), trading its forward's time for its memory."""

    n: int = 1
    c: int = 1
    h: int = 1
    w: int = 1
    devices: tuple[int, ...] = field(default=None)
    sync: str = "ps"
    c_sizes: tuple[int, ...] | None = None
    recompute: bool = False

    def __post_init__(self):
        devices = self.devices
        if (type(self.n) is int and type(self.c) is int and type(self.h) is int and type(self.w) is int
                and min(self.n, self.c, self.h, self.w) >= 1 and type(devices) is tuple
                and self.sync in SYNC_METHODS and self.c_sizes is None and set(map(type, devices)) <= {int}
                and type(self.recompute) is bool):
            return  # already valid and normalized: the common case, checked at C speed (the search builds many)
        for dim in DIMS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"degree {dim}={value!r} must be a positive int")
        try:
            devices = tuple(range(self.total)) if self.devices is None else tuple(self.devices)
        except TypeError:
            raise ValueError(f"devices must be a list of ints, got {self.devices!r}") from None
        if any(isinstance(d, bool) or not isinstance(d, int) for d in devices):
            raise ValueError(f"devices must be ints, got {list(devices)}")
        if self.sync not in SYNC_METHODS:
            raise ValueError(f"sync={self.sync!r} is not one of {', '.join(map(repr, SYNC_METHODS))}")
        if type(self.recompute) is not bool:
            raise ValueError(f"recompute={self.recompute!r} must be true or false")
        object.__setattr__(self, "devices", devices)
        if self.c_sizes is not None:
            try:
                sizes = tuple(self.c_sizes)
            except TypeError:
                raise ValueError(f"c_sizes must be a list of ints, got {self.c_sizes!r}") from None
            if len(sizes) != self.c or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
                raise ValueError(f"c_sizes={list(sizes)} must be {self.c} positive ints, one per channel block")
            object.__setattr__(self, "c_sizes", sizes)

    @property
    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def total(self) -> int:
        return prod(self.degrees.values())

    def split_dims(self) -> list[str]:
        return [dim for dim in DIMS if getattr(self, dim) > 1]

    def parts(self, shape) -> list[Part]:
        """The parts of a tensor of `shape` whose dimensions are the first len(shape) of (n, c, h, w)."""
        dims = DIMS[: len(shape)]
        ranges = [self.ranges(size, dim) for size, dim in zip(shape, dims)]
        return [
            Part(i, Rect.from_ranges(combo), self.devices[i]) for i, combo in enumerate(product(*ranges))
        ]

    def ranges(self, size: int, dim: str) -> tuple[tuple[int, int], ...]:
        """[lo, hi) of each block of dimension `dim` (of `size`), in order."""
        if dim == "c" and self.c_sizes is not None:
            if sum(self.c_sizes) != size:
                raise ValueError(f"c_sizes={list(self.c_sizes)} add up to {sum(self.c_sizes)}, not to the "
                                 f"{size} channels")
            edges = [0]
            for v in self.c_sizes:
                edges.append(edges[-1] + v)
            return tuple(zip(edges[:-1], edges[1:]))
        return blocks(size, getattr(self, dim))

    @property
    def is_even(self) -> bool:
        """Every split as equal as possible (the only kind the search's cost tables price)."""
        return self.c_sizes is None

    def to_dict(self) -> dict:
        out = {**{dim: getattr(self, dim) for dim in DIMS}, "devices": list(self.devices)}
        if self.sync != "ps":
            out["sync"] = self.sync
        if self.c_sizes is not None:
            out["c_sizes"] = list(self.c_sizes)
        if self.recompute:
            out["recompute"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ParallelConfig:
        return cls(**{k: data[k] for k in FIELDS if k in data})

    def __str__(self) -> str:
        degrees = ", ".join(f"{dim}={getattr(self, dim)}" for dim in DIMS)
        sizes = f" sizes {list(self.c_sizes)}" if self.c_sizes is not None else ""
        return (f"{{{degrees}}}{sizes} on {list(self.devices)}" + (f" ({self.sync})" if self.sync != "ps" else "")
                + (" (recompute)" if self.recompute else ""))


FIELDS = (*DIMS, "devices", "sync", "c_sizes", "recompute")  # the JSON fields of a config
