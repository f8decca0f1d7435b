"""Choosing among strategies by timing them on the machine itself.

The simulator ranks strategies by predicted step time, and where its costs are off it can rank
them wrongly: on Machine.local(2) (two worker processes sharing two cores with the scheduler)
its predictions for plans with many messages were the lowest, and the searched VGG-16-32
strategy measured 0.86x the throughput of OWT.  `pick_by_measurement` trains each candidate a
few steps on random data of the graph's shapes, in interleaved rounds (each candidate's second
step in a row is timed, as `bench.measure` does), and returns the fastest.
"""

from __future__ import annotations

import statistics

import numpy as np

from taskrt.graph.strategy import Strategy


def random_batch(graph, seed: int = 0) -> tuple:
    """Random data for every input of `graph`: floats, and labels below the class count of the
    loss that reads them."""
    rng = np.random.default_rng(seed)
    classes = {}
    for loss in graph.losses:
        logits, *labels = loss.inputs
        for name in labels:
            classes[name] = graph[logits].shape[1]
    out = []
    for layer in graph.inputs:
        if layer.name in classes:
            out.append(rng.integers(0, classes[layer.name], layer.shape))
        else:
            out.append(rng.standard_normal(layer.shape).astype(np.float32))
    return tuple(out)


def pick_by_measurement(graph, machine, candidates: dict[str, Strategy], rounds: int = 3, warmup: int = 1,
                        seed: int = 0) -> Strategy:
    """The candidate with the shortest median step on `machine` (a running cluster), named as given;
    its meta["chosen_by_measurement"] holds every candidate's median seconds.  Parameters and
    data are random (seeded): the timings, not the training, count."""
    from taskrt.training.trainer import Trainer

    if machine.is_simulated:
        raise ValueError(f"pick_by_measurement needs a running cluster (Machine.local or Machine.from_client), "
                         f"got the simulated machine {machine.description!r}: its simulation is already the measure")
    if not candidates:
        raise ValueError("pick_by_measurement needs at least one candidate strategy")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"pick_by_measurement: rounds must be at least 1 and warmup at least 0, "
                         f"got rounds={rounds}, warmup={warmup}")
    data = random_batch(graph, seed)
    trainers = {name: Trainer(graph, strategy.validated(graph, machine), machine, lr=1e-4, seed=seed)
                for name, strategy in candidates.items()}
    try:
        for trainer in trainers.values():
            for _ in range(warmup):
                trainer.step(*data)
        seconds = {name: [] for name in trainers}
        for _ in range(rounds):
            for name, trainer in trainers.items():
                trainer.step(*data)  # the timed step follows one of its own, as in training
                trainer.step(*data)
                seconds[name].append(trainer.stats.wall_s)
    finally:
        trainers.clear()  # their state leaves the workers
    median = {name: statistics.median(times) for name, times in seconds.items()}
    best = min(median, key=median.get)
    chosen = candidates[best]
    meta = {**chosen.meta, "chosen_by_measurement": {"chosen": best, "median_step_s": median, "rounds": rounds}}
    return Strategy(chosen.configs, name=chosen.name, meta=meta)
