"""Feeding data to a graph: binding arrays to input layers, batching, and the digits data set."""

from __future__ import annotations

import numpy as np


class InputError(ValueError):
    """Data that does not fit the graph's inputs; raised before any work starts."""


def data_inputs(graph, with_labels=True):
    return [l for l in graph.inputs if with_labels or l.op.dtype != "int64"]


class PrecisionWarning(UserWarning):
    """Values given in a wider float type than the trainer computes in, converted."""


def narrowed(what: str, given, dtype) -> None:
    """Warn (once per place in the caller's code) that floats of `given` dtype are converted to
    the narrower `dtype` the trainer computes in: a float64 array to a float32 trainer."""
    given, dtype = np.dtype(given), np.dtype(dtype)
    if given.kind == "f" and dtype.kind == "f" and given.itemsize > dtype.itemsize:
        import os
        import sys
        import warnings

        inside = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # taskrt's own frames
        frame, level = sys._getframe(1), 2
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside + os.sep):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"{what} given as {given.name}, converted to the trainer's {dtype.name} (give {dtype.name} "
                      f"arrays to skip the copy, or Trainer(dtype={given.name!r}) to compute in {given.name})",
                      PrecisionWarning, stacklevel=level)


def bind_inputs(graph, args, dtype, with_labels=True) -> dict[str, np.ndarray]:
    """Match positional arrays (in the order the inputs were added) or a dict to input layers.

    Checks shape and dtype kind; casts floats to the trainer's dtype (saying so, once per place in
    the caller's code, where that narrows them: `narrowed`) and labels to int64.
    """
    layers = data_inputs(graph, with_labels)
    names = [l.name for l in layers]
    if len(args) == 1 and isinstance(args[0], dict):
        given = dict(args[0])
        missing, extra = set(names) - set(given), set(given) - set(names)
        if missing or extra:
            raise InputError(f"graph {graph.name!r} takes inputs {names}; missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
    else:
        if len(args) != len(names):
            raise InputError(f"graph {graph.name!r} takes {len(names)} input arrays {names}, got {len(args)}")
        given = dict(zip(names, args))
    bound = {}
    for layer in layers:
        value = np.asarray(given[layer.name])
        if value.shape != layer.shape:
            raise InputError(f"input {layer.name!r} expects shape {layer.shape}, got {value.shape}")
        if layer.op.dtype == "int64":
            if value.dtype.kind not in "iu":
                raise InputError(f"input {layer.name!r} holds class labels and needs integers, got {value.dtype}")
            value = value.astype(np.int64)
            _check_labels(graph, layer.name, value)
        else:
            if value.dtype.kind not in "fiub":
                raise InputError(f"input {layer.name!r} needs numbers, got dtype {value.dtype}")
            if not np.isfinite(value).all():
                raise InputError(f"input {layer.name!r} contains NaN or infinite values")
            narrowed(layer.name, value.dtype, dtype)
            value = value.astype(dtype, copy=False)
        bound[layer.name] = np.ascontiguousarray(value)
    return bound


def _check_labels(graph, name, labels):
    for loss_name, _ in graph.consumers(name):
        classes = graph[graph[loss_name].inputs[0]].shape[1]
        if labels.min() < 0 or labels.max() >= classes:
            raise InputError(
                f"input {name!r} (labels of {loss_name!r}) must lie in [0, {classes}), "
                f"got values from {labels.min()} to {labels.max()}"
            )


def logits_layer(graph) -> str:
    losses = graph.losses
    if len(losses) != 1:
        raise InputError(f"predict needs a graph with exactly one loss layer, {graph.name!r} has {len(losses)}")
    return losses[0].inputs[0]


def batches_for_predict(graph, x: np.ndarray):
    """Split `x` into chunks of the graph's batch size, zero-padding the last; yields (chunk, rows used)."""
    layers = data_inputs(graph, with_labels=False)
    if len(layers) != 1:
        raise InputError(f"predict feeds one input, graph {graph.name!r} has {[l.name for l in layers]}")
    (layer,) = layers
    n = layer.shape[0]
    if x.ndim == 0 or len(x) == 0:
        raise InputError(f"predict needs at least one sample of shape {layer.shape[1:]}, got an array of shape "
                         f"{x.shape}")
    if x.shape[1:] != layer.shape[1:]:
        raise InputError(f"input {layer.name!r} expects samples of shape {layer.shape[1:]}, got {x.shape[1:]}")
    for start in range(0, len(x), n):
        chunk = x[start : start + n]
        used = len(chunk)
        if used < n:
            chunk = np.concatenate([chunk, np.zeros((n - used, *chunk.shape[1:]), dtype=chunk.dtype)])
        yield chunk, used


def load_digits(image_size: int = 32, test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8x8 digits (1797 images, shipped inside the package, no download),
    scaled by pixel repetition and zero-padded to `image_size`, values in [0, 1].

    Returns (x_train, y_train, x_test, y_test) with x of shape (n, 1, image_size, image_size).
    """
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    images = digits.images.astype(np.float32) / 16.0
    scale = image_size // 8
    if scale < 1:
        raise InputError(f"digits are 8x8; image_size must be at least 8, got {image_size}")
    images = np.kron(images, np.ones((scale, scale), dtype=np.float32))
    border = image_size - images.shape[1]
    before = border // 2
    images = np.pad(images, ((0, 0), (before, border - before), (before, border - before)))
    x, y = images[:, None], digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def epoch_batches(x, y, batch: int, rng: np.random.Generator):
    """Shuffled full batches of one epoch (the remainder is dropped: the graph's batch is fixed)."""
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch + 1, batch):
        idx = order[start : start + batch]
        yield x[idx], y[idx]
