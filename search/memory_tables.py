"""A step's memory per device as a sum over layers and edges, for the search under a budget.

`search.memory.step_memory` counts a strategy's bytes per device by kind; the peak of device d
is its total, which is a per-device sum plus a per-device maximum:

    peak_d = sum over layers L of A_d(L, c_L) + sum over edges e of E_d(e, c_u, c_v)
             + max over layers L of W_d(L, c_L)

- A_d(L, c): what layer L under config c keeps on d: its parameter shards, their gradients, the
  optimizer state and received gradients of the chunks d owns (search.memory's `_shards`, with
  the config's sync method), its outputs kept for backward, and for an input layer its data tiles;
- E_d(e, cu, cv): the values forward moves for the edge: each piece a consumer part on d reads
  from a producer part elsewhere, once per (value, reading device), and each slice cut on d for
  another device, once per value (a tile read whole travels as it is);
- W_d(L, c): the largest backward working set of a part of L on d (its input tiles, its output
  and output gradient), counted for every part of a layer whose backward may run.

The tables here give, per layer and config, a(L, c) = max_d A_d and w(L, c) = max_d W_d, and per
edge and config pair, e(cu, cv) = max_d E_d; the measure

    M(S) = sum_L a(L, c_L) + sum_e e(c_u, c_v) + max_L w(L, c_L)

bounds max_d peak_d from above, with equality when every term peaks on the same device (as in
strategies that split every layer evenly over the same devices).  It counts more than the plan
in a few places: a value two consumers of one producer read counts once per edge, W counts
every part of a layer that may run a backward task, and the data tiles count whether or not a
part reads them.  Tables are integers (bytes), built once per distinct layer and edge.
"""

from __future__ import annotations

import time
import weakref

import numba
import numpy as np

from taskrt.search.edge_memory import (
    distinct_devices,
    edges_distinct,
    edges_general,
    edges_separable,
    edges_tabulated,
    follows_blocks,
    interval_tables,
    is_grid,
    local_parts,
    need_classes,
    producer_intervals,
)
from taskrt.search.fronts import gather
from taskrt.search.layer_space import Configs


class MemoryTables:
    """The measure's tables for one graph over the cost tables' configs (bytes, int64): a(L, c)
    (`kept`; `by_device`: A_d(L, c)) and w(L, c) (`working`) per layer, e(cu, cv) per edge (in
    Tables.edges' order) for the config pairs asked (`edge`)."""

    def __init__(self, graph, cost_model, tables):
        started = time.perf_counter()
        self.cache = _CACHES.setdefault(cost_model, {})
        self.devices = cost_model.machine.num_devices
        needed = graph.needs_backward()
        itemsize = cost_model.itemsize
        slots = len(cost_model.optimizer.slots)
        self.kept, self.working, self.by_device, spaces = {}, {}, {}, {}
        for layer in graph:
            space = spaces[layer.name] = cost_model.layer_space(layer)
            configs = tables.configs[layer.name]
            allreduce = getattr(configs, "allreduce", None)
            if allreduce is None:
                allreduce = (np.zeros(len(configs), dtype=bool) if isinstance(configs, Configs)  # every one "ps"
                             else np.array([c.sync == "allreduce" for c in configs], dtype=bool))
            size = _itemsize(layer, itemsize)
            loss = layer.kind == "softmax_cross_entropy"
            backward = loss or layer.name in needed
            params = cost_model.channel_params(layer.op) if layer.param_shapes else 0
            key = ("layer", space.key, allreduce.tobytes(), size, layer.is_input, loss, backward, params, slots)
            if key not in self.cache:
                parts = space.parts
                inputs = np.zeros(len(parts.device), dtype=np.int64)
                for needs in space.needs:
                    inputs += _volumes(needs.table.lo, needs.table.hi)
                self.cache[key] = _layer_tables(parts.lo, parts.hi, parts.device, parts.starts, allreduce, params,
                                                size, itemsize, layer.is_input, loss, backward, inputs, self.devices,
                                                slots)
            by_device, self.working[layer.name] = self.cache[key]
            self.by_device[layer.name] = by_device
            self.kept[layer.name] = by_device.max(axis=1) if by_device.shape[1] else np.zeros(len(by_device), np.int64)
        self.edges = []  # per edge: (producer space, consumer space, input index, item size, cache key)
        for u, v, j, _ in tables.edges:
            producer, consumer = spaces[u], spaces[v]
            size = _itemsize(graph[u], itemsize)
            self.edges.append((producer, consumer, j, size,
                               ("edge", id(producer.grid), id(consumer.grid), consumer.needs[j].key(), size)))
        self.seconds = time.perf_counter() - started

    def edge(self, i: int, rows=None, cols=None, wanted=None) -> np.ndarray:
        """e(cu, cv) of edge i for producer configs `rows` and consumer configs `cols` (default: all);
        with `wanted` (a boolean matrix over them), only those pairs, `unknown` elsewhere."""
        producer, consumer, j, size, key = self.edges[i]
        table = self.cache.get(key)
        whole = (rows is None or len(rows) == table.shape[0]) and (cols is None or len(cols) == table.shape[1]) if (
            table is not None) else False
        if whole and self.cache.get(("complete", key)):
            return table if wanted is None else np.where(wanted, table, UNKNOWN)
        parts, needs = producer.parts, consumer.needs[j].table
        if table is None:
            table = self.cache[key] = np.full((len(parts.starts), len(needs.starts)), -1, dtype=np.int64)
        rows = np.arange(table.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
        cols = np.arange(table.shape[1]) if cols is None else np.asarray(cols, dtype=np.int64)
        asked = np.ones((len(rows), len(cols)), dtype=bool) if wanted is None else np.asarray(wanted, dtype=bool)
        started = time.perf_counter()
        fast = self.cache.get(("fast", key))
        if fast is None:
            fast = self.cache[("fast", key)] = self._fast_path(producer, consumer, j)
        if fast[0] == "tabulated":
            _, local, local_reader, lonely, ids, sums, counts, volumes, shape = fast
            edges_tabulated(parts.lo, parts.hi, parts.device, parts.starts, local, needs.lo, needs.hi, needs.device,
                             needs.starts, local_reader, lonely, ids, sums, counts, volumes, shape,
                             size, self.devices, rows, cols, asked, table)
        elif fast[0] == "separable":
            _, shape, local, local_reader, lonely, driven_by = fast
            edges_separable(parts.lo, parts.hi, parts.device, parts.starts, shape, local, needs.lo, needs.hi,
                             needs.device, needs.starts, needs.degrees, local_reader, lonely, driven_by, size,
                             self.devices, rows, cols, asked, table)
        elif fast[0] == "distinct":
            classes = fast[1]
            edges_distinct(parts.lo, parts.hi, parts.device, parts.starts, needs.lo, needs.hi, needs.device,
                            needs.starts, classes, size, self.devices, rows, cols, asked, table)
        else:
            edges_general(parts.lo, parts.hi, parts.device, parts.starts, needs.lo, needs.hi, needs.device,
                          needs.starts, size, self.devices, rows, cols, asked, table)
        self.seconds += time.perf_counter() - started
        if wanted is None and len(rows) == table.shape[0] and len(cols) == table.shape[1]:
            self.cache[("complete", key)] = True  # every config pair (in order): all known now
            return table
        out = gather(table, rows, cols)
        return out if wanted is None else np.where(asked, out, UNKNOWN)

    def _fast_path(self, producer, consumer, j) -> tuple:
        """How edge tables of this producer and consumer input are counted: "tabulated" or
        "separable" (every config one part per device, the producer's parts its grid's blocks, each
        input dimension of a need following one output dimension's block; "tabulated" where each
        output dimension drives at most one input dimension), "distinct" (one part per device) or
        "general"."""
        parts, needs = producer.parts, consumer.needs[j].table
        mine = self.cache.get(("producer", id(producer.grid)))
        if mine is None:  # what depends on the producer alone, shared by every edge out of its configs
            shape = parts.hi.max(axis=0)
            distinct = distinct_devices(parts.device, parts.starts)
            grid = distinct and is_grid(parts.lo, parts.hi, parts.block, parts.degrees, parts.starts, shape)
            # per dimension, the distinct intervals of its parts (and each part's)
            intervals = producer_intervals(parts.lo, parts.hi, shape) if grid else None
            local = local_parts(parts.device, parts.starts, self.devices) if distinct else None
            mine = self.cache[("producer", id(producer.grid))] = (distinct, grid, shape, local, intervals,
                                                                  np.prod(parts.hi - parts.lo, axis=1))
        distinct, grid, shape, local, intervals, volumes = mine
        theirs = self.cache.get(("consumer", id(consumer.needs[j])))
        if theirs is None:  # what depends on the consumer's needs alone
            driven_by = np.asarray(consumer.needs[j].driven_by, dtype=np.int64)
            reads = distinct_devices(needs.device, needs.starts)
            classes = need_classes(needs.lo, needs.hi, needs.starts) if reads else None
            follows = reads and follows_blocks(needs.lo, needs.hi, needs.block, needs.degrees, needs.starts,
                                                driven_by)
            lonely = np.bincount(classes, minlength=len(classes))[classes] == 1 if reads else None
            local_reader = local_parts(needs.device, needs.starts, self.devices) if reads else None
            theirs = self.cache[("consumer", id(consumer.needs[j]))] = (reads, classes, follows, lonely, local_reader,
                                                                       driven_by)
        reads, classes, follows, lonely, local_reader, driven_by = theirs
        if not (distinct and reads):
            return ("general",)
        if not (grid and follows and len(driven_by) == parts.lo.shape[1]):
            return ("distinct", classes)
        drivers = driven_by[driven_by >= 0]
        if len(np.unique(drivers)) < len(drivers):  # an output dimension drives two input dimensions
            return ("separable", shape, local, local_reader, lonely, driven_by)
        # per (producer interval, consumer config) along each input dimension: the sum of its overlaps
        # with the config's distinct needs there, and how many of them hold it whole
        lo, hi, first, ids = intervals
        sums, counts = interval_tables(lo, hi, first, needs.lo, needs.hi, needs.starts, needs.degrees, driven_by)
        return ("tabulated", local, local_reader, lonely, ids, sums, counts, volumes, shape)


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CostModel -> {key: table}
UNKNOWN = 2**50  # the bytes of a config pair not asked for (search.pareto: more than any budget)


def memory_tables(graph, cost_model, tables) -> MemoryTables:
    """The measure's tables for `graph` over `tables` (CostModel.tables of the search space)."""
    return MemoryTables(graph, cost_model, tables)


def _itemsize(layer, itemsize: int) -> int:
    return 8 if layer.is_input and layer.op.dtype == "int64" else itemsize


@numba.njit(cache=True, nogil=True)
def _volumes(lo, hi):
    out = np.empty(len(lo), dtype=np.int64)
    for p in range(len(lo)):
        volume = 1
        for e in range(lo.shape[1]):
            volume *= max(hi[p, e] - lo[p, e], 0)
        out[p] = volume
    return out


@numba.njit(cache=True, nogil=True)
def _layer_tables(lo, hi, device, starts, allreduce, per_channel, size, itemsize, is_input, loss, backward, inputs,
                  devices, slots):
    """Per config: what each device keeps of the layer (parameters, gradients, optimizer state,
    outputs or data tiles), and w = its largest backward working set of one part."""
    configs, total, rank = len(starts), len(device), lo.shape[1]
    kept = np.zeros((configs, devices), dtype=np.int64)
    working = np.zeros(configs, dtype=np.int64)
    memory = np.zeros(devices, dtype=np.int64)
    members = np.empty(total, dtype=np.int64)
    done = np.zeros(total, dtype=np.bool_)
    for a in range(configs):
        first, stop = starts[a], starts[a + 1] if a + 1 < configs else total
        memory[:] = 0
        for p in range(first, stop):
            volume = 1
            for e in range(rank):
                volume *= hi[p, e] - lo[p, e]
            if is_input:
                memory[device[p]] += volume * size  # the data tile
            elif not loss:
                memory[device[p]] += volume * itemsize  # the output, kept for backward
            if backward:
                working[a] = max(working[a], (inputs[p] + volume) * itemsize)
        if per_channel > 0:  # search.memory._shards, for this config's parts
            for p in range(first, stop):
                nbytes = per_channel * (hi[p, 1] - lo[p, 1]) * itemsize
                memory[device[p]] += 2 * nbytes  # weights and gradient
                done[p] = False
            for p in range(first, stop):
                if done[p]:
                    continue
                replicas = 0
                for q in range(p, stop):
                    if not done[q] and lo[q, 1] == lo[p, 1] and hi[q, 1] == hi[p, 1]:
                        done[q] = True
                        members[replicas] = device[q]
                        replicas += 1
                elements = per_channel * (hi[p, 1] - lo[p, 1])
                chunks = min(replicas, elements) if allreduce[a] else 1
                for i in range(chunks):
                    chunk = (elements // chunks + (1 if i < elements % chunks else 0)) * itemsize
                    # optimizer state and its update, the updated weights, received gradients
                    memory[members[i]] += (2 * slots + 1) * chunk + (replicas - 1) * chunk
                    if chunks > 1:
                        memory[members[i]] += chunk  # the master chunk
        kept[a] = memory
    return kept, working
