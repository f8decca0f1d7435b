"""Recomputation's cost on Machine.local(2), measured against simulated (not a test: run it on a
quiet machine):

    .venv/bin/python -m tests.measure_recompute vgg16_32,alexnet32 data 60
    .venv/bin/python -m tests.measure_recompute vgg16_32:64 searched 15

The same strategy (`data`: every layer over samples; `owt`: convolutions over samples, the
fully-connected layers over channels; `searched`: what search.optimize returns for a budget only
recomputation meets, halfway between the least peak it finds with recomputation and the least
keeping every activation) with and without its layers recomputed (`data`, `owt`: the
convolutions), trained in interleaved rounds; the measured increase is the median of the rounds'
paired differences, the simulated one the difference of the simulator's steps under a CostModel
of the same cluster (as bench/accuracy.py predicts).  A model may name its batch ("vgg16_32:64").
Prints a JSON row per model, with both memory predictions; `searched` adds the search's budget,
the layers recomputed and the loss of two float64 steps beside one device's."""
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile

import numpy as np

import taskrt as tr
from taskrt import models, search
from taskrt.bench.measure import interleaved
from taskrt.bench.memory_recompute import paired_rounds
from taskrt.graph.config import ParallelConfig as P
from taskrt.planning.memory import plan_memory
from taskrt.planning.peak import peak_memory
from taskrt.search.measured import random_batch
from taskrt.training.reference import SingleDeviceTrainer

MODELS = {"vgg16_32": lambda batch=16: models.vgg16(batch=batch, image_size=32, num_classes=10),
          "alexnet32": lambda batch=32: models.alexnet(batch=batch, image_size=32, num_classes=10)}
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def least_peak(g, machine, cm, keep_everything=False) -> float:
    """The smallest peak the search finds (its MemoryBudgetError's), optionally keeping every activation."""
    from contextlib import ExitStack
    from unittest import mock

    with ExitStack() as stack:
        if keep_everything:  # no layer can be recomputed
            for module in ("recompute_search", "recompute_tables"):
                stack.enter_context(mock.patch(f"taskrt.search.{module}.candidates", return_value=[]))
        try:
            search.optimize(g, machine, cm, fewer_devices=False, memory=1)
        except search.MemoryBudgetError as error:
            number, unit = re.search(r"smallest peak found is ([\d.]+) (\w+)", str(error)).groups()
            return float(number) * UNITS[unit]
    raise AssertionError("a budget of one byte fits")


def searched(g, machine, cm):
    """The budgeted search's strategy for a budget only recomputation meets (between the least
    peaks with and without recomputation, halfway or nearer the latter where the runtime's
    schedule holds more than the search's count), and the same configs keeping every
    activation; with what the search said."""
    keeping, again = least_peak(g, machine, cm, keep_everything=True), least_peak(g, machine, cm)
    for fraction in (0.5, 0.75, 0.95):  # nearer the least peak keeping everything where the schedule's is over
        budget = int(again + fraction * (keeping - again))
        try:
            strategy = search.optimize(g, machine, cm, fewer_devices=False, memory=budget)
            break
        except search.MemoryBudgetError as error:
            print(f"budget {budget}: {error}", flush=True)
    else:
        raise AssertionError("no budget between the least peaks fits")
    plain = tr.Strategy({n: dataclasses.replace(c, recompute=False) for n, c in strategy.items()})
    info = {"budget_bytes": budget, "least_keeping_bytes": keeping, "least_recomputing_bytes": again,
            "recomputed": strategy.meta["recomputed"], "predicted_step_s": strategy.meta["predicted_step_s"],
            "predicted_keeping_s": cm.breakdown(g, plain).total,
            "schedule_peak_per_device": strategy.meta.get("schedule_peak_per_device"),
            "search_recompute": strategy.meta["search"].get("budget", {}).get("recompute")}
    return {"plain": plain.validated(g), "recompute": strategy}, info


def exactness(g, strategy, machine, x, y) -> dict:
    """Two float64 steps of `strategy` beside one device's: the losses and their largest difference."""
    hyper = {"lr": 1e-3, "momentum": 0.9, "dtype": "float64", "seed": 3}
    reference = SingleDeviceTrainer(g, **hyper)
    trainer = tr.Trainer(g, strategy, machine, **hyper)
    losses = [(trainer.step(x, y), reference.step(x, y)) for _ in range(2)]
    return {"losses_float64": losses, "largest_difference": max(abs(a - b) for a, b in losses)}


def strategies(g, split):
    if split == "data":
        plain = tr.Strategy({l.name: P(n=2) for l in g if not l.is_input})
    else:  # convolutions over samples, fully-connected layers over channels (OWT-style)
        plain = tr.Strategy({l.name: P(c=2) if l.kind == "linear" else P(n=2) if l.kind != "softmax_cross_entropy"
                             else P() for l in g if not l.is_input})
    again = tr.Strategy({n: dataclasses.replace(c, recompute=g[n].kind == "conv2d") for n, c in plain.items()})
    return {"plain": plain.validated(g), "recompute": again.validated(g)}


if __name__ == "__main__":
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(MODELS)
    split = sys.argv[2] if len(sys.argv) > 2 else "data"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    machine = tr.Machine.local(2)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the search times every config's parts: the cache of this host's part timings saves that
        cm = search.CostModel(machine, cache=None if split == "searched" else f"{tmp}/costs.json")
        for name in names:
            model, _, batch = name.partition(":")
            g = MODELS[model](int(batch)) if batch else MODELS[model]()
            x, y = random_batch(g, 0)
            chosen, info = searched(g, machine, cm) if split == "searched" else (strategies(g, split), None)
            trainers = {k: tr.Trainer(g, s, machine, lr=1e-4, momentum=0.9, seed=0) for k, s in chosen.items()}
            # interleaved rounds (bench.memory_recompute.paired_rounds: two steps in a row, the second
            # timed), each round's plain and recomputing steps back to back: the increase is the
            # median of the rounds' differences, so the host's drift over the rounds cancels
            interleaved({k: t.step for k, t in trainers.items()}, x, y, 2, name)
            times, _ = paired_rounds(trainers, x, y, rounds)
            load = os.getloadavg()
            sims, mem = {}, {}
            for k, t in trainers.items():
                runtime = cm.runtime(t.plan, t.executor.fused, t.executor_kind)
                sims[k] = cm.simulate(t.plan, t.executor.fused, runtime, t.executor_kind).step_s
                mem[k] = ({d: m.total for d, m in plan_memory(t.plan).items()},
                          {d: p.total for d, p in peak_memory(t.plan).items()})
            measured = {k: statistics.median(v) for k, v in times.items()}
            differences = [a - b for a, b in zip(times["recompute"], times["plain"])]
            quartile = {k: float(np.percentile(v, 25)) for k, v in times.items()}  # the least disturbed
            q1, q3 = np.percentile(differences, [25, 75])
            row = {"measured_ms": {k: v * 1e3 for k, v in measured.items()},
                   "load_average": load,
                   "simulated_ms": {k: v * 1e3 for k, v in sims.items()},
                   "measured_increase_ms": statistics.median(differences) * 1e3,
                   "measured_increase_iqr_ms": [q1 * 1e3, q3 * 1e3],
                   "measured_first_quartile_ms": {k: v * 1e3 for k, v in quartile.items()},
                   "first_quartile_increase_ms": (quartile["recompute"] - quartile["plain"]) * 1e3,
                   "simulated_increase_ms": (sims["recompute"] - sims["plain"]) * 1e3,
                   "recompute_kernels_ms": sum(cm.timer(trainers["recompute"].plan)(task)
                                               for task in trainers["recompute"].plan.tasks
                                               if task.phase == "recompute") * 1e3,
                   "memory_sum_bytes": {k: v[0] for k, v in mem.items()},
                   "memory_peak_bytes": {k: v[1] for k, v in mem.items()}}
            row["increase_error"] = row["simulated_increase_ms"] / row["measured_increase_ms"] - 1
            if info is not None:
                first = {k: t.step(x, y) for k, t in trainers.items()}  # float32: the same kernels on the same tiles
                row.update(search=info, float32_losses_equal=first["plain"] == first["recompute"],
                           **exactness(g, chosen["recompute"], machine, x, y))
            out[name] = row
            print(name, split, json.dumps(row, indent=1, default=str), flush=True)
    machine.close()
