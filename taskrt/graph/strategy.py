"""Strategy: a ParallelConfig for every layer; readable JSON; validation that names the layer.

    s = Strategy({"conv1": ParallelConfig(n=2), "fc1": ParallelConfig(c=2)})
    s = s.validated(graph, machine)       # checks, and fills input layers with their defaults
    s.save("lenet.json"); Strategy.load("lenet.json", graph, machine)

Input layers (the image, the labels) may be left out: they take the split their first consumer
reads (its n, h and w degrees, no channel split), on the devices of that consumer's
channel-0 parts, so each device receives the data it works on.
"""

from __future__ import annotations

import json
from pathlib import Path

from taskrt.graph.config import DIMS, FIELDS, ParallelConfig
from taskrt.graph.files import write_atomic

FORMAT = "taskrt-strategy/1"


class StrategyError(ValueError):
    """A strategy that does not fit the graph or the machine; the message names the layer."""


class Strategy:
    def __init__(self, configs: dict[str, ParallelConfig], name: str = "", meta: dict | None = None, replan=None):
        self.configs = dict(configs)
        self.name = name
        self.meta = dict(meta or {})  # JSON-ready notes, e.g. the search's predicted costs
        # How to make a strategy for the devices left after a lost worker, `replan(graph, machine)
        # -> Strategy`, given by whoever built this one (search.optimize: search again); None: the
        # trainer re-maps this one (taskrt.training.elastic.remap).  Not saved with the strategy.
        self.replan = replan

    def __getitem__(self, layer: str) -> ParallelConfig:
        return self.configs[layer]

    def __contains__(self, layer: str) -> bool:
        return layer in self.configs

    def __iter__(self):
        return iter(self.configs)

    def items(self):
        return self.configs.items()

    def __eq__(self, other):
        return isinstance(other, Strategy) and self.configs == other.configs

    def __repr__(self):
        return f"Strategy({self.name or ''!s}{len(self.configs)} layers)"

    # ---- validation -------------------------------------------------------------------------
    def validated(self, graph, machine=None) -> Strategy:
        """A copy that is checked against `graph` (and `machine`, if given) and has every layer."""
        num_devices = None if machine is None else machine.num_devices
        unknown = [name for name in self.configs if name not in graph.layers]
        if unknown:
            raise StrategyError(
                f"strategy names layer {unknown[0]!r}, which graph {graph.name!r} does not have "
                f"(its layers: {', '.join(graph.layers)})"
            )
        configs = {}
        for layer in graph:
            if layer.name in self.configs:
                configs[layer.name] = self.configs[layer.name]
            elif not layer.is_input:
                raise StrategyError(f"layer {layer.name!r} has no parallel config in the strategy")
        # Check the configs given before deriving input defaults from them, so that a mistake is
        # reported for the layer it was made in (and a bad consumer cannot break the derivation).
        for layer in graph:
            if layer.name in configs:
                check_config(layer, configs[layer.name], num_devices)
        for layer in graph.inputs:
            if layer.name not in configs:
                configs[layer.name] = default_input_config(graph, layer, configs)
                try:
                    check_config(layer, configs[layer.name], num_devices)
                except StrategyError as e:
                    raise StrategyError(f"{e} (the default config of input {layer.name!r}, derived from its "
                                        f"first consumer; give {layer.name!r} a config of its own)") from None
        return Strategy({layer.name: configs[layer.name] for layer in graph}, self.name, self.meta, self.replan)

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"format": FORMAT, "name": self.name,
               "layers": {name: cfg.to_dict() for name, cfg in self.configs.items()}}
        return {**out, "meta": self.meta} if self.meta else out

    @classmethod
    def from_dict(cls, data, source: str = "strategy") -> Strategy:
        if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
            raise StrategyError(f"{source}: expected an object with a 'layers' object mapping layer names to "
                                "configs like {\"n\": 2, \"c\": 1, \"h\": 1, \"w\": 1, \"devices\": [0, 1]}")
        if data.get("format", FORMAT) != FORMAT:
            raise StrategyError(f"{source}: format {data.get('format')!r} is not {FORMAT!r}")
        configs = {}
        for name, spec in data["layers"].items():
            if not isinstance(spec, dict):
                raise StrategyError(f"{source}: layer {name!r}: config must be an object, got {spec!r}")
            extra = set(spec) - set(FIELDS)
            if extra:
                raise StrategyError(f"{source}: layer {name!r}: unknown fields {sorted(extra)}; "
                                    f"a config has {', '.join(DIMS)}, devices and optionally sync, c_sizes and "
                                    "recompute")
            if "devices" not in spec:
                raise StrategyError(f"{source}: layer {name!r}: missing field 'devices'")
            try:
                configs[name] = ParallelConfig.from_dict(spec)
            except (TypeError, ValueError) as e:
                raise StrategyError(f"{source}: layer {name!r}: {e}") from None
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise StrategyError(f"{source}: 'meta' must be an object, got {meta!r}")
        return cls(configs, data.get("name", ""), meta)

    def save(self, path) -> None:
        """Write atomically: a reader never sees half a file."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path, graph=None, machine=None) -> Strategy:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise StrategyError(f"cannot read strategy file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise StrategyError(f"{path} is not a text (UTF-8) file: {e.reason} at byte {e.start}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        strategy = cls.from_dict(data, source=str(path))
        return strategy.validated(graph, machine) if graph is not None else strategy

    # ---- report -----------------------------------------------------------------------------
    def table(self, graph=None) -> str:
        """One row per layer, in the style of the paper's Table 5."""
        names = list(graph.layers) if graph is not None else list(self.configs)
        rows = [f"{'layer':<22} {'kind':<22} {'config':<28} devices"]
        for name in names:
            cfg = self.configs[name]
            kind = graph[name].kind if graph is not None else ""
            degrees = "{" + ", ".join(f"{d}={getattr(cfg, d)}" for d in DIMS) + "}"
            sync = f"  (sync: {cfg.sync})" if cfg.sync != "ps" else ""
            sizes = f"  (channels {list(cfg.c_sizes)})" if cfg.c_sizes is not None else ""
            again = "  (recompute)" if cfg.recompute else ""
            rows.append(f"{name:<22} {kind:<22} {degrees:<28} {list(cfg.devices)}{sync}{sizes}{again}")
        return "\n".join(rows)


def default_input_config(graph, layer, configs) -> ParallelConfig:
    consumers = [name for name, _ in graph.consumers(layer.name)]
    if not consumers or consumers[0] not in configs:
        return ParallelConfig(devices=(0,))
    cfg = configs[consumers[0]]
    keep = {dim: (getattr(cfg, dim) if dim in layer.dims and dim != "c" else 1) for dim in DIMS}
    # Devices of the consumer's parts with channel block 0, in row-major order of (n, h, w).
    grid = [(i, j, k, m) for i in range(cfg.n) for j in range(cfg.c) for k in range(cfg.h) for m in range(cfg.w)]
    devices = [cfg.devices[p] for p, (i, j, k, m) in enumerate(grid)
               if j == 0 and (keep["h"] > 1 or k == 0) and (keep["w"] > 1 or m == 0)]
    return ParallelConfig(**keep, devices=tuple(devices))


def check_config(layer, cfg: ParallelConfig, num_devices) -> None:
    where = f"layer {layer.name!r} ({layer.kind})"
    if cfg.recompute and (layer.is_input or layer.kind == "softmax_cross_entropy"):
        what = "an input: its tiles are data" if layer.is_input else "the loss: it runs once, in forward"
        raise StrategyError(f"{where} cannot be recomputed (recompute=true): it is {what}")
    for dim in DIMS:
        degree = getattr(cfg, dim)
        if degree == 1:
            continue
        if dim not in layer.dims:
            raise StrategyError(
                f"{where} cannot be split over {dim!r} (degree {degree}); it splits over {', '.join(layer.dims)}"
            )
        size = layer.shape[layer.dims.index(dim)]
        if degree > size:
            raise StrategyError(f"{where}: degree {dim}={degree} is larger than the dimension, which has size {size}")
    if cfg.c_sizes is not None:
        if "c" not in layer.dims:
            raise StrategyError(f"{where} has no channel dimension to split unevenly (c_sizes={list(cfg.c_sizes)}); "
                                f"it splits over {', '.join(layer.dims)}")
        channels = layer.shape[layer.dims.index("c")]
        if sum(cfg.c_sizes) != channels:
            raise StrategyError(f"{where}: c_sizes={list(cfg.c_sizes)} add up to {sum(cfg.c_sizes)}; the layer has "
                                f"{channels} channels, so they must add up to {channels}")
    if len(cfg.devices) != cfg.total:
        raise StrategyError(
            f"{where}: {len(cfg.devices)} devices {list(cfg.devices)} given for {cfg.total} parts "
            f"(n*c*h*w = {cfg.n}*{cfg.c}*{cfg.h}*{cfg.w}); give one device per part"
        )
    if len(set(cfg.devices)) != len(cfg.devices):
        dup = sorted({d for d in cfg.devices if cfg.devices.count(d) > 1})
        raise StrategyError(f"{where}: device(s) {dup} appear twice in {list(cfg.devices)}; each part needs its "
                            "own device")
    negative = [d for d in cfg.devices if d < 0]
    if negative and num_devices is None:
        raise StrategyError(f"{where}: negative device id(s) {negative}; device ids start at 0")
    if num_devices is not None:
        bad = [d for d in cfg.devices if not 0 <= d < num_devices]
        if bad:
            raise StrategyError(
                f"{where}: device id(s) {bad} out of range; the machine has devices 0..{num_devices - 1}"
            )
