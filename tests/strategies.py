"""Hypothesis strategies: random parallel configurations over every dimension a layer allows."""

from __future__ import annotations

from math import prod

from hypothesis import strategies as st

from taskrt.graph.config import SYNC_METHODS, ParallelConfig
from taskrt.graph.strategy import Strategy


@st.composite
def layer_configs(draw, layer, num_devices):
    degrees, budget = {}, num_devices
    for dim, size in zip(layer.dims, layer.shape):
        degree = draw(st.integers(1, max(1, min(size, budget))))
        degrees[dim] = degree
        budget //= degree
    devices = draw(st.permutations(range(num_devices)))[: prod(degrees.values())]
    return ParallelConfig(**degrees, devices=tuple(devices), sync=draw(st.sampled_from(SYNC_METHODS)))


@st.composite
def random_strategies(draw, graph, max_devices=4):
    """(number of devices, Strategy); input layers are sometimes left to their default."""
    num_devices = draw(st.integers(1, max_devices))
    configs = {}
    for layer in graph:
        if layer.is_input and draw(st.booleans()):
            continue
        configs[layer.name] = draw(layer_configs(layer, num_devices))
    return num_devices, Strategy(configs)
