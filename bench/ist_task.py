"""The generated task of the IST benchmarks, shaped like the seed's 2-layer Google Speech network
(4096 features, 35 classes, hidden layers of 4096), and what training on it needs: the network,
each step's batches for n sites, and test accuracy of the whole network.

No download: every class is a mixture of `modes` Gaussian clusters in a `latent`-dimensional
space, seen through a fixed random projection to `features` dimensions, a tanh, and noise in
every feature.  A class is not one blob, so no linear read-out separates the classes; a hidden
layer learns it in a few hundred steps (see results/ist.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from search.baselines import data_parallel
from taskrt import Graph, Strategy
from taskrt.ist import full_network_logits, units_of


@dataclass(frozen=True)
class Task:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    calibrate: np.ndarray  # training samples the batch norms' statistics are recomputed on

    @property
    def features(self) -> int:
        return self.x_train.shape[1]

    @property
    def classes(self) -> int:
        return int(self.y_train.max()) + 1


def speech_like(features=4096, classes=35, train=16384, test=1024, calibrate=256, latent=32, modes=4, noise=1.0,
                seed=0) -> Task:
    """Seeded: the same arguments give the same task.  Features standardized with the training
    set's mean and deviation."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, modes, latent))
    projection = rng.standard_normal((latent, features)) / np.sqrt(latent)
    n = train + test
    y = rng.integers(0, classes, n)
    z = centers[y, rng.integers(0, modes, n)] + rng.standard_normal((n, latent))
    x = (np.tanh(z @ projection) + noise * rng.standard_normal((n, features))).astype(np.float32)
    mean, std = x[:train].mean(axis=0), x[:train].std(axis=0)
    x = (x - mean) / std
    return Task(x[:train], y[:train], x[train:], y[train:], x[:calibrate])


def network(widths, batch: int, norm=True, bias=False, name="speech") -> Graph:
    """widths[0] features -> hidden linear layers (each [batch norm] ReLU) -> widths[-1] classes
    (the output layer bias-free, as IST needs).  `bias`: on the hidden layers (with batch norm
    its shift does that job)."""
    g = Graph(name)
    x = g.input("x", (batch, widths[0]))
    for i, width in enumerate(widths[1:-1], start=1):
        x = g.linear(x, width, bias=bias, name=f"fc{i}")
        if norm:
            x = g.batch_norm(x, name=f"bn{i}")
        x = g.relu(x, name=f"relu{i}")
    g.softmax_cross_entropy(g.linear(x, widths[-1], bias=False, name="out"), name="loss")
    return g


def dp_strategy(graph, machine) -> Strategy:
    """The data-parallel baseline: every layer on every device, gradients summed by ring all-reduce."""
    dp = data_parallel(graph, machine)
    return Strategy({name: replace(config, sync="allreduce") for name, config in dp.configs.items()},
                    name="data parallel, ring all-reduce")


def site_batches(task: Task, sites: int, batch: int, seed: int):
    """Endless steps: each a list of `sites` (x, labels) batches of `batch` samples, cut in turn
    from shuffled epochs of the training set.  Every method sees the same samples at a step."""
    rng = np.random.default_rng(seed)
    order, at = rng.permutation(len(task.x_train)), 0
    while True:
        step = []
        for _ in range(sites):
            if at + batch > len(order):
                order, at = rng.permutation(len(task.x_train)), 0
            idx = order[at : at + batch]
            at += batch
            step.append((task.x_train[idx], task.y_train[idx]))
        yield step


def test_accuracy(graph, task: Task, params: dict, buffers: dict, calibrated=True) -> float:
    """Test accuracy of the whole network; its batch norms normalize with statistics recomputed on
    `task.calibrate` (the seed's Sec. 3.3), or with their running statistics.  NaN where the
    parameters are not finite (a diverged run)."""
    running = {k: np.stack([v["running_mean"], v["running_var"]]) for k, v in buffers.items()}
    calibrate = task.calibrate if calibrated and running else None
    logits = full_network_logits(graph, units_of(graph), params, running, task.x_test, calibrate)
    if not np.isfinite(logits).all():
        return float("nan")
    return float((logits.argmax(axis=1) == task.y_test).mean())
