"""A graph input: data the trainer scatters to devices (images or labels)."""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.ops.base import Op
from taskrt.ops.errors import ShapeError


@dataclass(frozen=True)
class Input(Op):
    shape: tuple[int, ...]
    dtype: str = "float"

    kind = "input"

    def __post_init__(self):
        if len(self.shape) not in (1, 2, 4):
            raise ShapeError(f"input must have rank 4 (n, c, h, w), 2 (n, c) or 1 (n,), got shape {self.shape}")
        if any(int(s) < 1 for s in self.shape):
            raise ShapeError(f"input dimensions must be >= 1, got shape {self.shape}")
        if self.dtype not in ("float", "int64"):
            raise ShapeError(f"input dtype must be 'float' (the trainer's dtype) or 'int64', got {self.dtype!r}")

    @property
    def out_shape(self):
        return tuple(self.shape)

    def flops(self, out):
        return 0

    def attrs(self):
        return {"shape": list(self.shape), "dtype": self.dtype}
