"""The peak of memory a step holds on each device under the runtime's schedule, and what is held then.

    peaks = peak_memory(plan, itemsize=4, slots=1)     # {device: PeakMemory}
    peaks[0].total, peaks[0].gradients, peaks[0].at, peaks[0].layers

Each device runs one program per step (`taskrt.planning.programs`): its given values (state chunks,
data tiles, running statistics) are there from the start, then its instructions run in order, a
Compute's fused run dropping each inner value after its last reader, the program dropping each value
after the instruction that reads it last.  This replays that order with the planned size of every
value, counting each buffer once: a value that is a view of another (an `Alias`, a tuple's element,
a slice that is contiguous in its source, flatten's output, add's input gradients) adds nothing.
The given values count for the whole step: Dask holds them (the program before's result, the
scattered tiles) while the step runs.  (In a window of steps run by one program, as `fit` runs
short steps, a step's state carried from the step before and the tiles it reads itself go at their
last reader: such a step holds less than predicted.)  The peak is the largest sum, taken as each task's value
appears (its inputs still held) and as each value arrives from another device.

Held at the peak, by kind (bytes):
- parameters: weights (state chunks, fetched or gathered copies, new weights) and running statistics;
- optimizer: the optimizer's slots of the state chunks (and of the new state, once updated);
- activations: data tiles and forward values (outputs, slices, statistics) kept for backward;
- gradients: values of backward and synchronization (input and parameter gradients, their sums);
- transfers: values received and not yet read here, and values made here that only wait to be sent;
- workspace: what the task running at the peak has just made (`at` names it).

`scratch` (not a kind, not in `total`): the most the kernels' own temporaries add on top of what is
held, `max over tasks (held while the task runs + its scratch) - total`, the task at `scratch_at`.
A task's scratch is what its numpy kernels allocate besides their result (`taskrt.ops.scratch`: a
convolution's padded copies, im2col columns, Winograd's buffers, a backward's relu-masked gradient);
`total + scratch` is what a device needs at least, what `taskrt.training.memory.check_fits` compares
with its memory.  `total` stays the held values alone, what the workers measure.

Not counted in `total` nor in `scratch`: other kernels' temporaries (an input assembled from
several pieces, a gradient sum before the update, other ops' buffers), values that arrived before
the program asks for them, and what the process holds besides the step (Python, libraries, Dask,
the allocator's free memory).  A worker measures the same sum (`taskrt.execution.held`), so the
two agree up to what the model does not know about a value's buffer; a GPU worker's allocator
peak includes the kernels' temporaries too.

`taskrt.planning.memory.plan_memory` is the other account, the one the search uses: the sum of
everything a step ever holds on a device (all of forward, all gradients, the optimizer's state, the
largest backward working set), with no order and no sharing.  It is an upper bound of this peak,
fast enough to prune configurations; this one is what a worker should see.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from math import prod

from taskrt.ops import scratch
from taskrt.planning.plan import BUFFER, DATA, STATE, TASK, Dep, Plan
from taskrt.planning.programs import Compute, Recv, Send, device_programs
from taskrt.planning.tasks import (
    Alias,
    Backward,
    ClipCoefficient,
    Element,
    Forward,
    GatherChunks,
    Loss,
    NormBackward,
    ReduceGrads,
    Slice,
    Spec,
    SquaredNorm,
    Update,
)

KINDS = ("parameters", "optimizer", "activations", "gradients", "transfers", "workspace")
# phases of forward values (copies computed again for backward too); the rest are gradients
FORWARD_PHASES = frozenset({"fwd", "slice", "fstat", "fstats", "running", "recompute", "reslice"})


@dataclass(frozen=True)
class PeakMemory:
    """A device's peak in one step (bytes), by kind (see the module docstring); `at`: the task whose
    value made it (its key), or ("recv", value) for a value arriving, or None for the given values;
    `layers`: ((layer, bytes), ...) held at the peak, most first."""

    parameters: int = 0
    optimizer: int = 0
    activations: int = 0
    gradients: int = 0
    transfers: int = 0
    workspace: int = 0
    at: tuple | None = None
    layers: tuple = ()
    scratch: int = 0
    scratch_at: tuple | None = None

    @property
    def needed(self) -> int:
        """Held values and the kernels' scratch on top: the least memory the step needs."""
        return self.total + self.scratch

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) for kind in KINDS)

    def kinds(self) -> list[tuple[str, int]]:
        """(kind, bytes) of the kinds held at the peak, most first."""
        return sorted(((k, getattr(self, k)) for k in KINDS if getattr(self, k)), key=lambda kv: -kv[1])

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["at"] = None if self.at is None else list(self.at)
        out["layers"] = [list(pair) for pair in self.layers]
        out["scratch_at"] = None if self.scratch_at is None else list(self.scratch_at)
        return {**out, "total": self.total}


def peak_memory(plan: Plan, itemsize: int = 4, slots: int = 1, accumulating: bool = False) -> dict[int, PeakMemory]:
    """{device: its PeakMemory} for one step of `plan` (see the module docstring): values of
    `itemsize` bytes an element, `slots` arrays of optimizer state per chunk (SGD 1, Adam 2), one
    more when `accumulating` (an accumulated gradient).  Found once per plan and arguments."""
    key = ("peak", itemsize, slots, accumulating)
    if key not in plan.derived:
        programs = device_programs(plan)
        plan.derived[key] = {d: _Replay(plan, p, itemsize, slots + accumulating).peak() for d, p in programs.items()}
    return plan.derived[key]


def contiguous(shape, window: tuple) -> bool:
    """Whether `window` (slices with starts and stops) of a C-contiguous array of `shape` is
    contiguous: past its first axis longer than one, every axis is whole (numpy's own test, which
    leaves out axes of length one)."""
    lengths = [s.stop - s.start for s in window]
    if prod(lengths) <= 1:
        return True
    first = next(i for i, n in enumerate(lengths) if n > 1)
    return all(lengths[i] == shape[i] for i in range(first + 1, len(shape)))


class _Replay:
    """One device's program replayed with planned sizes.  A value is an element (root buffer id,
    contiguous: whether it is its buffer's whole C-contiguous array or a contiguous view of it),
    None, or a list of those (a backward's gradients, a state chunk)."""

    def __init__(self, plan: Plan, program, itemsize: int, slots: int):
        self.plan, self.program, self.itemsize, self.slots = plan, program, itemsize, slots
        self.reads, self.sends = _uses(program)
        self.received = {c.name for c in program.code if isinstance(c, Recv)}

    def peak(self) -> PeakMemory:
        total, event = self._run()
        if not total:
            return PeakMemory()
        (top, at), peak = self.top, self._run(stop=event)
        return replace(peak, scratch=max(top - total, 0), scratch_at=at if top > total else None)

    # ---- the replay ---------------------------------------------------------------------------
    def _run(self, stop=None):
        """The program replayed: (peak bytes, its event); with `stop`, the PeakMemory at that event."""
        self.buffers: dict[int, list] = {}  # root -> [references, bytes, kind, layer]
        self.total, self.best, self.event, self.made, self.fresh = 0, (0, 0), 0, (), 0
        self.top = (0, None)  # (held + the running task's scratch, its key) at its most
        live: dict = {}
        for name in self.program.inputs:  # given: held for the whole step (one more reference)
            live[name] = self._given(name)
            self._hold(live[name], 2)
        if self._check(stop, None, live):
            return self.breakdown
        for instruction, drops in zip(self.program.code, self.program.drops):
            if isinstance(instruction, Compute):
                run, last = instruction.run, _last_use(instruction.run)
                exports = set(run.exports)
                for n, (key, spec, refs) in enumerate(run.steps):
                    args = [live[instruction.inputs[ref]] if kind == "in" else live[Dep(TASK, ref)]
                            for kind, ref in refs]
                    first = self.fresh
                    live[Dep(TASK, key)] = value = self._make(self.plan.by_key[key], spec, args)
                    self._hold(value)
                    self.made = tuple(r for r in _roots(value) if r >= first)
                    extra = _scratch(spec, self.itemsize)
                    if extra and self.total + extra > self.top[0]:
                        self.top = (self.total + extra, key)
                    if self._check(stop, key, live):
                        return self.breakdown
                    for kind, ref in refs:
                        if kind == "own" and last[ref] == n and ref not in exports:
                            self._let_go(live.pop(Dep(TASK, ref)))
            elif isinstance(instruction, Recv):
                live[instruction.name] = value = self._new(self.plan.nbytes_of(instruction.name) or 0,
                                                           *self._origin(instruction.name))
                self._hold(value)
                self.made = ()
                if self._check(stop, ("recv", instruction.name), live):
                    return self.breakdown
            else:
                self.event += 1
            for name in drops:
                self._let_go(live.pop(name))
        return self.best

    def _check(self, stop, at, live) -> bool:
        """After a value appeared (event `self.event`): note a new peak; at event `stop`, keep the
        breakdown of what is held and say so."""
        if self.total > self.best[0]:
            self.best = (self.total, self.event)
        if stop == self.event:
            self.breakdown = self._breakdown(at, live)
            return True
        self.event += 1
        return False

    def _new(self, nbytes: int, kind: str, layer: str) -> tuple:
        root, self.fresh = self.fresh, self.fresh + 1
        self.buffers[root] = [0, int(nbytes), kind, layer]
        return (root, True)

    def _hold(self, value, times: int = 1):
        for root in _roots(value):
            entry = self.buffers[root]
            if entry[0] == 0:
                self.total += entry[1]
            entry[0] += times

    def _let_go(self, value):
        for root in _roots(value):
            entry = self.buffers[root]
            entry[0] -= 1
            if entry[0] == 0:
                self.total -= entry[1]
                del self.buffers[root]

    # ---- values -----------------------------------------------------------------------------
    def _given(self, name: Dep):
        plan = self.plan
        if name.kind == STATE:
            layer, shard, k = name.key
            lo, hi, _ = plan.shards[layer][shard].chunks[k]
            chunk = (hi - lo) * self.itemsize
            return [self._new(chunk, "parameters", layer), *(self._new(chunk, "optimizer", layer)
                                                             for _ in range(self.slots))]
        if name.kind in (DATA, BUFFER):
            return self._new(plan.nbytes_of(name), "activations" if name.kind == DATA else "parameters", name.key[0])
        return None  # the hyper-parameters

    def _origin(self, name: Dep) -> tuple[str, str]:
        """(kind, layer) of a value that comes from another device."""
        while name.kind == TASK:
            task = self.plan.by_key[name.key]
            if not isinstance(_inner(task.spec), (Alias, Slice, Element)):
                return _kind(task), task.layer
            name = task.deps[0]  # a view or a part of it
        return ("activations" if name.kind == DATA else "parameters"), name.key[0]

    def _make(self, task, spec, args):
        """The value `task` makes from `args`: new buffers of their planned sizes, or views."""
        spec, size, layer = _inner(spec), self.itemsize, task.layer
        if isinstance(spec, Alias):
            return args[0]
        if isinstance(spec, Element):
            return args[0][spec.element]
        if isinstance(spec, Slice):
            piece = spec.piece
            source = args[piece.dep] if piece.element is None else args[piece.dep][piece.element]
            if source[1] and contiguous(piece.src.shape, piece.rect.relative_to(piece.src)):
                return source  # ascontiguousarray copies nothing
            return self._new(task.nbytes, self.buffers[source[0]][2], layer)
        if isinstance(spec, ReduceGrads) and len(spec.grads) == 1:  # read, not copied
            dep, element, _ = spec.grads[0]
            return args[dep] if element is None else args[dep][element]
        if isinstance(spec, Update):  # the new weights and slots
            return [self._new(self.buffers[root][1], self.buffers[root][2], layer) for root, _ in args[0]]
        if isinstance(spec, Forward):
            return self._forward(task, spec, args)
        if isinstance(spec, Loss):  # (d logits, None, losses)
            return [self._new(spec.inputs.rects[0].volume * size, "gradients", layer), None,
                    self._new(spec.out.volume * size, "gradients", layer)]
        if isinstance(spec, Backward):
            return self._backward(spec, args, layer)
        if isinstance(spec, NormBackward):
            return [self._new(spec.inputs.rects[0].volume * size, "gradients", layer), None]
        if isinstance(spec, (SquaredNorm, ClipCoefficient)):
            return self._new(8, "gradients", layer)
        if isinstance(spec, GatherChunks):
            return self._new(task.nbytes, "parameters", layer)
        return self._new(task.nbytes or 0, _kind(task), layer)

    def _read(self, args, pieces, rect):
        """The element an input read from `pieces` over `rect` is a view of, or None where the task
        assembles it anew (several pieces, or one that covers more)."""
        if len(pieces) != 1 or pieces[0].rect != rect:
            return None
        piece = pieces[0]
        source = args[piece.dep] if piece.element is None else args[piece.dep][piece.element]
        return source[0], source[1] and contiguous(piece.src.shape, piece.rect.relative_to(piece.src))

    def _forward(self, task, spec, args):
        """A forward's output: new, except for the ops that give their input back where it is
        contiguous (flatten of whole rows, identity, a channel slice of all its input's channels)."""
        op, rects = spec.op, spec.inputs.rects
        rect = rects[0] if rects else None
        whole = rect is not None and (
            op.kind == "identity" or (op.kind == "channel_slice" and rect.shape[1] == spec.out.shape[1])
            or (op.kind == "flatten" and (spec.out.shape[1] == prod(rect.shape[1:]) or spec.out.shape[0] == 1)))
        if not whole:
            return self._new(task.nbytes, "activations", task.layer)
        source = self._read(args, spec.inputs.pieces[0], rect)
        if source is not None and source[1]:
            return (source[0], True)
        if source is None or op.kind == "flatten":  # the assembled input, or a strided view reshaped: a copy
            return self._new(rect.volume * self.itemsize, "activations", task.layer)
        return self._new(task.nbytes, "activations", task.layer)

    def _backward(self, spec, args, layer):
        """[input gradients..., parameter gradient] of a Backward: new arrays, except for the ops
        whose input gradient is (a part of) the output gradient itself (add, concat, identity, a
        channel slice of all its input's channels)."""
        size, op, rects = self.itemsize, spec.op, spec.inputs.rects
        passes = op.kind in ("add", "concat", "identity") or (
            op.kind == "channel_slice" and rects[0] is not None and rects[0].shape[1] == spec.out.shape[1])
        dy = None
        if passes and any(need and rect is not None for rect, need in zip(rects, spec.need_dx)):
            dy = self._read(args, spec.dy, spec.out) if spec.dy else None
            if dy is None:  # assembled from its pieces (or zeros): one new array the gradients are views of
                dy = self._new(spec.out.volume * size, "gradients", layer)
        dxs = []
        for rect, need in zip(rects, spec.need_dx):
            if not need or rect is None:
                dxs.append(None)
            elif dy is not None:
                dxs.append((dy[0], dy[1] and rect.shape[1] == spec.out.shape[1]))
            else:
                dxs.append(self._new(rect.volume * size, "gradients", layer))
        params = None
        if spec.params is not None:
            params = self._new(sum(prod(shape) for _, shape in spec.params.layout) * size, "gradients", layer)
        return [*dxs, params]

    # ---- what is held -------------------------------------------------------------------------
    def _breakdown(self, at, live) -> PeakMemory:
        """What is held now, by kind and by layer (see the module docstring)."""
        waiting = self._waiting(live)
        by_kind, by_layer = dict.fromkeys(KINDS, 0), {}
        made = set(self.made)
        for root, (_, nbytes, kind, layer) in self.buffers.items():
            if root in made:
                kind = "workspace"
            elif root in waiting:
                kind = "transfers"
            by_kind[kind] += nbytes
            by_layer[layer] = by_layer.get(layer, 0) + nbytes
        layers = tuple(sorted(((k, v) for k, v in by_layer.items() if v), key=lambda kv: -kv[1]))
        return PeakMemory(**by_kind, at=at, layers=layers)

    def _waiting(self, live) -> set:
        """Buffers each live name of which is a value received and not read here yet, or a value
        that only waits to be sent (no task here reads it again)."""
        now, flight, settled = self.event, set(), set()
        for name, value in live.items():
            reads = self.reads.get(name, ())
            later = any(e > now for e in reads)
            unread = name in self.received and not any(e <= now for e in reads)
            waits = (unread and later) or (not later and any(e > now for e in self.sends.get(name, ())))
            for root in _roots(value):
                (flight if waits else settled).add(root)
        return flight - settled


def _uses(program) -> tuple[dict, dict]:
    """{name: events at which a task reads it}, {name: events at which it is sent}: the events
    numbered as the replay numbers them (one per task, value received and value sent)."""
    reads, sends, event = {}, {}, 1  # event 0: the given values
    for instruction in program.code:
        if isinstance(instruction, Compute):
            for _, _, refs in instruction.run.steps:
                for kind, ref in refs:
                    name = instruction.inputs[ref] if kind == "in" else Dep(TASK, ref)
                    reads.setdefault(name, []).append(event)
                event += 1
        else:
            if isinstance(instruction, Send):
                sends.setdefault(instruction.name, []).append(event)
            event += 1
    return reads, sends


def _last_use(run) -> dict:
    last = {}
    for n, (_, _, refs) in enumerate(run.steps):
        for kind, ref in refs:
            if kind == "own":
                last[ref] = n
    return last


def _roots(value) -> tuple:
    """The buffers of a value (an element, None, or a list of elements and Nones)."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(element[0] for element in value if element is not None)
    return (value[0],)


def _inner(spec):
    """The spec a wrapper runs (`Received`'s, or that of a value computed again for backward)."""
    while isinstance(getattr(spec, "spec", None), Spec):
        spec = spec.spec
    return spec


def _scratch(spec, itemsize: int) -> int:
    """Bytes the kernels of a task allocate besides its result (`taskrt.ops.scratch`; convolutions)."""
    spec = _inner(spec)
    if not isinstance(spec, (Forward, Backward)) or spec.op.kind != "conv2d" or spec.inputs.rects[0] is None:
        return 0
    backward = isinstance(spec, Backward)
    return scratch.conv_part(spec.op, spec.out, spec.inputs.rects[0].shape, itemsize, backward,
                             backward and spec.need_dx[0])


def _kind(task) -> str:
    """The kind of a task's new value, by its phase."""
    if task.phase in ("wfetch", "wgather"):
        return "parameters"
    return "activations" if task.phase in FORWARD_PHASES else "gradients"
