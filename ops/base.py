"""What every op knows: shapes, parallelizable dimensions, region rules, FLOPs, kernels.

An op is a frozen dataclass bound to the shapes of its inputs.  Its kernels compute on a
*tile*: given the Rect of the output a task owns, `input_rects` says which Rect of each input
the task reads (halo included, clipped to the tensor), and `forward` / `backward` receive
exactly those input tiles.  The tile's output equals the same slice of the whole-tensor
output, so any partition of the output computes the original network.

Backward reads the rule the other way: the gradient of each input tile covers the Rect it
read; overlapping contributions from neighbouring tiles are summed by the caller.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from taskrt.ops.rect import Rect

IMAGE_DIMS = ("n", "c", "h", "w")
MATRIX_DIMS = ("n", "c")
VECTOR_DIMS = ("n",)


def dims_of(shape) -> tuple[str, ...]:
    return {4: IMAGE_DIMS, 2: MATRIX_DIMS, 1: VECTOR_DIMS}[len(shape)]


def array_module(*arrays):
    """numpy, or cupy when any argument is a cupy array (cupy is imported only if loaded)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays):
        return cupy
    import numpy

    return numpy


@dataclass(frozen=True)
class Op:
    """Base class.  Subclasses set `kind`, store their input shapes and override what applies."""

    in_shapes: tuple[tuple[int, ...], ...]

    kind = "op"
    #: does the op's backward need its forward output (e.g. fused relu, max pool)?
    saves_output = False
    #: do its statistics reduce over the parts of a channel (batch norm)?  The lowering then
    #: plans the reduction as tasks; `statistics_hops` dependent tasks it adds per direction.
    reduces_statistics = False
    statistics_hops = 0

    # ---- shapes -------------------------------------------------------------------------
    @property
    def out_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def dims(self) -> tuple[str, ...]:
        """Output dimensions this op can be split over (the paper's Table 1)."""
        return dims_of(self.out_shape)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """State that is not trained by gradients (batch norm's running statistics)."""
        return {}

    # ---- region rules -------------------------------------------------------------------
    def input_rects(self, out: Rect) -> list[Rect | None]:
        """For each input, the Rect a task owning `out` reads (None: it reads nothing)."""
        return [out for _ in self.in_shapes]

    def param_rects(self, out: Rect) -> dict[str, Rect]:
        """For each parameter, the Rect a task owning `out` reads."""
        return {}

    # ---- cost ---------------------------------------------------------------------------
    def flops(self, out: Rect) -> int:
        """Forward FLOPs of the tile (multiply-add counts as two)."""
        return out.volume

    def backward_flops(self, out: Rect) -> int:
        return 2 * self.flops(out)

    # ---- kernels ------------------------------------------------------------------------
    def forward(self, xs, params, out: Rect):
        """Output tile for Rect `out`; `xs[i]` is the tile of input i over `input_rects(out)[i]`."""
        raise NotImplementedError

    def backward(self, dy, xs, y, params, out: Rect, need_dx):
        """Gradients of one tile: (list of input-tile gradients or None, dict of param gradients).

        `need_dx[i]` says whether input i's gradient is wanted; unwanted ones are not computed.
        `y` is the forward output tile when `saves_output`, else None.
        """
        raise NotImplementedError

    # ---- description --------------------------------------------------------------------
    def attrs(self) -> dict:
        """Hyper-parameters, JSON-ready (used to describe and rebuild the graph)."""
        return {}
