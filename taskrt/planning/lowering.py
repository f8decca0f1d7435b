"""Lowering: (graph, strategy) -> the Plan of one step.  Pure: no Dask, no arrays.

For every part of every layer it asks the op's region rule which Rect of each input the part
reads, and takes it from the producer's parts that intersect it: in place when the producer's
part is on the same device, as a whole tile when the consumer needs all of it, otherwise
through a slice task on the producer's device so that only the intersection travels.
Backward reads the same rule the other way, and the consumer's backward reuses the pieces its
forward fetched.  Replicated parameter shards synchronize as their layer's config says: through
a parameter server on the shard's first device ("ps"), or by reduce-scatter and all-gather
among the replicas ("allreduce": each replica sums and updates one chunk of the flat shard and
gathers the others' chunks before its forward; every device sends and receives 2 (R-1)/R of
the shard, the bandwidth of a ring all-reduce, in two dependent hops instead of 2 (R-1)).

Batch normalization reduces each channel's statistics over every part holding that channel (a
channel group: the parts of one `c` block).  Forward: each part computes its partial statistics
("fstat"), the group's first device combines them ("fstats") and every part normalizes with
the result ("fwd"); training also updates the group's running statistics there ("running").
Backward is the same shape over the gradient sums ("bstat", "bstats", "bwd"), and the summed
sums are the parameter gradient the shard's update reads.  Every one of these values that
crosses devices is a transfer of the plan like any other.

A layer whose config says `recompute` keeps no output for backward: its backward readers read
copies computed again just before them (taskrt.planning.recompute).
"""

from __future__ import annotations

from math import prod

from taskrt.ops.rect import Rect
from taskrt.planning.params import shard_sizes
from taskrt.planning.plan import BUFFER, DATA, HYPER_DEP, STATE, TASK, Buffer, Dep, Plan, Shard, Task, output_keys
from taskrt.planning.recompute import Recomputation
from taskrt.planning.tasks import (
    Alias,
    Backward,
    ClipCoefficient,
    CombineStats,
    Element,
    Forward,
    GatherChunks,
    GradSums,
    Inputs,
    Loss,
    Normalize,
    NormBackward,
    Params,
    PartialStats,
    Piece,
    ReduceGrads,
    Slice,
    SquaredNorm,
    SumArrays,
    Update,
    UpdateRunning,
)

MODES = ("train", "gradients", "predict")


class _Deps:
    """The dependency list of one task under construction; returns positions, no duplicates."""

    def __init__(self, first=()):
        self.deps: list[Dep] = list(first)
        self.position = {dep: i for i, dep in enumerate(self.deps)}

    def add(self, dep: Dep) -> int:
        if dep not in self.position:
            self.position[dep] = len(self.deps)
            self.deps.append(dep)
        return self.position[dep]


class _Lowering:
    def __init__(self, graph, strategy, mode, itemsize, clip=False):
        self.graph, self.mode, self.itemsize = graph, mode, itemsize
        self.clip = clip and mode == "train"
        self.clipped: list[tuple] = []  # (layer, shard, chunk, device, summed gradient, segments) to update
        self.sync = {layer.name: strategy[layer.name].sync for layer in graph}
        self.parts = {layer.name: strategy[layer.name].parts(layer.shape) for layer in graph}
        self.needed = graph.needs_backward() if mode != "predict" else set()
        self.tasks: dict[tuple, Task] = {}
        self.slices: dict[tuple, Dep] = {}
        self.slice_count: dict[Dep, int] = {}  # slices cut from each value so far (for their keys)
        self.shards: dict[str, list[Shard]] = {}
        self.shard_of: dict[tuple[str, int], int] = {}
        self.fetched: dict[tuple[str, int, int], Dep] = {}
        self.gathered: dict[tuple[str, int, int], Dep] = {}
        self.readers: dict[Dep, int] = {}  # the one device that reads each travelling key
        self.aliases: dict[tuple[Dep, int], Dep] = {}
        self.alias_count: dict[str, int] = {}
        self.buffers: dict[str, list[Buffer]] = {}
        self.groups: dict[str, list[list]] = {}  # batch norm: parts by channel block
        self.grad_sums: dict[tuple[str, int], Dep] = {}  # (layer, group) -> its summed gradient sums
        again = [layer.name for layer in graph if strategy[layer.name].recompute] if mode != "predict" else []
        self.recompute = Recomputation(self.tasks, self.add, again) if again else None

    # ---- helpers ----------------------------------------------------------------------------
    def itemsize_of(self, layer_name) -> int:
        layer = self.graph[layer_name]
        return 8 if layer.is_input and layer.op.dtype == "int64" else self.itemsize

    def add(self, task: Task) -> Dep:
        self.tasks[task.key] = task
        return Dep(TASK, task.key)

    def for_backward(self, deps) -> tuple:
        """The dependencies of a backward-phase task reading `deps`: recomputed layers' forward
        values replaced by their copies computed again."""
        return tuple(deps) if self.recompute is None else self.recompute.substitute(deps)

    def output_of(self, layer_name, part) -> Dep:
        if self.graph[layer_name].is_input:
            return Dep(DATA, (layer_name, part.index))
        return Dep(TASK, (f"{layer_name}-fwd", part.index))

    def nbytes_of(self, dep: Dep) -> int:
        if dep.kind == DATA:
            layer, index = dep.key
            return self.parts[layer][index].rect.volume * self.itemsize_of(layer)
        if dep.kind == BUFFER:
            return self.buffers[dep.key[0]][dep.key[1]].nbytes
        return self.tasks[dep.key].nbytes

    def route(self, dep: Dep, home: int, device: int, layer: str) -> Dep:
        """The key a task on `device` reads `dep` (living on `home`) through.

        Every key that travels has exactly one reading device, so it has one holder when it
        is fetched and Dask cannot take it from a replica elsewhere: the plan then names the
        source of every transfer.  Each further reading device gets an alias: a task on
        `home` returning the same array under a new key (no copy).
        """
        if home == device:
            return dep
        first = self.readers.setdefault(dep, device)
        if first == device:
            return dep
        if (dep, device) not in self.aliases:
            index = self.alias_count.get(layer, 0)
            self.alias_count[layer] = index + 1
            self.aliases[(dep, device)] = self.add(Task(
                (f"{layer}-send", index), "send", layer, home, Alias(), (dep,), self.nbytes_of(dep)))
        return self.aliases[(dep, device)]

    def pieces(self, deps: _Deps, need, device, sources, slice_phase, slice_layer, itemsize):
        """Pieces tiling `need` for a task on `device`.

        `sources` are (producer part, dep, element, Rect the value covers).  A value on another
        device travels whole only when it is a plain array the task needs all of; otherwise a
        slice task on its device cuts out the intersection.
        """
        out = []
        for part, dep, element, src in sources:
            inter = src.intersect(need)
            if inter.empty:
                continue
            if part.device != device:
                if element is not None or inter != src:
                    key = (dep, element, inter)
                    if key not in self.slices:
                        index = self.slice_count.get(dep, 0)
                        self.slice_count[dep] = index + 1
                        self.slices[key] = self.add(Task(
                            (f"{slice_layer}-{slice_phase}", *dep.key[1:], index), slice_phase, slice_layer,
                            part.device, Slice(Piece(0, element, src, inter)), (dep,), inter.volume * itemsize,
                        ))
                    dep, element, src = self.slices[key], None, inter
                dep = self.route(dep, part.device, device, slice_layer)
            out.append(Piece(deps.add(dep), element, src, inter))
        return tuple(out)

    def inputs(self, deps: _Deps, layer, part) -> Inputs:
        rects = layer.op.input_rects(part.rect)
        all_pieces = []
        for src_name, need in zip(layer.inputs, rects):
            if need is None:
                all_pieces.append(())
                continue
            sources = [(p, self.output_of(src_name, p), None, p.rect) for p in self.parts[src_name]]
            all_pieces.append(self.pieces(deps, need, part.device, sources, "slice", src_name,
                                          self.itemsize_of(src_name)))
        return Inputs(tuple(rects), tuple(all_pieces))

    # ---- parameters -------------------------------------------------------------------------
    def plan_shards(self, layer):
        shards: list[Shard] = []
        for part in self.parts[layer.name]:
            rects = layer.op.param_rects(part.rect)
            match = next((s for s in shards if s.rects == rects), None)
            if match is None:
                layout = tuple(shard_sizes(rects))
                nbytes = sum(prod(shape) for _, shape in layout) * self.itemsize
                match = Shard(layer.name, len(shards), rects, layout, part.device, (), nbytes, self.sync[layer.name])
                shards.append(match)
            shards[match.index] = Shard(**{**match.__dict__, "devices": (*match.devices, part.device)})
            self.shard_of[(layer.name, part.index)] = match.index
        self.shards[layer.name] = shards

    def params(self, deps: _Deps, layer, part) -> Params | None:
        if not layer.param_shapes:
            return None
        shard = self.shards[layer.name][self.shard_of[(layer.name, part.index)]]
        chunks = shard.chunks
        if len(chunks) == 1:
            home = chunks[0][2]
            if part.device == home:  # the state itself: read its weights in place
                return Params(deps.add(Dep(STATE, (layer.name, shard.index, 0))), 0, shard.layout)
            fetched = self.route(self.weights(shard, 0), home, part.device, layer.name)
            return Params(deps.add(fetched), None, shard.layout)
        key = (layer.name, shard.index, part.device)
        if key not in self.gathered:  # all-gather: the chunks of the other replicas come to this device
            gather, pieces = _Deps(), []
            for k, (_, _, home) in enumerate(chunks):
                if home == part.device:
                    pieces.append((gather.add(Dep(STATE, (layer.name, shard.index, k))), 0))
                else:
                    pieces.append((gather.add(self.route(self.weights(shard, k), home, part.device, layer.name)), None))
            self.gathered[key] = self.add(Task(
                (f"{layer.name}-wgather", shard.index, part.device), "wgather", layer.name, part.device,
                GatherChunks(tuple(pieces)), tuple(gather.deps), shard.nbytes))
        return Params(deps.add(self.gathered[key]), None, shard.layout)

    def weights(self, shard, k) -> Dep:
        """The weights of chunk `k` of a shard's state, as an array on the chunk's device (what travels)."""
        if (shard.layer, shard.index, k) not in self.fetched:
            lo, hi, home = shard.chunks[k]
            self.fetched[(shard.layer, shard.index, k)] = self.add(Task(
                (f"{shard.layer}-wfetch", shard.index, k), "wfetch", shard.layer, home,
                Element(0), (Dep(STATE, (shard.layer, shard.index, k)),), (hi - lo) * self.itemsize,
            ))
        return self.fetched[(shard.layer, shard.index, k)]

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, layer):
        if layer.op.reduces_statistics:
            return self.forward_statistics(layer)
        for part in self.parts[layer.name]:
            deps = _Deps()
            inputs = self.inputs(deps, layer, part)
            if layer.kind == "softmax_cross_entropy":
                spec = Loss(layer.op, part.rect, inputs, layer.shape[0])
                key, phase, nbytes = (f"{layer.name}-loss", part.index), "loss", None
                flops = layer.op.flops(part.rect) + layer.op.backward_flops(part.rect)
            else:
                params = self.params(deps, layer, part)
                # a random op (dropout) draws from the step's seed and number in training, nothing in prediction
                draw = deps.add(HYPER_DEP) if getattr(layer.op, "random", False) and self.mode != "predict" else None
                spec = Forward(layer.op, part.rect, inputs, params, draw)
                key, phase = (f"{layer.name}-fwd", part.index), "fwd"
                nbytes, flops = part.rect.volume * self.itemsize, layer.op.flops(part.rect)
            self.add(Task(key, phase, layer.name, part.device, spec, tuple(deps.deps), nbytes, flops))

    # ---- batch normalization ----------------------------------------------------------------
    def plan_groups(self, layer):
        groups: dict[tuple[int, int], list] = {}
        for part in self.parts[layer.name]:
            groups.setdefault((part.rect.lo[1], part.rect.hi[1]), []).append(part)
        self.groups[layer.name] = list(groups.values())
        self.buffers[layer.name] = [Buffer(layer.name, g, channels, parts[0].device, 2 * (channels[1] - channels[0])
                                           * self.itemsize) for g, (channels, parts) in enumerate(groups.items())]

    def forward_statistics(self, layer):
        name, op = layer.name, layer.op
        stats_of = {}
        for g, group in enumerate(self.groups[name]):
            home, channels = group[0].device, group[0].rect.hi[1] - group[0].rect.lo[1]
            if self.mode == "predict":
                stats = Dep(BUFFER, (name, g))
            else:
                combine = _Deps()
                for part in group:
                    deps = _Deps()
                    inputs = self.inputs(deps, layer, part)
                    partial = self.add(Task((f"{name}-fstat", part.index), "fstat", name, part.device,
                                            PartialStats(op, inputs), tuple(deps.deps), 3 * channels * self.itemsize,
                                            3 * part.rect.volume))
                    combine.add(self.route(partial, part.device, home, name))
                stats = self.add(Task((f"{name}-fstats", g), "fstats", name, home, CombineStats(op),
                                      tuple(combine.deps), 3 * channels * self.itemsize, 8 * channels * len(group)))
                if self.mode == "train":
                    self.add(Task((f"{name}-running", g), "running", name, home, UpdateRunning(op),
                                  (Dep(BUFFER, (name, g)), stats), 2 * channels * self.itemsize, 6 * channels))
            for part in group:
                stats_of[part.index] = (stats, home)
        for part in self.parts[name]:
            deps = _Deps()
            inputs = self.inputs(deps, layer, part)
            params = self.params(deps, layer, part)
            stats, home = stats_of[part.index]
            spec = Normalize(op, part.rect, inputs, params, deps.add(self.route(stats, home, part.device, name)),
                             self.mode == "predict")
            self.add(Task((f"{name}-fwd", part.index), "fwd", name, part.device, spec, tuple(deps.deps),
                          part.rect.volume * self.itemsize, op.flops(part.rect) - 3 * part.rect.volume))

    def backward_statistics(self, layer):
        name, op = layer.name, layer.op
        sources = list(self.gradient_sources(name))
        sums_of = {}
        for g, group in enumerate(self.groups[name]):
            home, channels = group[0].device, group[0].rect.hi[1] - group[0].rect.lo[1]
            combine = _Deps()
            for part in group:
                fwd = self.tasks[(f"{name}-fwd", part.index)]
                deps = _Deps(fwd.deps)
                dy = self._dy(deps, part, sources)
                partial = self.add(Task((f"{name}-bstat", part.index), "bstat", name, part.device,
                                        GradSums(op, fwd.spec.inputs, fwd.spec.stats, dy, part.rect),
                                        self.for_backward(deps.deps), 2 * channels * self.itemsize,
                                        5 * part.rect.volume))
                combine.add(self.route(partial, part.device, home, name))
            sums = self.add(Task((f"{name}-bstats", g), "bstats", name, home, SumArrays(), tuple(combine.deps),
                                 2 * channels * self.itemsize, 2 * channels * len(group)))
            self.grad_sums[(name, g)] = sums
            for part in group:
                sums_of[part.index] = (sums, home)
        need_dx = tuple(src in self.needed for src in layer.inputs)
        if not any(need_dx):
            return
        for part in self.parts[name]:
            fwd = self.tasks[(f"{name}-fwd", part.index)]
            deps = _Deps(fwd.deps)
            dy = self._dy(deps, part, sources)
            sums, home = sums_of[part.index]
            spec = fwd.spec
            self.add(Task((f"{name}-bwd", part.index), "bwd", name, part.device,
                          NormBackward(op, part.rect, spec.inputs, spec.params, spec.stats, dy,
                                       deps.add(self.route(sums, home, part.device, name)), spec.params.layout),
                          self.for_backward(deps.deps), None,
                          op.backward_flops(part.rect) - 5 * part.rect.volume))

    # ---- backward ---------------------------------------------------------------------------
    def gradient_sources(self, layer_name):
        """(consumer part, dep of its backward value, element, Rect) of every gradient of `layer_name`."""
        for consumer_name, j in self.graph.consumers(layer_name):
            consumer = self.graph[consumer_name]
            if consumer_name not in self.needed:
                continue
            phase = "loss" if consumer.kind == "softmax_cross_entropy" else "bwd"
            for part in self.parts[consumer_name]:
                read = consumer.op.input_rects(part.rect)[j]
                if read is not None:
                    yield part, Dep(TASK, (f"{consumer_name}-{phase}", part.index)), j, read

    def backward(self, layer):
        if layer.op.reduces_statistics:
            return self.backward_statistics(layer)
        sources = list(self.gradient_sources(layer.name))
        for part in self.parts[layer.name]:
            fwd = self.tasks[(f"{layer.name}-fwd", part.index)]
            deps = _Deps(fwd.deps)  # same pieces and parameters as forward: already on this device
            spec = fwd.spec
            output = deps.add(Dep(TASK, fwd.key)) if layer.op.saves_output else None
            dy = self._dy(deps, part, sources)
            need_dx = tuple(src in self.needed for src in layer.inputs)
            self.add(Task(
                (f"{layer.name}-bwd", part.index), "bwd", layer.name, part.device,
                Backward(layer.op, part.rect, spec.inputs, spec.params, output, dy, need_dx, spec.draw),
                self.for_backward(deps.deps), None, layer.op.backward_flops(part.rect),
            ))

    def _dy(self, deps, part, sources):
        out = []
        for q, dep, element, read in sources:
            # slices of a consumer's input gradient are named after the consumer
            consumer = dep.key[0].rsplit("-", 1)[0]
            out += self.pieces(deps, part.rect, part.device, [(q, dep, element, read)], "gslice", consumer,
                               self.itemsize)
        return tuple(out)

    # ---- parameter synchronization ----------------------------------------------------------
    def synchronize(self, layer):
        """Per chunk of each shard's state, on the chunk's device: sum the replicas' gradients of
        the chunk and update it (or, without training, return the sum)."""
        n_inputs = len(layer.inputs)
        for shard in self.shards[layer.name]:
            replicas = [p for p in self.parts[layer.name] if self.shard_of[(layer.name, p.index)] == shard.index]
            chunks = shard.chunks
            for k, (lo, hi, home) in enumerate(chunks):
                updates_here = self.mode == "train" and not self.clip
                deps = _Deps([Dep(STATE, (layer.name, shard.index, k))] if updates_here else [])
                span = None if len(chunks) == 1 else (lo, hi)
                grads = []
                if layer.op.reduces_statistics:  # the group's summed gradient, already on its readers
                    group = next(g for g, parts in enumerate(self.groups[layer.name]) if parts[0] in replicas)
                    sums = self.route(self.grad_sums[(layer.name, group)], self.groups[layer.name][group][0].device,
                                      home, layer.name)
                    grads.append((deps.add(sums), None, span))
                for part in [] if layer.op.reduces_statistics else replicas:
                    bwd = Dep(TASK, (f"{layer.name}-bwd", part.index))
                    if part.device == home:  # its own gradient: the chunk is cut in place
                        grads.append((deps.add(bwd), n_inputs, span))
                    elif span is None:  # the whole gradient travels to the server
                        grad = self.add(Task((f"{layer.name}-grad", part.index), "grad", layer.name, part.device,
                                             Element(n_inputs), (bwd,), shard.nbytes))
                        grads.append((deps.add(grad), None, None))
                    else:  # reduce-scatter: only this chunk of the gradient travels
                        piece = Piece(0, n_inputs, Rect((0,), (shard.size,)), Rect((lo,), (hi,)))
                        cut = self.add(Task((f"{layer.name}-rslice", part.index, k), "rslice", layer.name,
                                            part.device, Slice(piece), (bwd,), (hi - lo) * self.itemsize))
                        grads.append((deps.add(cut), None, None))
                flops = 4 * (hi - lo) * len(grads)
                key = (shard.index, k)
                segments = chunk_segments(shard.layout, lo, hi)
                if updates_here:
                    deps.add(HYPER_DEP)
                    self.add(Task((f"{layer.name}-update", *key), "update", layer.name, home,
                                  Update(tuple(grads), layer.name, segments), tuple(deps.deps), None, flops))
                else:  # the gradients' sum; clipping updates from it once the global norm is known
                    reduced = self.add(Task((f"{layer.name}-reduce", *key), "reduce", layer.name, home,
                                            ReduceGrads(tuple(grads)), tuple(deps.deps), (hi - lo) * self.itemsize,
                                            flops))
                    if self.clip:
                        self.clipped.append((layer.name, shard.index, k, home, reduced, segments, hi - lo))

    def clip_updates(self):
        """Gradient clipping by the global norm: each device sums the squares of the gradients it
        updates ("gnorm"), one device adds them up into the clipping coefficient ("gtotal": 8
        bytes from each device, 8 to each), and every chunk is updated from its summed gradient
        scaled by it."""
        by_device: dict[int, list] = {}
        for entry in self.clipped:
            by_device.setdefault(entry[3], []).append(entry)
        if not by_device:
            return
        where = min(by_device)
        combine = _Deps()
        for device, entries in sorted(by_device.items()):
            deps = _Deps()
            chunks = tuple((deps.add(reduced), deps.add(Dep(STATE, (layer, shard, k))))
                           for layer, shard, k, _, reduced, _, _ in entries)
            deps.add(HYPER_DEP)
            partial = self.add(Task(("clip-gnorm", device), "gnorm", "clip", device, SquaredNorm(chunks),
                                    tuple(deps.deps), 8, 2 * sum(e[6] for e in entries)))
            combine.add(self.route(partial, device, where, "clip"))
        combine.add(HYPER_DEP)
        total = self.add(Task(("clip-gtotal", 0), "gtotal", "clip", where, ClipCoefficient(), tuple(combine.deps), 8,
                              2 * len(by_device)))
        for layer, shard, k, home, reduced, segments, size in self.clipped:
            deps = _Deps([Dep(STATE, (layer, shard, k))])
            grad = deps.add(reduced)
            coefficient = deps.add(self.route(total, where, home, "clip"))
            deps.add(HYPER_DEP)
            self.add(Task((f"{layer}-update", shard, k), "update", layer, home,
                          Update(((grad, None, None),), layer, segments, coefficient), tuple(deps.deps), None,
                          4 * size))

    # ---- whole step -------------------------------------------------------------------------
    def build(self, target=None) -> Plan:
        layers = list(self.graph)
        for layer in layers:
            if layer.param_shapes:
                self.plan_shards(layer)
            if layer.op.reduces_statistics:
                self.plan_groups(layer)
        for layer in layers:
            if layer.is_input or (self.mode == "predict" and layer.kind == "softmax_cross_entropy"):
                continue
            self.forward(layer)
        for layer in reversed(layers):
            if layer.name in self.needed and not layer.is_input and layer.kind != "softmax_cross_entropy":
                self.backward(layer)
                if layer.param_shapes:
                    self.synchronize(layer)
        if self.clip:
            self.clip_updates()
        outputs = self.outputs(target)
        tasks = _prune(self.tasks, outputs)
        used = {dep.key[0] for t in tasks for dep in t.deps if dep.kind == DATA}
        data = {layer.name: self.parts[layer.name] for layer in self.graph.inputs if layer.name in used}
        data_nbytes = {(name, p.index): p.rect.volume * self.itemsize_of(name)
                       for name, parts in data.items() for p in parts}
        shards = self.shards if self.mode != "predict" else {
            name: s for name, s in self.shards.items() if any(t.layer == name for t in tasks)}
        buffers = {name: b for name, b in self.buffers.items() if any(t.layer == name for t in tasks)}
        return Plan(self.mode, tasks, shards, data, data_nbytes, outputs, buffers)

    def outputs(self, target):
        if self.mode == "predict":
            return {"logits": [(f"{target}-fwd", p.index) for p in self.parts[target]]}
        losses = [(f"{layer.name}-loss", p.index) for layer in self.graph.losses for p in self.parts[layer.name]]
        phase = "update" if self.mode == "train" else "reduce"
        state = {(name, s.index, k): (f"{name}-{phase}", s.index, k) for name, shards in self.shards.items()
                 for s in shards for k in range(len(s.chunks))}
        out = {"loss": losses, "state" if self.mode == "train" else "grads": state}
        if self.mode == "train":
            out["buffers"] = {(name, b.index): (f"{name}-running", b.index)
                              for name, buffers in self.buffers.items() for b in buffers}
        return out


def _prune(tasks: dict[tuple, Task], outputs) -> list[Task]:
    """Keep only tasks some output depends on (in their original order)."""
    wanted = set()
    stack = output_keys(outputs)
    while stack:
        key = stack.pop()
        if key in wanted:
            continue
        wanted.add(key)
        stack += [d.key for d in tasks[key].deps if d.kind == TASK]
    return [t for k, t in tasks.items() if k in wanted]


def chunk_segments(layout, lo: int, hi: int) -> tuple[tuple[str, int, int], ...]:
    """(parameter name, lo, hi) of each parameter of a shard's flat `layout` within its chunk
    [lo, hi), relative to the chunk."""
    out, start = [], 0
    for name, shape in layout:
        stop = start + prod(shape)
        if start < hi and stop > lo:
            out.append((name, max(start, lo) - lo, min(stop, hi) - lo))
        start = stop
    return tuple(out)


def lower(graph, strategy, mode: str = "train", itemsize: int = 4, target: str | None = None,
          clip: bool = False) -> Plan:
    """The plan of one step.  `mode`: "train" (forward, backward, synchronization and the
    optimizer's update), "gradients" (the same, summing gradients instead of updating) or
    "predict" (forward up to `target`, by default the logits of the graph's loss).  `clip`
    (training): the update scales the gradients to a global norm first (`clip_updates`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    strategy = strategy.validated(graph)
    if mode == "predict" and target is None:
        from taskrt.data.arrays import logits_layer

        target = logits_layer(graph)
    return _Lowering(graph, strategy, mode, itemsize, clip).build(target)
