"""Recomputation in the search's tables: what recomputing a set R of layers changes in the time
and the memory measure, with R fixed (search.recompute_search picks the sets).

For a layer X in R under config c (ParallelConfig.recompute; taskrt.planning.recompute):
- time: its slowest part's forward again (`forward`, priced as the simulator prices a copy), and
  for every edge to a consumer whose backward reads the copy, the edge's forward transfer again
  (a resend travels as the forward value did);
- the summed memory: a(X, c) loses X's output kept for backward (`outputs`, per device, as
  search.memory_tables counts it).  The values forward moved stay in the edge terms (the copies'
  moves are among them, so counting them in the sum bounds counting them in the working set);
- the working set: X's copy is alive from the first backward that reads it to the last (and,
  down a chain of recomputed layers, until the copies made from it are read), as
  search.memory.step_memory counts it.  At a layer's backward, the copy of a recomputed layer
  that is the layer itself or one of its inputs is counted exactly: a unary term, or a term of
  the edge joining them (search.pareto takes edge working sets).  The working term is a max over
  layers and edges, so the copies of several layers alive at one layer cannot all be paired
  with it: a copy alive at a layer it is not paired with (an earlier link of a chain) counts
  there as the least any config of its layer holds on one device, and its layer may take only
  the configs holding that least (on k devices: the splits over all k).  M stays an upper bound
  of step_memory's peak; the space of such a layer shrinks, so the search is exact over the
  configs left.
"""

from __future__ import annotations

import weakref

import numpy as np

from taskrt.search.memory_tables import UNKNOWN

LOSS = "softmax_cross_entropy"


def candidates(graph) -> list[str]:
    """The layers recomputing can change: not inputs or the loss, whose backward runs, whose copy
    some backward reads (its own, or a consumer's other than the loss): search.memory's
    `_recomputed`."""
    needed = graph.needs_backward()
    consumers = consumer_map(graph)
    out = []
    for layer in graph:
        if layer.is_input or layer.kind == LOSS or layer.name not in needed:
            continue
        if reads_itself(layer, needed) or any(graph[c].kind != LOSS for c, _ in consumers.get(layer.name, ())):
            out.append(layer.name)
    return out


def consumer_map(graph) -> dict:
    """graph.consumers of every layer, in one pass: name -> [(consumer, input index)]."""
    out = {}
    for layer in graph:
        for i, src in enumerate(layer.inputs):
            out.setdefault(src, []).append((layer.name, i))
    return out


def reads_itself(layer, needed) -> bool:
    """Whether a layer's own backward reads its output (search.memory._reads_itself)."""
    return layer.name in needed and layer.op.saves_output and not layer.op.reduces_statistics


class RecomputeTables:
    """Per layer and config of the cost tables: the forward seconds computed again, the output bytes
    per device, and per edge the forward transfer seconds; each computed when first asked."""

    def __init__(self, graph, cost_model, tables, memory_tables):
        self.graph, self.cost_model, self.tables, self.memory = graph, cost_model, tables, memory_tables
        self.cache = _CACHES.setdefault(cost_model, {})
        self.needed = graph.needs_backward()
        self.position = {name: i for i, name in enumerate(graph.layers)}
        self.consumers = consumer_map(graph)
        self.edge_index, self.resent = {}, {}  # (producer, consumer) -> first edge; producer -> edges resent
        for i, (u, v, _, _) in enumerate(tables.edges):
            self.edge_index.setdefault((u, v), i)
            if graph[v].kind != LOSS:
                self.resent.setdefault(u, []).append(i)
        self._forward, self._outputs, self._candidates = {}, {}, None

    def forward(self, name: str) -> np.ndarray:
        """Seconds of the layer's slowest part's forward, and its task's overhead, per config."""
        if name not in self._forward:
            # every candidate at once: parts not timed yet are measured together, not a layer at a time
            layers = [self.graph[n] for n in dict.fromkeys([name, *self.candidates()]) if n not in self._forward]
            spaces = {layer.name: self.cost_model.layer_space(layer) for layer in layers}
            # as layers whose backward does not run: forward only, no input gradient (task_prices' key)
            self._forward.update(self.cost_model.compute_costs(layers, spaces, set()))
        return self._forward[name]

    def candidates(self) -> list[str]:
        """candidates(graph), found once."""
        if self._candidates is None:
            self._candidates = candidates(self.graph)
        return self._candidates

    def outputs(self, name: str) -> np.ndarray:
        """Bytes of the layer's output on each device, per config: (configs, devices)."""
        if name not in self._outputs:
            layer = self.graph[name]
            space = self.cost_model.layer_space(layer)
            key = ("outputs", space.key, self.cost_model.itemsize, self.memory.devices)
            if key not in self.cache:
                parts = space.parts
                sizes = np.diff(np.append(parts.starts, len(parts.device)))
                config = np.repeat(np.arange(len(parts.starts)), sizes)
                out = np.zeros((len(parts.starts), self.memory.devices), dtype=np.int64)
                np.add.at(out, (config, parts.device), np.prod(parts.hi - parts.lo, axis=1) * self.cost_model.itemsize)
                self.cache[key] = out
            self._outputs[name] = self.cache[key]
        return self._outputs[name]

    def copy(self, name: str) -> np.ndarray:
        """The most bytes of a copy of the layer's output on one device, per config."""
        return self.outputs(name).max(axis=1)

    def kept_without_output(self, name: str) -> np.ndarray:
        """a(L, c) with the layer's output not kept."""
        return (self.memory.by_device[name] - self.outputs(name)).max(axis=1)

    def resend(self, i: int) -> np.ndarray:
        """Edge i's forward transfer seconds (producer configs x consumer configs)."""
        u, v, j, _ = self.tables.edges[i]
        model = self.cost_model
        producer, consumer = model.layer_space(self.graph[u]), model.layer_space(self.graph[v])
        itemsize = 8 if self.graph[u].is_input and self.graph[u].op.dtype == "int64" else model.itemsize
        key = ("resend", id(producer.grid), id(consumer.grid), consumer.needs[j].key(), itemsize)
        if key not in self.cache:
            self.cache[key] = model.transfer_job(producer, consumer, consumer.needs[j], itemsize, False)()
        return self.cache[key]

    def seconds_again(self, name: str, choice: dict) -> tuple[float, dict]:
        """At the configs of `choice` (config index per layer in the tables): the layer's forward
        computed again, and per consumer the seconds of its forward transfers sent again."""
        resent = {}
        for i in self.resent.get(name, ()):
            consumer = self.tables.edges[i][1]
            resent[consumer] = resent.get(consumer, 0.0) + float(self.resend(i)[choice[name], choice[consumer]])
        return float(self.forward(name)[choice[name]]), resent

    def readers(self, name: str) -> list[str]:
        """The layers whose backward reads the layer's copy (its consumers but the loss)."""
        return list(dict.fromkeys(c for c, _ in self.consumers.get(name, ()) if self.graph[c].kind != LOSS))

    def spans(self, recomputed) -> dict:
        """Per recomputed layer, the positions (layer order) its copy is alive over in backward."""
        spans = {}
        for layer in reversed(list(self.graph)):
            name = layer.name
            if name not in recomputed:
                continue
            reading = self.readers(name)
            first = [self.position[c] for c in reading] + [spans[c][1] for c in reading if c in recomputed]
            last = [self.position[c] for c in reading]
            if reads_itself(layer, self.needed):
                first.append(self.position[name])
                last.append(self.position[name])
            spans[name] = (min(last), max(first))
        return spans

    def problem(self, recomputed, keep: dict, unary: dict, edges: list, kept_bytes: dict, working: dict):
        """The search's tables (restricted to `keep`, as given) with `recomputed` fixed: (unary,
        edges, kept_bytes, working, edge_working), edge_working a matrix per edge or None."""
        recomputed = frozenset(recomputed)
        unary, kept_bytes, working = dict(unary), dict(kept_bytes), dict(working)
        edges = list(edges)
        edge_working = [None] * len(edges)
        for name in recomputed:
            rows = keep[name]
            unary[name] = unary[name] + self.forward(name)[rows]
            kept_bytes[name] = self.kept_without_output(name)[rows]
            for i in self.resent.get(name, ()):
                u, v, m = edges[i]
                edges[i] = (u, v, m + self.resend(i)[np.ix_(rows, keep[v])])
        spans = self.spans(recomputed)
        alive = {}
        for name, (low, high) in spans.items():
            for p in range(low, high + 1):
                alive.setdefault(p, []).append(name)
        names = list(self.graph.layers)
        paired, apart = {}, set()  # per position the input copy paired with it; the copies counted apart
        for p, living in alive.items():
            name = names[p]
            inputs = [x for x in living if x != name and (x, name) in self.edge_index]
            paired[p] = max(inputs, key=lambda x: int(self.copy(x)[keep[x]].max()), default=None)
            apart.update(x for x in living if x != name and x != paired[p])
        least = {}
        for x in apart:  # only the configs holding the least of its copy on one device (see the module)
            copies = self.copy(x)[keep[x]]
            least[x] = int(copies.min())
            kept_bytes[x] = np.where(copies == least[x], kept_bytes[x], UNKNOWN)
        for p, living in alive.items():
            name = names[p]
            extra = np.zeros(len(keep[name]), dtype=np.int64)
            if name in living:  # its own backward reads its copy: exact
                extra += self.copy(name)[keep[name]]
            extra += sum(least[x] for x in living if x != name and x != paired[p])
            working[name] = working[name] + extra
            if paired[p] is not None:
                x = paired[p]
                edge_working[self.edge_index[(x, name)]] = self.copy(x)[keep[x]][:, None] + working[name][None, :]
        return unary, edges, kept_bytes, working, edge_working


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CostModel -> {key: table}
