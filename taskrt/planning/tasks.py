"""What a task does on its device.  Each spec is a small frozen dataclass, callable with the
values of its dependencies in order; the plan carries specs, Dask ships them to workers.

A dependency value is an array or a tuple of arrays (a backward task returns its input
gradients and its parameter gradient together).  A `Piece` says which element of which
dependency to read and which sub-Rect of it: a piece that already lives on the device is cut
in place here, without a task of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from taskrt.ops import Op, array_module, optim, reuse
from taskrt.ops.rect import Rect
from taskrt.planning.params import pack, unpack


class Spec:
    """Base of task specs.  Dask tokenizes a submitted graph; the keys already carry the step and
    the run, so a spec's identity is all it needs (walking every Rect and op would cost about
    half a millisecond per task per step)."""

    def __dask_tokenize__(self):
        return (type(self).__name__, id(self))


@dataclass(frozen=True)
class Piece:
    dep: int  # position among the task's dependencies
    element: int | None  # element of a tuple value, or None for a plain array
    src: Rect  # the Rect the (element) array covers
    rect: Rect  # the Rect this piece contributes

    @cached_property
    def window(self) -> tuple[slice, ...]:
        """The slices that cut this piece out of its array (found once: a step cuts every piece)."""
        return self.rect.relative_to(self.src)


def cut(values, piece: Piece):
    value = values[piece.dep]
    if piece.element is not None:
        value = value[piece.element]
    return value[piece.window]


def assemble(values, rect: Rect, pieces: tuple[Piece, ...]):
    """The array over `rect` from pieces that tile it (a view when one piece covers it all)."""
    if len(pieces) == 1 and pieces[0].rect == rect:
        return cut(values, pieces[0])
    first = cut(values, pieces[0])
    out = array_module(first).empty(rect.shape, dtype=first.dtype)
    for piece in pieces:
        out[piece.rect.relative_to(rect)] = cut(values, piece)
    return out


def accumulate(values, rect: Rect, pieces: tuple[Piece, ...], like=None):
    """Sum of overlapping gradient contributions over `rect` (Legion's reduction privilege).  No
    contribution at all (a part of a tensor nothing reads: a w-split whose last column a stride-2
    pool skips, a channel block no slice takes) is a zero gradient, made like array `like`."""
    if not pieces:
        return array_module(like).zeros(rect.shape, dtype=like.dtype)
    if len(pieces) == 1 and pieces[0].rect == rect:
        return cut(values, pieces[0])
    first = cut(values, pieces[0])
    out = array_module(first).zeros(rect.shape, dtype=first.dtype)
    for piece in pieces:
        out[piece.rect.relative_to(rect)] += cut(values, piece)
    return out


@dataclass(frozen=True)
class Params:
    dep: int
    element: int | None  # 0 when reading the (weights, velocity) state in place
    layout: tuple  # ((name, shape), ...) as in params.shard_sizes

    def read(self, values) -> dict:
        flat = values[self.dep] if self.element is None else values[self.dep][self.element]
        return unpack(flat, self.layout)


@dataclass(frozen=True)
class Inputs:
    """Per input of the op: the Rect the task reads (None: nothing) and the pieces that tile it."""

    rects: tuple[Rect | None, ...]
    pieces: tuple[tuple[Piece, ...], ...]

    def read(self, values) -> list:
        return [None if r is None else assemble(values, r, p) for r, p in zip(self.rects, self.pieces)]


@dataclass(frozen=True)
class Forward(Spec):
    op: Op
    out: Rect
    inputs: Inputs
    params: Params | None
    draw: int | None = None  # a random op in training (dropout): the dependency holding the hyper-parameters

    def __call__(self, *values):
        params = self.params.read(values) if self.params else {}
        return self.op.forward(self.inputs.read(values), params, self.out, **drawn(values, self.draw))


def drawn(values, position) -> dict:
    """A random op's keyword for this step: draw=(seed, step), the same on every device and part."""
    if position is None:
        return {}
    hyper = values[position]
    return {"draw": (int(hyper["seed"]), int(hyper["draw"]))}


@dataclass(frozen=True)
class Backward(Spec):
    """Input gradients and the flat parameter gradient of one part: (dx_0, ..., dx_k, dparams)."""

    op: Op
    out: Rect
    inputs: Inputs
    params: Params | None
    output: int | None  # dependency holding the forward output, when the op needs it
    dy: tuple[Piece, ...]
    need_dx: tuple[bool, ...]
    draw: int | None = None  # as Forward's: a random op draws what its forward drew

    def __call__(self, *values):
        params = self.params.read(values) if self.params else {}
        y = values[self.output] if self.output is not None else None
        xs = self.inputs.read(values)
        dy = accumulate(values, self.out, self.dy, like=next((x for x in xs if x is not None), y))
        dxs, dparams = self.op.backward(dy, xs, y, params, self.out, self.need_dx, **drawn(values, self.draw))
        return (*dxs, pack(dparams, array_module(dy)) if dparams else None)


@dataclass(frozen=True)
class Loss(Spec):
    """Forward and backward of a loss part: (d logits, None, per-sample losses).

    The batch loss is the mean over all `batch` samples, so each per-sample loss receives 1/batch.
    """

    op: Op
    out: Rect
    inputs: Inputs
    batch: int

    def __call__(self, *values):
        xs = self.inputs.read(values)
        losses = self.op.forward(xs, {}, self.out)
        dy = array_module(losses).full(losses.shape, 1.0 / self.batch, dtype=xs[0].dtype)
        (dlogits, _), _ = self.op.backward(dy, xs, None, {}, self.out, (True, False))
        return dlogits, None, losses


@dataclass(frozen=True)
class Slice(Spec):
    """The intersecting part of a tile, as its own contiguous array, so only it travels."""

    piece: Piece

    def __call__(self, *values):
        piece = cut(values, self.piece)  # the dependency may be a tuple (a backward's gradients)
        return array_module(piece).ascontiguousarray(piece)


@dataclass(frozen=True)
class Element(Spec):
    """One element of a tuple value (a parameter gradient, or the weights of a state)."""

    element: int

    def __call__(self, value):
        return value[self.element]


@dataclass(frozen=True)
class Alias(Spec):
    """The same array under a new key (so that each key has one reading device); no copy."""

    def __call__(self, value):
        return value


@dataclass(frozen=True)
class Recompute(Spec):
    """A forward value computed again for backward (taskrt.planning.recompute): `spec`, a forward
    part or a slice or alias of one, run again.  Late: fusion runs it in the stage of its
    earliest reader, so a device computes it just before the backward task that reads it
    (`taskrt.planning.fusion.stages`)."""

    spec: Spec
    late = True

    def __call__(self, *values):
        return self.spec(*values)

    @property
    def op(self) -> Op:
        return self.spec.op

    @property
    def out(self) -> Rect:
        return self.spec.out


@dataclass(frozen=True)
class Received(Spec):
    """`spec` run on values that came through Dask's messages (another device's outputs, the
    client's data tiles and state): each array at an address that is not a multiple of its
    item size is first copied to memory of this device.  Dask leaves a received array where it
    lies in the message buffer, most often 2 bytes off (dask 2026.8), and kernels on misaligned
    arrays are slow: numpy's matmul copies the operand on every call, and AlexNet-32's fc1 ran
    161 ms on a data-parallel replica against 19 ms on the device that held its weights."""

    spec: Spec

    def __call__(self, *values):
        return self.spec(*(_aligned(v) for v in values))

    @property
    def late(self) -> bool:
        return getattr(self.spec, "late", False)


def _aligned(value):
    if isinstance(value, tuple):
        return tuple(_aligned(v) for v in value)
    if isinstance(value, np.ndarray) and not value.flags.aligned:
        out = reuse.empty(value.shape, value.dtype)
        np.copyto(out, value)
        return out
    return value


def _sum_grads(values, grads):
    """Sum of gradient values; each is (dependency, element or None, (lo, hi) of the flat array or None)."""
    parts = []
    for dep, element, span in grads:
        g = values[dep] if element is None else values[dep][element]
        parts.append(g if span is None else g[span[0] : span[1]])
    if len(parts) == 1:  # read, never written: no copy (a copy of VGG's fc2 gradient is 67 MB per step)
        return parts[0]
    xp = array_module(parts[0])
    out = reuse.empty(parts[0].shape, xp.result_type(*parts)) if xp is np else None
    total = xp.add(parts[0], parts[1], out=out)  # a new array: the inputs are other tasks' values
    for g in parts[2:]:
        total += g
    return total


@dataclass(frozen=True)
class Update(Spec):
    """Parameter server of one chunk of a shard's state: sum the replicas' gradients and apply the
    optimizer (`ops.optim`), or, on a micro-batch of an accumulation, add them to the chunk's
    accumulated gradient.

    Dependencies: the state (weights, *optimizer slots[, accumulated gradient]), the gradients,
    the clipping coefficient when `clip` is its position, and last the step's hyper-parameters
    (`ops.optim.Optimizer.hyper`, with "accumulate": (micro-batch, of k) when accumulating).
    `segments`: (parameter name, lo, hi) of the chunk, for the parameters left out of weight
    decay (`hyper["no_decay"]`)."""

    grads: tuple[tuple[int, int | None, tuple[int, int] | None], ...]
    layer: str = ""
    segments: tuple[tuple[str, int, int], ...] = ()
    clip: int | None = None

    def __call__(self, state, *values):
        hyper = optim.as_hyper(values[-1])
        g = _sum_grads((state, *values), self.grads)
        return apply_update(hyper, state, g, self.decays(hyper),
                            None if self.clip is None else values[self.clip - 1])

    def decays(self, hyper) -> tuple | None:
        """((start, weight decay), ...) where a parameter of the chunk is left out, else None."""
        left_out = hyper.get("no_decay") or ()
        if not any((self.layer, name) in left_out for name, _, _ in self.segments):
            return None
        return tuple((lo, 0.0 if (self.layer, name) in left_out else hyper["weight_decay"])
                     for name, lo, _ in self.segments)


def apply_update(hyper: dict, state: tuple, g, decays=None, clip=None) -> tuple:
    """The new state of a chunk given its summed gradient `g` (see `Update`)."""
    slots = len(optim.OPTIMIZERS[hyper["rule"]].slots)
    accumulated = state[1 + slots] if len(state) > 1 + slots else None
    position, count = hyper.get("accumulate", (0, 1))
    if position < count - 1:  # a micro-batch before the last: add, keep weights and slots as they are
        xp = array_module(g)
        total = g.copy() if accumulated is None else xp.add(accumulated, g)
        return (*state[: 1 + slots], total)
    if accumulated is not None:
        g = array_module(g).add(accumulated, g)
    scale = 1.0 / count if clip is None else float(clip[0]) / count
    return optim.update(hyper, state[0], tuple(state[1 : 1 + slots]), g, decays, scale)


@dataclass(frozen=True)
class SquaredNorm(Spec):
    """One device's share of the gradients' global norm: the sum of squares of the (summed)
    gradients of the chunks it updates, each as its update will see it (with the accumulated
    micro-batches, over their count); 0 on a micro-batch before the last.

    Dependencies: per chunk its summed gradient and its state (for the accumulated gradient),
    then the hyper-parameters."""

    chunks: tuple[tuple[int, int], ...]  # (gradient dependency, state dependency)

    def __call__(self, *values):
        hyper = optim.as_hyper(values[-1])
        position, count = hyper.get("accumulate", (0, 1))
        if position < count - 1:
            return np.zeros(1)
        slots = len(optim.OPTIMIZERS[hyper["rule"]].slots)
        total = 0.0
        for grad, state in self.chunks:
            g = values[grad]
            if len(values[state]) > 1 + slots:
                g = array_module(g).add(values[state][1 + slots], g)
            flat = g.reshape(-1) / count if count > 1 else g.reshape(-1)
            total += float(flat @ flat)
        return np.array([total])  # an array: it travels (and is counted) as 8 bytes


@dataclass(frozen=True)
class ClipCoefficient(Spec):
    """`torch.nn.utils.clip_grad_norm_`'s coefficient from every device's sum of squares:
    min(1, max_norm / (norm + 1e-6)); hyper-parameters last ("max_norm")."""

    def __call__(self, *values):
        hyper = values[-1]
        norm = float(sum(float(v[0]) for v in values[:-1])) ** 0.5
        return np.array([min(1.0, hyper["max_norm"] / (norm + 1e-6))])


@dataclass(frozen=True)
class ReduceGrads(Spec):
    grads: tuple[tuple[int, int | None, tuple[int, int] | None], ...]

    def __call__(self, *values):
        return _sum_grads(values, self.grads)


@dataclass(frozen=True)
class GatherChunks(Spec):
    """All-gather of a shard's weights: its chunks in order, each (dependency, element or None)."""

    chunks: tuple[tuple[int, int | None], ...]

    def __call__(self, *values):
        arrays = [values[dep] if element is None else values[dep][element] for dep, element in self.chunks]
        return array_module(arrays[0]).concatenate(arrays)


# ---- batch normalization: statistics reduced over the parts of a channel group ---------------
@dataclass(frozen=True)
class PartialStats(Spec):
    """(count, mean, M2) per channel of one part's input tile: a (3, C) array."""

    op: Op
    inputs: Inputs

    def __call__(self, *values):
        return self.op.partial_stats(self.inputs.read(values)[0])


@dataclass(frozen=True)
class CombineStats(Spec):
    """The statistics of a channel group from its parts' partial statistics (every dependency)."""

    op: Op

    def __call__(self, *partials):
        return self.op.combine_stats(list(partials))


@dataclass(frozen=True)
class UpdateRunning(Spec):
    """New running statistics of a channel group: dependencies (running (2, C), batch statistics)."""

    op: Op

    def __call__(self, running, stats):
        return self.op.update_running(running, stats)


@dataclass(frozen=True)
class Normalize(Spec):
    """Forward of a batch-norm part with its group's statistics (dependency `stats`): the batch's
    (count, mean, M2) while training, the running (mean, variance) when `infer`."""

    op: Op
    out: Rect
    inputs: Inputs
    params: Params
    stats: int
    infer: bool = False

    def __call__(self, *values):
        x, params = self.inputs.read(values)[0], self.params.read(values)
        if self.infer:
            return self.op.infer(x, values[self.stats], params)
        return self.op.normalize(x, values[self.stats], params)


@dataclass(frozen=True)
class GradSums(Spec):
    """One part's sums of dy and dy * xhat per channel, packed flat like its parameter shard
    (bias, then weight): summed over the group they are the parameter gradient."""

    op: Op
    inputs: Inputs
    stats: int
    dy: tuple[Piece, ...]
    out: Rect

    def __call__(self, *values):
        x = self.inputs.read(values)[0]
        dy = accumulate(values, self.out, self.dy, like=x)
        return pack(self.op.grad_sums(dy, x, values[self.stats]), array_module(dy))


@dataclass(frozen=True)
class SumArrays(Spec):
    """The sum of its dependencies (arrays of one shape)."""

    def __call__(self, *values):
        total = values[0].copy()
        for value in values[1:]:
            total += value
        return total


@dataclass(frozen=True)
class NormBackward(Spec):
    """Input gradient of a batch-norm part from its group's statistics and gradient sums:
    (dx, None); the parameter gradient is the group's sums, synchronized from there."""

    op: Op
    out: Rect
    inputs: Inputs
    params: Params
    stats: int
    dy: tuple[Piece, ...]
    sums: int
    layout: tuple

    def __call__(self, *values):
        x, params = self.inputs.read(values)[0], self.params.read(values)
        dy = accumulate(values, self.out, self.dy, like=x)
        sums = unpack(values[self.sums], self.layout)
        return self.op.input_grad(dy, x, values[self.stats], sums, params), None
