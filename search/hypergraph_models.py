"""The hypergraph models of a network (seed 003), filters as vertices and feature maps as nets: the
explicit hypergraph and its PaToH text format, the coarse-grain and fine-grain models, and a
partition's metrics.  `search.hypergraph` partitions them and puts a partition onto the runtime;
its docstring tells the whole story."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import prod

import numpy as np

from taskrt.graph.config import blocks
from taskrt.ops.rect import Rect

FILTER_KINDS = ("conv2d", "linear")
CHANNEL_LOCAL_KINDS = ("pool2d", "relu", "flatten")  # channel j of the output needs channel j only


class HypergraphError(ValueError):
    """A graph the hypergraph models cannot describe, or a partition that does not fit it."""


# ---- the explicit hypergraph and the PaToH text format ----------------------------------------
@dataclass(frozen=True)
class Hypergraph:
    """Vertices with weights and nets with costs, pins in CSR form (net i: pins[start[i]:start[i+1]]).

    The first pin of a net is its home: the producer that sends the map (a map net), or, when
    `gathers[i]`, the reduction vertex every other part sends a partial sum to."""

    weights: np.ndarray  # (vertices,) int64
    costs: np.ndarray  # (nets,) int64
    start: np.ndarray  # (nets + 1,) int64
    pins: np.ndarray  # (pins,) int64
    gathers: np.ndarray = None  # (nets,) bool

    def __post_init__(self):
        if self.gathers is None:
            object.__setattr__(self, "gathers", np.zeros(len(self.costs), dtype=bool))

    @property
    def num_vertices(self) -> int:
        return len(self.weights)

    @property
    def num_nets(self) -> int:
        return len(self.costs)

    def nets(self) -> list[list[int]]:
        return [self.pins[a:b].tolist() for a, b in zip(self.start[:-1], self.start[1:])]

    def connectivity(self, parts: np.ndarray) -> np.ndarray:
        """lambda(n) of every net under a vertex -> part assignment."""
        net = np.repeat(np.arange(self.num_nets), np.diff(self.start))
        pairs = np.unique(net * (int(parts.max()) + 1) + parts[self.pins])
        return np.bincount(pairs // (int(parts.max()) + 1), minlength=self.num_nets)

    def sent(self, parts: np.ndarray, k: int) -> np.ndarray:
        """Bytes each part sends: a map net's home sends cost * (lambda - 1); for a reduction net,
        every part other than the home's sends one partial sum (cost)."""
        lam = self.connectivity(parts)
        out = np.zeros(k, dtype=np.int64)
        home = parts[self.pins[self.start[:-1]]]
        maps = ~self.gathers
        np.add.at(out, home[maps], (self.costs * (lam - 1))[maps])
        if self.gathers.any():
            net = np.repeat(np.arange(self.num_nets), np.diff(self.start))
            keys = np.unique(net * k + parts[self.pins])
            net_of, part_of = keys // k, keys % k
            other = self.gathers[net_of] & (part_of != home[net_of])
            np.add.at(out, part_of[other], self.costs[net_of[other]])
        return out


def to_patoh(h: Hypergraph, base: int = 0) -> str:
    """PaToH's input format (the thesis's Fig. 3.5): a header `base vertices nets pins 3`, a line
    per net (its cost, then its pins), then the vertex weights."""
    lines = [f"{base} {h.num_vertices} {h.num_nets} {len(h.pins)} 3"]
    for cost, net in zip(h.costs.tolist(), h.nets()):
        lines.append(" ".join(map(str, [cost, *(p + base for p in net)])))
    lines.append(" ".join(map(str, h.weights.tolist())))
    return "\n".join(lines) + "\n"


def from_patoh(text: str) -> Hypergraph:
    """Read PaToH's format; the weight flag says what is given (0 none, 1 vertex weights, 2 net
    costs, 3 both); missing weights and costs are 1.  Comment lines start with %."""
    rows = [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("%")]
    if not rows or len(rows[0]) < 4:
        raise HypergraphError("PaToH file: the first line must be `base vertices nets pins [weights]`")
    head = [int(v) for v in rows[0]]
    base, nv, nn, npins = head[:4]
    flag = head[4] if len(head) > 4 else 0
    if base not in (0, 1) or flag not in (0, 1, 2, 3):
        raise HypergraphError(f"PaToH file: base {base} must be 0 or 1 and the weight flag {flag} one of 0-3")
    if len(rows) < 1 + nn:
        raise HypergraphError(f"PaToH file: {nn} nets announced, {len(rows) - 1} lines follow")
    costs, start, pins = [], [0], []
    for row in rows[1:1 + nn]:
        values = [int(v) for v in row]
        if flag in (2, 3):
            costs.append(values[0])
            values = values[1:]
        else:
            costs.append(1)
        pins += [v - base for v in values]
        start.append(len(pins))
    if len(pins) != npins:
        raise HypergraphError(f"PaToH file: {npins} pins announced, {len(pins)} found")
    if any(not 0 <= p < nv for p in pins):
        raise HypergraphError(f"PaToH file: a pin lies outside vertices {base}..{nv - 1 + base}")
    weights = [int(v) for row in rows[1 + nn:] for v in row] if flag in (1, 3) else [1] * nv
    if len(weights) != nv:
        raise HypergraphError(f"PaToH file: {nv} vertex weights expected, {len(weights)} found")
    return Hypergraph(np.array(weights, dtype=np.int64), np.array(costs, dtype=np.int64),
                      np.array(start, dtype=np.int64), np.array(pins, dtype=np.int64))


# ---- the coarse-grain model --------------------------------------------------------------------
@dataclass(frozen=True)
class VertexLayer:
    """The vertices of one conv2d, linear or input layer: one per output channel (filter)."""

    name: str
    size: int  # filters
    work: float  # forward + backward FLOPs of one filter, its channel-local followers included
    followers: tuple[tuple[str, int], ...] = ()  # (layer, elements per channel): they take its split
    follower_work: float = 0.0  # the part of `work` the followers do


@dataclass(frozen=True)
class MapNets:
    """One net per channel of `tensor`: its producer is a vertex of layer `producer`, every vertex
    of the `readers` layers reads it."""

    producer: int
    tensor: str
    cost: int  # bytes of one channel of `tensor` at the batch
    readers: tuple[int, ...]


@dataclass(frozen=True)
class CoarseModel:
    graph: str
    batch: int
    layers: tuple[VertexLayer, ...]
    nets: tuple[MapNets, ...]
    itemsize: int = 4

    @property
    def sizes(self) -> np.ndarray:
        return np.array([v.size for v in self.layers], dtype=np.int64)

    @property
    def work(self) -> np.ndarray:
        return np.array([v.work for v in self.layers])

    @property
    def total_work(self) -> float:
        return float(self.sizes @ self.work)

    def index(self, name: str) -> int:
        return next(i for i, v in enumerate(self.layers) if v.name == name)

    # -- metrics in closed form, from how many filters of each layer each part holds --
    def check_counts(self, counts) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 2 or counts.shape[0] != len(self.layers):
            raise HypergraphError(f"counts must be (layers={len(self.layers)}, parts), got shape {counts.shape}")
        bad = np.flatnonzero(counts.sum(axis=1) != self.sizes)
        if len(bad) or (counts < 0).any():
            i = int(bad[0]) if len(bad) else int(np.argwhere(counts < 0)[0, 0])
            raise HypergraphError(f"layer {self.layers[i].name!r}: counts {counts[i].tolist()} must be non-negative "
                                  f"and add up to its {self.layers[i].size} filters")
        return counts

    def sent(self, counts) -> np.ndarray:
        """Bytes each part sends in a forward pass: the producer of a map sends it to every other
        part holding a reader, i.e. cost * (lambda - 1) for each net."""
        counts = self.check_counts(counts)
        out = np.zeros(counts.shape[1], dtype=np.int64)
        for net in self.nets:
            readers = (counts[list(net.readers)] > 0).any(axis=0)  # parts holding any reader
            others = readers.sum() - readers  # readers on parts other than the producer's
            out += net.cost * counts[net.producer] * others
        return out

    def volume(self, counts) -> int:
        """The connectivity-1 cutsize: bytes moved by a forward pass."""
        return int(self.sent(counts).sum())

    def part_work(self, counts) -> np.ndarray:
        counts = self.check_counts(counts)
        return self.work @ counts

    # -- the explicit hypergraph --
    def atoms(self, atoms=None) -> list[tuple[tuple[int, int], ...]]:
        """Per layer, the [lo, hi) filter ranges the partitioner keeps together.  `atoms`: None (a
        vertex per filter), an int (at most that many per layer) or one count per layer."""
        if atoms is None or isinstance(atoms, int | np.integer):
            counts = [v.size if atoms is None else min(v.size, int(atoms)) for v in self.layers]
        else:
            counts = [int(a) for a in atoms]
            if len(counts) != len(self.layers) or any(not 1 <= a <= v.size for a, v in zip(counts, self.layers)):
                raise HypergraphError(f"atoms {counts}: give one count per layer ({len(self.layers)}), each between "
                                      "1 and the layer's filters")
        return [blocks(v.size, a) for v, a in zip(self.layers, counts)]

    def work_atoms(self, k: int, per_part: int = 10, floor: int = 16) -> list[int]:
        """Atoms per layer for a k-way partition: none does more than 1/per_part of a part's average
        work, and a layer has at least `floor` (or all its filters, if fewer)."""
        cap = self.total_work / k / per_part
        per_atom = [max(1, math.floor(cap / v.work)) if v.work > 0 else v.size for v in self.layers]  # filters
        return [max(min(v.size, floor), math.ceil(v.size / n)) for v, n in zip(self.layers, per_atom)]

    def hypergraph(self, atoms=None, unit_work: float = 1.0, unit_bytes: int = 1) -> Hypergraph:
        """The explicit hypergraph, a vertex per atom (per filter with atoms=None), weights in
        units of `unit_work` FLOPs and costs in units of `unit_bytes` (rounded, at least 1)."""
        atoms = self.atoms(atoms)
        first = np.cumsum([0] + [len(a) for a in atoms])
        weights = np.concatenate([[v.work * (hi - lo) for lo, hi in a] for v, a in zip(self.layers, atoms)])
        costs, nets = [], []
        for net in self.nets:
            readers = np.concatenate([np.arange(first[r], first[r + 1]) for r in net.readers])
            for i, (lo, hi) in enumerate(atoms[net.producer]):
                costs.append(net.cost * (hi - lo))
                nets.append(np.concatenate([[first[net.producer] + i], readers]))
        start = np.cumsum([0] + [len(n) for n in nets])
        return Hypergraph(units(weights, unit_work), units(np.array(costs, dtype=np.float64), unit_bytes),
                          start.astype(np.int64), np.concatenate(nets).astype(np.int64) if nets else np.zeros(0, int))

    def counts_of(self, vertex_parts, k: int, atoms=None) -> np.ndarray:
        """Filters per (layer, part) from the part of every vertex of `hypergraph(atoms)`."""
        counts = np.zeros((len(self.layers), k), dtype=np.int64)
        at = 0
        for i, layer_atoms in enumerate(self.atoms(atoms)):
            for lo, hi in layer_atoms:
                counts[i, vertex_parts[at]] += hi - lo
                at += 1
        return counts


def units(values, unit) -> np.ndarray:
    return np.maximum(1, np.rint(np.asarray(values, dtype=np.float64) / unit)).astype(np.int64)


def coarse_grain(graph, work="flops", itemsize: int = 4) -> CoarseModel:
    """The coarse-grain hypergraph model of `graph` at its batch size.

    `work`: "flops" (forward + backward FLOPs of each filter) or a callable (layer) -> seconds
    of the whole layer's forward and backward, e.g. from a `search.CostModel`."""
    owner: dict[str, tuple[int, int]] = {}  # layer -> (vertex layer, elements per channel)
    layers: list[dict] = []
    readers: dict[tuple[int, str], list[int]] = {}
    loss_kinds = ("softmax_cross_entropy",)
    for layer in graph:
        kind = layer.kind
        if kind == "input":
            if len(layer.shape) < 2:  # labels: read by the loss only
                continue
            owner[layer.name] = (len(layers), prod(layer.shape[2:]))
            layers.append({"name": layer.name, "size": layer.shape[1], "work": 0.0, "followers": [],
                           "follower_work": 0.0})
        elif kind in FILTER_KINDS:
            source = layer.inputs[0]
            if getattr(layer.op, "groups", 1) != 1:
                raise HypergraphError(f"layer {layer.name!r} ({kind}, groups={layer.op.groups}): the hypergraph "
                                      "models describe dense filters, each reading every input channel; a grouped "
                                      "convolution's filters read their own group's channels only")
            if source not in owner:
                raise HypergraphError(f"layer {layer.name!r} ({kind}) reads {source!r}, which the hypergraph "
                                      "models cannot follow to the filters that produce it")
            index = len(layers)
            owner[layer.name] = (index, prod(layer.shape[2:]))
            layers.append({"name": layer.name, "size": layer.shape[1], "work": _work(layer, work),
                           "followers": [], "follower_work": 0.0})
            readers.setdefault((owner[source][0], source), []).append(index)
        elif kind in CHANNEL_LOCAL_KINDS:
            source = layer.inputs[0]
            if source not in owner:
                raise HypergraphError(f"layer {layer.name!r} ({kind}) reads {source!r}, which the hypergraph "
                                      "models cannot follow to the filters that produce it")
            index, per_channel = owner[source]
            vertex = layers[index]
            if kind != "flatten":  # a flattened channel keeps its elements, now along c
                per_channel = prod(layer.shape[2:])
            owner[layer.name] = (index, per_channel)
            vertex["followers"].append((layer.name, layer.shape[1] // vertex["size"]))
            vertex["work"] += _work(layer, work)
            vertex["follower_work"] += _work(layer, work)
        elif kind in loss_kinds:
            continue
        else:
            raise HypergraphError(f"layer {layer.name!r} ({kind}): the hypergraph models describe chains of "
                                  f"{', '.join(FILTER_KINDS + CHANNEL_LOCAL_KINDS)} layers; {kind} layers "
                                  f"{'(branches that merge) ' if kind in ('concat', 'add') else ''}are not modelled")
    batch = graph.inputs[0].shape[0]
    vertex_layers, nets = [], []
    for v in layers:  # work was summed over whole layers: per filter
        vertex_layers.append(VertexLayer(v["name"], v["size"], v["work"] / v["size"], tuple(v["followers"]),
                                         v["follower_work"] / v["size"]))
    for (producer, tensor), reading in readers.items():
        per_channel = owner[tensor][1]
        nets.append(MapNets(producer, tensor, batch * per_channel * itemsize, tuple(reading)))
    return CoarseModel(graph.name, batch, tuple(vertex_layers), tuple(nets), itemsize)


def _work(layer, work) -> float:
    if callable(work):
        return float(work(layer))
    if work != "flops":
        raise HypergraphError(f"work={work!r}: give 'flops' or a callable (layer) -> seconds")
    out = Rect.full(layer.shape)
    return float(layer.op.flops(out) + layer.op.backward_flops(out))


# ---- the fine-grain model ----------------------------------------------------------------------
@dataclass(frozen=True)
class FineModel:
    """Sec. 3.3: per filter layer, a vertex per (filter atom, input-channel atom) doing that part of
    the convolution, and a reduction vertex per filter atom that sums the partial results and runs
    the channel-local followers.  Map nets: the producer's reduction vertex (or input vertex) and
    every channel vertex reading that map; reduction nets: a filter atom's channel vertices and its
    reduction vertex, costing the partial sums' bytes."""

    coarse: CoarseModel
    hypergraph: Hypergraph
    layer_of: np.ndarray  # (vertices,): vertex layer each vertex belongs to
    filters_of: np.ndarray  # (vertices,): filters (reduction vertices, inputs) or filter-channels it stands for


def fine_grain(graph, work="flops", itemsize: int = 4, max_atoms: int | None = 32,
               unit_work: float = 1.0, unit_bytes: int = 1) -> FineModel:
    """The fine-grain model with at most `max_atoms` filter atoms and channel atoms per layer."""
    coarse = coarse_grain(graph, work, itemsize)
    atoms = coarse.atoms(max_atoms)
    # vertices are numbered in network order: a filter atom's channel vertices, then its reduction vertex
    weights, layer_of, filters_of = [], [], []
    home: dict[int, list[int]] = {}  # vertex layer -> vertex id of each atom's reduction (or input) vertex
    channel: dict[int, dict[tuple[int, int], int]] = {}  # filter layer -> (filter atom, channel atom) -> vertex
    incoming = {r: net for net in coarse.nets for r in net.readers}
    costs, nets, gathers = [], [], []

    def add(w, layer, filters):
        weights.append(w)
        layer_of.append(layer)
        filters_of.append(filters)
        return len(weights) - 1

    for i, v in enumerate(coarse.layers):
        if i not in incoming:  # an input: one vertex per channel atom
            home[i] = [add(0.0, i, hi - lo) for lo, hi in atoms[i]]
            continue
        source = incoming[i]
        in_atoms = atoms[source.producer]
        in_channels = coarse.layers[source.producer].size
        partial = coarse.batch * prod(graph[v.name].shape[2:]) * itemsize  # one filter's output, before followers
        own = v.work - v.follower_work  # per filter, shared by its input channels
        home[i], channel[i] = [], {}
        for a, (lo, hi) in enumerate(atoms[i]):
            for b, (clo, chi) in enumerate(in_atoms):
                channel[i][(a, b)] = add(own * (hi - lo) * (chi - clo) / in_channels, i, (hi - lo) * (chi - clo))
            # the reduction vertex: summing the channel atoms' partial results, then the followers
            adds = partial / itemsize * (len(in_atoms) - 1)
            home[i].append(add((v.follower_work + adds) * (hi - lo), i, hi - lo))
            costs.append(partial * (hi - lo))
            nets.append([home[i][-1], *(channel[i][(a, b)] for b in range(len(in_atoms)))])
            gathers.append(True)
    for net in coarse.nets:
        for b, (lo, hi) in enumerate(atoms[net.producer]):
            pins = [home[net.producer][b]]
            for r in net.readers:
                pins += [channel[r][(a, b)] for a in range(len(atoms[r]))]
            costs.append(net.cost * (hi - lo))
            nets.append(pins)
            gathers.append(False)
    start = np.cumsum([0] + [len(n) for n in nets]).astype(np.int64)
    h = Hypergraph(units(weights, unit_work), units(np.array(costs, dtype=np.float64), unit_bytes), start,
                   np.concatenate([np.asarray(n, dtype=np.int64) for n in nets]), np.array(gathers))
    return FineModel(coarse, h, np.array(layer_of), np.array(filters_of))


# ---- partitions and their metrics --------------------------------------------------------------
@dataclass(frozen=True)
class Metrics:
    """Table 5.1-5.12's columns: work in FLOPs, communication in bytes (forward pass)."""

    max_work: float
    min_work: float
    avg_work: float
    volume: int
    max_comm: int
    avg_comm: float

    @property
    def max_min(self) -> float:
        return self.max_work / self.min_work if self.min_work else float("inf")

    @property
    def max_avg(self) -> float:
        return self.max_work / self.avg_work

    @property
    def max_avg_comm(self) -> float:
        return self.max_comm / self.avg_comm if self.avg_comm else 0.0


def _metrics(work: np.ndarray, sent: np.ndarray) -> Metrics:
    return Metrics(float(work.max()), float(work.min()), float(work.mean()), int(sent.sum()), int(sent.max()),
                   float(sent.mean()))


@dataclass(frozen=True)
class Partition:
    """A k-way partition of a model: for the coarse-grain model, filters of each layer per part;
    for the fine-grain model, the part of each vertex."""

    model: CoarseModel | FineModel
    k: int
    method: str
    counts: np.ndarray | None = None  # (layers, k), coarse-grain
    vertex_parts: np.ndarray | None = None  # (vertices,), fine-grain
    seconds: float = 0.0  # time to partition, building the partitioner's input included
    info: dict = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        return self.counts is not None

    def metrics(self) -> Metrics:
        if self.counts is not None:
            return _metrics(self.model.part_work(self.counts), self.model.sent(self.counts))
        h = self.model.hypergraph
        work = np.bincount(self.vertex_parts, weights=h.weights.astype(np.float64), minlength=self.k)
        return _metrics(work, h.sent(self.vertex_parts, self.k))
