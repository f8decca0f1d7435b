"""The standard strategies the paper compares against, for any graph and machine.

- data parallelism: every layer split over samples on all devices;
- model parallelism (Krizhevsky 2014): every layer's parameters split over all devices, i.e.
  outputs split over channels (the loss, which needs whole rows, over samples);
- OWT ("one weird trick"): data parallel up to the first fully-connected layer, model
  parallel from there on.
Degrees are capped by the dimension's size; input layers follow their first consumer.
"""

from __future__ import annotations

from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy


def _split(layer, dim, devices) -> ParallelConfig:
    if dim not in layer.dims:
        dim = "n"
    degree = min(devices, layer.shape[layer.dims.index(dim)])
    return ParallelConfig(**{dim: degree}, devices=tuple(range(degree)))


def data_parallel(graph, machine) -> Strategy:
    d = machine.num_devices
    return Strategy({l.name: _split(l, "n", d) for l in graph if not l.is_input}, name="data parallel")


def model_parallel(graph, machine) -> Strategy:
    d = machine.num_devices
    return Strategy({l.name: _split(l, "c", d) for l in graph if not l.is_input}, name="model parallel")


def owt(graph, machine) -> Strategy:
    d = machine.num_devices
    after_fc: set[str] = set()
    for layer in graph:
        if layer.kind == "linear" or any(src in after_fc for src in layer.inputs):
            after_fc.add(layer.name)
    configs = {l.name: _split(l, "c" if l.name in after_fc else "n", d) for l in graph if not l.is_input}
    return Strategy(configs, name="OWT")


BASELINES = {"data": data_parallel, "model": model_parallel, "owt": owt}
