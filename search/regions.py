"""The lowering's region logic in array form, for costing thousands of config pairs at once.

Every part of every config of a layer becomes a row: the lo/hi of its output Rect and its
device, built with the same block rule as ParallelConfig.parts.  For a consumer, each part's
*needed* input Rect comes from the op's region rule, asked once per distinct 1-D block: the
rules of all ops are separable (each input dimension's range depends on one output dimension),
which `Needs` checks rather than assumes.  The zoo's ops have their rule here in array form
(`RULES`, tested equal to each op's `input_rects`), so all blocks are asked at once; any other
op is asked block by block.  Overlap volumes between producer parts and consumer needs are then
exactly the numbers the lowering moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from taskrt.graph.config import DIMS
from taskrt.ops import (
    AdaptivePool2d,
    ChannelShuffle,
    ChannelSlice,
    Concat,
    Conv2d,
    Flatten,
    Linear,
    Mean,
    Op,
    Pool2d,
    SoftmaxCrossEntropy,
)
from taskrt.ops.adaptive_pool import bin_start, bin_stop
from taskrt.ops.rect import Rect


@dataclass
class PartTable:
    """All parts of a list of configs: one row per part, grouped by config (in order)."""

    lo: np.ndarray  # (parts, rank)
    hi: np.ndarray  # (parts, rank)
    device: np.ndarray  # (parts,)
    starts: np.ndarray  # first row of each config (for np.*.reduceat)
    block: np.ndarray  # (parts, rank): block index of the part along each dimension
    degrees: np.ndarray | None = None  # (configs, rank): blocks per dimension of each config
    config: np.ndarray | None = None  # (parts,): the config of each part

    def __post_init__(self):
        if self.config is None:
            self.config = np.repeat(np.arange(len(self.starts)), np.diff(np.append(self.starts, len(self.device))))
        if self.degrees is None:
            self.degrees = np.maximum.reduceat(self.block, self.starts, axis=0) + 1

    @property
    def shape(self) -> np.ndarray:
        return self.hi - self.lo

    def slots(self, size) -> Slots:
        """The blocks of the configs along each dimension of a tensor of shape `size`, as slots."""
        if getattr(self, "_slots", None) is None:
            counts, first, lo, hi = _slots(np.asarray(size, dtype=np.int64), self.degrees)
            self.keep_slots(Slots(first, lo, hi, counts.tolist(), part_slots(first, self.config, self.block)))
        return self._slots

    def keep_slots(self, slots: Slots):
        """Slots worked out elsewhere (search.transfer.Grid.of_blocks makes them in the same
        compiled call as the table)."""
        self._slots = slots


@numba.njit(cache=True, nogil=True)
def part_slots(first, config, block):
    """Each part's slot along each dimension: its config's first slot there plus its block."""
    out = np.empty_like(block)
    for row in range(len(config)):
        for e in range(block.shape[1]):
            out[row, e] = first[config[row], e] + block[row, e]
    return out


@numba.njit(cache=True, nogil=True)
def _slots(size, degrees):
    """Slots along each dimension: per degree used (ascending), its blocks (as `block_slots`)."""
    configs, rank = degrees.shape
    top = degrees.max() + 1
    start = np.full((rank, top), -1, dtype=np.int64)  # first slot of each degree used
    counts = np.zeros(rank, dtype=np.int64)
    for d in range(rank):
        for a in range(configs):
            start[d, degrees[a, d]] = 0
        for g in range(1, top):
            if start[d, g] == 0:
                start[d, g] = counts[d]
                counts[d] += g
    lo = np.zeros((rank, counts.max()), dtype=np.int64)
    hi = np.zeros((rank, counts.max()), dtype=np.int64)
    for d in range(rank):
        for g in range(1, top):
            if start[d, g] >= 0:
                q, r = size[d] // g, size[d] % g
                for b in range(g):
                    lo[d, start[d, g] + b] = b * q + min(b, r)
                    hi[d, start[d, g] + b] = lo[d, start[d, g] + b] + q + (1 if b < r else 0)
    first = np.empty((configs, rank), dtype=np.int64)
    for a in range(configs):
        for d in range(rank):
            first[a, d] = start[d, degrees[a, d]]
    return counts, first, lo, hi


@dataclass
class Slots:
    """Per dimension, one slot per (degree, block) for every degree the configs use along it
    (degrees ascending, blocks in order: `block_slots`)."""

    first: np.ndarray  # (configs, rank): each config's first slot along each dimension
    lo: np.ndarray  # (rank, width): each slot's block, padded with empty ones to the widest dimension
    hi: np.ndarray
    count: list[int]  # slots along each dimension
    part: np.ndarray  # (parts, rank): each part's slot


def part_table(shape, configs) -> PartTable:
    """All parts of all configs, vectorized: the same blocks, order and devices as ParallelConfig.parts."""
    uneven = next((c for c in configs if not c.is_even), None)
    if uneven is not None:
        raise ValueError(f"config {uneven} splits channels unevenly; the cost tables price even splits only "
                         "(time such a strategy by simulating its plan: taskrt.planning.simulate)")
    degrees = np.array([[getattr(c, dim) for dim in DIMS[: len(shape)]] for c in configs], dtype=np.int64)
    device = np.concatenate([np.asarray(c.devices, dtype=np.int64) for c in configs])
    return grid_parts(shape, degrees, device)


def grid_parts(shape, degrees: np.ndarray, device: np.ndarray | None = None, first=None) -> PartTable:
    """The parts of configs given as (configs, rank) degrees, in config order, on the devices given
    for every part, or else on each config's block of devices from `first`."""
    first = np.zeros(len(degrees), dtype=np.int64) if first is None else first
    starts, config, block, lo, hi, on = _grid_parts(np.asarray(shape, dtype=np.int64), degrees, first)
    device = on if device is None else np.asarray(device, dtype=np.int64)
    return PartTable(lo, hi, device, starts, block, degrees, config)


@numba.njit(cache=True, nogil=True)
def _grid_parts(shape, degrees, first):
    """Parts numbered row-major over each config's grid of blocks, blocks as equal as possible
    (the first ones one larger), part i of a config on device first + i, as ParallelConfig.parts."""
    configs, rank = degrees.shape
    starts = np.zeros(configs, dtype=np.int64)
    total = 0
    for a in range(configs):
        starts[a] = total
        size = 1
        for d in range(rank):
            size *= degrees[a, d]
        total += size
    config = np.empty(total, dtype=np.int64)
    device = np.empty(total, dtype=np.int64)
    block = np.empty((total, rank), dtype=np.int64)
    lo = np.empty((total, rank), dtype=np.int64)
    hi = np.empty((total, rank), dtype=np.int64)
    q = np.empty(rank, dtype=np.int64)
    r = np.empty(rank, dtype=np.int64)
    b = np.empty(rank, dtype=np.int64)
    for a in range(configs):
        end = starts[a + 1] if a + 1 < configs else total
        for d in range(rank):  # divided once per config, not per part
            q[d], r[d] = shape[d] // degrees[a, d], shape[d] % degrees[a, d]
        b[:] = 0
        for row in range(starts[a], end):
            config[row] = a
            device[row] = first[a] + row - starts[a]
            for d in range(rank):
                block[row, d] = b[d]
                lo[row, d] = b[d] * q[d] + min(b[d], r[d])
                hi[row, d] = lo[row, d] + q[d] + (1 if b[d] < r[d] else 0)
            for d in range(rank - 1, -1, -1):  # the next part's blocks: row-major, the last dimension fastest
                b[d] += 1
                if b[d] < degrees[a, d]:
                    break
                b[d] = 0
    return starts, config, block, lo, hi, device


def block_slots(size: int, degrees) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks of each of `degrees` (distinct, ascending) along a dimension of `size`, one slot
    per (degree, block): the first slot of each degree, and every slot's lo and hi."""
    degrees = np.asarray(degrees, dtype=np.int64)
    first = np.zeros(len(degrees), dtype=np.int64)
    np.cumsum(degrees[:-1], out=first[1:])
    of_slot = np.repeat(degrees, degrees)
    block = np.arange(len(of_slot)) - np.repeat(first, degrees)
    q, r = size // of_slot, size % of_slot
    lo = block * q + np.minimum(block, r)
    return first, lo, lo + q + (block < r)


# ---- region rules in array form ------------------------------------------------------------------
def input_ranges(op, j: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`op.input_rects(Rect(lo[k], hi[k]))[j]` for every row k at once: (reads, lo, hi) of input j,
    zeros where the rule gives None.  Ops whose rule has an array form here (RULES, keyed by the
    `input_rects` they mirror) take it; any other op's own rule is asked row by row."""
    rule = RULES.get(type(op).input_rects)
    if rule is not None:
        return rule(op, j, lo, hi)
    rank = len(op.in_shapes[j])
    reads = np.zeros(len(lo), dtype=bool)
    out_lo, out_hi = np.zeros((len(lo), rank), dtype=np.int64), np.zeros((len(lo), rank), dtype=np.int64)
    for k, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
        r = op.input_rects(Rect(tuple(a), tuple(b)))[j]
        if r is not None:
            reads[k], out_lo[k], out_hi[k] = True, r.lo, r.hi
    return reads, out_lo, out_hi


def _same(op, j, lo, hi):  # Op.input_rects: the output's own Rect
    return np.ones(len(lo), dtype=bool), lo, hi


def _window(op, lo, hi, channels_lo, channels_hi):
    """ops.conv.window_input_rect: samples kept, the given channels, ops.windows.halo in h and w (the
    extent of a dilated kernel; pooling has no dilation)."""
    in_lo, in_hi = np.empty_like(lo), np.empty_like(hi)
    in_lo[:, 0], in_hi[:, 0] = lo[:, 0], hi[:, 0]
    in_lo[:, 1], in_hi[:, 1] = channels_lo, channels_hi
    dilation = getattr(op, "dilation", (1, 1))
    for axis, kernel, stride, padding, spacing in zip((2, 3), op.kernel, op.stride, op.padding, dilation):
        start = lo[:, axis] * stride - padding
        stop = (hi[:, axis] - 1) * stride - padding + spacing * (kernel - 1) + 1
        in_lo[:, axis] = np.clip(start, 0, op.in_shapes[0][axis])  # empty at a border: windows in the padding
        in_hi[:, axis] = np.clip(stop, 0, op.in_shapes[0][axis])
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


def _conv(op, j, lo, hi):
    """Conv2d.input_rects: with one group every input channel, else the input channels of the groups
    the rows' output channels belong to."""
    cin, groups = op.in_shapes[0][1], op.groups
    if groups == 1:
        return _window(op, lo, hi, 0, cin)
    per_group, inputs = op.out_channels // groups, cin // groups
    return _window(op, lo, hi, lo[:, 1] // per_group * inputs, -(-hi[:, 1] // per_group) * inputs)


def _pool(op, j, lo, hi):
    return _window(op, lo, hi, lo[:, 1], hi[:, 1])


def _all_features(op, j, lo, hi):  # linear, and the loss's logits: every feature of the samples
    features = op.in_shapes[0][1]
    return _same(op, j, np.stack([lo[:, 0], np.zeros_like(lo[:, 0])], axis=1),
                 np.stack([hi[:, 0], np.full_like(hi[:, 0], features)], axis=1))


def _loss(op, j, lo, hi):
    return _all_features(op, j, lo, hi) if j == 0 else _same(op, j, lo, hi)


def _flatten(op, j, lo, hi):
    shape, plane = op.in_shapes[0], op._plane
    in_lo = np.zeros((len(lo), len(shape)), dtype=np.int64)
    in_hi = np.broadcast_to(np.array(shape, dtype=np.int64), in_lo.shape).copy()
    in_lo[:, 0], in_hi[:, 0] = lo[:, 0], hi[:, 0]
    in_lo[:, 1], in_hi[:, 1] = lo[:, 1] // plane, -(-hi[:, 1] // plane)
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


def _concat(op, j, lo, hi):
    offsets = op.offsets
    c0, c1 = np.maximum(lo[:, 1], offsets[j]), np.minimum(hi[:, 1], offsets[j + 1])
    reads = c0 < c1
    in_lo, in_hi = lo.copy(), hi.copy()
    in_lo[:, 1], in_hi[:, 1] = c0 - offsets[j], c1 - offsets[j]
    in_lo[~reads], in_hi[~reads] = 0, 0
    return reads, in_lo, in_hi


def _adaptive_pool(op, j, lo, hi):  # whole bins: [floor(i0*H/oh), ceil(i1*H/oh)) per axis
    in_lo, in_hi = lo.copy(), hi.copy()
    for axis, out in zip((2, 3), op.output_size):
        size = op.in_shapes[0][axis]
        in_lo[:, axis], in_hi[:, axis] = bin_start(lo[:, axis], out, size), bin_stop(hi[:, axis], out, size)
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


def _mean(op, j, lo, hi):  # samples and channels kept, whole planes
    shape = op.in_shapes[0]
    in_lo = np.zeros((len(lo), 4), dtype=np.int64)
    in_hi = np.broadcast_to(np.array(shape, dtype=np.int64), in_lo.shape).copy()
    in_lo[:, :2], in_hi[:, :2] = lo[:, :2], hi[:, :2]
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


def _channel_slice(op, j, lo, hi):
    in_lo, in_hi = lo.copy(), hi.copy()
    in_lo[:, 1] += op.start
    in_hi[:, 1] += op.start
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


def _channel_shuffle(op, j, lo, hi):  # the smallest channel range holding the sources
    src = op.sources(0, op.in_shapes[0][1])
    channel = np.arange(len(src))
    inside = (channel >= lo[:, 1, None]) & (channel < hi[:, 1, None])
    empty = ~inside.any(axis=1)
    in_lo, in_hi = lo.copy(), hi.copy()
    in_lo[:, 1] = np.where(empty, 0, np.where(inside, src, len(src)).min(axis=1))
    in_hi[:, 1] = np.where(empty, 0, np.where(inside, src, -1).max(axis=1) + 1)
    return np.ones(len(lo), dtype=bool), in_lo, in_hi


RULES = {Op.input_rects: _same, Conv2d.input_rects: _conv, Pool2d.input_rects: _pool,
         Linear.input_rects: _all_features, SoftmaxCrossEntropy.input_rects: _loss,
         Flatten.input_rects: _flatten, Concat.input_rects: _concat, AdaptivePool2d.input_rects: _adaptive_pool,
         Mean.input_rects: _mean, ChannelSlice.input_rects: _channel_slice,
         ChannelShuffle.input_rects: _channel_shuffle}


class NotSeparable(ValueError):
    pass


class Needs:
    """What each part of a consumer reads of its input `j`, per part (`table`) and per 1-D block.

    The rule is asked once per block of every degree along each output dimension, the others
    whole; each input dimension may vary with one output dimension only (its driver), which is
    checked.  A part's need then takes each input dimension from its block along the driver."""

    def __init__(self, op, j: int, parts: PartTable, configs=None):
        out_shape = tuple(op.out_shape)
        rank = len(op.in_shapes[j])
        self.out_shape = out_shape
        slots = parts.slots(out_shape)
        # one probe per slot: the whole output except that slot's block along its dimension; row 0 is whole
        counts = np.array(slots.count)
        probe_lo, probe_hi = _probes(np.array(out_shape, dtype=np.int64), counts, slots.lo, slots.hi)
        reads, in_lo, in_hi = input_ranges(op, j, probe_lo, probe_hi)
        # per output dimension and slot: the answer (backward costs in search.transfer read these)
        (*by_slot, driven_by, clash, lo, hi, self.volume, own) = _needs(reads, in_lo, in_hi, counts, slots.lo.shape[1],
                                                                        slots.part, parts.lo, parts.hi)
        if clash[0] >= 0:
            raise NotSeparable(f"{op.kind}: input {j} dimension {clash[0]} depends on output dimensions "
                               f"{clash[1]} and {clash[2]}")
        self.by_slot = BySlot(*by_slot)
        self.driver = {e: int(d) for e, d in enumerate(driven_by.tolist()) if d >= 0}
        self.constant = {e: (int(in_lo[0, e]), int(in_hi[0, e])) for e in range(rank) if e not in self.driver}
        self.table = PartTable(lo, hi, parts.device, parts.starts, parts.block, parts.degrees, parts.config)
        self.reads_own_part = bool(own)
        self.driven_by = driven_by  # per input dimension: the output dimension driving it, or -1
        self.reads_nothing = self.volume == 0  # per part (search.transfer skips these receivers)

    def key(self) -> bytes:
        """What the needs of every part follow from, given the parts' blocks: equal keys, equal needs."""
        if getattr(self, "_key", None) is None:
            b = self.by_slot
            self._key = b"".join(np.ascontiguousarray(a).tobytes() + bytes(str(a.shape), "ascii") for a in (
                b.reads, b.lo, b.hi, b.drives, b.constant_lo, b.constant_hi, b.has_constant))
        return self._key


@numba.njit(cache=True, nogil=True)
def _probes(out_shape, counts, slot_lo, slot_hi):
    rank = len(out_shape)
    probe_lo = np.zeros((1 + counts.sum(), rank), dtype=np.int64)
    probe_hi = np.empty((1 + counts.sum(), rank), dtype=np.int64)
    probe_hi[:] = out_shape
    row = 1
    for d in range(rank):
        for s in range(counts[d]):
            probe_lo[row, d], probe_hi[row, d] = slot_lo[d, s], slot_hi[d, s]
            row += 1
    return probe_lo, probe_hi


@numba.njit(cache=True, nogil=True)
def _needs(reads, in_lo, in_hi, counts, width, part_slot, parts_lo, parts_hi):
    """The probes' answers sorted into BySlot's arrays (`_answers`), each input dimension's driver
    (-1: none), a clash (`_answers`), each part's need and its volume (`_needs_table`), and
    whether every part reads exactly its own output Rect."""
    rank_out, rank = len(counts), in_lo.shape[1]
    slot_reads = np.zeros((rank_out, width))
    slot_lo = np.zeros((rank_out, width, rank), dtype=np.int64)
    slot_hi = np.zeros((rank_out, width, rank), dtype=np.int64)
    drives = np.zeros((rank_out, rank), dtype=np.bool_)
    constant_lo, constant_hi = in_lo[0].copy(), in_hi[0].copy()
    has_constant = np.zeros(rank, dtype=np.bool_)
    driven_by = np.full(rank, -1, dtype=np.int64)
    clash = _answers(reads, in_lo, in_hi, counts, driven_by, slot_reads, slot_lo, slot_hi, drives, constant_lo,
                     constant_hi, has_constant)
    if clash[0] >= 0:
        lo = np.zeros((0, rank), dtype=np.int64)
        return (slot_reads, slot_lo, slot_hi, drives, constant_lo, constant_hi, has_constant, driven_by, clash, lo,
                lo, np.zeros(0, dtype=np.int64), False)
    lo, hi, volume = _needs_table(part_slot, slot_reads, slot_lo, slot_hi, driven_by, in_lo[0], in_hi[0])
    own = rank == rank_out
    for p in range(len(lo) if own else 0):
        for e in range(rank):
            own = own and lo[p, e] == parts_lo[p, e] and hi[p, e] == parts_hi[p, e]
    return (slot_reads, slot_lo, slot_hi, drives, constant_lo, constant_hi, has_constant, driven_by, clash, lo, hi,
            volume, own)


@numba.njit(cache=True, nogil=True)
def _answers(reads, in_lo, in_hi, counts, driven_by, slot_reads, slot_lo, slot_hi, drives, constant_lo, constant_hi,
             has_constant):
    """Sort the probes' answers (row 0: the whole output) into BySlot's arrays and find each input
    dimension's driver: the output dimension along whose blocks its range varies.  Returns
    (input dimension, output dimension, output dimension) of a clash, or -1s."""
    rank_out, rank = len(counts), in_lo.shape[1]
    row = 1
    for d in range(rank_out):
        for s in range(counts[d]):
            slot_reads[d, s] = 1.0 if reads[row] else 0.0
            for e in range(rank):
                if reads[row] and (in_lo[row, e] != in_lo[0, e] or in_hi[row, e] != in_hi[0, e]):
                    if driven_by[e] >= 0 and driven_by[e] != d:
                        return np.array([e, driven_by[e], d])
                    driven_by[e] = d
            row += 1
    row = 1
    for d in range(rank_out):
        for s in range(counts[d]):
            for e in range(rank):
                if driven_by[e] == d and reads[row]:
                    slot_lo[d, s, e], slot_hi[d, s, e] = in_lo[row, e], in_hi[row, e]
            row += 1
    for e in range(rank):
        if driven_by[e] >= 0:
            drives[driven_by[e], e] = True
            constant_lo[e], constant_hi[e] = 0, 0
        else:
            has_constant[e] = True
    return np.array([-1, -1, -1])


@numba.njit(cache=True, nogil=True)
def _needs_table(part_slot, reads, slot_lo, slot_hi, driven_by, base_lo, base_hi):
    """Each part's need from the answers per slot: zeros where a block along some output
    dimension reads nothing; otherwise each input dimension from the part's block along the
    dimension driving it, or the constant range; and the need's volume."""
    parts, rank_out = part_slot.shape
    rank = len(base_lo)
    lo = np.zeros((parts, rank), dtype=np.int64)
    hi = np.zeros((parts, rank), dtype=np.int64)
    volume = np.zeros(parts, dtype=np.int64)
    for p in range(parts):
        reading = True
        for d in range(rank_out):
            reading = reading and reads[d, part_slot[p, d]] > 0
        if not reading:
            continue
        volume[p] = 1
        for e in range(rank):
            d = driven_by[e]
            if d < 0:
                lo[p, e], hi[p, e] = base_lo[e], base_hi[e]
            else:
                lo[p, e], hi[p, e] = slot_lo[d, part_slot[p, d], e], slot_hi[d, part_slot[p, d], e]
            volume[p] *= max(hi[p, e] - lo[p, e], 0)
    return lo, hi, volume


@dataclass
class BySlot:
    """A consumer's needs of one input per output dimension d and slot s (blocks of every degree
    its configs use, `block_slots` order): whether the block reads anything, and the range of
    each input dimension d drives; the ranges of input dimensions no output dimension drives."""

    reads: np.ndarray  # (output rank, slots), 1.0 or 0.0
    lo: np.ndarray  # (output rank, slots, input rank)
    hi: np.ndarray
    drives: np.ndarray  # (output rank, input rank)
    constant_lo: np.ndarray  # (input rank,)
    constant_hi: np.ndarray
    has_constant: np.ndarray


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
