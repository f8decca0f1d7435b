"""The runtime's plan beside the analytic model of seed 001 (search.analytic), layer by layer.

    rows = plan_vs_model(graph, pr=2, pc=2, conv="grid")     # one row per (layer, what moves)

For a graph on a Pr x Pc grid (the strategy `search.integrated` builds), every word the plan moves
is attributed to the weight layer whose step needs it, and set beside the model's volume terms
(words summed over the P processes, the per-process beta coefficients times P):

- "forward input": what layer i's forward fetches; the model's all-gather of Y_{i-1} (plus the
  layout change before layer i when its grid differs, Eq. 6's form).  For the loss: Y_L.
- "input gradient": what layer i's backward sends back; the model's all-reduce of dX_i.
- "weight gradient": layer i's parameter synchronization; the model's ring all-reduce of dW_i.

Where they differ, each row names why and gives the runtime figure the explanation predicts from
the model's; `explained` says whether the plan moves exactly that.  The reasons:

- pooling: the model all-gathers Y_{i-1} as the layer wrote it; the runtime moves layer i's input,
  after the pooling between them (d_in(i) / d_out(i-1) of the words);
- reduce-scatter: the model all-reduces dX_i because its 1.5D algorithm keeps X_i replicated over
  Pr; the runtime's producer is split over channels, so each process needs only its own block
  summed: half the words;
- the loss: it needs the logits once per sample, not on every process of a grid row (1 / Pr of the
  all-gather), and sends their gradient back the same way (the model has no term for it);
- the input: the model assumes the data replicated over Pr; the runtime scatters each sample
  once and moves it to the other processes of its row;
- biases: the model's |W| counts weights only; the runtime synchronizes biases too.
Totals of the weight-gradient all-reduce agree for both sync methods; so does what the busiest
device receives under "allreduce" (2 (Pc-1)/Pc |W|/Pr, evenly chunked), while the parameter
server receives (Pc-1) |W|/Pr on one device, Pc/2 times as much.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.planning.plan import DATA, TASK
from taskrt.search import analytic
from taskrt.search.families import integrated

FORWARD, BACKWARD, SYNC = "forward input", "input gradient", "weight gradient"


@dataclass(frozen=True)
class Row:
    layer: str
    what: str  # FORWARD, BACKWARD or SYNC
    model_words: float  # summed over the P processes
    runtime_words: int
    expected_words: float  # what the explanation predicts the runtime moves
    why: str
    busiest_model: float = 0.0  # weight gradients: words the busiest process receives (model) ...
    busiest_runtime: int = 0  # ... and the busiest device (runtime)

    @property
    def explained(self) -> bool:
        return abs(self.runtime_words - self.expected_words) <= 1e-9 * max(1.0, self.expected_words)

    def to_dict(self) -> dict:
        return {**self.__dict__, "explained": self.explained}


def plan_vs_model(graph, pr: int, pc: int, conv: str = "grid", sync: str = "allreduce") -> list[Row]:
    """Rows for `graph` on a pr x pc grid (conv layers on the grid or batch parallel, as in Figs. 6
    and 7): the plan of `search.integrated` against Eq. 8 with a grid per layer."""
    p = pr * pc
    machine = Machine.simulated(1, p)
    strategy = integrated(graph, machine, pr, pc, conv=conv, sync=sync)
    plan = lower(graph, strategy)
    layers = analytic.layer_dims(graph)
    grids = analytic.figure_grids(layers, analytic.Grid(pr, pc), conv)
    model = analytic.eq8_per_layer(layers, grids, graph.inputs[0].shape[0], count_redistribution=True)
    moved, busy = _plan_words(graph, plan)
    rows = []
    for i, layer in enumerate(layers):
        terms = model.layer(layer.name)
        grid = grids[layer.name]
        if i == 0:
            words = p * terms.term(analytic.REDISTRIBUTE).words
            data = p * (grid.pr - 1) / grid.pr * graph.inputs[0].shape[0] / grid.pc * layer.d_in
            rows.append(Row(layer.name, FORWARD, words, moved[(layer.name, FORWARD)], data,
                            "the input: assumed replicated over Pr by the model, scattered once by the runtime"))
        else:
            previous = layers[i - 1]
            gather = p * model.layer(previous.name).term(analytic.ALLGATHER_Y).words
            change = p * terms.term(analytic.REDISTRIBUTE).words
            expected = gather * layer.d_in / previous.d_out + change
            why = "equal" if layer.d_in == previous.d_out else (
                f"pooling: the runtime moves layer {layer.name}'s input ({layer.d_in:,} per sample), the model "
                f"{previous.name}'s output ({previous.d_out:,})")
            rows.append(Row(layer.name, FORWARD, gather + change, moved[(layer.name, FORWARD)], expected, why))
            dx = p * terms.term(analytic.ALLREDUCE_DX).words
            rows.append(Row(layer.name, BACKWARD, dx, moved[(layer.name, BACKWARD)], dx / 2,
                            "reduce-scatter: the producer is split over channels and needs only its block summed"))
        dw = p * terms.term(analytic.ALLREDUCE_DW).words
        with_bias = dw * (layer.weights + layer.biases) / layer.weights
        rows.append(Row(layer.name, SYNC, dw, moved[(layer.name, SYNC)], with_bias,
                        "equal" if not layer.biases else "biases: the runtime synchronizes them too",
                        busiest_model=terms.term(analytic.ALLREDUCE_DW).words * (layer.weights + layer.biases)
                        / layer.weights, busiest_runtime=busy.get(layer.name, 0)))
    last = layers[-1]
    logits = p * model.layer(last.name).term(analytic.ALLGATHER_Y).words
    pr_last = grids[last.name].pr
    rows.append(Row("loss", FORWARD, logits, moved[("loss", FORWARD)], logits / pr_last,
                    "the loss reads each sample's logits once, not on every process of the row"))
    rows.append(Row("loss", BACKWARD, 0.0, moved[("loss", BACKWARD)], logits / pr_last,
                    "the logits' gradient goes back to the fc parts (no term in the model)"))
    return rows


def _plan_words(graph, plan):
    """Words the plan moves per (weight layer or "loss", what), and per layer the synchronization
    words the busiest device receives."""
    weight_or_loss = {}
    for layer in reversed(list(graph)):  # a parameter-free layer belongs to the weight layer it feeds
        if layer.param_shapes or layer.kind == "softmax_cross_entropy":
            weight_or_loss[layer.name] = "loss" if layer.kind == "softmax_cross_entropy" else layer.name
        else:
            consumers = [name for name, _ in graph.consumers(layer.name)]
            weight_or_loss[layer.name] = weight_or_loss.get(consumers[0]) if consumers else None
    moved, busy, sync_busy = Counter(), {}, Counter()
    for transfer in plan.transfers():
        dep = transfer.dep
        if _is_labels(graph, plan, dep):  # class labels: the model has no term for them
            continue
        words = transfer.nbytes // 4
        phase, origin = _origin(plan, dep)
        if phase in ("wfetch", "grad", "rslice"):
            moved[(origin, SYNC)] += words
            sync_busy[(origin, transfer.dst)] += words
        elif phase in ("fwd", "data"):
            moved[(weight_or_loss[plan.by_key[transfer.reader].layer], FORWARD)] += words
        else:  # an input gradient, sent back by the layer that computed it
            moved[(weight_or_loss[origin], BACKWARD)] += words
    for (layer, _), words in sync_busy.items():
        busy[layer] = max(busy.get(layer, 0), words)
    return moved, busy


def _origin(plan, dep):
    """(phase, layer) of the value behind a travelling key, through aliases and slices: "data",
    "fwd" (an activation), "bwd" / "loss" (an input gradient) or a synchronization phase."""
    while dep.kind == TASK:
        task = plan.by_key[dep.key]
        if task.phase not in ("send", "slice", "gslice"):
            return task.phase, task.layer
        dep = task.deps[0]
    return "data", dep.key[0]


def _is_labels(graph, plan, dep) -> bool:
    while dep.kind == TASK:
        dep = plan.by_key[dep.key].deps[0]
    return dep.kind == DATA and graph[dep.key[0]].op.dtype == "int64"
