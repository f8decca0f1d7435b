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
prepared, while this thread prepares the next layers and the t_c and t_s tables (`Kernels`).  The
search's other compiled functions release it too, so that the helper, which needs the GIL for a
moment between two kernels, need not wait for this thread's switch interval while it is in one.

A layer's tables depend only on its op and configs, its configs, parts and grid only on its
output shape, and an edge's t_x only on its two grids and what the consumer reads per block, so
a CostModel computes each once (a network's repeated layers share them, and so does a second
search with the same CostModel).  Nothing is kept between CostModels.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numba
import numpy as np

from ops.rect import Rect
from search import transfer
from search.regions import Needs, PartTable, part_table
from search.space import config_grid, layer_configs, search_space
from search.step_costs import robust_line, step_costs, trimmed_mean
from taskrt.config import DIMS, ParallelConfig
from taskrt.files import write_atomic
from taskrt.machine import DEVICE_KINDS
from taskrt.params import resolve_dtype
from taskrt.plan import DATA, TASK

CACHE_FORMAT = "taskrt-costs/4"  # parts: [forward s, backward s (with packing the parameter gradient)], from
# kernels started with the core's cache evicted
# Machine.calibrate's costs: hops between computing tasks, across devices, a graph's intake; CPU per byte moved,
# per message; CPU per task fitted to training steps where devices share cores; the scheduler's
# answer to which workers there are; on CPU workers, the latencies of training steps' hops, start and answer
# (the start's line fitted by Theil-Sen)
CALIBRATION_FORMAT = 10
# what `CostModel.fit_to_steps` measures on training steps: the latencies, the rows they and the
# processor time per task are fitted to (that time only where devices share the host's cores;
# elsewhere `cpu_per_task_s` is the no-op tasks')
STEP_LATENCIES = ("step_dispatch_s", "step_fetch_s", "step_answer_s", "step_start_extra_s",
                  "step_start_extra_per_task_s")
STEP_FITTED = (*STEP_LATENCIES, "step_start_rows", "step_cpu_rows")


def default_cache_path() -> Path:
    root = os.environ.get("TASKRT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "taskrt")
    return Path(root) / "costs.json"


class CostCache:
    """Measured part times by device kind and tile signature, persisted as JSON."""

    def __init__(self, path=None):
        self.path = Path(path) if path else None
        self.data = {"format": CACHE_FORMAT, "parts": {}, "overhead": {}}
        if self.path and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
                if loaded.get("format") == CACHE_FORMAT:
                    self.data = loaded
            except (OSError, ValueError):
                pass  # an unreadable cache is a cold cache

    def get(self, kind, signature):
        return self.data["parts"].get(kind, {}).get(signature)

    def put_many(self, kind, values: dict):
        self.data["parts"].setdefault(kind, {}).update(values)
        self.save()

    def save(self):
        if self.path:
            write_atomic(self.path, json.dumps(self.data, indent=0, sort_keys=True))


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
                 placement="first", progress=True):
        self.machine = machine
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
        # processor time per task is fitted to training steps (`_calibrate`), and a kernel runs
        # slower while another one runs beside it than alone (memory bandwidth, last-level cache):
        # parts are timed both ways (`measure(..., corun=True)`), and the simulator takes the
        # slow-down while kernels overlap.
        self.corun = not self.estimated and machine.num_devices > 1 and self._shared_cores()
        self.calibration = self._calibrate()
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

    # ---- runtime overhead -------------------------------------------------------------------
    def _calibrate(self) -> dict:
        """The cluster's runtime costs (`Machine.calibrate`), cached like part timings.  Where
        devices share the host's cores, the runtime's processor time per task is fitted to
        training steps instead (`search.step_costs`), the no-op tasks' kept beside; on CPU
        workers the latencies come from training steps too (`_step_latencies`)."""
        if self.estimated:
            kind = self.machine.devices[0].kind
            return {"per_task_s": 0.0, "per_hop_s": 0.0, "memory_bandwidth": DEVICE_KINDS[kind]["memory_bandwidth"]}
        key = f"{self.machine.devices[0].kind}|{self.machine.num_devices} devices"
        cached = self.cache.data["overhead"].get(key)
        if cached is None or cached.get("format") != CALIBRATION_FORMAT:
            from tqdm import tqdm

            timed = self._cpu_workers()  # training steps measure the latencies (`fit_to_steps`)
            # about 8 s, and 11 s more of training steps: once per cluster, then cached
            with tqdm(total=2 if timed else 1, desc="calibrating the runtime's costs (once per cluster)",
                      disable=not self.progress or None, leave=False) as bar:
                cached = {**self.machine.calibrate(), "format": CALIBRATION_FORMAT}
                bar.update()
                if timed:
                    fitted = self.fit_to_steps(cached)
                    if "cpu_per_task_s" in fitted:  # the no-op tasks' kept beside the steps' fit
                        cached["noop_cpu_per_task_s"] = cached["cpu_per_task_s"]
                    cached.update(fitted)
                    bar.update()
            self.cache.data["overhead"][key] = cached
            self.cache.save()
        return cached

    def fit_to_steps(self, calibration: dict) -> dict:
        """What `_calibrate` fits to training steps of the calibration network, measured now
        (`search.step_costs`) on `calibration`'s other costs: where devices share the host's cores,
        the processor time per task (and the rows it is fitted to); the latencies of steps
        (`_step_latencies`).  On CPU workers only: elsewhere no-op tasks measure them ({})."""
        if not self._cpu_workers():
            return {}
        fit_cpu = self.corun
        measured = step_costs(self.machine, calibration["cpu_per_byte_s"], calibration["cpu_per_message_s"],
                              fit_cpu=fit_cpu)
        out = {k: measured[k] for k in ("cpu_per_task_s", "step_cpu_rows")} if fit_cpu else {}
        # the start is fitted beyond what `runtime` models without an earlier fit's
        unfitted = {k: v for k, v in calibration.items() if k not in STEP_FITTED}
        out.update(self._step_latencies({**unfitted, **out}, measured))
        return out

    def _step_latencies(self, calibration: dict, measured: dict) -> dict:
        """The simulator's latencies from training steps (`search.step_costs`), as `runtime` uses
        them: the dispatch of a task whose inputs are on its device and the fetch beyond it of one
        reading another device (each gap less the device's own time per task, which the simulator
        charges inside the task), the answer, and the start beyond what `runtime` models, fitted
        as a + b * tasks to the steps' first task (Theil-Sen: robust to one strategy far off)."""
        from taskrt.fusion import fused_plan

        def net(gaps):
            return [g - (calibration["export_s"] if phase == "export" else calibration["per_task_s"])
                    for g, phase in gaps]

        out = {}
        same, cross = (trimmed_mean(net(measured["step_gaps"][k])) for k in ("same", "cross"))
        if same is not None:
            out["step_dispatch_s"] = max(same, 0.0)
        if cross is not None:
            dispatch = out.get("step_dispatch_s", self._noop_dispatch(calibration))
            out["step_fetch_s"] = max(cross - dispatch, 0.0)
        if measured["step_answers"]:  # the median: a few steps, one of them may be slow
            out["step_answer_s"] = max(float(np.median(measured["step_answers"])), 0.0)
        unfitted = {**calibration, **out}  # the start as modeled without a fitted extra
        rows = []
        for plan, firsts in measured["step_starts"]:
            if firsts:
                runtime, tasks = self._runtime(unfitted, plan), len(fused_plan(plan)[0].tasks)
                modeled = runtime.start_s + runtime.per_task_submit_s * tasks + runtime.dispatch_s + runtime.task_s
                rows.append((tasks, float(np.median(firsts)) - modeled))
        if rows:
            intercept, slope = robust_line(*np.array(rows).T)
            out.update({"step_start_extra_s": float(intercept), "step_start_extra_per_task_s": float(slope),
                        "step_start_rows": [[int(t), float(e)] for t, e in rows]})
        return out

    @staticmethod
    def _noop_dispatch(calibration: dict) -> float:
        """A dependent task's dispatch between no-op tasks: a hop less the device's time per task."""
        return max(calibration["per_hop_s"] - calibration["per_task_s"], 0.0)

    def _cpu_workers(self) -> bool:
        """Whether the devices are CPU workers (of a Dask cluster)."""
        return all(d.kind.startswith("cpu:") for d in self.machine.devices)

    def _shared_cores(self) -> bool:
        """Whether the devices are CPU workers on one host, sharing its cores with the runtime."""
        return self._cpu_workers() and len({d.node for d in self.machine.devices}) == 1

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
                self._edges[key] = _read_only(table)
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
        return _first_part_bytes(parts.lo, parts.hi, parts.starts, volumes, self.channel_params(op), self.itemsize)

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
            space.cheaper = (configs, _read_only(np.minimum(ps, allreduce)))
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
        return Breakdown({n: float(v[0]) for n, v in tables.compute.items()},
                         {n: float(v[0]) for n, v in tables.sync.items()}, t_x, self.estimated)

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
                out[layer.name] = self._compute[key] = _read_only(_slowest(fwd, bwd, backward, table.starts,
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
            out[name] = self._compute[key] = _read_only(np.maximum.reduceat(times, starts) + hops * self.hop)
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
                beside = self.measure(kind, parts, corun=True, what="part kernels on every device at once")
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
        """A function giving the kernel seconds of each task of `plan` (the runtime's own cost per
        task is in `runtime()`); with `corun`, of its parts while kernels run beside them on the
        other devices (`part_time`)."""
        sync = {}  # task key -> (device kind, phase, elements, gradients): timed like parts
        for task in plan.tasks:
            if task.phase in ("update", "reduce"):
                kind = self.kinds[self.kind_index[task.device]]
                lo, hi, _ = plan.shards[task.layer][task.key[1]].chunks[task.key[2]]
                sync[task.key] = (kind, task.phase, hi - lo, len(task.spec.grads))
        self._time_synchronization(set(sync.values()))
        if not self.estimated:  # parts not timed yet: measured together, not one call each
            missing = {}
            for task in plan.tasks:
                if task.phase in ("fwd", "bwd", "loss"):
                    kind, op = self.kinds[self.kind_index[task.device]], task.spec.op
                    self._lookup(kind, op, task.spec.out, _need_dx(task), missing)
            self._measure_missing(missing)
        # On CPU workers a task first copies the arrays Dask hands it out of a message, which are
        # misaligned (taskrt.tasks.Received): another device's values and the client's data tiles.
        received = {}
        bandwidth = self.calibration.get("fresh_copy_bandwidth", self.memory_bandwidth)
        if not self.estimated:
            for task in plan.tasks:
                if self.kinds[self.kind_index[task.device]].startswith("cpu"):
                    nbytes = sum(plan.nbytes_of(d) or 0 for d in task.deps
                                 if d.kind == DATA or (d.kind == TASK and plan.device_of(d) != task.device))
                    if nbytes:
                        received[task.key] = nbytes / bandwidth

        def task_time(task) -> float:
            return received.get(task.key, 0.0) + kernel_time(task)

        def kernel_time(task) -> float:
            spec = task.spec
            if task.phase == "fwd":
                return self.part_time(spec.op, spec.out, _need_dx(task), task.device, corun)[0]
            if task.phase == "bwd":
                return self.part_time(spec.op, spec.out, _need_dx(task), task.device, corun)[1]
            if task.phase == "loss":
                return sum(self.part_time(spec.op, spec.out, _need_dx(task), task.device, corun))
            if task.phase in ("slice", "gslice", "rslice", "wgather"):  # copies into a fresh array
                return task.nbytes / self.calibration.get("fresh_copy_bandwidth", self.memory_bandwidth)
            if task.phase in ("update", "reduce"):
                return self._sync_times[sync[task.key]]
            if task.phase in ("fstats", "bstats", "running"):  # batch norm: a sum of small per-channel arrays
                bandwidth = self.calibration.get("fresh_copy_bandwidth", self.memory_bandwidth)
                return task.nbytes * len(task.deps) / bandwidth
            # fstat, bstat: batch norm's per-part statistics; the part's measured forward and backward
            # (measure_parts runs the op's whole-tile kernels) already include computing them
            return 0.0  # send, wfetch, grad: a reference to an array that exists already

        return task_time

    def _time_synchronization(self, items):
        """Seconds of parameter-server updates (and gradient sums) of the given sizes: estimated
        from memory bandwidth on simulated devices, otherwise run on a device and cached."""
        missing = {}
        for item in items:
            if item in self._sync_times:
                continue
            kind, phase, elements, grads = item
            if self.estimated:
                passes = grads + (4 if phase == "update" else 1)  # read gradients, w, v; write w, v
                self._sync_times[item] = passes * elements * self.itemsize / DEVICE_KINDS[kind]["memory_bandwidth"]
                continue
            sig = json.dumps(["synchronize", phase, elements, grads, self.dtype])
            cached = self.cache.get(kind, sig)
            if cached is not None:
                self._sync_times[item] = cached[0]
            else:
                missing.setdefault(kind, {})[sig] = item
        for kind, items_of_kind in missing.items():
            seconds = self.measure(kind, {sig: item[1:] for sig, item in items_of_kind.items()},
                                   measure_synchronization, "synchronizations")
            self.cache.put_many(kind, {sig: [t, 0.0] for sig, t in seconds.items()})
            for sig, t in seconds.items():
                self._sync_times[items_of_kind[sig]] = t

    def simulate(self, plan, fused: bool = True, runtime=None):
        """One step of `plan` simulated on this model's machine (`taskrt.simulate`), with its part
        timings, the slow-down of kernels running beside each other, and the runtime's costs
        (`runtime(plan, fused)`, unless given, already built)."""
        from taskrt.simulate import simulate

        corun = self.timer(plan, corun=True) if self.corun else None
        return simulate(plan, self.timer(plan), self.machine,
                        self.runtime(plan, fused) if runtime is None else runtime, corun)

    def runtime(self, plan, fused: bool = True):
        """The runtime's costs for `plan`: none for a simulated machine; for a Dask cluster, what
        `Machine.calibrate` measured (scheduler round trip per dependent task, worker time per
        task, a fetch from another device beyond the link, graph submission per task and the
        scheduler taking a graph in, one scatter call per device that receives data, the
        data the graph carries at its measured rate), for
        the tasks the executor submits: fused (the Trainer's default) or one per plan task."""
        from taskrt.simulate import Runtime

        if self.estimated:
            return Runtime()
        return self._runtime(self.calibration, plan, fused)

    def _runtime(self, c: dict, plan, fused: bool = True):
        """`runtime` under the calibration `c` (`_step_latencies` asks it before the fitted start)."""
        from taskrt.executor import data_bytes_by_device, gpu_devices, graph_seconds, inline_data_devices
        from taskrt.simulate import Runtime

        by_device, inline = data_bytes_by_device(plan), inline_data_devices(plan)  # carried, or scattered
        receivers = set(by_device) - inline
        scattered = sum(by_device[d] for d in receivers)
        carried = sum(by_device[d] for d in inline)
        shared_cores = self._shared_cores()
        # a hop between devices beyond one on a device: the link's latency, and the rest is the fetch
        cross = c.get("per_cross_hop_s")
        fetch = 0.0 if cross is None else max(cross - c["per_hop_s"] - float(self.latency[1, 0]), 0.0)
        noop_dispatch = self._noop_dispatch(c)
        # what a one-task graph waits for its task beyond submitting one task and sending it out: the
        # scheduler taking the graph in, once a step
        intake = max(c["first_start_s"] - c["submit_per_task_s"] - noop_dispatch, 0.0)
        # before the graph leaves, the client asks which devices have a worker, then builds and
        # serializes the step's graph; on its way the graph is read and written again (beyond a
        # one-task graph's way, in first_start_s): timed here on this plan
        graph = graph_seconds(plan, gpu_devices(self.machine), self.machine.tag, fused)
        client = c.get("check_s", 0.0) + graph.client_s + graph.transit_s
        start = (client + len(receivers) * c["scatter_s"] + scattered / c["client_bandwidth"]
                 + carried * c["inline_per_byte_s"] + intake)
        # Measured on training steps where there are (CPU workers): what no-op tasks miss of a
        # real step's hops, its answer and its start (`_step_latencies`).  The start and the answer
        # are read off the same steps, and where the task stream places a run early, time moves
        # from one to the other (one device: answers of 3 to 20 ms, starts 1 ms late to 19 early);
        # a start fitted below zero takes the rest off the answer, so their sum stays as measured.
        start += c.get("step_start_extra_s", 0.0)
        answer = c.get("step_answer_s", c.get("answer_s", c["per_hop_s"]))
        if start < 0 and "step_answer_s" in c:
            answer = max(answer + start, 0.0)
        cores = c["cores"] if shared_cores else 0
        if self.corun:
            # Parts are timed beside each other too (`corun`): their slow-down is in those timings.
            # `Machine.calibrate`'s effective cores, lowered by a reference kernel's slow-down beside
            # another (1.58-2.0 of 2 in 11-26's runs), would count it a second time.
            cores = float(os.cpu_count() or 1)
        return Runtime(dispatch_s=c.get("step_dispatch_s", noop_dispatch), task_s=c["per_task_s"],
                       fetch_s=c.get("step_fetch_s", fetch), export_s=c["export_s"],
                       answer_s=answer, start_s=max(start, 0.0),
                       per_task_submit_s=max(c["submit_per_task_s"] + c.get("step_start_extra_per_task_s", 0.0), 0.0),
                       cores=cores,
                       cpu_per_task_s=c["cpu_per_task_s"], cpu_per_message_s=c.get("cpu_per_message_s", 0.0),
                       cpu_per_byte_s=c["cpu_per_byte_s"], fused=fused)

    def measure(self, kind, items: dict, timing=None, what="part kernels", corun: bool = False) -> dict:
        """Time each item on a device of this kind (one at a time, as in training) with `timing`
        (default `measure_parts`); returns {signature: what `timing` gave for it}.  With `corun`,
        devices of the kind time the same items at once, as many as the host's cores run at once
        (more would time the cores' sharing, which the simulator models apart), and each timing
        is their mean."""
        from tqdm import tqdm

        timing = timing or measure_parts
        devices = [d.id for d in self.machine.devices if d.kind == kind]
        devices = devices[: max(2, os.cpu_count() or 1)] if corun else devices[:1]
        client = self.machine.client
        sigs = list(items)
        out = {}
        with tqdm(total=len(sigs), desc=f"measuring {len(sigs)} {what}", disable=not self.progress or None,
                  leave=False) as bar:
            for start in range(0, len(sigs), 8):
                chunk = sigs[start : start + 8]
                futures = [client.submit(timing, [items[s] for s in chunk], self.repeats, self.dtype,
                                         pure=False, resources={self.machine.tag(device): 1}) for device in devices]
                results = client.gather(futures)
                out.update(zip(chunk, np.mean(results, axis=0).tolist() if len(results) > 1 else results[0]))
                bar.update(len(chunk))
        self.measurements += len(sigs)
        return out

    # ---- t_s --------------------------------------------------------------------------------
    def sync_methods(self, layer, table) -> dict[str, np.ndarray]:
        """t_s of every config under each sync method (see taskrt.lowering): {"ps": ..., "allreduce": ...}.

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
        ps, allreduce = _sync_times(
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


def corun_kind(kind: str) -> str:
    """The cache's name for the part timings of a device kind taken with every device at once."""
    return f"{kind}|beside others"


def _need_dx(task) -> tuple:
    """Which input gradients a forward, backward or loss task's part timing includes."""
    if task.phase == "fwd":
        return tuple(False for _ in task.spec.op.in_shapes)
    return (True, False) if task.phase == "loss" else tuple(task.spec.need_dx)


def _plus_transpose(table: np.ndarray) -> np.ndarray:
    return table + table.T


_HELPER: tuple | None = None  # (process id, executor): a forked child starts its own
_SWITCH = threading.Lock()
_switch = {"users": 0, "saved": None}


class Kernels:
    """Tables whose kernels run on one helper thread as soon as they are started, while this
    thread goes on preparing other tables; `tables()` runs on this thread too whatever the
    helper has not begun, and gives every table.  The t_x kernels release the GIL, so on two
    cores they overlap this thread's Python.  Meanwhile Python's switch interval is shortened
    (SWITCH_INTERVAL_S): a helper wanting the GIL back to start its next kernel would otherwise
    wait up to 5 ms for this thread to let it go at every kernel (slower than one thread)."""

    SWITCH_INTERVAL_S = 1e-4

    def __init__(self):
        self.results = {}  # key -> its table, None until its kernel has run
        self.queue = queue.SimpleQueue()
        self.helper = None

    def __contains__(self, key) -> bool:
        return key in self.results

    def __enter__(self) -> Kernels:
        global _HELPER
        if (os.cpu_count() or 1) >= 2:
            if _HELPER is None or _HELPER[0] != os.getpid():
                _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="taskrt-tables"))
            with _SWITCH:
                if _switch["users"] == 0:
                    _switch["saved"] = sys.getswitchinterval()
                    sys.setswitchinterval(min(self.SWITCH_INTERVAL_S, _switch["saved"]))
                _switch["users"] += 1
            self.helper = _HELPER[1].submit(self._drain, True)
        return self

    def __exit__(self, *exc):
        self._stop()  # after an error before tables(): what is still queued is dropped
        return False

    def start(self, key, job):
        """The table `key` is what `job()` gives; it starts."""
        self.results[key] = None
        self.queue.put((key, job))

    def tables(self) -> dict:
        """Every started table by key, once its kernel is done (this thread runs those the helper
        has not begun)."""
        self._drain(False)
        self._stop()
        return self.results

    def _drain(self, wait: bool):
        """Run queued jobs; the helper (`wait`) until told to stop, this thread until none is left."""
        while True:
            try:
                item = self.queue.get() if wait else self.queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                return
            key, job = item
            self.results[key] = job()

    def _stop(self):
        """Stop the helper (its error, if it had one, raised here), dropping any job still queued,
        and give back the switch interval."""
        if self.helper is None:
            return
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        self.queue.put(None)
        try:
            self.helper.result()
        finally:
            self.helper = None
            with _SWITCH:
                _switch["users"] -= 1
                if _switch["users"] == 0:
                    sys.setswitchinterval(_switch["saved"])


@dataclass
class Geometry:
    """Configs splitting a layer's output, with their part table and block grid: the same for
    every layer with the same output shape (a convolution, its batch norm and its relu)."""

    configs: Sequence[ParallelConfig]
    parts: PartTable
    grid: transfer.Grid
    index: dict | None = None  # position of each config by its split and devices


class Configs(Sequence):
    """A layer's configs as (configs, 4) degrees over (n, c, h, w) and each one's first device,
    each ParallelConfig made when first read: a search reads only the ones it chooses.
    `allreduce` marks those that synchronize by all-reduce (the others: "ps")."""

    def __init__(self, degrees: np.ndarray, first: np.ndarray, make, allreduce: np.ndarray | None = None):
        self.degrees, self.first, self.allreduce = degrees, first, allreduce
        self._make = make  # (degrees, first device, sync) -> ParallelConfig, shared by every layer

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices; IndexError past the end
        sync = "allreduce" if self.allreduce is not None and self.allreduce[i] else "ps"
        return self._make(tuple(self.degrees[i].tolist()), int(self.first[i]), sync)

    def with_allreduce(self, allreduce: np.ndarray) -> Configs:
        return Configs(self.degrees, self.first, self._make, allreduce)


@dataclass
class LayerSpace:
    """A layer's configs with their geometry and needs (one per input): everything the tables
    need of a layer besides its op, so layers with the same op and configs share it."""

    key: tuple  # (op, the configs given, or None for the search space)
    geometry: Geometry
    needs: list[Needs]
    cheaper: tuple | None = None  # the configs with the cheaper sync method, and its t_s

    @property
    def configs(self) -> Sequence[ParallelConfig]:
        return self.geometry.configs

    @property
    def parts(self) -> PartTable:
        return self.geometry.parts

    @property
    def grid(self) -> transfer.Grid:
        return self.geometry.grid


def _read_only(table: np.ndarray) -> np.ndarray:
    """A table the cost model hands out to several layers or searches: nobody may change it."""
    table.setflags(write=False)
    return table


@numba.njit(cache=True, nogil=True)
def _first_part_bytes(lo, hi, starts, volumes, per_channel, itemsize):
    """Per config, taskrt.memory.part_footprint of its first part: 3 x its parameters (weights,
    gradient, velocity) and 2 x its input tiles (`volumes`: of each input, per part) and output."""
    configs, rank = len(starts), lo.shape[1]
    out = np.empty(configs, dtype=np.int64)
    for a in range(configs):
        p = starts[a]
        volume = 1
        for e in range(rank):
            volume *= max(hi[p, e] - lo[p, e], 0)
        inputs = 0
        for v in volumes:
            inputs += v[p]
        params = per_channel * (hi[p, 1] - lo[p, 1]) if rank > 1 else per_channel
        out[a] = itemsize * (3 * params + 2 * (inputs + volume))
    return out


def channel_params(op) -> int:
    """Parameters a part reads per channel of its output: every op's parameter Rects span its
    channel range and nothing else varies (tests/test_search.py checks it for every op kind)."""
    rank = len(op.out_shape)
    return sum(r.volume for r in op.param_rects(Rect((0,) * rank, (1,) * rank)).values())


@numba.njit(cache=True, nogil=True)
def _sync_times(starts, device, c_lo, c_hi, per_channel, inv_bandwidth, latency, node, nodes, nic, itemsize, hop):
    """Per config: the parameter server's time and the all-reduce's, each with its dependent tasks
    (`hop` seconds each; see CostModel.sync_methods).  A config's parts with the same channel block
    form a shard, served by its first part's device."""
    configs, parts = len(starts), len(device)
    ps, allreduce = np.zeros(configs), np.zeros(configs)
    replicated = np.zeros(configs, dtype=np.bool_)
    shard_of = np.empty(parts, dtype=np.int64)
    first = np.empty(parts, dtype=np.int64)
    members = np.empty(parts, dtype=np.int64)
    chunk = np.empty(parts)
    ps_nic, allreduce_nic = np.zeros(nodes), np.zeros(nodes)
    for a in range(configs):
        r0, r1 = starts[a], starts[a + 1] if a + 1 < configs else parts
        shards = 0
        for r in range(r0, r1):
            s = 0
            while s < shards and not (c_lo[first[s]] == c_lo[r] and c_hi[first[s]] == c_hi[r]):
                s += 1
            if s == shards:
                first[s] = r
                shards += 1
            shard_of[r] = s
        ps_nic[:] = 0.0
        allreduce_nic[:] = 0.0
        for s in range(shards):
            server = device[first[s]]
            volume = per_channel * (c_hi[first[s]] - c_lo[first[s]])
            nbytes = volume * itemsize
            gradients_in, weights_out, replicas = 0.0, 0.0, 0
            for r in range(first[s], r1):
                if shard_of[r] != s:
                    continue
                d = device[r]
                gradients_in += nbytes * inv_bandwidth[d, server] + latency[d, server]
                weights_out += nbytes * inv_bandwidth[server, d] + latency[server, d]
                if node[d] != node[server]:  # gradients to the server, weights back
                    ps_nic[node[server]] += nbytes
                    ps_nic[node[d]] += nbytes
                members[replicas] = d
                replicas += 1
            ps[a] = max(ps[a], max(gradients_in, weights_out))
            if replicas == 1:
                continue
            replicated[a] = True
            # all-reduce: replica i owns chunk i of the flat shard (taskrt.plan.chunk_bounds)
            owners = min(replicas, volume)
            for i in range(replicas):
                chunk[i] = volume // owners + (1 if i < volume % owners else 0) if i < owners else 0.0
            for k in range(replicas):
                dk = members[k]
                has_k = 1.0 if chunk[k] > 0 else 0.0
                in_seconds, in_chunks, in_latency, in_has = 0.0, 0.0, 0.0, 0.0
                out_seconds, out_chunks, out_latency, out_has = 0.0, 0.0, 0.0, 0.0
                received = 0.0
                for i in range(replicas):
                    di = members[i]
                    has_i = 1.0 if chunk[i] > 0 else 0.0
                    in_seconds += inv_bandwidth[di, dk] * itemsize
                    in_chunks += inv_bandwidth[di, dk] * itemsize * chunk[i]
                    in_latency += latency[di, dk]
                    in_has += latency[di, dk] * has_i
                    out_seconds += inv_bandwidth[dk, di] * itemsize
                    out_chunks += inv_bandwidth[dk, di] * itemsize * chunk[i]
                    out_latency += latency[dk, di]
                    out_has += latency[dk, di] * has_i
                    if node[di] != node[dk]:  # its chunk of their gradients, their chunks of the weights
                        received += chunk[i] + chunk[k]
                incoming = chunk[k] * in_seconds + in_chunks + has_k * in_latency + in_has
                outgoing = chunk[k] * out_seconds + out_chunks + has_k * out_latency + out_has
                allreduce[a] = max(allreduce[a], max(incoming, outgoing))
                allreduce_nic[node[dk]] += received * itemsize
        ps[a] = max(ps[a], ps_nic.max() * nic)
        allreduce[a] = max(allreduce[a], allreduce_nic.max() * nic)
    with_ps, with_allreduce = np.empty(configs), np.empty(configs)
    for a in range(configs):  # tasks: (grad, update, wfetch) and (rslice, update, wfetch, wgather) when replicated
        with_ps[a] = ps[a] + (3 if replicated[a] else 1) * hop
        with_allreduce[a] = allreduce[a] + 4 * hop if replicated[a] else ps[a] + hop
    return with_ps, with_allreduce


# ---- part timing (runs on a device) ---------------------------------------------------------
def measure_parts(items, repeats, dtype):
    """Median seconds of the forward and of the backward kernel for each (op, output Rect, need_dx),
    on this worker's device: on a GPU worker the arrays live on the GPU and every timing waits for
    the device to finish (taskrt.device.synchronize).  The backward includes packing the parameter
    gradient into one flat array, as a backward task does (taskrt.tasks.Backward): for a
    fully-connected layer that copy is as large as its weights.  On a CPU each kernel starts with
    its data out of the core's own cache (`evict_core_cache`), as in a step, where other kernels
    run in between: run back to back on the same arrays, small kernels timed 8-9% faster than in
    a step (LeNet-5 one-device plan in one process, against 2-3% with the eviction)."""
    from ops import array_module
    from taskrt.device import synchronize, to_device
    from taskrt.params import pack

    def backward(op, dy, xs, y, params, rect, need_dx):
        _, dparams = op.backward(dy, xs, y, params, rect, need_dx)
        if dparams:
            pack(dparams, array_module(dy))

    rng = np.random.default_rng(0)
    out = []
    for op, rect, need_dx in items:
        xs = []
        for i, r in enumerate(op.input_rects(rect)):
            if r is None:
                xs.append(None)
            elif op.kind == "softmax_cross_entropy" and i == 1:
                xs.append(rng.integers(0, op.in_shapes[0][1], size=r.shape))
            else:
                xs.append(rng.standard_normal(r.shape).astype(dtype))
        params = {k: (rng.standard_normal(r.shape) * 0.01).astype(dtype) for k, r in op.param_rects(rect).items()}
        xs, params = [to_device(x) for x in xs], {k: to_device(v) for k, v in params.items()}
        y = op.forward(xs, params, rect)
        dy = array_module(y).ones_like(y)
        backward(op, dy, xs, y, params, rect, need_dx)  # warm-up
        on_cpu = array_module(y) is np
        fwd, bwd = [], []
        for _ in range(repeats):
            if on_cpu:
                evict_core_cache()
            synchronize()
            start = time.perf_counter()
            y = op.forward(xs, params, rect)
            synchronize()
            forward_s = time.perf_counter() - start
            if on_cpu:
                evict_core_cache()
            start = time.perf_counter()
            backward(op, dy, xs, y, params, rect, need_dx)
            synchronize()
            fwd.append(forward_s)
            bwd.append(time.perf_counter() - start)
        out.append([float(np.median(fwd)), float(np.median(bwd))])
    return out


_EVICTION: list = []  # the buffer evict_core_cache reads, made on first use


def evict_core_cache():
    """Read a buffer twice the size of a core's L2 cache (at least 4 MiB), so that what the next
    kernel touches is no longer in it."""
    if not _EVICTION:
        _EVICTION.append(np.ones(max(2 * _l2_bytes(), 4 << 20) // 8))
    _EVICTION[0].sum()


def _l2_bytes() -> int:
    """A core's L2 cache size as Linux reports it (0 where it does not)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(text[:-1]) << 10 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 0


def measure_synchronization(items, repeats, dtype):
    """Median seconds of an SGD update (or a gradient sum) over `elements` parameters from
    `grads` replicas, for each (phase, elements, grads), as the Update / ReduceGrads tasks run it."""
    from taskrt.device import synchronize, to_device
    from taskrt.tasks import ReduceGrads, Update

    rng = np.random.default_rng(0)
    hyper = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4}
    out = []
    for phase, elements, grads in items:
        state = to_device((rng.standard_normal(elements).astype(dtype), np.zeros(elements, dtype=dtype)))
        values = [to_device(rng.standard_normal(elements).astype(dtype)) for _ in range(grads)]
        if phase == "update":
            spec, args = Update(tuple((i + 1, None, None) for i in range(grads))), (state, *values, hyper)
        else:
            spec, args = ReduceGrads(tuple((i, None, None) for i in range(grads))), tuple(values)
        spec(*args)
        times = []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            spec(*args)
            synchronize()
            times.append(time.perf_counter() - start)
        out.append(float(np.median(times)))
    return out


def roofline_parts(op, shapes, peak, bandwidth, itemsize, per_channel=None,
                   device=None) -> tuple[np.ndarray, np.ndarray]:
    """Roofline estimates (forward, backward) for many parts of one op at once:
    max(FLOPs / peak, bytes / memory bandwidth) from the device kind's data sheet.

    `shapes`: the parts' output tile shapes, then each input's tile shapes (rows); `peak` and
    `bandwidth`: of each part's device kind, or of each device when `device` gives each part's;
    `per_channel`: `channel_params(op)`, if known.  FLOPs and parameter volumes of every op grow
    linearly with the output tile (parameters with its channel extent), so one unit tile gives
    the rates."""
    out = np.asarray(shapes[0], dtype=np.int64)
    unit = Rect((0,) * out.shape[1], (1,) * out.shape[1])
    inputs = tuple(np.asarray(s, dtype=np.int64) for s in shapes[1:]) or (np.zeros((len(out), 1), dtype=np.int64),)
    if device is None:  # a peak and bandwidth per part
        device = np.arange(len(out))
        peak, bandwidth = np.broadcast_to(peak, len(out)), np.broadcast_to(bandwidth, len(out))
    return _roofline(out, inputs, channel_params(op) if per_channel is None else per_channel, itemsize,
                     float(op.flops(unit)), float(op.backward_flops(unit)), np.asarray(peak, dtype=np.float64),
                     np.asarray(bandwidth, dtype=np.float64), np.asarray(device, dtype=np.int64))


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


@numba.njit(cache=True, nogil=True)
def _roofline(out, inputs, per_channel, itemsize, flops, backward_flops, peak, bandwidth, device):
    """Per part: the volume of its output tile and of its input tiles (elements), the parameters
    of its channels, and the larger of compute and memory time each way (roofline_parts)."""
    parts, rank = out.shape
    forward, backward = np.empty(parts), np.empty(parts)
    read = np.zeros(parts)
    for shape in inputs:
        for p in range(parts):
            v = 1
            for e in range(shape.shape[1]):
                v *= shape[p, e]
            read[p] += v
    for p in range(parts):
        v = 1
        for e in range(rank):
            v *= out[p, e]
        volume = float(v)
        params = per_channel * out[p, 1] if rank > 1 else per_channel
        moved = (read[p] + volume + params) * itemsize
        d = device[p]
        forward[p] = max(flops * volume / peak[d], moved / bandwidth[d])
        backward[p] = max(backward_flops * volume / peak[d], 2 * moved / bandwidth[d])
    return forward, backward
