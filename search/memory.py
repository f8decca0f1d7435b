"""Memory per device of a training step under a strategy, without lowering it.

The same accounting as taskrt.planning.memory.plan_memory (tests check they agree on many strategies),
counted from the region rules instead of the plan's tasks:
- each layer's parameter shards (parts with the same channel block), their gradients, the
  optimizer state of the chunks each device owns, and what a server or chunk owner receives;
- every part's output, the data tiles, and every value forward moves: a producer's tile that a
  part on another device needs whole, or else the slice cut for it on the producer's device;
  each value counts once on the device that cuts it and once on each other device reading it;
- the largest backward working set of a part on each device, with the copies computed again of
  the recomputed layers alive while its layer's backward runs (their outputs and moves count
  there, not as activations).

Where a plan would drop tasks no output needs (a part no consumer reads, a layer feeding
nothing), a config splits channels unevenly, or a recomputed layer is one whose backward does
not run, the plan is lowered and measured instead.
"""

from __future__ import annotations

import numba
import numpy as np

from taskrt.planning.memory import KINDS, DeviceMemory
from taskrt.search.layer_space import channel_params
from taskrt.search.regions import Needs, part_table

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TRANSIENT = range(len(KINDS))


def step_memory(graph, strategy, itemsize: int = 4, regions=None, per_channel=None,
                slots: int = 1) -> dict[int, DeviceMemory]:
    """Bytes per device, by kind, of one training step of `graph` under `strategy` (validated).

    `regions(layer, config)`, if given, returns the parts of `layer` under `config` as
    (lo, hi, device) rows and each input's needs as (lo, hi) rows (zero rows: reads nothing),
    as `CostModel.regions` does from the search's tables; by default they are computed here.
    `per_channel(op)`: `search.layer_space.channel_params` by default, or a CostModel's, which has them
    already."""
    if any(not config.is_even for config in strategy.configs.values()):
        return _lowered(graph, strategy, itemsize, slots)
    regions = regions or _regions
    if per_channel is None:
        known = {}

        def per_channel(op) -> int:
            if op not in known:
                known[op] = channel_params(op)
            return known[op]

    layers = {layer.name: regions(layer, strategy[layer.name]) for layer in graph}
    needed = graph.needs_backward()
    again = _recomputed(graph, strategy, needed)
    if again is None:
        return _lowered(graph, strategy, itemsize, slots)
    devices = 1 + max(int(parts[2].max()) for parts, _ in layers.values())
    memory = np.zeros((devices, len(KINDS)), dtype=np.int64)
    present = np.zeros(devices, dtype=bool)  # devices the plan has tasks or data on
    read = {name: np.zeros(len(parts[2]), dtype=bool) for name, (parts, _) in layers.items()}  # by a consumer part
    read_again = {name: np.zeros(len(layers[name][0][2]), dtype=bool) for name in again}  # in backward
    readers = {name: [] for name in again}  # the layers whose backward reads each one's copies
    takes_dy = {}  # per part of a needed layer: whether its backward tasks read its output gradient
    moves = {name: [] for name in layers}  # per producer: the pieces its consumers' parts on other devices read
    working = {}  # per layer, the largest backward working set of a part on each device
    for layer in graph:
        (lo, hi, device), needs = layers[layer.name]
        if layer.param_shapes:
            _shards(lo[:, 1], hi[:, 1], device, per_channel(layer.op), itemsize,
                    strategy[layer.name].sync == "allreduce", slots, memory)
        if not layer.is_input:  # a forward (or loss) task per part; forward keeps its output
            kept = 0 if layer.kind == "softmax_cross_entropy" or layer.name in again else itemsize
            _outputs(lo, hi, device, kept, memory, present)
        # which parts run a backward task some output needs (the loss's parts always do)
        backward = np.full(len(device), layer.kind == "softmax_cross_entropy"
                           or (layer.name in needed and bool(layer.param_shapes) and not layer.op.reduces_statistics))
        inputs = np.zeros(len(device), dtype=np.int64)  # elements of its input tiles
        for j, src in enumerate(layer.inputs):
            (p_lo, p_hi, p_device), (n_lo, n_hi) = layers[src][0], needs[j]
            # its input gradient goes to a producer part's backward
            gradient = takes_dy[src] if src in needed and layer.name in needed else None
            mark = read[src] if src not in again else np.zeros_like(read[src])
            pieces = _reads(p_lo, p_hi, p_device, n_lo, n_hi, device, mark, gradient, backward, inputs)
            reads_again = layer.kind != "softmax_cross_entropy"  # its backward reads what its forward read
            if src in again:
                read[src] |= mark
                if reads_again and mark.any():
                    read_again[src] |= mark
                    readers[src].append(layer.name)
            if len(pieces):
                moves[src].append((pieces, reads_again))
        if layer.name in needed:  # batch norm's gradient sums read it in every part
            takes_dy[layer.name] = backward | layer.op.reduces_statistics
        scratch = np.zeros((devices, len(KINDS)), dtype=np.int64)
        _transient(lo, hi, device, backward, inputs, itemsize, scratch)
        working[layer.name] = scratch[:, TRANSIENT]
        np.maximum(memory[:, TRANSIENT], working[layer.name], out=memory[:, TRANSIENT])
    kept = [layer for layer in graph if not layer.is_input and layer.kind != "softmax_cross_entropy"]
    if not all(read[layer.name].all() for layer in kept):
        return _lowered(graph, strategy, itemsize, slots)  # the plan drops the tasks of parts nothing reads
    if not all(read_again[name].all() or _reads_itself(graph[name], needed) for name in again):
        return _lowered(graph, strategy, itemsize, slots)  # backward computes only some parts again
    copies = {}  # per recomputed layer, the bytes of its copies on each device
    for layer in graph:
        size = _itemsize(layer, itemsize)
        (lo, hi, device), _ = layers[layer.name]
        if layer.is_input and read[layer.name].any():  # the data tiles
            present[device] = True
            np.add.at(memory[:, ACTIVATIONS], device, np.prod(hi - lo, axis=1) * size)
        if layer.name in again:  # forward drops them; backward computes them again
            scratch = np.zeros((devices, len(KINDS)), dtype=np.int64)
            np.add.at(scratch[:, ACTIVATIONS], device, np.prod(hi - lo, axis=1) * size)
            read_back = [pieces for pieces, reads_again in moves[layer.name] if reads_again]
            if read_back:
                _forward_values(layers[layer.name][0], read_back, size, scratch)
            copies[layer.name] = scratch[:, ACTIVATIONS]
        elif moves[layer.name]:
            _forward_values(layers[layer.name][0], [pieces for pieces, _ in moves[layer.name]], size, memory)
    if again:
        _working_with_copies(graph, readers, needed, working, copies, memory)
    return {d: DeviceMemory(*map(int, memory[d])) for d in np.flatnonzero(present).tolist()}


def _reads_itself(layer, needed) -> bool:
    """Whether a layer's own backward reads its output (and so every part of it)."""
    return layer.name in needed and layer.op.saves_output and not layer.op.reduces_statistics


def _recomputed(graph, strategy, needed) -> set | None:
    """The recomputed layers whose copies backward reads: its own backward (where it reads its
    output) or a consumer's other than the loss.  None where a recomputed layer's backward does
    not run: consumers' copies may then read some of its parts only (the plan is lowered)."""
    out = set()
    for layer in graph:
        if not strategy[layer.name].recompute:
            continue
        if layer.name not in needed:
            return None
        if _reads_itself(layer, needed) or any(graph[c].kind != "softmax_cross_entropy"
                                               for c, _ in graph.consumers(layer.name)):
            out.add(layer.name)
    return out


def _working_with_copies(graph, readers, needed, working, copies, memory):
    """Each device's largest backward working set with the copies alive (taskrt.planning.memory):
    a recomputed layer's copies live from the first layer whose backward reads them, or reads a
    copy made from them, to the last, in backward's order of layers."""
    position = {name: i for i, name in enumerate(graph.layers)}
    spans = {}
    for layer in reversed(list(graph)):
        if layer.name not in readers:
            continue
        reading = readers[layer.name]
        first = [position[c] for c in reading] + [spans[c][1] for c in reading if c in readers]
        last = [position[c] for c in reading]
        if _reads_itself(layer, needed):
            first.append(position[layer.name])
            last.append(position[layer.name])
        spans[layer.name] = (min(last), max(first))  # (at least one reader: its consumers read all of it)
    for name, at in position.items():
        alive = sum((copies[layer] for layer, (last, first) in spans.items() if last <= at <= first),
                    np.zeros_like(memory[:, TRANSIENT]))
        np.maximum(memory[:, TRANSIENT], working.get(name, 0) + alive, out=memory[:, TRANSIENT])


def _itemsize(layer, itemsize) -> int:
    return 8 if layer.is_input and layer.op.dtype == "int64" else itemsize


def _regions(layer, config):
    parts = part_table(layer.shape, [config])
    return (parts.lo, parts.hi, parts.device), [
        (n.table.lo, n.table.hi) for n in (Needs(layer.op, j, parts) for j in range(len(layer.inputs)))]


@numba.njit(cache=True, nogil=True)
def _outputs(lo, hi, device, itemsize, memory, present):
    """Each part's output, kept for backward (`itemsize` 0: not counted), on its device."""
    for p in range(len(device)):
        volume = 1
        for e in range(lo.shape[1]):
            volume *= hi[p, e] - lo[p, e]
        memory[device[p], ACTIVATIONS] += volume * itemsize
        present[device[p]] = True


@numba.njit(cache=True, nogil=True)
def _transient(lo, hi, device, backward, inputs, itemsize, memory):
    """The largest backward working set on each device (part_footprint(...).transient): a part's
    input tiles (`inputs`, elements), its output and output gradient, for the parts `backward` says."""
    for p in range(len(device)):
        if backward[p]:
            volume = 1
            for e in range(lo.shape[1]):
                volume *= hi[p, e] - lo[p, e]
            memory[device[p], TRANSIENT] = max(memory[device[p], TRANSIENT], (inputs[p] + volume) * itemsize)


@numba.njit(cache=True, nogil=True)
def _reads(lo, hi, device, need_lo, need_hi, to, read, gradient, backward, inputs):
    """One edge under the strategy: mark the producer parts some consumer part reads (`read`),
    the consumer parts whose input gradient a producer part's backward takes (`backward`, given
    which producer parts take one: `gradient`), add each consumer part's input volume to
    `inputs`, and return the pieces parts on other devices read: (producer part, piece lo, piece
    hi, reading device) rows."""
    parts, consumers, rank = len(device), len(to), lo.shape[1]
    pieces = np.empty((parts * consumers, 2 + 2 * rank), dtype=np.int64)
    count = 0
    for q in range(consumers):
        volume = 1
        for e in range(rank):
            volume *= max(need_hi[q, e] - need_lo[q, e], 0)
        inputs[q] += volume
        for p in range(parts):
            meets = True
            for e in range(rank):
                meets = meets and max(lo[p, e], need_lo[q, e]) < min(hi[p, e], need_hi[q, e])
            if not meets:
                continue
            read[p] = True
            if gradient is not None and gradient[p]:
                backward[q] = True
            if device[p] != to[q]:
                pieces[count, 0] = p
                for e in range(rank):
                    pieces[count, 1 + e] = max(lo[p, e], need_lo[q, e])
                    pieces[count, 1 + rank + e] = min(hi[p, e], need_hi[q, e])
                pieces[count, 1 + 2 * rank] = to[q]
                count += 1
    return pieces[:count]


@numba.njit(cache=True, nogil=True)
def _shards(c_lo, c_hi, device, per_channel, itemsize, allreduce, slots, memory):
    """Each part's device holds its shard's weights and gradient; the shard's state lives on its
    first device ("ps") or in one chunk per replica ("allreduce": taskrt.planning.plan.chunk_bounds), and the owner of
    each chunk receives the other replicas' gradients of it."""
    parts = len(device)
    done = np.zeros(parts, dtype=np.bool_)
    members = np.empty(parts, dtype=np.int64)
    for p in range(parts):
        nbytes = per_channel * (c_hi[p] - c_lo[p]) * itemsize
        memory[device[p], PARAMETERS] += nbytes
        memory[device[p], GRADIENTS] += nbytes
    for p in range(parts):
        if done[p]:
            continue
        replicas = 0
        for q in range(p, parts):
            if not done[q] and c_lo[q] == c_lo[p] and c_hi[q] == c_hi[p]:
                done[q] = True
                members[replicas] = device[q]
                replicas += 1
        size = per_channel * (c_hi[p] - c_lo[p])
        chunks = min(replicas, size) if allreduce else 1
        for i in range(chunks):
            chunk = (size // chunks + (1 if i < size % chunks else 0)) * itemsize
            memory[members[i], OPTIMIZER] += 2 * slots * chunk  # its slots, and their updated copies
            memory[members[i], PARAMETERS] += chunk  # the updated weights, beside the old
            memory[members[i], GRADIENTS] += (replicas - 1) * chunk
            if chunks > 1:  # a master chunk beside the gathered copy
                memory[members[i], PARAMETERS] += chunk


def _forward_values(producer, moves, itemsize, memory):
    """What forward moves out of one layer's tiles: `moves` rows (tile, piece lo, piece hi,
    reading device) for its consumers' parts on other devices.  A tile a part needs whole
    travels as it is, otherwise the slice of it the part needs is cut on the tile's device; a
    slice is cut once, and a value travels once to each device reading it (taskrt.planning.lowering
    pieces and route)."""
    lo, hi, device = producer
    _moved(np.concatenate(moves) if len(moves) > 1 else moves[0], lo, hi, device, itemsize, memory)


@numba.njit(cache=True, nogil=True)
def _moved(moves, lo, hi, device, itemsize, memory):
    rank = lo.shape[1]
    travels = _first_of_each(moves, moves.shape[1])  # each (value, reading device) once
    cut = _first_of_each(moves, moves.shape[1] - 1)  # each value once, whichever device reads it
    for m in range(len(moves)):
        p = moves[m, 0]
        nbytes = itemsize
        whole = True
        for e in range(rank):
            nbytes *= moves[m, 1 + rank + e] - moves[m, 1 + e]
            whole = whole and moves[m, 1 + e] == lo[p, e] and moves[m, 1 + rank + e] == hi[p, e]
        if travels[m]:
            memory[moves[m, 1 + 2 * rank], ACTIVATIONS] += nbytes
        if cut[m] and not whole:
            memory[device[p], ACTIVATIONS] += nbytes


@numba.njit(cache=True, nogil=True)
def _first_of_each(rows, columns):
    """Whether each row is the first with its first `columns` entries (a hash table of rows)."""
    size = 1
    while size < 4 * len(rows):
        size *= 2
    table = np.full(size, -1, dtype=np.int64)
    first = np.zeros(len(rows), dtype=np.bool_)
    for m in range(len(rows)):
        h = 0
        for c in range(columns):
            h = (h * 1000003) ^ rows[m, c]
        h &= size - 1
        while True:
            other = table[h]
            if other < 0:
                table[h] = m
                first[m] = True
                break
            same = True
            for c in range(columns):
                same = same and rows[other, c] == rows[m, c]
            if same:
                break
            h = (h + 1) & (size - 1)
    return first


def _lowered(graph, strategy, itemsize, slots):
    from taskrt.planning.lowering import lower
    from taskrt.planning.memory import plan_memory

    return plan_memory(lower(graph, strategy, itemsize=itemsize), itemsize, slots)
