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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ops.rect import Rect
from search import transfer
from search.regions import Needs, part_table
from search.space import search_space
from taskrt.config import ParallelConfig
from taskrt.files import write_atomic
from taskrt.machine import DEVICE_KINDS
from taskrt.params import resolve_dtype
from taskrt.plan import chunk_bounds

CACHE_FORMAT = "taskrt-costs/2"  # parts: [forward s, backward s]


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

    configs: dict[str, list[ParallelConfig]]
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
        self.calibration = self._calibrate()
        self.hop = self.calibration["per_hop_s"] if overhead is None else float(overhead)
        self.memory_bandwidth = self.calibration["memory_bandwidth"]
        self.kinds = sorted({d.kind for d in machine.devices})
        self.kind_index = {d.id: self.kinds.index(d.kind) for d in machine.devices}
        self._times: dict[tuple, tuple] = {}  # (device kind, op, need_dx, tile shapes) -> (forward s, backward s)
        self._volumes: dict[tuple, int] = {}
        self._sync_times: dict[tuple, float] = {}

    # ---- runtime overhead -------------------------------------------------------------------
    def _calibrate(self) -> dict:
        """The cluster's runtime costs (`Machine.calibrate`), cached like part timings."""
        if self.estimated:
            kind = self.machine.devices[0].kind
            return {"per_task_s": 0.0, "per_hop_s": 0.0, "memory_bandwidth": DEVICE_KINDS[kind]["memory_bandwidth"]}
        key = f"{self.machine.devices[0].kind}|{self.machine.num_devices} devices"
        cached = self.cache.data["overhead"].get(key)
        if cached is None or "fresh_copy_bandwidth" not in cached:
            cached = self.machine.calibrate()
            self.cache.data["overhead"][key] = cached
            self.cache.save()
        return cached

    # ---- tables -----------------------------------------------------------------------------
    def space(self, graph) -> dict[str, list[ParallelConfig]]:
        return search_space(graph, self.machine, self.powers_of_two, self.placement, self.itemsize)

    def tables(self, graph, configs=None) -> Tables:
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        choose_sync = configs is None  # the space: each config gets the cheaper sync method
        configs = dict(configs or self.space(graph))
        needed = graph.needs_backward()
        parts = {layer.name: part_table(layer.shape, configs[layer.name]) for layer in graph}
        needs = {(layer.name, j): Needs(layer.op, j, parts[layer.name], configs[layer.name])
                 for layer in graph for j in range(len(layer.inputs))}
        seconds = {"space and regions": lap()}
        compute = self.compute_costs(graph, parts, needs, needed)
        seconds["compute"] = lap()
        sync = {}
        for layer in graph:
            methods = self.sync_methods(layer, parts[layer.name])
            if choose_sync:
                ps, allreduce = methods["ps"], methods["allreduce"]
                sync[layer.name] = np.minimum(ps, allreduce)
                configs[layer.name] = [replace(c, sync="allreduce" if a < p else "ps")
                                       for c, p, a in zip(configs[layer.name], ps, allreduce)]
            else:
                sync[layer.name] = np.array([methods[c.sync][i] for i, c in enumerate(configs[layer.name])])
        seconds["sync"] = lap()
        grids = {name: transfer.Grid(table, graph[name].shape, self.links.node, self.machine.num_devices)
                 for name, table in parts.items()}
        edges = [(src, layer.name, j, self.transfer_costs(graph, src, layer.name, grids[src], grids[layer.name],
                                                          needs[(layer.name, j)], needed))
                 for layer in graph for j, src in enumerate(layer.inputs)]
        seconds["edges"] = lap()
        notes = ["t_c estimated by roofline (simulated machine)"] if self.estimated else []
        return Tables(configs, compute, sync, edges, self.estimated, notes, seconds)

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
    def compute_costs(self, graph, parts, needs, needed) -> dict[str, np.ndarray]:
        """Per layer, per config: the slowest part's forward (+ backward when the layer needs it),
        plus its tasks' overhead.

        Parts are timed by signature (device kind, op, tile shapes): equal parts share one timing,
        found in the cache, estimated (simulated machine) or measured on a device."""
        plans, missing = {}, {}
        for layer in graph:
            table = parts[layer.name]
            if layer.is_input:
                continue
            backward = layer.name in needed or layer.kind == "softmax_cross_entropy"
            need_dx = tuple(src in needed for src in layer.inputs)
            shapes = [table.shape] + [needs[(layer.name, j)].table.shape for j in range(len(layer.inputs))]
            # each direction's dependent tasks: the part's, and batch norm's statistics reduction before it
            hops = (2 if layer.name in needed else 1) * (1 + layer.op.statistics_hops)
            if self.estimated:  # a formula per part: no need to find the distinct ones
                fwd, bwd = roofline_parts(layer.op, shapes, self.kinds, self.kind_index, table.device, self.itemsize)
                plans[layer.name] = (None, fwd + bwd * backward, table.starts, hops)
                continue
            kinds = np.array([self.kind_index[d] for d in table.device])
            rows = np.concatenate([kinds[:, None], *shapes], axis=1)
            unique, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
            keys = []
            for row, index in zip(unique.tolist(), first.tolist()):
                rect = Rect(tuple(table.lo[index].tolist()), tuple(table.hi[index].tolist()))
                key = self._lookup(self.kinds[row[0]], layer.op, rect, need_dx, missing)
                keys.append(key)
            plans[layer.name] = (keys, (inverse.ravel(), backward), table.starts, hops)
        self._measure_missing(missing)
        out = {}
        for layer in graph:
            if layer.is_input:
                out[layer.name] = np.zeros(len(parts[layer.name].starts))
                continue
            keys, times, starts, hops = plans[layer.name]
            if keys is not None:
                inverse, backward = times
                times = np.array([sum(self._times[k][: 2 if backward else 1]) for k in keys])[inverse]
            out[layer.name] = np.maximum.reduceat(times, starts) + hops * self.hop
        return out

    def _lookup(self, kind, op, rect, need_dx, missing) -> tuple:
        """The timing key of a part; its (forward, backward) seconds go into `_times` from the
        cache, or the part is queued in `missing` to be measured."""
        shapes = tuple(None if r is None else r.shape for r in op.input_rects(rect))
        key = (kind, op, need_dx, rect.shape, shapes)
        if key not in self._times:
            sig = self.signature(op, rect, need_dx)
            cached = self.cache.get(kind, sig)
            if cached is not None:
                self._times[key] = tuple(cached)
            else:
                missing.setdefault(kind, {})[sig] = (key, (op, rect, need_dx))
        return key

    def _measure_missing(self, missing):
        for kind, items in missing.items():
            measured = self.measure(kind, {sig: item for sig, (_, item) in items.items()})
            self.cache.put_many(kind, measured)
            self._times.update({items[sig][0]: tuple(t) for sig, t in measured.items()})

    def part_time(self, op, rect, need_dx, device: int = 0) -> tuple[float, float]:
        """(forward, backward) seconds of one part on `device`'s kind: cached, estimated or measured."""
        kind = self.kinds[self.kind_index[device]]
        if self.estimated:
            shapes = [np.array([rect.shape])] + [np.array([r.shape if r else (0,) * len(s)])
                                                 for r, s in zip(op.input_rects(rect), op.in_shapes)]
            fwd, bwd = roofline_parts(op, shapes, [kind], {0: 0}, np.array([0]), self.itemsize)
            return float(fwd[0]), float(bwd[0])
        missing = {}
        key = self._lookup(kind, op, rect, tuple(need_dx), missing)
        self._measure_missing(missing)
        return self._times[key]

    def signature(self, op, rect, need_dx) -> str:
        """The cache key of a part: what determines its kernels' work, as text."""
        shapes = [None if r is None else list(r.shape) for r in op.input_rects(rect)]
        return json.dumps([op.kind, op.attrs(), shapes, list(rect.shape), list(need_dx), self.dtype], sort_keys=True)

    # ---- one task, for the simulator ---------------------------------------------------------
    def timer(self, plan):
        """A function giving the kernel seconds of each task of `plan` (the runtime's own cost per
        task is in `runtime()`)."""
        sync = {}  # task key -> (device kind, phase, elements, gradients): timed like parts
        for task in plan.tasks:
            if task.phase in ("update", "reduce"):
                kind = self.kinds[self.kind_index[task.device]]
                lo, hi, _ = plan.shards[task.layer][task.key[1]].chunks[task.key[2]]
                sync[task.key] = (kind, task.phase, hi - lo, len(task.spec.grads))
        self._time_synchronization(set(sync.values()))

        def task_time(task) -> float:
            spec = task.spec
            if task.phase == "fwd":
                return self.part_time(spec.op, spec.out, tuple(False for _ in spec.op.in_shapes), task.device)[0]
            if task.phase == "bwd":
                return self.part_time(spec.op, spec.out, spec.need_dx, task.device)[1]
            if task.phase == "loss":
                return sum(self.part_time(spec.op, spec.out, (True, False), task.device))
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

    def runtime(self, plan):
        """The runtime's costs for `plan`: none for a simulated machine; for a Dask cluster, what
        `Machine.calibrate` measured (scheduler round trip per dependent task, worker time per
        task, graph submission per task, one scatter call per device that receives data)."""
        from taskrt.simulate import Runtime

        if self.estimated:
            return Runtime()
        c = self.calibration
        receivers = {p.device for parts in plan.data.values() for p in parts}
        data = sum(plan.data_nbytes.values())
        shared_cores = all(d.kind.startswith("cpu:") for d in self.machine.devices) and len(
            {d.node for d in self.machine.devices}) == 1
        return Runtime(dispatch_s=max(c["per_hop_s"] - c["per_task_s"], 0.0), task_s=c["per_task_s"],
                       start_s=len(receivers) * c["scatter_s"] + data / c["client_bandwidth"],
                       per_task_submit_s=c["submit_per_task_s"], cores=c["cores"] if shared_cores else 0,
                       cpu_per_task_s=c["cpu_per_task_s"], cpu_per_byte_s=c["cpu_per_byte_s"])

    def measure(self, kind, items: dict, timing=None, what="part kernels") -> dict:
        """Time each item on a device of this kind (one at a time, as in training) with `timing`
        (default `measure_parts`); returns {signature: what `timing` gave for it}."""
        from tqdm import tqdm

        timing = timing or measure_parts
        device = next(d.id for d in self.machine.devices if d.kind == kind)
        client = self.machine.client
        sigs = list(items)
        out = {}
        with tqdm(total=len(sigs), desc=f"measuring {len(sigs)} {what}", disable=not self.progress or None,
                  leave=False) as bar:
            for start in range(0, len(sigs), 8):
                chunk = sigs[start : start + 8]
                future = client.submit(timing, [items[s] for s in chunk], self.repeats, self.dtype,
                                       pure=False, resources={self.machine.tag(device): 1})
                out.update(zip(chunk, future.result()))
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
        config = table.config
        # parts reading the same parameters (same channel block of the same config) form a shard
        shard_of = np.unique(np.stack([config, table.lo[:, 1], table.hi[:, 1]], axis=1), axis=0,
                             return_inverse=True)[1].ravel()
        first = np.full(shard_of.max() + 1, -1)
        for row in range(len(shard_of) - 1, -1, -1):
            first[shard_of[row]] = row
        server = table.device[first[shard_of]]
        extents, which = np.unique(np.stack([table.lo[:, 1], table.hi[:, 1]], axis=1), axis=0, return_inverse=True)
        volume = np.array([self._shard_volume(layer, lo, hi) for lo, hi in extents.tolist()])[which.ravel()]
        device = table.device
        nbytes = volume * self.itemsize
        gradients_in = nbytes * self.inv_bandwidth[device, server] + self.latency[device, server]
        weights_out = nbytes * self.inv_bandwidth[server, device] + self.latency[server, device]
        per_shard = np.maximum(np.bincount(shard_of, weights=gradients_in), np.bincount(shard_of, weights=weights_out))
        replicas = np.bincount(shard_of)
        shard_config = config[first]
        replicated = np.zeros(configs, dtype=bool)
        np.logical_or.at(replicated, shard_config, replicas > 1)
        ps = np.zeros(configs)
        np.maximum.at(ps, shard_config, per_shard)
        node = self.links.node
        nodes = node.max() + 1
        # bytes into each node's interface per config (what leaves a node equals what enters another:
        # every sync message is answered by one of the same size, so in and out agree per node)
        ps_nic, allreduce_nic = np.zeros((configs, nodes)), np.zeros((configs, nodes))
        across = node[device] != node[server]
        np.add.at(ps_nic, (config[across], node[server][across]), nbytes[across])  # gradients to the server
        np.add.at(ps_nic, (config[across], node[device][across]), nbytes[across])  # weights to the replica
        allreduce = np.zeros(configs)
        for shard in np.flatnonzero(replicas > 1):
            rows = np.flatnonzero(shard_of == shard)  # in part order: the order of the chunks
            devices, size = device[rows], int(volume[rows[0]])
            bounds = chunk_bounds(size, len(rows))
            chunk = np.zeros(len(rows))
            chunk[: len(bounds)] = [hi - lo for lo, hi in bounds]
            seconds = self.inv_bandwidth[np.ix_(devices, devices)] * self.itemsize  # per element, row -> column
            lat = self.latency[np.ix_(devices, devices)]
            has = chunk > 0
            incoming = (chunk * seconds.sum(axis=0) + seconds.T @ chunk  # gradients of its chunk, the others' chunks
                        + has * lat.sum(axis=0) + lat.T @ has)
            outgoing = chunk * seconds.sum(axis=1) + seconds @ chunk + has * lat.sum(axis=1) + lat @ has
            busy = np.maximum(incoming, outgoing)
            allreduce[shard_config[shard]] = max(allreduce[shard_config[shard]], busy.max())
            other = node[devices][:, None] != node[devices][None, :]  # sender (row) and receiver on different nodes
            received = (other * (chunk[:, None] + chunk[None, :])).sum(axis=0) * self.itemsize  # its chunk, theirs
            np.add.at(allreduce_nic[shard_config[shard]], node[devices], received)
        nic = self.links.nic_inv_bandwidth
        ps = np.maximum(ps, ps_nic.max(axis=1) * nic)
        allreduce = np.maximum(allreduce, allreduce_nic.max(axis=1) * nic)
        return {"ps": ps + np.where(replicated, 3, 1) * self.hop,
                "allreduce": np.where(replicated, allreduce + 4 * self.hop, ps + self.hop)}

    def _shard_volume(self, layer, c0, c1) -> int:
        key = (layer.name, int(c0), int(c1))
        if key not in self._volumes:
            rect = Rect.full(layer.shape).replace(1, int(c0), int(c1))
            self._volumes[key] = sum(r.volume for r in layer.op.param_rects(rect).values())
        return self._volumes[key]

    # ---- t_x --------------------------------------------------------------------------------
    def transfer_costs(self, graph, src, dst, producer: transfer.Grid, consumer: transfer.Grid, needs: Needs,
                       needed) -> np.ndarray:
        """(configs of src) x (configs of dst): see search.transfer."""
        itemsize = 8 if graph[src].is_input and graph[src].op.dtype == "int64" else self.itemsize
        backward = src in needed
        fast = transfer.separable(producer, consumer, needs.table, needs, self.links, itemsize, backward)
        if fast is not None:
            return fast
        return transfer.general(producer.table, needs.table, self.links, itemsize, backward)


# ---- part timing (runs on a device) ---------------------------------------------------------
def measure_parts(items, repeats, dtype):
    """Median seconds of the forward and of the backward kernel for each (op, output Rect, need_dx),
    on this worker's device: on a GPU worker the arrays live on the GPU and every timing waits for
    the device to finish (taskrt.device.synchronize)."""
    from ops import array_module
    from taskrt.device import synchronize, to_device

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
        op.backward(dy, xs, y, params, rect, need_dx)  # warm-up
        fwd, bwd = [], []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            y = op.forward(xs, params, rect)
            synchronize()
            middle = time.perf_counter()
            op.backward(dy, xs, y, params, rect, need_dx)
            synchronize()
            fwd.append(middle - start)
            bwd.append(time.perf_counter() - middle)
        out.append([float(np.median(fwd)), float(np.median(bwd))])
    return out


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


def roofline_parts(op, shapes, kinds, kind_index, device, itemsize) -> tuple[np.ndarray, np.ndarray]:
    """Roofline estimates (forward, backward) for many parts of one op at once:
    max(FLOPs / peak, bytes / memory bandwidth) from the device kind's data sheet.

    `shapes`: the parts' output tile shapes, then each input's tile shapes (rows).  FLOPs and
    parameter volumes of every op grow linearly with the output tile (parameters with its
    channel extent), so one unit tile gives the rates."""
    out = shapes[0]
    volume = np.prod(out, axis=1).astype(np.float64)
    unit = Rect((0,) * out.shape[1], (1,) * out.shape[1])
    inputs = sum(np.prod(s, axis=1).astype(np.float64) for s in shapes[1:])
    params = sum(r.volume for r in op.param_rects(unit).values()) * (out[:, 1] if out.shape[1] > 1 else 1)
    moved = (inputs + volume + params) * itemsize
    spec = [DEVICE_KINDS[k] for k in kinds]
    peak = np.array([spec[kind_index[d]]["flops"] for d in device])
    bandwidth = np.array([spec[kind_index[d]]["memory_bandwidth"] for d in device])
    forward = np.maximum(op.flops(unit) * volume / peak, moved / bandwidth)
    backward = np.maximum(op.backward_flops(unit) * volume / peak, 2 * moved / bandwidth)
    return forward, backward
