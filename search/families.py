"""Strategy families of the hybrid systems the runtime also runs (seeds 000 and 001).

- `splitbrain(g, machine, mp)`: SplitBrain's group model parallelism.  Every layer before the
  fully-connected ones is data parallel over all P devices; each fully-connected layer is
  sharded over its output channels inside groups of `mp` consecutive devices (c = mp), and the
  P / mp groups are data parallel (n = P / mp).  mp = 1 is pure data parallelism, mp = P one
  group (Krizhevsky's scheme the paper builds on).
- `integrated(g, machine, pr, pc, conv, domain)`: Gholami et al.'s Pr x Pc process grid.  A
  fully-connected layer is split n = Pc by c = Pr (model parallel along Pr, batch along Pc);
  convolutions are either batch parallel over all P (conv="batch", the paper's Fig. 7) or on
  the same grid (conv="grid", Fig. 6); layers named in `domain` (or the first `domain` convs)
  split n = Pc by h = Pr instead (domain parallel along Pr, Eq. 9).

Each returns a plain, validated Strategy.  Parts are numbered row-major over (n, c, h, w), so
the Pr processes sharing a sample block are consecutive devices: one MP group (000) or one
grid row (001) per block of devices.  Layers without parameters follow the split of the layer
they read where they can; inputs are split over samples on all devices (each device loads its
own samples), and so is the loss.  Both families synchronize replicated weights with `sync`,
"allreduce" by default as both papers assume (001 counts ring all-reduce; 000 averages model
replicas peer to peer).

What the runtime does not reproduce: SplitBrain's modulo layer feeds the fully-connected layers
B/K samples at a time over K iterations and divides their gradients by K; here one step
computes exactly what one device computes, the group's samples in one pass.
"""

from __future__ import annotations

from numbers import Integral

from taskrt.graph.config import SYNC_METHODS, ParallelConfig
from taskrt.graph.strategy import Strategy, StrategyError

CONV_MODES = ("batch", "grid")
# split c without reading other channels
CHANNEL_FOLLOWERS = ("pool2d", "relu", "add", "concat", "flatten", "adaptive_pool2d", "mean", "scale")
# split h as their input does (a halo at most); not adaptive pooling or mean, whose outputs are often one row
SPATIAL_FOLLOWERS = ("pool2d", "relu", "add", "concat", "scale", "channel_slice", "channel_shuffle")


class FamilyError(StrategyError):
    """A grouping the machine or the graph cannot take; the message says what would be valid."""


def _positive(family, what, value):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise FamilyError(f"{family}: {what} must be a positive int, got {value!r}")


def _check_sync(family, sync):
    if sync not in SYNC_METHODS:
        raise FamilyError(f"{family}: sync must be one of {SYNC_METHODS}, got {sync!r}")


def _divisors(p):
    return [d for d in range(1, p + 1) if p % d == 0]


def _batch(graph):
    return next(layer.shape[0] for layer in graph if layer.is_input)


def _config(p, sync, **degrees):
    return ParallelConfig(**degrees, devices=tuple(range(p)), sync=sync)


def _data_parallel_inputs(graph, p, sync, family):
    batch = _batch(graph)
    if batch < p:
        raise FamilyError(f"{family}: batch {batch} is smaller than the {p} devices that split it; "
                          f"use a batch of at least {p}")
    return {layer.name: _config(p, sync, n=p) for layer in graph if layer.is_input}


def _finish(graph, machine, configs, name):
    try:
        return Strategy(configs, name=name).validated(graph, machine)
    except StrategyError as e:
        raise FamilyError(f"{name}: {e}") from None


def splitbrain(graph, machine, mp: int, sync: str = "allreduce") -> Strategy:
    """Group model parallelism with groups of `mp` devices (see the module docstring).

    A fully-connected layer with fewer output features than `mp` cannot be sharded that finely
    and stays data parallel (SplitBrain shards only the layers worth it); parameter-free layers
    after a sharded one (a separate relu) keep its split."""
    family = f"splitbrain(mp={mp})"
    _positive(family, "mp", mp)
    _check_sync(family, sync)
    p = machine.num_devices
    if p % mp:
        raise FamilyError(f"{family}: the MP group size must divide the {p} devices; valid: {_divisors(p)}")
    configs = _data_parallel_inputs(graph, p, sync, family)
    for layer in graph:
        if layer.is_input:
            continue
        producer = configs.get(layer.inputs[0]) if layer.inputs else None
        if layer.kind == "linear" and layer.shape[1] >= mp:
            configs[layer.name] = _config(p, sync, n=p // mp, c=mp)
        elif layer.kind in ("relu", "add") and producer is not None and producer.c > 1:
            configs[layer.name] = producer
        else:
            configs[layer.name] = _config(p, sync, n=p)
    return _finish(graph, machine, configs, family)


def integrated(graph, machine, pr: int, pc: int, conv: str = "batch", domain=None, sync: str = "allreduce"
               ) -> Strategy:
    """The Pr x Pc grid of seed 001 (see the module docstring).

    `domain`: None, an int k (the first k convolutions, with the parameter-free layers between
    them), or layer names; those layers split n = Pc, h = Pr."""
    family = f"integrated({pr}x{pc}, conv={conv})"
    _positive(family, "pr", pr)
    _positive(family, "pc", pc)
    _check_sync(family, sync)
    if conv not in CONV_MODES:
        raise FamilyError(f"{family}: conv must be one of {CONV_MODES}, got {conv!r}")
    p = machine.num_devices
    if pr * pc != p:
        raise FamilyError(f"{family}: the grid has pr * pc = {pr * pc} processes but the machine has {p} devices; "
                          f"valid (pr, pc): {[(d, p // d) for d in _divisors(p)]}")
    domain_layers = _domain_layers(graph, domain, family)
    configs = _data_parallel_inputs(graph, p, sync, family)
    grid = _config(p, sync, n=pc, c=pr)
    batch = _config(p, sync, n=p)
    spatial = _config(p, sync, n=pc, h=pr)
    for layer in graph:
        if layer.is_input:
            continue
        producer = configs.get(layer.inputs[0])
        if layer.name in domain_layers:
            configs[layer.name] = spatial
        elif layer.kind == "linear":
            configs[layer.name] = grid
        elif layer.kind == "conv2d":
            configs[layer.name] = grid if conv == "grid" else batch
        elif layer.kind == "softmax_cross_entropy":
            configs[layer.name] = batch
        elif producer == spatial and layer.kind in SPATIAL_FOLLOWERS:
            configs[layer.name] = spatial
        elif producer == grid and layer.kind in CHANNEL_FOLLOWERS:
            configs[layer.name] = grid
        else:
            configs[layer.name] = batch
    return _finish(graph, machine, configs, family)


def _domain_layers(graph, domain, family) -> set[str]:
    if domain is None:
        return set()
    if isinstance(domain, Integral) and not isinstance(domain, bool):
        convs = [layer.name for layer in graph if layer.kind == "conv2d"]
        if not 0 <= domain <= len(convs):
            raise FamilyError(f"{family}: domain={domain} convolutions, but the graph has {len(convs)}")
        if domain == 0:
            return set()
        last = list(graph.layers).index(convs[domain - 1])
        return {name for name in list(graph.layers)[: last + 1] if graph[name].kind == "conv2d"}
    names = [domain] if isinstance(domain, str) else list(domain)
    for name in names:
        if name not in graph.layers:
            raise FamilyError(f"{family}: domain layer {name!r} is not in graph {graph.name!r}")
        if "h" not in graph[name].dims:
            raise FamilyError(f"{family}: domain layer {name!r} ({graph[name].kind}) cannot be split over h; "
                              "domain parallelism splits images (conv and pool layers)")
    return set(names)


def splitbrain_family(graph, machine, sync="allreduce") -> dict[str, Strategy]:
    """Every valid SplitBrain configuration on the machine: {"splitbrain mp=k": Strategy}."""
    out = {}
    for mp in _divisors(machine.num_devices):
        try:
            out[f"splitbrain mp={mp}"] = splitbrain(graph, machine, mp, sync)
        except FamilyError:
            continue
    return out


def integrated_family(graph, machine, conv="batch", sync="allreduce") -> dict[str, Strategy]:
    """Every valid Pr x Pc grid on the machine: {"grid PrxPc (conv)": Strategy}."""
    out = {}
    p = machine.num_devices
    for pr in _divisors(p):
        try:
            out[f"grid {pr}x{p // pr} ({conv})"] = integrated(graph, machine, pr, p // pr, conv, sync=sync)
        except FamilyError:
            continue
    return out
