"""Parameters: deterministic initialization, and packing of a shard into one flat array.

A shard (the part of a layer's parameters one task reads) travels and is updated as a single
flat array: one key per shard in Dask, one message per transfer, and a byte count that is
exactly the array's size.
"""

from __future__ import annotations

import zlib
from math import prod

import numpy as np

from taskrt.ops import reuse
from taskrt.ops.rect import Rect

DTYPES = {"float32": np.float32, "float64": np.float64}
UNIT_SCALE_KINDS = ("batch_norm", "layer_norm", "scale")  # weights start at one, biases at zero (as PyTorch's)


def resolve_dtype(dtype) -> np.dtype:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return np.dtype(DTYPES[name])


def init_parameters(graph, seed: int = 0, dtype="float32") -> dict[str, dict[str, np.ndarray]]:
    """He-normal weights (std sqrt(2 / fan_in)), zero biases (norms and scales: ones and zeros); a
    graph imported from PyTorch starts from the module's own values.

    Each layer draws from its own generator seeded by (seed, layer name), so a layer's initial
    values do not depend on the rest of the graph.
    """
    dtype = resolve_dtype(dtype)
    params = {}
    imported = getattr(graph, "imported", None)  # a PyTorch module's own values (taskrt.graph.from_torch)
    for layer in graph:
        shapes = layer.param_shapes
        if not shapes:
            continue
        if imported is not None and layer.name in imported.params:
            params[layer.name] = {k: np.asarray(imported.params[layer.name][k], dtype=dtype).reshape(s).copy()
                                  for k, s in shapes.items()}
            continue
        if layer.op.buffer_shapes() or layer.kind in UNIT_SCALE_KINDS:  # norms: the identity scale and shift
            params[layer.name] = {k: np.full(s, 1.0 if k == "weight" else 0.0, dtype=dtype) for k, s in shapes.items()}
            continue
        rng = np.random.default_rng([seed, zlib.crc32(layer.name.encode())])
        w_shape = shapes["weight"]
        fan_in = prod(w_shape[1:])
        params[layer.name] = {"weight": (rng.standard_normal(w_shape) * np.sqrt(2.0 / fan_in)).astype(dtype)}
        if "bias" in shapes:
            params[layer.name]["bias"] = np.zeros(shapes["bias"], dtype=dtype)
    return params


def init_buffers(graph, dtype="float32") -> dict[str, np.ndarray]:
    """Running statistics of every batch norm as one (2, C) array: mean 0 and variance 1."""
    dtype = resolve_dtype(dtype)
    imported = getattr(graph, "imported", None)
    return {layer.name: np.asarray(imported.buffers[layer.name], dtype=dtype).copy()
            if imported is not None and layer.name in imported.buffers else
            np.stack([np.zeros(layer.shape[1], dtype), np.ones(layer.shape[1], dtype)])
            for layer in graph if layer.op.buffer_shapes()}


def shard_sizes(rects: dict[str, Rect]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter in a shard, in packing order (sorted by name)."""
    return [(name, rects[name].shape) for name in sorted(rects)]


def pack(arrays: dict, xp=np):
    """Concatenate a shard's parameters (sorted by name) into one flat array (for numpy, on reused
    memory: a fully-connected layer's gradient is as large as its weights)."""
    parts = [arrays[name].ravel() for name in sorted(arrays)]
    if xp is not np:
        return xp.concatenate(parts)
    out = reuse.empty(sum(p.size for p in parts), np.result_type(*parts))
    return np.concatenate(parts, out=out)


def unpack(flat, layout: list[tuple[str, tuple[int, ...]]]) -> dict:
    """Views of a flat shard as named arrays; `layout` as from `shard_sizes`."""
    out, start = {}, 0
    for name, shape in layout:
        size = prod(shape)
        out[name] = flat[start : start + size].reshape(shape)
        start += size
    return out


def slice_params(params: dict[str, np.ndarray], rects: dict[str, Rect]) -> dict[str, np.ndarray]:
    return {name: params[name][rects[name].relative_to(Rect.full(params[name].shape))] for name in rects}
