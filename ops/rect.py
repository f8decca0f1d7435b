"""Rect: a half-open box of indices, one [lo, hi) per dimension.

Everything about data movement is computed from Rects: which part of a tensor a task
reads, which slice of a tile travels to another device, which gradient contributions
overlap.  Intersection, volume and translation are the whole algebra.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Rect:
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def __post_init__(self):
        if len(self.lo) != len(self.hi):
            raise ValueError(f"Rect bounds of different rank: lo={self.lo} hi={self.hi}")

    @classmethod
    def full(cls, shape) -> Rect:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @classmethod
    def from_ranges(cls, ranges) -> Rect:
        ranges = list(ranges)
        return cls(tuple(int(a) for a, _ in ranges), tuple(int(b) for _, b in ranges))

    @property
    def rank(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in zip(self.lo, self.hi))

    @property
    def volume(self) -> int:
        return prod(self.shape)

    @property
    def empty(self) -> bool:
        return any(b <= a for a, b in zip(self.lo, self.hi))

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.lo, self.hi))

    def intersect(self, other: Rect) -> Rect:
        return Rect(tuple(map(max, self.lo, other.lo)), tuple(map(min, self.hi, other.hi)))

    def contains(self, other: Rect) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi))

    def translate(self, offset) -> Rect:
        return Rect(tuple(a + o for a, o in zip(self.lo, offset)), tuple(b + o for b, o in zip(self.hi, offset)))

    def relative_to(self, outer: Rect) -> tuple[slice, ...]:
        """Slices that cut this Rect out of an array that holds `outer`."""
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.lo, self.hi, outer.lo))

    def replace(self, dim: int, lo: int, hi: int) -> Rect:
        return Rect(self.lo[:dim] + (lo,) + self.lo[dim + 1 :], self.hi[:dim] + (hi,) + self.hi[dim + 1 :])

    def __repr__(self) -> str:
        return "Rect(" + ", ".join(f"{a}:{b}" for a, b in zip(self.lo, self.hi)) + ")"
