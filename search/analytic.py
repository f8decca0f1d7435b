"""The analytic alpha-beta communication model of Gholami et al., "Integrated Model, Batch, and Domain
Parallelism in Training Neural Networks" (SPAA 2018), evaluated on a taskrt Graph.

    layers = layer_dims(models.alexnet(batch=2048, image_size=224))
    eq8_integrated(layers, pr=16, pc=32, batch=2048).total_s          # seconds per iteration
    eq5_batch_threshold(layers[3])                                      # 13.63...: B* of conv4

What a "layer" is.  The paper's network is a chain Y_i = W_i X_i, X_{i+1} = f(Y_i) of L weight layers
(Section 1).  Its layers i = 1..L are the graph's conv2d and linear layers in graph order; everything
else (relu, pooling, flatten, the loss) carries no weights and sends nothing in the model.  The
paper's formulas have no pooling: there X_{i+1} has the shape of Y_i.  Here d_{i-1} of layer i (its
`d_in`) is what layer i actually reads, after any pooling before it, and d_i (its `d_out`) is what it
writes, before any pooling after it (Eq. 2: d_{i-1} = X_H X_W X_C, d_i = Y_H Y_W Y_C).  A graph with
branches is read as one chain in graph order.

A fully connected layer is the convolution whose kernel covers its whole input (Section 2.4:
"k_h = X_H, k_w = X_W"): after a flatten of (c, h, w) maps it has X_C = c, X_H = k_h = h,
X_W = k_w = w and Y_H = Y_W = 1, so |W| = k_h k_w X_C Y_C = d_{i-1} d_i as the paper says; on an
(n, c) input it is a 1x1 convolution of a 1x1 map.

|W_i| counts the weight tensor only: the paper's Eq. 2 has no biases ("the number of distinct
parameters ... (k_h k_w X_C) Y_C"), so biases are left out of every formula and reported apart
(`LayerDims.biases`).

Units.  alpha is seconds per message; beta is seconds per byte, 1 / (6 GB/s) in Table 1 (GB = 1e9
bytes); the formulas count words, so a term's bandwidth time is words * word_bytes * beta (fp32: 4
bytes a word).  Every term reports its words per process (the paper's beta coefficient), so a
runtime's byte counts can be compared term by term.  log is ceil(log2(.)), and log of 1 is 0.

Index ranges follow the paper's: the all-gather of Y_i runs over i = 1..L and the all-reduce of the
input gradient over i = 2..L (no gradient below the first layer).  Eqs. 4, 7 and 8 write their
weight sums from i = 0; there is no W_0 (the input has no weights) and Section 2.4 states that Eq. 9
with L_M = L is Eq. 8, which holds only if those sums run over the same layers 1..L as Eq. 9's; so
they are summed over 1..L here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from numbers import Integral, Real

# Section 2.2: "model parallelism has lower communication volume than batch parallelism for B <= 12"
# for AlexNet's 3x3 filters on 13x13x384 activations.  Eq. 5 itself gives 2*9*384 / (3*169) = 13.63
# for those dimensions, i.e. B <= 13; both are kept so reports can show them side by side.
PAPER_EQ5_BATCH_LIMIT = 12

# Intel Xeon Phi 7250 (the KNL of Cori, Table 1) data-sheet peak: 68 cores x 1.4 GHz x 64 fp32
# FLOP per cycle (two AVX-512 FMA units: 2 x 16 lanes x 2 FLOP).
KNL_7250_PEAK_FLOPS = 68 * 1.4e9 * 64

ALLGATHER_Y = "allgather_y"        # Eqs. 3, 8, 9, first sum: all-gather of Y_i within the Pr group
ALLREDUCE_DX = "allreduce_dx"      # Eqs. 3, 8, 9, second sum: all-reduce of the input gradient
ALLREDUCE_DW = "allreduce_dw"      # Eqs. 4, 7, 8, 9: ring all-reduce of the weight gradient
HALO_X = "halo_x"                  # Eqs. 7, 9: halo exchange of the input (forward)
HALO_Y = "halo_y"                  # Eqs. 7, 9: halo exchange at the output (backward)
REDISTRIBUTE = "redistribute"      # Eq. 6: layout change between layers on different grids
ACTIVATION_TERMS = (ALLGATHER_Y, ALLREDUCE_DX, HALO_X, HALO_Y, REDISTRIBUTE)  # all but the weight gradient

CONV_PLACEMENTS = ("grid", "batch")  # Fig. 6: conv layers on the same grid; Fig. 7: conv layers batch parallel


# ---- checks -------------------------------------------------------------------------------------
def _positive_int(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def _positive_real(what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def ceil_log2(p: int) -> int:
    """ceil(log2(p)) for p >= 1; 0 for p = 1 (the paper's log, a message count of Bruck / ring steps)."""
    return (_positive_int("process count", p) - 1).bit_length()


# ---- values -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interconnect:
    """The alpha-beta network of Table 1 (NERSC Cori): alpha = 2 us, 1/beta = 6 GB/s, fp32 words."""

    alpha_s: float = 2e-6                  # latency: seconds per message
    bandwidth_bytes_per_s: float = 6e9     # 1/beta: bytes per second (GB = 1e9 bytes)
    word_bytes: int = 4                    # the formulas count words; fp32

    def __post_init__(self):
        if isinstance(self.alpha_s, bool) or not isinstance(self.alpha_s, Real) or not 0 <= self.alpha_s < float("inf"):
            raise ValueError(f"alpha_s must be a finite number >= 0 (seconds per message), got {self.alpha_s!r}")
        _positive_real("bandwidth_bytes_per_s (1/beta)", self.bandwidth_bytes_per_s)
        _positive_int("word_bytes", self.word_bytes)

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_bytes_per_s

    @property
    def beta_s_per_word(self) -> float:
        return self.word_bytes / self.bandwidth_bytes_per_s


TABLE1 = Interconnect()


@dataclass(frozen=True)
class LayerDims:
    """One weight layer i in the paper's notation (Eq. 2), per sample.

    `weights` is |W_i| (the weight tensor, no bias); `biases` is the bias count, outside the model.
    """

    name: str
    kind: str  # "conv" or "fc"
    X_C: int
    X_H: int
    X_W: int
    Y_C: int
    Y_H: int
    Y_W: int
    kh: int
    kw: int
    weights: int
    biases: int = 0

    def __post_init__(self):
        if self.kind not in ("conv", "fc"):
            raise ValueError(f"layer {self.name!r}: kind must be 'conv' or 'fc', got {self.kind!r}")
        for field in ("X_C", "X_H", "X_W", "Y_C", "Y_H", "Y_W", "kh", "kw", "weights"):
            _positive_int(f"layer {self.name!r}: {field}", getattr(self, field))
        if isinstance(self.biases, bool) or not isinstance(self.biases, Integral) or self.biases < 0:
            raise ValueError(f"layer {self.name!r}: biases must be an int >= 0, got {self.biases!r}")
        if self.weights != self.kh * self.kw * self.X_C * self.Y_C:  # Eq. 2
            raise ValueError(f"layer {self.name!r}: weights = {self.weights} but Eq. 2 gives kh kw X_C Y_C = "
                             f"{self.kh * self.kw * self.X_C * self.Y_C}")

    @property
    def d_in(self) -> int:
        """d_{i-1} = X_H X_W X_C: the input layer i reads, per sample."""
        return self.X_H * self.X_W * self.X_C

    @property
    def d_out(self) -> int:
        """d_i = Y_H Y_W Y_C: the output layer i writes, per sample."""
        return self.Y_H * self.Y_W * self.Y_C

    @property
    def macs(self) -> int:
        """Multiply-adds of the forward pass, per sample: each of Y_H Y_W output pixels applies all of W."""
        return self.weights * self.Y_H * self.Y_W


def layer_dims(graph) -> tuple[LayerDims, ...]:
    """The weight layers (conv2d, linear) of a taskrt Graph in graph order, as the paper's layers."""
    layers = []
    for layer in graph:
        if layer.kind not in ("conv2d", "linear"):
            continue
        params = layer.param_shapes
        weights, biases = prod(params["weight"]), prod(params["bias"]) if "bias" in params else 0
        if layer.kind == "conv2d":
            if layer.op.groups != 1 or tuple(layer.op.dilation) != (1, 1):
                raise ValueError(f"layer {layer.name!r}: a conv2d with groups={layer.op.groups}, dilation="
                                 f"{tuple(layer.op.dilation)}: the paper's model counts dense, undilated convolutions "
                                 "(every filter reads every input channel; a halo of half the kernel)")
            _, x_c, x_h, x_w = layer.op.in_shapes[0]
            _, y_c, y_h, y_w = layer.shape
            kh, kw = layer.op.kernel
            layers.append(LayerDims(layer.name, "conv", x_c, x_h, x_w, y_c, y_h, y_w, kh, kw, weights, biases))
            continue
        producer = graph[layer.inputs[0]]
        if producer.kind == "flatten" and len(producer.op.in_shapes[0]) == 4:
            _, x_c, x_h, x_w = producer.op.in_shapes[0]  # the fc layer is a convolution over the whole map
        else:
            x_c, x_h, x_w = layer.op.in_shapes[0][1], 1, 1
        layers.append(LayerDims(layer.name, "fc", x_c, x_h, x_w, layer.shape[1], 1, 1, x_h, x_w, weights, biases))
    if not layers:
        raise ValueError(f"graph {graph.name!r} has no conv2d or linear layer: the model has nothing to count")
    return tuple(layers)


@dataclass(frozen=True)
class Term:
    """One collective of one layer: `messages` alphas and `words` words per process."""

    name: str
    messages: float
    words: float
    latency_s: float
    bandwidth_s: float

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s


def _term(name: str, messages: float, words: float, net: Interconnect) -> Term:
    return Term(name, messages, words, messages * net.alpha_s, words * net.beta_s_per_word)


@dataclass(frozen=True)
class LayerCost:
    layer: str
    terms: tuple[Term, ...]

    def term(self, name: str) -> Term:
        """The named term, or a zero one where this layer has none (e.g. no input gradient for i = 1)."""
        return next((t for t in self.terms if t.name == name), Term(name, 0, 0, 0.0, 0.0))

    @property
    def latency_s(self) -> float:
        return sum(t.latency_s for t in self.terms)

    @property
    def bandwidth_s(self) -> float:
        return sum(t.bandwidth_s for t in self.terms)

    @property
    def words(self) -> float:
        return sum(t.words for t in self.terms)

    @property
    def total_s(self) -> float:
        return sum(t.total_s for t in self.terms)


@dataclass(frozen=True)
class Breakdown:
    """Communication per iteration, per layer and per named term, of one equation."""

    equation: str
    layers: tuple[LayerCost, ...]

    def layer(self, name: str) -> LayerCost:
        for cost in self.layers:
            if cost.layer == name:
                return cost
        raise KeyError(f"no layer {name!r} in this breakdown; layers: {[c.layer for c in self.layers]}")

    def term(self, name: str) -> Term:
        """The named term summed over layers."""
        parts = [cost.term(name) for cost in self.layers]
        return Term(name, sum(t.messages for t in parts), sum(t.words for t in parts),
                    sum(t.latency_s for t in parts), sum(t.bandwidth_s for t in parts))

    def term_names(self) -> list[str]:
        return list(dict.fromkeys(t.name for cost in self.layers for t in cost.terms))

    @property
    def latency_s(self) -> float:
        return sum(c.latency_s for c in self.layers)

    @property
    def bandwidth_s(self) -> float:
        return sum(c.bandwidth_s for c in self.layers)

    @property
    def words(self) -> float:
        return sum(c.words for c in self.layers)

    @property
    def total_s(self) -> float:
        return sum(c.total_s for c in self.layers)

    def rows(self) -> list[dict]:
        """One JSON-ready dict per (layer, term)."""
        return [{"equation": self.equation, "layer": c.layer, "term": t.name, "messages": t.messages,
                 "words": t.words, "latency_s": t.latency_s, "bandwidth_s": t.bandwidth_s, "total_s": t.total_s}
                for c in self.layers for t in c.terms]


@dataclass(frozen=True)
class Grid:
    """A Pr x Pc process grid: Pr splits the model (or the domain), Pc the batch."""

    pr: int
    pc: int

    def __post_init__(self):
        _positive_int("Pr", self.pr)
        _positive_int("Pc", self.pc)

    @property
    def processes(self) -> int:
        return self.pr * self.pc

    def __str__(self):
        return f"{self.pr}x{self.pc}"


def _check_layers(layers: Sequence[LayerDims]) -> tuple[LayerDims, ...]:
    layers = tuple(layers)
    if not layers or not all(isinstance(layer, LayerDims) for layer in layers):
        raise ValueError("layers must be a non-empty sequence of LayerDims (see layer_dims(graph))")
    return layers


# ---- the equations ------------------------------------------------------------------------------
def eq3_model_parallel(layers: Sequence[LayerDims], p: int, batch: int, net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 3, pure model parallelism on P processes:

        sum_{i=1}^{L} (a ceil(log P) + b B (P-1)/P d_i) + 2 sum_{i=2}^{L} (a ceil(log P) + b B (P-1)/P d_{i-1})
    """
    layers, p, batch = _check_layers(layers), _positive_int("P", p), _positive_int("batch size B", batch)
    log_p, share = ceil_log2(p), (p - 1) / p
    costs = []
    for i, layer in enumerate(layers, start=1):
        terms = [_term(ALLGATHER_Y, log_p, batch * share * layer.d_out, net)]
        if i >= 2:
            terms.append(_term(ALLREDUCE_DX, 2 * log_p, 2 * batch * share * layer.d_in, net))
        costs.append(LayerCost(layer.name, tuple(terms)))
    return Breakdown("Eq. 3 (model)", tuple(costs))


def eq4_batch_parallel(layers: Sequence[LayerDims], p: int, net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 4, pure batch parallelism on P processes: 2 sum_i (a ceil(log P) + b (P-1)/P |W_i|)."""
    layers, p = _check_layers(layers), _positive_int("P", p)
    log_p, share = ceil_log2(p), (p - 1) / p
    return Breakdown("Eq. 4 (batch)", tuple(
        LayerCost(layer.name, (_term(ALLREDUCE_DW, 2 * log_p, 2 * share * layer.weights, net),))
        for layer in layers))


def eq5_batch_threshold(layer: LayerDims) -> float:
    """Eq. 5: B* = 2 kh kw X_C / (3 Y_H Y_W).  Batch parallelism moves fewer words than model parallelism
    for B > B*; model parallelism for B < B* (the ratio of volumes 2|W_i| / (3 B d_i))."""
    return 2 * layer.kh * layer.kw * layer.X_C / (3 * layer.Y_H * layer.Y_W)


def eq6_redistribution(layer: LayerDims, p: int, batch: int, net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 6, switching from batch to model parallelism before `layer`: a ceil(log P) + b B (P-1)/P d.

    The tensor gathered is X of the layer switched to, so d is that layer's d_in (the paper writes d_i
    in its own indexing)."""
    p, batch = _positive_int("P", p), _positive_int("batch size B", batch)
    term = _term(REDISTRIBUTE, ceil_log2(p), batch * ((p - 1) / p) * layer.d_in, net)
    return Breakdown("Eq. 6 (redistribute batch to model)", (LayerCost(layer.name, (term,)),))


def _halo_terms(layer: LayerDims, split: int, samples: float, net: Interconnect) -> list[Term]:
    """Eq. 9's halo exchanges (Eq. 7's with B/Pc samples): a + b samples X_W X_C floor(kh/2) and
    a + b samples Y_W Y_C floor(kw/2).

    A domain in one piece has no neighbour, and a 1x1 kernel needs no halo ("for a 1x1 convolution no
    communication is needed"): those send nothing, not even the alpha.  Eq. 9 writes X^{i+1} for the
    second halo, which is Y^i in the paper's pooling-free chain; with pooling we keep Y^i, the tensor
    whose gradient the layer's backward reads."""
    terms = []
    for name, rows, per_row in ((HALO_X, layer.kh // 2, layer.X_W * layer.X_C),
                                (HALO_Y, layer.kw // 2, layer.Y_W * layer.Y_C)):
        if split > 1 and rows > 0:
            terms.append(_term(name, 1, samples * per_row * rows, net))
    return terms


def eq7_domain_parallel(layers: Sequence[LayerDims], p: int, batch: int, net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 7, pure domain parallelism on P processes (each image split in P strips):

        sum_i (a + b B X_W X_C floor(kh/2)) + sum_i (a + b B Y_W Y_C floor(kw/2)) + 2 sum_i (a ceil(log P)
        + b (P-1)/P |W_i|)

    Fully connected layers count as the convolution covering their input (kh = X_H), the large halo
    that makes domain parallelism a poor fit for them (Section 2.4)."""
    layers, p, batch = _check_layers(layers), _positive_int("P", p), _positive_int("batch size B", batch)
    log_p, share = ceil_log2(p), (p - 1) / p
    costs = []
    for layer in layers:
        terms = []
        if p > 1 and layer.kh // 2 > 0:
            terms.append(_term(HALO_X, 1, batch * layer.X_W * layer.X_C * (layer.kh // 2), net))
        if p > 1 and layer.kw // 2 > 0:
            terms.append(_term(HALO_Y, 1, batch * layer.Y_W * layer.Y_C * (layer.kw // 2), net))
        terms.append(_term(ALLREDUCE_DW, 2 * log_p, 2 * share * layer.weights, net))
        costs.append(LayerCost(layer.name, tuple(terms)))
    return Breakdown("Eq. 7 (domain)", tuple(costs))


def _model_batch_terms(layer: LayerDims, first: bool, grid: Grid, batch: int, net: Interconnect) -> list[Term]:
    """Eq. 8's three sums for one layer on a Pr x Pc grid:

        a ceil(log Pr) + b B/Pc (Pr-1)/Pr d_i                      all-gather of Y_i within Pr
        2 (a ceil(log Pr) + b B/Pc (Pr-1)/Pr d_{i-1})              all-reduce of dX_i within Pr, i >= 2
        2 (a ceil(log Pc) + b (Pc-1)/Pc |W_i| / Pr)                all-reduce of dW_i within Pc
    """
    pr, pc = grid.pr, grid.pc
    log_r, share_r, log_c, share_c = ceil_log2(pr), (pr - 1) / pr, ceil_log2(pc), (pc - 1) / pc
    terms = [_term(ALLGATHER_Y, log_r, batch / pc * share_r * layer.d_out, net)]
    if not first:
        terms.append(_term(ALLREDUCE_DX, 2 * log_r, 2 * (batch / pc) * share_r * layer.d_in, net))
    terms.append(_term(ALLREDUCE_DW, 2 * log_c, 2 * share_c * layer.weights / pr, net))
    return terms


def eq8_integrated(layers: Sequence[LayerDims], pr: int, pc: int, batch: int,
                   net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 8, integrated model and batch parallelism, every layer on one Pr x Pc grid (1.5D algorithm)."""
    layers, grid, batch = _check_layers(layers), Grid(pr, pc), _positive_int("batch size B", batch)
    return Breakdown(f"Eq. 8 ({grid})", tuple(
        LayerCost(layer.name, tuple(_model_batch_terms(layer, i == 0, grid, batch, net)))
        for i, layer in enumerate(layers)))


def eq9_integrated_domain(layers: Sequence[LayerDims], pr: int, pc: int, batch: int, domain: Collection[str],
                          net: Interconnect = TABLE1) -> Breakdown:
    """Eq. 9, integrated model, batch and domain parallelism on one Pr x Pc grid.  Layers named in
    `domain` (L_D) split each image in Pr strips; the others (L_M) split the model over Pr as in Eq. 8:

        L_M: Eq. 8's three sums (no input gradient for the first layer, as in Eq. 8)
        L_D: a + b B/Pc X_W X_C floor(kh/2), a + b B/Pc Y_W Y_C floor(kw/2), 2 (a ceil(log P) + b (P-1)/P |W_i|)

    Like the paper, no term is counted for switching between domain and model layouts."""
    layers, grid, batch = _check_layers(layers), Grid(pr, pc), _positive_int("batch size B", batch)
    names = [layer.name for layer in layers]
    unknown = sorted(set(domain) - set(names))
    if unknown:
        raise ValueError(f"domain layers {unknown} are not weight layers of this network; valid: {names}")
    p = grid.processes
    log_p, share = ceil_log2(p), (p - 1) / p
    costs = []
    for i, layer in enumerate(layers):
        if layer.name in domain:
            terms = _halo_terms(layer, grid.pr, batch / grid.pc, net)
            terms.append(_term(ALLREDUCE_DW, 2 * log_p, 2 * share * layer.weights, net))
        else:
            terms = _model_batch_terms(layer, i == 0, grid, batch, net)
        costs.append(LayerCost(layer.name, tuple(terms)))
    return Breakdown(f"Eq. 9 ({grid}, {len(set(domain))} domain layers)", tuple(costs))


def _redistribution_term(layer: LayerDims, before: Grid, after: Grid, batch: int, net: Interconnect) -> Term:
    """Layout change between a layer on grid `before` and the next, `layer`, on grid `after` (same P).

    After Eq. 8's all-gathers a process holds all features of the B/Pc samples of its grid column.  Going
    to a larger Pr (fewer, larger sample blocks) the new layer's input is all-gathered, in forward, over
    the g = Pr_after / Pr_before processes of its Pr group that hold different samples; going to a
    smaller Pr the same happens to its input gradient in backward.  It is Eq. 6's form:

        a ceil(log g) + b B/Pc (g-1)/g d_{i-1},   Pc of the grid with the larger Pr

    From pure batch (Pr_before = 1) it is Eq. 6 on the new Pr group with B/Pc samples.  Process ranks are
    numbered with the Pr index fastest, so the smaller grid's Pr groups nest in the larger's."""
    small, large = sorted((before, after), key=lambda grid: grid.pr)
    if large.pr % small.pr:
        raise ValueError(f"layer {layer.name!r}: grid {after} after grid {before}: the smaller Pr must divide "
                         f"the larger for the layouts to nest (powers of two always do)")
    g = large.pr // small.pr
    return _term(REDISTRIBUTE, ceil_log2(g), batch / large.pc * ((g - 1) / g) * layer.d_in, net)


def eq8_per_layer(layers: Sequence[LayerDims], grids: Mapping[str, Grid], batch: int, net: Interconnect = TABLE1,
                  *, count_redistribution: bool) -> Breakdown:
    """Eq. 8 with a grid per layer (Fig. 7: Pr = 1, Pc = P for conv layers, Pr x Pc for fc layers).

    Where a layer's grid differs from the previous layer's, the layout changes between them: the term
    `redistribute` (see `_redistribution_term`, Eq. 6's form) on the later layer.  The paper does not
    say whether its figures include it ("asymptotically free", Sections 2.2 and 2.3), so whether it is
    counted is the caller's explicit choice."""
    layers, batch = _check_layers(layers), _positive_int("batch size B", batch)
    names = [layer.name for layer in layers]
    missing, unknown = [n for n in names if n not in grids], sorted(set(grids) - set(names))
    if missing or unknown:
        raise ValueError(f"grids must name every weight layer once: missing {missing}, unknown {unknown}; "
                         f"weight layers: {names}")
    if len({grids[n].processes for n in names}) != 1:
        raise ValueError(f"every layer's grid must use the same P processes, got "
                         f"{ {n: str(grids[n]) for n in names} }")
    costs = []
    for i, layer in enumerate(layers):
        grid = grids[layer.name]
        terms = _model_batch_terms(layer, i == 0, grid, batch, net)
        before = grids[layers[i - 1].name] if i else grid
        if count_redistribution and before != grid:
            terms.append(_redistribution_term(layer, before, grid, batch, net))
        costs.append(LayerCost(layer.name, tuple(terms)))
    kinds = " + ".join(dict.fromkeys(str(grids[n]) for n in names))
    return Breakdown(f"Eq. 8 per layer ({kinds})", tuple(costs))


# ---- Figures 6 and 7: grid sweeps ---------------------------------------------------------------
def figure_grids(layers: Sequence[LayerDims], grid: Grid, conv: str) -> dict[str, Grid]:
    """The grid of every layer: conv = "grid" puts every layer on `grid` (Fig. 6); conv = "batch" puts
    conv layers on 1 x P and fc layers on `grid` (Fig. 7)."""
    if conv not in CONV_PLACEMENTS:
        raise ValueError(f"conv must be one of {CONV_PLACEMENTS}, got {conv!r}")
    batch_grid = Grid(1, grid.processes)
    return {layer.name: batch_grid if conv == "batch" and layer.kind == "conv" else grid
            for layer in _check_layers(layers)}


@dataclass(frozen=True)
class GridResult:
    """One bar of Figs. 6/7: communication (Eq. 8 per layer) and computation per iteration on one grid."""

    grid: Grid
    comm: Breakdown
    compute_s: float

    @property
    def comm_s(self) -> float:
        return self.comm.total_s

    @property
    def batch_comm_s(self) -> float:
        """The weight-gradient all-reduce: the hatched part of the paper's bars."""
        return self.comm.term(ALLREDUCE_DW).total_s

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s


@dataclass(frozen=True)
class SweepPoint:
    """Every grid Pr x Pc = P (Pr a power of two, ascending) for one P; grids[0] is pure batch (Pr = 1)."""

    processes: int
    grids: tuple[GridResult, ...]

    @property
    def baseline(self) -> GridResult:
        return self.grids[0]

    @property
    def best(self) -> GridResult:
        """The fastest grid (all grids of a P share the compute time, so also the least communication)."""
        return min(self.grids, key=lambda r: r.total_s)

    @property
    def total_speedup(self) -> float:
        return 1.0 if self.best is self.baseline else self.baseline.total_s / self.best.total_s

    @property
    def comm_speedup(self) -> float:
        return 1.0 if self.best is self.baseline else self.baseline.comm_s / self.best.comm_s


def grid_sweep(layers: Sequence[LayerDims], batch: int, processes: Sequence[int], conv: str, compute_s: float,
               net: Interconnect = TABLE1, *, count_redistribution: bool) -> tuple[SweepPoint, ...]:
    """Figs. 6 (conv = "grid") and 7 (conv = "batch"): for each P every grid Pr x Pc = P with Pr a power of
    two, its communication per iteration and its total time, no overlap.

    `compute_s` is the computation time of one iteration of the whole batch on ONE process; a grid on P
    processes takes compute_s / P, the same for every grid of that P (the paper: "cases with the same
    computational workload").  The paper measured it (Intel Caffe on one KNL, Fig. 4) and gives no number;
    `knl_compute_s` is a data-sheet lower bound."""
    layers, batch = _check_layers(layers), _positive_int("batch size B", batch)
    if isinstance(compute_s, bool) or not isinstance(compute_s, Real) or not 0 <= compute_s < float("inf"):
        raise ValueError(f"compute_s must be a finite number >= 0 (seconds per iteration on one process), "
                         f"got {compute_s!r}")
    points = []
    for p in processes:
        p = _positive_int("P", p)
        results = []
        for pr in (2 ** k for k in range(p.bit_length()) if p % 2 ** k == 0):
            grid = Grid(pr, p // pr)
            comm = eq8_per_layer(layers, figure_grids(layers, grid, conv), batch, net,
                                 count_redistribution=count_redistribution)
            results.append(GridResult(grid, comm, compute_s / p))
        points.append(SweepPoint(p, tuple(results)))
    return tuple(points)


def training_flops(layers: Sequence[LayerDims], batch: int) -> int:
    """FLOPs of one training iteration: forward 2 x MACs of the weight layers, training 3 x forward
    (the paper's three matrix products Y = WX, dX = W^T dY, dW = dY X^T; Section 1)."""
    return 3 * 2 * _positive_int("batch size B", batch) * sum(layer.macs for layer in _check_layers(layers))


def knl_compute_s(layers: Sequence[LayerDims], batch: int, peak_flops: float = KNL_7250_PEAK_FLOPS) -> float:
    """Seconds of one training iteration of `batch` samples on one KNL at data-sheet peak: a LOWER BOUND on
    the compute time (real kernels reach a fraction of peak; the paper's measured times are not given)."""
    return training_flops(layers, batch) / _positive_real("peak_flops", peak_flops)


def implied_compute_s(baseline_comm_s: float, total_speedup: float, comm_speedup: float) -> float:
    """The per-process compute time C that makes a reported (total, communication) speedup pair over pure
    batch consistent with a pure-batch communication time T: (C + T) / (C + T / s_comm) = s_total, so
    C = T (1 - s_total / s_comm) / (s_total - 1).  An explanation of a published figure, not a model input."""
    baseline_comm_s = _positive_real("baseline_comm_s", baseline_comm_s)
    if not 1 < total_speedup < comm_speedup:
        raise ValueError(f"need 1 < total_speedup < comm_speedup, got total {total_speedup!r}, comm {comm_speedup!r}")
    return baseline_comm_s * (1 - total_speedup / comm_speedup) / (total_speedup - 1)
