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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ops.rect import Rect
from search import transfer
from search.regions import Needs, part_table
from search.space import search_space
from taskrt.config import ParallelConfig
from taskrt.files import write_atomic
from taskrt.machine import DEVICE_KINDS, resource_tag
from taskrt.params import resolve_dtype

CACHE_FORMAT = "taskrt-costs/1"


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
        self.measurements = 0  # part timings run by this model (not found in the cache)
        bandwidth = np.array(machine.bandwidth, dtype=float)
        self.inv_bandwidth = np.where(np.isinf(bandwidth), 0.0, 1.0 / bandwidth)
        self.latency = np.array(machine.latency, dtype=float)
        np.fill_diagonal(self.latency, 0.0)
        nic = getattr(machine, "nic_bandwidth", None)
        self.links = transfer.Links(self.inv_bandwidth, self.latency, np.array([d.node for d in machine.devices]),
                                    1.0 / nic if nic else 0.0)
        self.hop = self._overhead() if overhead is None else float(overhead)
        self.kinds = sorted({d.kind for d in machine.devices})
        self.kind_index = {d.id: self.kinds.index(d.kind) for d in machine.devices}
        self._times: dict[tuple, float] = {}  # (device kind, op, need_dx, backward, tile shapes) -> seconds
        self._volumes: dict[tuple, int] = {}

    # ---- runtime overhead -------------------------------------------------------------------
    def _overhead(self) -> float:
        if self.estimated:
            return 0.0
        key = f"{self.machine.devices[0].kind}|{self.machine.num_devices} devices"
        cached = self.cache.data["overhead"].get(key)
        if cached is None:
            cached = self.machine.task_overhead()
            self.cache.data["overhead"][key] = cached
            self.cache.save()
        return cached["per_hop_s"]

    # ---- tables -----------------------------------------------------------------------------
    def space(self, graph) -> dict[str, list[ParallelConfig]]:
        return search_space(graph, self.machine, self.powers_of_two, self.placement, self.itemsize)

    def tables(self, graph, configs=None) -> Tables:
        configs = configs or self.space(graph)
        needed = graph.needs_backward()
        parts = {layer.name: part_table(layer.shape, configs[layer.name]) for layer in graph}
        needs = {(layer.name, j): Needs(layer.op, j, parts[layer.name], configs[layer.name])
                 for layer in graph for j in range(len(layer.inputs))}
        compute = self.compute_costs(graph, parts, needs, needed)
        sync = {layer.name: self.sync_costs(layer, parts[layer.name]) for layer in graph}
        grids = {name: transfer.Grid(table, graph[name].shape, self.links.node, self.machine.num_devices)
                 for name, table in parts.items()}
        edges = [(src, layer.name, j, self.transfer_costs(graph, src, layer.name, grids[src], grids[layer.name],
                                                          needs[(layer.name, j)], needed))
                 for layer in graph for j, src in enumerate(layer.inputs)]
        notes = ["t_c estimated by roofline (simulated machine)"] if self.estimated else []
        return Tables(configs, compute, sync, edges, self.estimated, notes)

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
        """Per layer, per config: the slowest part's forward + backward, plus its tasks' overhead.

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
            hops = 2 if layer.name in needed else 1
            if self.estimated:  # a formula per part: no need to find the distinct ones
                times = roofline_parts(layer.op, shapes, backward, self.kinds, self.kind_index, table.device,
                                       self.itemsize)
                plans[layer.name] = (None, times, table.starts, hops)
                continue
            kinds = np.array([self.kind_index[d] for d in table.device])
            rows = np.concatenate([kinds[:, None], *shapes], axis=1)
            unique, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
            keys = []
            for row, index in zip(unique.tolist(), first.tolist()):
                key = (self.kinds[row[0]], layer.op, need_dx, backward, tuple(row[1:]))
                keys.append(key)
                if key in self._times:
                    continue
                rect = Rect(tuple(table.lo[index].tolist()), tuple(table.hi[index].tolist()))
                sig = self.signature(layer, rect, need_dx, backward)
                cached = self.cache.get(key[0], sig)
                if cached is not None:
                    self._times[key] = cached
                else:
                    missing.setdefault(key[0], {})[sig] = (key, (layer.op, rect, need_dx, backward))
            plans[layer.name] = (keys, inverse.ravel(), table.starts, hops)
        for kind, items in missing.items():
            measured = self.measure(kind, {sig: item for sig, (_, item) in items.items()})
            self.cache.put_many(kind, measured)
            self._times.update({items[sig][0]: t for sig, t in measured.items()})
        out = {}
        for layer in graph:
            if layer.is_input:
                out[layer.name] = np.zeros(len(parts[layer.name].starts))
                continue
            keys, inverse, starts, hops = plans[layer.name]
            times = inverse if keys is None else np.array([self._times[k] for k in keys])[inverse]
            out[layer.name] = np.maximum.reduceat(times, starts) + hops * self.hop
        return out

    def signature(self, layer, rect, need_dx, backward) -> str:
        """The cache key of a part: what determines its kernels' work, as text."""
        shapes = [None if r is None else list(r.shape) for r in layer.op.input_rects(rect)]
        return json.dumps([layer.kind, layer.op.attrs(), shapes, list(rect.shape), list(need_dx), backward,
                           self.dtype], sort_keys=True)

    def measure(self, kind, items: dict) -> dict:
        """Run each part's kernels on a device of this kind (one at a time, as in training)."""
        from tqdm import tqdm

        device = next(d.id for d in self.machine.devices if d.kind == kind)
        client = self.machine.client
        sigs = list(items)
        out = {}
        with tqdm(total=len(sigs), desc=f"measuring {len(sigs)} part kernels", disable=not self.progress or None,
                  leave=False) as bar:
            for start in range(0, len(sigs), 8):
                chunk = sigs[start : start + 8]
                future = client.submit(measure_parts, [items[s] for s in chunk], self.repeats, self.dtype,
                                       pure=False, resources={resource_tag(device): 1})
                out.update(zip(chunk, future.result()))
                bar.update(len(chunk))
        self.measurements += len(sigs)
        return out

    # ---- t_s --------------------------------------------------------------------------------
    def sync_costs(self, layer, table) -> np.ndarray:
        """Parameter server per shard: replicas send gradients in and fetch weights back, one
        after another at the server; shards synchronize in parallel."""
        if not layer.param_shapes:
            return np.zeros(len(table.starts))
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
        per_replica = (nbytes * (self.inv_bandwidth[device, server] + self.inv_bandwidth[server, device])
                       + self.latency[device, server] + self.latency[server, device])
        per_shard = np.bincount(shard_of, weights=per_replica)
        replicas = np.bincount(shard_of)
        shard_config = config[first]
        worst = np.zeros(len(table.starts))
        np.maximum.at(worst, shard_config, per_shard)
        replicated = np.zeros(len(table.starts), dtype=bool)
        np.logical_or.at(replicated, shard_config, replicas > 1)
        return worst + np.where(replicated, 3, 1) * self.hop  # (grad, update, wfetch) or update

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
    """Median seconds of forward (+ backward) for each (op, output Rect, need_dx, backward)."""
    import time

    rng = np.random.default_rng(0)
    out = []
    for op, rect, need_dx, backward in items:
        xs = []
        for i, r in enumerate(op.input_rects(rect)):
            if r is None:
                xs.append(None)
            elif op.kind == "softmax_cross_entropy" and i == 1:
                xs.append(rng.integers(0, op.in_shapes[0][1], size=r.shape))
            else:
                xs.append(rng.standard_normal(r.shape).astype(dtype))
        params = {k: (rng.standard_normal(r.shape) * 0.01).astype(dtype) for k, r in op.param_rects(rect).items()}

        _run_part(op, xs, params, rect, need_dx, backward)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _run_part(op, xs, params, rect, need_dx, backward)
            times.append(time.perf_counter() - start)
        out.append(float(np.median(times)))
    return out


def _run_part(op, xs, params, rect, need_dx, backward):
    y = op.forward(xs, params, rect)
    if backward:
        op.backward(np.ones_like(y), xs, y, params, rect, need_dx)


def roofline(op, rect, backward, kind, itemsize) -> float:
    """max(FLOPs / peak, bytes / memory bandwidth) for forward and backward: a data-sheet estimate."""
    inputs = [r.shape if r is not None else (0,) for r in op.input_rects(rect)]
    shapes = [np.array([rect.shape])] + [np.array([s]) for s in inputs]
    return float(roofline_parts(op, shapes, backward, [kind], {0: 0}, np.array([0]), itemsize)[0])


def roofline_parts(op, shapes, backward, kinds, kind_index, device, itemsize) -> np.ndarray:
    """The roofline estimate for many parts of one op at once.

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
    time = np.maximum(op.flops(unit) * volume / peak, moved / bandwidth)
    if backward:
        time += np.maximum(op.backward_flops(unit) * volume / peak, 2 * moved / bandwidth)
    return time
