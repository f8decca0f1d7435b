"""Hypergraph models of a network (seed 003): filters as vertices, feature maps as nets.

    model = coarse_grain(graph)                    # a vertex per filter, a net per feature map
    parts = partition(model, k=8)                  # Mt-KaHyPar, connectivity - 1, epsilon 0.1
    parts.metrics()                                # work balance and communication volume
    strategy = to_strategy(graph, parts, machine)  # uneven channel splits the runtime runs

The coarse-grain model has a vertex per filter of every conv2d and linear layer (and per channel
of an input), weighted by that filter's forward and backward FLOPs, including the channel-local
layers after it (pooling, ReLU, flatten), which follow their producer's split.  A net per
feature map has its producer and every filter that reads it as pins, and costs the map's bytes
at the graph's batch size.  Filters of a layer are interchangeable, so a coarse-grain partition
is, for the runtime, how many filters of each layer each device holds: `counts[layer][part]`.
The connectivity-1 volume then has a closed form per layer (`CoarseModel.volume`), which the
tests check against the explicit hypergraph.

The fine-grain model (Sec. 3.3) has a vertex per filter channel and a reduction vertex per
filter; reduction nets join a filter's channels to its reduction vertex.  Splitting a reduction
over input channels is not something the runtime's configs express, so fine-grain partitions
are analysed, not run.

Full-size models are large (VGG-16's coarse-grain model has 24.6 million pins, nearly all in the
dense fully-connected layers), so the partitioner sees `atoms`: groups of consecutive filters
of one layer, which it keeps together.  By default they are sized by work (`work_atoms`): no atom
does more than a tenth of a part's average work, so atoms never stand in the way of the balance,
and every layer has at least 16, so cuts can fall inside a layer.  Metrics are always those of the
per-filter model under the partition the atoms induce.

`optimal` solves the coarse-grain problem exactly as a mixed-integer program (HiGHS, through
scipy) for small k: the yardstick for what a partitioner could have found under the same weights.
"""

from __future__ import annotations

import math
import time

import numpy as np

from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.search.hypergraph_models import (
    CHANNEL_LOCAL_KINDS,
    FILTER_KINDS,
    CoarseModel,
    FineModel,
    Hypergraph,
    HypergraphError,
    MapNets,
    Metrics,
    Partition,
    VertexLayer,
    coarse_grain,
    fine_grain,
    from_patoh,
    to_patoh,
    units,
)

__all__ = ["CHANNEL_LOCAL_KINDS", "FILTER_KINDS", "CoarseModel", "FineModel", "Hypergraph", "HypergraphError",
           "MapNets", "Metrics", "Partition", "VertexLayer", "coarse_grain", "fine_grain", "from_patoh", "to_patoh",
           "partition", "optimal", "layer_wise", "horizontal", "incremental", "to_strategy", "forward_bytes"]


# ---- Mt-KaHyPar ---------------------------------------------------------------------------------
PRESETS = ("default", "quality", "highest_quality", "large_k", "deterministic", "deterministic_quality")
_MTKAHYPAR: dict = {}


def _mtkahypar(threads: int):
    try:
        import mtkahypar
    except ImportError:
        raise HypergraphError("partitioning needs Mt-KaHyPar: pip install mtkahypar (or pip install "
                              "'taskrt[hypergraph]'); the naive partitions (layer_wise, horizontal, "
                              "incremental) work without it") from None
    if threads not in _MTKAHYPAR:  # initializing starts its thread pool: once per process
        _MTKAHYPAR.clear()
        _MTKAHYPAR[threads] = mtkahypar.initialize(threads, False)
    return mtkahypar, _MTKAHYPAR[threads]


def partition(model, k: int, epsilon: float = 0.1, seed: int = 0, preset: str = "auto", atoms="auto",
              vcycles: int = 0, threads: int | None = None) -> Partition:
    """Partition `model` (a CoarseModel or FineModel) into `k` parts with Mt-KaHyPar, minimizing
    the connectivity-1 communication volume with every part's work at most (1 + epsilon) times
    the average.

    preset: one of PRESETS, or "auto": for the coarse-grain model "default" up to k = 64, "large_k"
    above (on VGG-16 at k = 128 the default's initial partitioning took 2.8 s against large_k's
    0.5 s, for equal volumes; at k = 64 the default's volume is 8% lower); for the fine-grain model
    "quality" (on VGG-16, 3-13% less volume than "default" at k = 8..128 in about the same time).
    vcycles: extra V-cycles of refinement.
    atoms (coarse-grain): "auto" (`work_atoms`, sized by the allowed imbalance), None (a vertex per
    filter), an int (at most that many per layer) or one count per layer.  `seed` makes it
    deterministic for a given thread count.  `seconds` counts building the partitioner's input
    and, on the first call in a process, starting Mt-KaHyPar's thread pool (`info["startup_s"]`)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise HypergraphError(f"k={k!r}: the number of parts must be a positive int")
    if not 0 <= epsilon:
        raise HypergraphError(f"epsilon={epsilon!r}: the allowed imbalance must be >= 0 (e.g. 0.1)")
    if preset != "auto" and preset not in PRESETS:
        raise HypergraphError(f"preset={preset!r} is not 'auto' or one of {', '.join(PRESETS)}")
    if isinstance(vcycles, bool) or not isinstance(vcycles, int) or vcycles < 0:
        raise HypergraphError(f"vcycles={vcycles!r}: give a number of extra V-cycles >= 0")
    import os

    t0 = time.perf_counter()
    coarse = isinstance(model, CoarseModel)
    if preset == "auto":
        preset = "quality" if not coarse else "default" if k <= 64 else "large_k"
    startup = 0.0

    def run(h: Hypergraph) -> np.ndarray:
        nonlocal startup
        if k == 1:
            return np.zeros(h.num_vertices, dtype=np.int64)
        t1 = time.perf_counter()
        mtk, init = _mtkahypar(threads or min(os.cpu_count() or 1, 8))
        startup += time.perf_counter() - t1
        mtk.set_seed(seed)
        context = init.context_from_preset(getattr(mtk.PresetType, preset.upper()))
        context.set_partitioning_parameters(k, epsilon, mtk.Objective.KM1)
        context.logging = False
        context.num_vcycles = vcycles
        hypergraph = init.create_hypergraph(context, h.num_vertices, h.num_nets, h.nets(), h.weights.tolist(),
                                            h.costs.tolist())
        return np.asarray(hypergraph.partition(context).get_partition(), dtype=np.int64)

    info = {"preset": preset, "vcycles": vcycles, "epsilon": epsilon, "seed": seed}
    if not coarse:
        h = _scaled(model.hypergraph)
        parts = run(h)
        info.update(vertices=h.num_vertices, nets=h.num_nets, pins=len(h.pins), startup_s=startup)
        return Partition(model, k, "hypergraph", vertex_parts=parts, seconds=time.perf_counter() - t0, info=info)
    if isinstance(atoms, str) and atoms != "auto":
        raise HypergraphError(f"atoms={atoms!r}: give 'auto', None, an int or one count per layer")
    # "auto": atoms of at most 2 epsilon of a part's average work, which balanced every VGG-16 partition
    # here (N = 2..128); where the result is out of balance all the same, atoms half as large, down to filters
    per_part = 1 / (2 * epsilon) if epsilon > 0 else math.inf
    cap = (1 + epsilon) * model.total_work / k * (1 + 1e-3)  # the partitioner sees weights rounded to units
    while True:
        chosen = model.work_atoms(k, per_part) if isinstance(atoms, str) else atoms
        # weights and costs as int32-safe units: Mt-KaHyPar sums them in 32 bits
        h = model.hypergraph(chosen, unit_work=max(1.0, model.total_work / 2 ** 28), unit_bytes=_byte_unit(model))
        counts = model.counts_of(run(h), k, chosen)
        per_filter = h.num_vertices == int(model.sizes.sum())
        if not isinstance(atoms, str) or per_filter or model.part_work(counts).max() <= cap:
            break
        per_part *= 2
    info.update(vertices=h.num_vertices, nets=h.num_nets, pins=len(h.pins), startup_s=startup,
                atoms=chosen if chosen is None or isinstance(chosen, int) else [int(a) for a in chosen])
    return Partition(model, k, "hypergraph", counts=counts, seconds=time.perf_counter() - t0, info=info)


def optimal(model: CoarseModel, k: int, epsilon: float = 0.1, time_limit: float = 60.0) -> Partition:
    """The coarse-grain partition of least volume with every part's work within (1 + epsilon) of
    the average, as a mixed-integer program solved by HiGHS (scipy.optimize.milp).  Exact for small
    k; when `time_limit` (seconds) stops it first, the best partition found is returned and
    `info["bound"]` (bytes) is the solver's proof that none moves less.

    Filters of a layer are interchangeable, so the unknowns are n[i, q], layer i's filters on part
    q, with x[i, q] = [n[i, q] > 0].  For the nets of producer p read by layers R: z[q] = part q
    holds a reader; the volume is cost * sum_q n[p, q] * (sum_q' z[q'] - z[q]), linear once
    y[q] = n[p, q] * z[q] is bounded by y <= n[p, q] and y <= size_p * z[q] (the objective pushes
    y up to the product)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    if not isinstance(model, CoarseModel):
        raise HypergraphError("optimal() solves the coarse-grain model; the fine-grain one is far too large")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise HypergraphError(f"k={k!r}: the number of parts must be a positive int")
    t0 = time.perf_counter()
    sizes, work, nets = model.sizes, model.work, model.nets
    L, J = len(model.layers), len(nets)
    n = np.arange(L * k).reshape(L, k)  # variable numbers
    x = n + L * k
    z = 2 * L * k + np.arange(J * k).reshape(J, k)
    y = z + J * k
    nvars = 2 * L * k + 2 * J * k
    cost = np.zeros(nvars)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def constraint(terms, low, high):
        for var, val in terms:
            rows.append(len(lo))
            cols.append(int(var))
            vals.append(float(val))
        lo.append(low)
        hi.append(high)

    for j, net in enumerate(nets):
        cost[z[j]] += net.cost * sizes[net.producer]
        cost[y[j]] -= net.cost
        for q in range(k):
            constraint([(y[j, q], 1), (n[net.producer, q], -1)], -np.inf, 0)
            constraint([(y[j, q], 1), (z[j, q], -sizes[net.producer])], -np.inf, 0)
            for r in net.readers:
                constraint([(z[j, q], 1), (x[r, q], -1)], 0, np.inf)
    for i in range(L):
        constraint([(n[i, q], 1) for q in range(k)], sizes[i], sizes[i])
        for q in range(k):
            constraint([(n[i, q], 1), (x[i, q], -sizes[i])], -np.inf, 0)
    cap = (1 + epsilon) * model.total_work / k
    for q in range(k):
        constraint([(n[i, q], work[i]) for i in range(L)], 0, cap)
    for q in range(k - 1):  # parts are interchangeable: order them by work
        constraint([(n[i, q], work[i]) for i in range(L)] + [(n[i, q + 1], -work[i]) for i in range(L)], 0, np.inf)
    upper = np.concatenate([np.repeat(sizes, k), np.ones(L * k + J * k),
                            np.repeat([sizes[net.producer] for net in nets], k)])
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvars)).tocsr()
    scale = max(1.0, float(np.abs(cost).max()))  # bytes in the objective: keep HiGHS's numbers near 1
    result = milp(cost / scale, constraints=LinearConstraint(matrix, lo, hi), integrality=np.ones(nvars),
                  bounds=Bounds(0, upper), options={"time_limit": time_limit})
    if result.x is None:
        raise HypergraphError(f"no {k}-way partition of {model.graph!r} within epsilon={epsilon} was found in "
                              f"{time_limit} s ({result.message})")
    counts = np.rint(result.x[:L * k]).reshape(L, k).astype(np.int64)
    bound = getattr(result, "mip_dual_bound", None)
    info = {"epsilon": epsilon, "optimal": result.status == 0, "time_limit": time_limit,
            "bound": float(bound) * scale if bound is not None else None, "message": result.message}
    return Partition(model, k, "optimal", counts=counts, seconds=time.perf_counter() - t0, info=info)


def _byte_unit(model: CoarseModel) -> int:
    total = sum(net.cost * model.layers[net.producer].size for net in model.nets)
    return max(1, int(total // 2 ** 24))


def _scaled(h: Hypergraph) -> Hypergraph:
    w_unit = max(1.0, float(h.weights.sum()) / 2 ** 24)
    c_unit = max(1.0, float(h.costs.sum()) / 2 ** 24)
    return Hypergraph(units(h.weights, w_unit), units(h.costs, c_unit), h.start, h.pins, h.gathers)


# ---- the thesis's naive partitions -------------------------------------------------------------
def layer_wise(model: CoarseModel, k: int) -> Partition:
    """Whole layers per part, split points set recursively (Sec. 5.1.1): split the layer sequence
    where the two sides' work per part is most even, then each side again.  Inputs go with the
    first layer.  At most one part per filter layer."""
    t0 = time.perf_counter()
    filters = [i for i, v in enumerate(model.layers) if v.work > 0]
    if k > len(filters):
        raise HypergraphError(f"layer-wise partitioning into k={k} parts needs at least {k} layers with work; "
                              f"{model.graph!r} has {len(filters)}")
    layer_work = model.sizes * model.work
    part_of = np.zeros(len(model.layers), dtype=np.int64)

    def split(seq, first_part, parts):
        if parts == 1:
            part_of[seq] = first_part
            return
        left_parts = parts // 2
        right_parts = parts - left_parts
        w = layer_work[seq]
        best = min(range(left_parts, len(seq) - right_parts + 1),
                   key=lambda cut: max(w[:cut].sum() / left_parts, w[cut:].sum() / right_parts))
        split(seq[:best], first_part, left_parts)
        split(seq[best:], first_part + left_parts, right_parts)

    split(np.array(filters), 0, k)
    for i, v in enumerate(model.layers):
        if v.work == 0:  # inputs: with the part of their first reader
            part_of[i] = part_of[min(r for net in model.nets if net.producer == i for r in net.readers)]
    counts = np.zeros((len(model.layers), k), dtype=np.int64)
    counts[np.arange(len(model.layers)), part_of] = model.sizes
    return Partition(model, k, "layer-wise", counts=counts, seconds=time.perf_counter() - t0)


def horizontal(model: CoarseModel, k: int) -> Partition:
    """Every layer's filters split evenly over the k parts (Sec. 5.1.2); a layer with fewer filters
    than parts continues where the previous one stopped, so work stays balanced."""
    t0 = time.perf_counter()
    counts = np.zeros((len(model.layers), k), dtype=np.int64)
    offset = 0
    for i, v in enumerate(model.layers):
        q, r = divmod(v.size, k)
        counts[i] = q
        counts[i, (offset + np.arange(r)) % k] += 1
        offset = (offset + r) % k
    return Partition(model, k, "horizontal", counts=counts, seconds=time.perf_counter() - t0)


def incremental(model, k: int) -> Partition:
    """Filters (coarse-grain) or filter channels (fine-grain) in network order go to the current
    part until its work exceeds the average, then to the next (Sec. 5.1.3 and 5.1.4)."""
    t0 = time.perf_counter()
    if isinstance(model, CoarseModel):
        average = model.total_work / k
        counts = np.zeros((len(model.layers), k), dtype=np.int64)
        part, load = 0, 0.0
        for i, v in enumerate(model.layers):
            left = v.size
            while left:
                if v.work == 0 or part == k - 1:
                    take = left
                else:  # filters until the part's work exceeds the average (the one that crosses included)
                    take = min(left, max(1, int(np.floor((average - load) / v.work)) + 1))
                counts[i, part] += take
                load += take * v.work
                left -= take
                if load > average and part < k - 1:
                    part, load = part + 1, 0.0
        return Partition(model, k, "filter-wise incremental", counts=counts, seconds=time.perf_counter() - t0)
    h = model.hypergraph
    average = float(h.weights.sum()) / k
    parts = np.zeros(h.num_vertices, dtype=np.int64)
    part, load = 0, 0.0
    for v in range(h.num_vertices):  # vertex numbers follow network order
        parts[v] = part
        load += float(h.weights[v])
        if load > average and part < k - 1:
            part, load = part + 1, 0.0
    return Partition(model, k, "channel-wise incremental", vertex_parts=parts, seconds=time.perf_counter() - t0)


# ---- onto the runtime --------------------------------------------------------------------------
def to_strategy(graph, part: Partition, machine=None, name: str = "") -> Strategy:
    """The runtime's strategy for a coarse-grain partition: part p is device p; each layer's
    channels are split unevenly over the devices holding its filters (in device order), and its
    channel-local followers take the same split.  The loss runs on the device holding most of the
    logits."""
    if not part.runnable:
        raise HypergraphError(f"a {part.method} partition of the fine-grain model splits reductions over input "
                              "channels, which the runtime's configs do not express; run a coarse-grain partition")
    model: CoarseModel = part.model
    if machine is not None and part.k > machine.num_devices:
        raise HypergraphError(f"a {part.k}-way partition needs {part.k} devices; the machine has "
                              f"{machine.num_devices}")
    configs = {}
    for i, v in enumerate(model.layers):
        row = part.counts[i]
        devices = tuple(int(p) for p in np.flatnonzero(row))
        sizes = tuple(int(row[p]) for p in devices)
        for layer, per_filter in ((v.name, 1), *v.followers):
            if len(devices) == 1:
                configs[layer] = ParallelConfig(devices=devices)
            else:
                configs[layer] = ParallelConfig(c=len(devices), devices=devices,
                                                c_sizes=tuple(s * per_filter for s in sizes))
    for layer in graph:
        if layer.name in configs or (layer.is_input and len(layer.shape) < 2):
            continue
        if layer.kind != "softmax_cross_entropy":
            raise HypergraphError(f"layer {layer.name!r} ({layer.kind}) has no place in the partition")
        logits = layer.inputs[0]
        owner = next(i for i, v in enumerate(model.layers)
                     if v.name == logits or any(f == logits for f, _ in v.followers))
        configs[layer.name] = ParallelConfig(devices=(int(np.argmax(part.counts[owner])),))
    strategy = Strategy(configs, name or f"{part.method} k={part.k}",
                        meta={"partition": {"method": part.method, "k": part.k, **part.info}})
    return strategy.validated(graph, machine)


def forward_bytes(plan) -> int:
    """Bytes a plan moves between devices for the forward pass (what the model's volume counts)."""
    return sum(t.nbytes for t in plan.transfers() if plan.by_key[t.reader].phase in ("fwd", "loss"))
