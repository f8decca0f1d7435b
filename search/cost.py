"""Cost model: the paper's equation 1, with a measured runtime-overhead term.

    cost(S) = sum over layers (t_c + t_s) + sum over edges t_x

- t_c(layer, config): forward + backward of the slowest part.  Measured by running the part's
  kernels on a device of the machine (median of repeats); parts with the same op and tile shape
  share one measurement, kept in a JSON cache keyed by device kind and tile signature, so a
  second search on the same machine measures nothing.  For Machine.simulated devices: a
  roofline estimate from the device kind's peak FLOP/s and memory bandwidth, and every result
  says so (`CostModel.estimated`).
- t_x(edge, cu, cv): the bytes the lowering moves for the edge (activations forward, gradients
  backward), from the same region rules (search.regions), over the machine's links: devices
  receive in parallel, one device's incoming pieces one after another.
- t_s(layer, config): the parameter server of each shard receives every replica's gradient and
  sends the weights back; shards synchronize in parallel.
- Runtime overhead: Dask spends about a few ms per dependent task (measured on the cluster,
  `Machine.task_overhead`); each layer pays it per task on its path (forward, backward, update,
  and for replicated weights the gradient extraction and weight fetch).  Zero for simulated
  machines unless given: the paper's runtime assumption.

The t_x kernels release the GIL: a helper thread runs each edge's as soon as both its layers are
prepared, while this thread prepares the next layers and the t_c and t_s tables
(`search.helper_thread.Kernels`).  The search's other compiled functions release it too, so that
the helper, which needs the GIL for a moment between two kernels, need not wait for this thread's
switch interval while it is in one.

Its parts live in rooms of their own: the cache on disk (`search.cost_cache`), each layer's
configs and geometry (`search.layer_space`), timing parts on a device (`search.part_timing`),
roofline estimates (`search.roofline`), t_s (`search.sync_cost`), t_x (`search.transfer`,
`search.regions`) and the runtime's own costs (`search.runtime_costs`).

A layer's tables depend only on its op and configs, its configs, parts and grid only on its
output shape, and an edge's t_x only on its two grids and what the consumer reads per block, so
a CostModel computes each once (a network's repeated layers share them, and so does a second
search with the same CostModel).  Nothing is kept between CostModels.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod

import numba
import numpy as np

from taskrt.graph.config import DIMS, ParallelConfig
from taskrt.machines.device_kinds import DEVICE_KINDS
from taskrt.ops.optim import SGD
from taskrt.ops.rect import Rect
from taskrt.planning.params import resolve_dtype
from taskrt.search import runtime_costs, transfer
from taskrt.search.cost_cache import CACHE_FORMAT, CostCache, corun_kind, default_cache_path
from taskrt.search.helper_thread import Kernels
from taskrt.search.layer_space import Configs, Geometry, LayerSpace, channel_params, first_part_bytes, read_only
from taskrt.search.part_timing import measure_parts, measure_synchronization, time_on_devices
from taskrt.search.regions import Needs, part_table
from taskrt.search.roofline import roofline_parts
from taskrt.search.runtime_costs import CALIBRATION_FORMAT, STEP_FITTED, STEP_LATENCIES
from taskrt.search.space import config_grid, layer_configs, search_space
from taskrt.search.sync_cost import sync_times
from taskrt.search.task_prices import task_timer

# moved to rooms of their own; importable from here as before
__all__ = ["CACHE_FORMAT", "CALIBRATION_FORMAT", "STEP_FITTED", "STEP_LATENCIES", "Breakdown", "CostCache",
           "CostModel", "Kernels", "Tables", "channel_params", "corun_kind", "default_cache_path", "measure_parts",
           "measure_synchronization", "roofline_parts"]


@dataclass
class Tables:
    """Cost vectors and matrices of one graph over its search space (seconds)."""

    configs: dict[str, Sequence[ParallelConfig]]
    compute: dict[str, np.ndarray]
    sync: dict[str, np.ndarray]
    edges: list[tuple[str, str, int, np.ndarray]]  # (producer, consumer, input index, Cu x Cv)
    estimated: bool
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # time spent building each kind of table

    def unary(self, layer) -> np.ndarray:
        return self.compute[layer] + self.sync[layer]


@dataclass
class Breakdown:
    """Predicted step time of a strategy, per layer (edge costs go to the consuming layer)."""

    t_c: dict[str, float]
    t_s: dict[str, float]
    t_x: dict[str, float]
    estimated: bool

    @property
    def total(self) -> float:
        return sum(self.t_c.values()) + sum(self.t_s.values()) + sum(self.t_x.values())

    def table(self) -> str:
        rows = [f"{'layer':<24} {'t_c ms':>9} {'t_x ms':>9} {'t_s ms':>9}"]
        for name in self.t_c:
            ms = [self.t_c[name] * 1e3, self.t_x[name] * 1e3, self.t_s[name] * 1e3]
            rows.append(f"{name:<24} " + " ".join(f"{v:9.3f}" for v in ms))
        rows.append(f"{'total':<24} {sum(self.t_c.values()) * 1e3:9.3f} {sum(self.t_x.values()) * 1e3:9.3f} "
                    f"{sum(self.t_s.values()) * 1e3:9.3f}   = {self.total * 1e3:.3f} ms per step")
        if self.estimated:
            rows.append("(t_c estimated by roofline from the device kind's data sheet: simulated machine)")
        return "\n".join(rows)


class CostModel:
    def __init__(self, machine, cache=None, repeats=5, dtype="float32", overhead=None, powers_of_two=True,
                 placement="first", progress=True, optimizer=None):
        """`optimizer` (`taskrt.optim`): whose updates the simulator prices (default: SGD with momentum)."""
        self.machine = machine
        self.optimizer = optimizer if optimizer is not None else SGD(0.01, momentum=0.9)
        self.estimated = machine.is_simulated
        self.itemsize = resolve_dtype(dtype).itemsize
        self.dtype = resolve_dtype(dtype).name
        self.repeats = repeats
        self.powers_of_two, self.placement, self.progress = powers_of_two, placement, progress
        self.cache = CostCache(default_cache_path() if cache is None else (cache or None))
        self.measurements = 0  # timings run by this model (not found in the cache)
        bandwidth = np.array(machine.bandwidth, dtype=float)
        self.inv_bandwidth = np.where(np.isinf(bandwidth), 0.0, 1.0 / bandwidth)
        self.latency = np.array(machine.latency, dtype=float)
        np.fill_diagonal(self.latency, 0.0)
        nic = getattr(machine, "nic_bandwidth", None)
        self.links = transfer.Links(self.inv_bandwidth, self.latency, np.array([d.node for d in machine.devices]),
                                    1.0 / nic if nic else 0.0)
        # Where devices share the host's cores and memory (CPU workers on one host), the runtime's
        # processor time per task is fitted to training steps (`search.runtime_costs`), and a kernel runs
        # slower while another one runs beside it than alone (memory bandwidth, last-level cache):
        # parts are timed both ways (`measure(..., corun=True)`), and the simulator takes the
        # slow-down while kernels overlap.
        self.corun = not self.estimated and machine.num_devices > 1 and runtime_costs.shared_cores(machine)
        self.calibration = runtime_costs.calibration(machine, self.cache, self.corun, progress)
        self.hop = self.calibration["per_hop_s"] if overhead is None else float(overhead)
        self.memory_bandwidth = self.calibration["memory_bandwidth"]
        self.kinds = sorted({d.kind for d in machine.devices})
        self.kind_index = {d.id: self.kinds.index(d.kind) for d in machine.devices}
        # each device's data sheet (the roofline of simulated devices)
        self._peak = np.array([DEVICE_KINDS[d.kind]["flops"] if self.estimated else 0.0 for d in machine.devices])
        self._bandwidth = np.array([DEVICE_KINDS[d.kind]["memory_bandwidth"] if self.estimated else 0.0
                                    for d in machine.devices])
        self._times: dict[tuple, tuple] = {}  # (device kind, op, need_dx, tile shapes) -> (forward s, backward s)
        self._corun_times: dict[tuple, tuple] = {}  # the same keys -> timed with every device at once
        self._sync_times: dict[tuple, float] = {}
        # Tables of one layer depend only on its op and configs, of an edge only on its two ends: a
        # network's repeated layers (and a second search with this model) compute them once.
        self._grids: dict[tuple, tuple] = {}  # largest degree per dimension -> config_grid
        self._geometries: dict[tuple, Geometry] = {}  # (dims, shape, kept) -> Geometry
        self._configs: dict[tuple, ParallelConfig] = {}  # (degrees, first device, sync) -> the config
        self._spaces: dict[tuple, LayerSpace] = {}  # (op, given configs or None) -> LayerSpace
        self._compute: dict[tuple, np.ndarray] = {}
        self._per_channel: dict = {}  # op -> channel_params(op)
        self._edges: dict[tuple, np.ndarray] = {}


    # ---- runtime overhead (search.runtime_costs) ----------------------------------------------
    def fit_to_steps(self, calibration: dict) -> dict:
        """What the calibration fits to training steps of the calibration network, measured now on
        `calibration`'s other costs (`search.runtime_costs.fit_to_steps`); {} off CPU workers."""
        return runtime_costs.fit_to_steps(self.machine, calibration, self.corun)


    # ---- tables -----------------------------------------------------------------------------
    def space(self, graph) -> dict[str, list[ParallelConfig]]:
        return search_space(graph, self.machine, self.powers_of_two, self.placement, self.itemsize)

    def tables(self, graph, configs=None) -> Tables:
        """t_c, t_s and t_x over every layer's configs: `configs` (name -> list), by default the
        search space, where each config takes the cheaper sync method."""
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        choose_sync = configs is None  # the space: each config gets the cheaper sync method
        needed = graph.needs_backward()
        with Kernels() as kernels:
            # Each edge's t_x kernels start on the helper as soon as both its layers have their space
            # (layers come in topological order), while this thread goes on with the next layers.
            spaces, edges = {}, []
            for layer in graph:
                spaces[layer.name] = space = self.layer_space(layer, None if configs is None else configs[layer.name])
                for j, src in enumerate(layer.inputs):
                    edges.append((src, layer.name, j, self._edge_key(graph[src], spaces[src], space, j,
                                                                     src in needed, kernels)))
            seconds = {"space and regions": lap()}
            compute = self.compute_costs(graph, spaces, needed)
            seconds["compute"] = lap()
            sync, chosen = {}, {}
            for layer in graph:
                space = spaces[layer.name]
                if choose_sync:
                    chosen[layer.name], sync[layer.name] = self._cheaper_sync(layer, space)
                else:
                    methods = self.sync_methods(layer, space.parts)
                    chosen[layer.name] = space.configs
                    sync[layer.name] = np.array([methods[c.sync][i] for i, c in enumerate(space.configs)])
            seconds["sync"] = lap()
            for key, table in kernels.tables().items():
                self._edges[key] = read_only(table)
        edges = [(src, dst, j, self._edges[key]) for src, dst, j, key in edges]
        seconds["edges"] = lap()  # waiting for the kernels not done meanwhile
        notes = ["t_c estimated by roofline (simulated machine)"] if self.estimated else []
        return Tables(chosen, compute, sync, edges, self.estimated, notes, seconds)

    def layer_space(self, layer, configs=None) -> LayerSpace:
        """`layer`'s configs (by default its search space: `search.space.layer_configs`) with their
        part table, grid and needs, shared by every layer with the same op and configs."""
        key = (layer.op, None if configs is None else tuple(configs))
        space = self._spaces.get(key)
        if space is None:
            if configs is None:
                geometry, needs = self._fitting_configs(layer)
            else:
                parts = part_table(layer.shape, configs)
                geometry = Geometry(list(configs), parts,
                                    transfer.Grid(parts, layer.shape, self.links.node))
                needs = [Needs(layer.op, j, parts) for j in range(len(layer.inputs))]
            space = self._spaces[key] = LayerSpace(key, geometry, needs)
        return space

    def regions(self, layer, config, position=None):
        """The parts of `layer` under `config` as (lo, hi, device) rows, and each input's needs as
        (lo, hi) rows (zero rows: reads nothing), from the layer's search space when the config is
        in it, at `position` if known (search.memory.step_memory takes this)."""
        space = self.layer_space(layer)
        if position is None:
            geometry = space.geometry
            if geometry.index is None:
                geometry.index = {(c.n, c.c, c.h, c.w, c.devices): i for i, c in enumerate(geometry.configs)}
            position = geometry.index.get((config.n, config.c, config.h, config.w, config.devices))
            if position is None or not config.is_even:
                space, position = self.layer_space(layer, [config]), 0
        parts = space.parts
        rows = slice(parts.starts[position],
                     parts.starts[position + 1] if position + 1 < len(parts.starts) else len(parts.device))
        return (parts.lo[rows], parts.hi[rows], parts.device[rows]), [(n.table.lo[rows], n.table.hi[rows])
                                                                      for n in space.needs]

    def _fitting_configs(self, layer):
        """The search space of `layer` (as `search.space.layer_configs` gives it), built from arrays:
        every config's parts and needs at once, dropping those whose largest part does not fit."""
        op = layer.op
        geometry = self._geometry(op.dims, layer.shape)
        needs = [Needs(op, j, geometry.parts) for j in range(len(op.in_shapes))]
        memory = min((d.memory for d in self.machine.devices if d.memory), default=None)
        if memory is not None:
            fits = self._largest_part_bytes(op, geometry.parts, needs) <= memory
            if not fits.all():
                if not fits.any():  # its message names the layer and the smallest need
                    layer_configs(layer, self.machine.num_devices, self.powers_of_two, self.placement, memory,
                                  self.itemsize)
                geometry = self._geometry(op.dims, layer.shape, fits)
                needs = [Needs(op, j, geometry.parts) for j in range(len(op.in_shapes))]
        return geometry, needs

    def _geometry(self, dims, shape, keep=None) -> Geometry:
        """The configs splitting `dims` of a tensor of `shape` (those `keep` says), with their part
        table and grid: the same for every layer with this output shape."""
        key = (dims, shape, None if keep is None else keep.tobytes())
        if key not in self._geometries:
            # the configs depend on each dimension's size only up to the device count
            limits = tuple(min(shape[dims.index(dim)], self.machine.num_devices) if dim in dims else 1 for dim in DIMS)
            if limits not in self._grids:
                self._grids[limits] = config_grid(dims, shape, self.machine.num_devices, self.powers_of_two,
                                                  self.placement)
            degrees, first = self._grids[limits]
            if keep is not None:
                degrees, first = degrees[keep], first[keep]
            configs = Configs(degrees, first, self._config)
            grid = transfer.Grid.of_blocks(shape, np.ascontiguousarray(degrees[:, : len(shape)]), first,
                                           self.links.node)
            self._geometries[key] = Geometry(configs, grid.table, grid)
        return self._geometries[key]

    def _largest_part_bytes(self, op, parts, needs) -> np.ndarray:
        """Per config, `search.space.part_memory`: the footprint of its first part (the largest)."""
        volumes = tuple(n.volume for n in needs) or (np.zeros(len(parts.device), dtype=np.int64),)
        return first_part_bytes(parts.lo, parts.hi, parts.starts, volumes, self.channel_params(op), self.itemsize)

    def channel_params(self, op) -> int:
        if op not in self._per_channel:
            self._per_channel[op] = channel_params(op)
        return self._per_channel[op]

    def _config(self, degrees, first, sync="ps") -> ParallelConfig:
        key = (degrees, first, sync)
        config = self._configs.get(key)
        if config is None:
            config = self._configs[key] = ParallelConfig(*degrees, devices=tuple(range(first, first + prod(degrees))),
                                                         sync=sync)
        return config

    def _cheaper_sync(self, layer, space):
        """The space's configs, each with the cheaper sync method, and their t_s."""
        if space.cheaper is None:
            methods = self.sync_methods(layer, space.parts)
            ps, allreduce = methods["ps"], methods["allreduce"]
            configs = space.configs
            cheaper = allreduce < ps
            if cheaper.any():
                configs = configs.with_allreduce(cheaper)
            space.cheaper = (configs, read_only(np.minimum(ps, allreduce)))
        return space.cheaper

    def _edge_key(self, producer, u: LayerSpace, v: LayerSpace, j, backward, kernels: Kernels) -> tuple:
        """The key of an edge's t_x table in `_edges`; a table not known yet has its kernels
        started in `kernels`."""
        itemsize = 8 if producer.is_input and producer.op.dtype == "int64" else self.itemsize
        # t_x depends on the ops only through the consumer's needs: e.g. every batch norm reading a
        # convolution of one output shape has the same table
        key = (id(u.grid), id(v.grid), v.needs[j].key(), backward, itemsize)
        if key not in self._edges and key not in kernels:
            kernels.start(key, self.transfer_job(u, v, v.needs[j], itemsize, backward))
        return key

    def breakdown(self, graph, strategy) -> Breakdown:
        """Predicted cost of `strategy` under the model, layer by layer."""
        strategy = strategy.validated(graph, self.machine)
        single = {name: [strategy[name]] for name in graph.layers}
        tables = self.tables(graph, single)
        t_x = {name: 0.0 for name in graph.layers}
        for _, dst, _, matrix in tables.edges:
            t_x[dst] += float(matrix[0, 0])
        t_c = {n: float(v[0]) for n, v in tables.compute.items()}
        for name in (n for n, c in strategy.items() if c.recompute):  # its forward and forward transfers again
            t_c[name] += float(self.compute_costs([graph[name]], {name: self.layer_space(graph[name], single[name])},
                                                  set())[name][0])
            for src, dst, j, _ in tables.edges:
                if src == name and graph[dst].kind != "softmax_cross_entropy":
                    u, v = self.layer_space(graph[src], single[src]), self.layer_space(graph[dst], single[dst])
                    t_x[dst] += float(self.transfer_job(u, v, v.needs[j], self.itemsize, False)()[0, 0])
        return Breakdown(t_c, {n: float(v[0]) for n, v in tables.sync.items()}, t_x, self.estimated)

    # ---- t_c --------------------------------------------------------------------------------
    def compute_costs(self, graph, spaces, needed) -> dict[str, np.ndarray]:
        """Per layer, per config: the slowest part's forward (+ backward when the layer needs it),
        plus its tasks' overhead.

        Parts are timed by signature (device kind, op, tile shapes): equal parts share one timing,
        found in the cache, estimated (simulated machine) or measured on a device."""
        plans, missing, out = {}, {}, {}
        for layer in graph:
            space = spaces[layer.name]
            table = space.parts
            if layer.is_input:
                out[layer.name] = np.zeros(len(table.starts))
                continue
            backward = layer.name in needed or layer.kind == "softmax_cross_entropy"
            need_dx = tuple(src in needed for src in layer.inputs)
            key = (space.key, backward, need_dx, layer.name in needed)
            if key in self._compute:
                out[layer.name] = self._compute[key]
                continue
            shapes = [table.shape] + [needs.table.shape for needs in space.needs]
            # each direction's dependent tasks: the part's, and batch norm's statistics reduction before it
            hops = (2 if layer.name in needed else 1) * (1 + layer.op.statistics_hops)
            if self.estimated:  # a formula per part: no need to find the distinct ones
                fwd, bwd = roofline_parts(layer.op, shapes, self._peak, self._bandwidth, self.itemsize,
                                          self.channel_params(layer.op), table.device)
                out[layer.name] = self._compute[key] = read_only(_slowest(fwd, bwd, backward, table.starts,
                                                                           hops * self.hop))
                continue
            kinds = np.array([self.kind_index[d] for d in table.device])
            rows = np.concatenate([kinds[:, None], *shapes], axis=1)
            unique, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
            keys = []
            for row, index in zip(unique.tolist(), first.tolist()):
                rect = Rect(tuple(table.lo[index].tolist()), tuple(table.hi[index].tolist()))
                keys.append(self._lookup(self.kinds[row[0]], layer.op, rect, need_dx, missing))
            plans[layer.name] = (key, keys, inverse.ravel(), backward, table.starts, hops)
        self._measure_missing(missing)
        for name, (key, keys, inverse, backward, starts, hops) in plans.items():
            times = np.array([sum(self._times[k][: 2 if backward else 1]) for k in keys])[inverse]
            out[name] = self._compute[key] = read_only(np.maximum.reduceat(times, starts) + hops * self.hop)
        return {layer.name: out[layer.name] for layer in graph}

    def _lookup(self, kind, op, rect, need_dx, missing) -> tuple:
        """The timing key of a part; its (forward, backward) seconds go into `_times` from the
        cache, or the part is queued in `missing` to be measured."""
        shapes = tuple(None if r is None else r.shape for r in op.input_rects(rect))
        key = (kind, op, need_dx, rect.shape, shapes)
        if key not in self._times or (self.corun and key not in self._corun_times):
            sig = self.signature(op, rect, need_dx)
            cached = self.cache.get(kind, sig)
            beside = self.cache.get(corun_kind(kind), sig) if self.corun else None
            if cached is not None and (beside is not None or not self.corun):
                self._times[key] = tuple(cached)
                if beside is not None:
                    self._corun_times[key] = tuple(beside)
            else:
                # one signature may stand for several keys: layers of different shapes whose parts
                # have equal tiles (a pool split 2x2 in space, another split in channels)
                keys, _ = missing.setdefault(kind, {}).setdefault(sig, ([], (op, rect, need_dx)))
                keys.append(key)
        return key

    def _measure_missing(self, missing):
        for kind, items in missing.items():
            parts = {sig: item for sig, (_, item) in items.items()}
            measured = self.measure(kind, parts)
            self.cache.put_many(kind, measured)
            self._times.update({key: tuple(t) for sig, t in measured.items() for key in items[sig][0]})
            if self.corun:
                beside = self.measure(kind, parts, corun=True, what="part kernels, run beside each other,")
                self.cache.put_many(corun_kind(kind), beside)
                self._corun_times.update({key: tuple(t) for sig, t in beside.items() for key in items[sig][0]})

    def part_time(self, op, rect, need_dx, device: int = 0, corun: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one part on `device`'s kind: cached, estimated or measured;
        with `corun`, while kernels run on the other devices too (where that differs, `self.corun`)."""
        kind = self.kinds[self.kind_index[device]]
        if self.estimated:
            shapes = [np.array([rect.shape])] + [np.array([r.shape if r else (0,) * len(s)])
                                                 for r, s in zip(op.input_rects(rect), op.in_shapes)]
            fwd, bwd = roofline_parts(op, shapes, self._peak[device], self._bandwidth[device], self.itemsize)
            return float(fwd[0]), float(bwd[0])
        missing = {}
        key = self._lookup(kind, op, rect, tuple(need_dx), missing)
        self._measure_missing(missing)
        return self._corun_times.get(key, self._times[key]) if corun else self._times[key]

    def signature(self, op, rect, need_dx) -> str:
        """The cache key of a part: what determines its kernels' work, as text."""
        shapes = [None if r is None else list(r.shape) for r in op.input_rects(rect)]
        return json.dumps([op.kind, op.attrs(), shapes, list(rect.shape), list(need_dx), self.dtype], sort_keys=True)

    # ---- one task, for the simulator ---------------------------------------------------------
    def timer(self, plan, corun: bool = False):
        """A function giving the kernel seconds of each task of `plan` (`search.task_prices`)."""
        return task_timer(self, plan, corun)

    def _time_synchronization(self, items):
        """Seconds of parameter-server updates (and gradient sums) of the given sizes: estimated
        from memory bandwidth on simulated devices, otherwise run on a device and cached."""
        missing = {}
        rule = self.optimizer.kind
        slots = len(self.optimizer.slots)
        for item in items:
            if item in self._sync_times:
                continue
            kind, phase, elements, grads = item
            if self.estimated:  # read the gradients, the weights and slots; write the weights and slots
                passes = grads + (2 + 2 * slots if phase == "update" else 1)
                self._sync_times[item] = passes * elements * self.itemsize / DEVICE_KINDS[kind]["memory_bandwidth"]
                continue
            # SGD's signature as before, so caches measured before optimizers had names keep serving
            sig = json.dumps(["synchronize", phase, elements, grads, self.dtype]
                             + ([rule] if phase == "update" and rule != "sgd" else []))
            cached = self.cache.get(kind, sig)
            if cached is not None:
                self._sync_times[item] = cached[0]
            else:
                missing.setdefault(kind, {})[sig] = item
        for kind, items_of_kind in missing.items():
            seconds = self.measure(kind, {sig: (*item[1:], rule) for sig, item in items_of_kind.items()},
                                   measure_synchronization, "synchronizations")
            self.cache.put_many(kind, {sig: [t, 0.0] for sig, t in seconds.items()})
            for sig, t in seconds.items():
                self._sync_times[items_of_kind[sig]] = t

    def simulate(self, plan, fused: bool = True, runtime=None, executor: str = "programs"):
        """One step of `plan` simulated on this model's machine (`taskrt.planning.simulate`), with its part
        timings, the slow-down of kernels running beside each other, and the runtime's costs
        (`runtime(plan, fused, executor)`, unless given, already built)."""
        from taskrt.planning.simulate import simulate

        corun = self.timer(plan, corun=True) if self.corun else None
        return simulate(plan, self.timer(plan), self.machine,
                        self.runtime(plan, fused, executor) if runtime is None else runtime, corun)

    def runtime(self, plan, fused: bool = True, executor: str = "programs"):
        """The runtime's costs for `plan`: none for a simulated machine; for a Dask cluster, what
        `Machine.calibrate` measured (scheduler round trip per dependent task, worker time per
        task, a fetch from another device beyond the link, graph submission per task and the
        scheduler taking a graph in, one scatter call per device that receives data, the
        data the graph carries at its measured rate), for
        the executor `executor`: "programs" (the Trainer's default, one program per device) or
        "tasks", whose tasks are fused runs or one per plan task."""
        from taskrt.planning.simulate import Runtime

        if self.estimated:
            return Runtime()
        return runtime_costs.runtime(self.machine, self.calibration, plan, fused, self.corun, executor)


    def measure(self, kind, items: dict, timing=None, what="part kernels", corun: bool = False) -> dict:
        """Time each item on a device of this kind with `timing` (default `measure_parts`; see
        `search.part_timing.time_on_devices`); returns {signature: what `timing` gave for it}."""
        out = time_on_devices(self.machine, kind, items, timing or measure_parts, self.repeats, self.dtype,
                              corun, self.progress, what, self.cache.path)
        self.measurements += len(items)
        return out


    # ---- t_s --------------------------------------------------------------------------------
    def sync_methods(self, layer, table) -> dict[str, np.ndarray]:
        """t_s of every config under each sync method (see taskrt.planning.lowering): {"ps": ..., "allreduce": ...}.

        Shards synchronize in parallel.  Links are full duplex, as in t_x and the simulator: a
        device receives its incoming messages one after another and sends its outgoing ones one
        after another, both at once, so a shard costs its busiest device's larger direction.
        "ps": the server receives every replica's gradient and sends each the weights.
        "allreduce": each replica owns one chunk of the shard; it receives the other replicas'
        gradients of its chunk (reduce-scatter) and their updated chunks (all-gather), and sends
        the same amounts.  Traffic between nodes also passes each node's shared network interface
        (as in t_x and the simulator): every shard of the layer synchronizes at once, so a node's
        interface carries the bytes all of them send across, and a config costs at least its
        busiest interface's time.  Both add the dependent tasks' overhead: (grad, update, wfetch)
        and (rslice, update, wfetch, wgather) when replicated, the update alone otherwise."""
        configs = len(table.starts)
        if not layer.param_shapes:
            return {"ps": np.zeros(configs), "allreduce": np.zeros(configs)}
        # parts reading the same parameters (same channel block of the same config) form a shard
        ps, allreduce = sync_times(
            table.starts, table.device, table.lo[:, 1], table.hi[:, 1], self.channel_params(layer.op),
            self.inv_bandwidth, self.latency, self.links.node, int(self.links.node.max()) + 1,
            self.links.nic_inv_bandwidth, self.itemsize, self.hop)
        return {"ps": ps, "allreduce": allreduce}

    # ---- t_x --------------------------------------------------------------------------------
    def transfer_job(self, u: LayerSpace, v: LayerSpace, needs: Needs, itemsize: int, backward: bool):
        """A function giving the t_x table of an edge, (configs of u) x (configs of v) (see
        search.transfer)."""
        if backward and u.grid is v.grid and needs.reads_own_part:
            # Same configs on both sides and each part reads its own Rect (batch norm, relu): the
            # gradients retrace the activations' paths, so backward of (a, b) is forward of (b, a).
            forward = self.transfer_job(u, v, needs, itemsize, False)
            return lambda: _plus_transpose(forward())
        fast = transfer.separable_job(u.grid, v.grid, needs.table, needs, self.links, itemsize, backward)
        if fast is not None:
            return fast
        return lambda: transfer.general(u.parts, needs.table, self.links, itemsize, backward)


def _plus_transpose(table: np.ndarray) -> np.ndarray:
    return table + table.T


@numba.njit(cache=True, nogil=True)
def _slowest(forward, backward, with_backward, starts, overhead):
    """Per config: its slowest part's forward (+ backward), plus the tasks' overhead."""
    configs, parts = len(starts), len(forward)
    out = np.empty(configs)
    for a in range(configs):
        slowest = -np.inf
        for p in range(starts[a], starts[a + 1] if a + 1 < configs else parts):
            slowest = max(slowest, forward[p] + backward[p] * (1.0 if with_backward else 0.0))
        out[a] = slowest + overhead
    return out
