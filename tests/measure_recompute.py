"""Recomputation's cost on Machine.local(2), measured against simulated (not a test: run it on a
quiet machine):

    .venv/bin/python -m tests.measure_recompute vgg16_32,alexnet32 data 60

The same strategy (`data`: every layer over samples; `owt`: convolutions over samples, the
fully-connected layers over channels) with and without its convolutions recomputed, trained in
interleaved rounds; the measured increase is the median of the rounds' paired differences, the
simulated one the difference of the simulator's steps under a CostModel of the same cluster (as
bench/accuracy.py predicts).  Prints a JSON row per model, with both memory predictions."""
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import taskrt as tr
from taskrt import models, search
from taskrt.bench.measure import interleaved
from taskrt.graph.config import ParallelConfig as P
from taskrt.planning.memory import plan_memory
from taskrt.planning.peak import peak_memory
from taskrt.search.measured import random_batch

MODELS = {"vgg16_32": lambda: models.vgg16(batch=16, image_size=32, num_classes=10),
          "alexnet32": lambda: models.alexnet(batch=32, image_size=32, num_classes=10)}


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
        cm = search.CostModel(machine, cache=f"{tmp}/costs.json")
        for name in names:
            g = MODELS[name]()
            x, y = random_batch(g, 0)
            trainers = {k: tr.Trainer(g, s, machine, lr=1e-4, momentum=0.9, seed=0)
                        for k, s in strategies(g, split).items()}
            for t in trainers.values():
                t.step(x, y)
            # interleaved rounds (bench.measure.interleaved's turns: two steps in a row, the second
            # timed), each round's plain and recomputing steps back to back: the increase is the
            # median of the rounds' differences, so the host's drift over the rounds cancels
            interleaved({k: t.step for k, t in trainers.items()}, x, y, 2, name)
            times = {k: [] for k in trainers}
            for _ in range(rounds):
                for k, t in trainers.items():
                    t.step(x, y)
                    start = time.perf_counter()
                    t.step(x, y)
                    times[k].append(time.perf_counter() - start)
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
            out[name] = row
            print(name, split, json.dumps(row, indent=1, default=str), flush=True)
    machine.close()
