"""What a memory budget costs `search.optimize` (not a test: run it on a quiet machine):

    .venv/bin/python -m tests.measure_search_budget simulated [case ...]
    .venv/bin/python -m tests.measure_search_budget cluster

`simulated`: simulated P100s at 32 images per device (VGG-16 also as 16 images of 32x32, 10
classes; the cases by index, all by default), a budget halfway between the smallest peak any
strategy reaches (recomputing included) and the unconstrained optimum's; the median CPU time
(`time.process_time`) of 7 alternating runs from a fresh CostModel, without and with the budget,
after a warm-up.  With `--keep`, recomputation is left out (no layer a candidate) and the budget is
halfway between the least peak keeping every activation and the optimum's.

`cluster`: VGG-16-32 at batch 64 on `Machine.local(2)` with a warm cost model (this host's cost
cache): the median wall time of 5 runs without a budget, under one the unconstrained optimum's
schedule fits, and under a binding one (search.optimize holds a cluster's budget against the
peak under the runtime's schedule).
"""

import re
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from unittest import mock

from taskrt import models, search
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.planning.peak import peak_memory

CASES = [("vgg16 (16, 32px, 10)", 1, 2), ("vgg16", 1, 2), ("vgg16", 4, 4), ("resnet50", 1, 2),
         ("resnet50", 1, 4), ("resnet50", 4, 4), ("lenet5", 4, 4), ("alexnet", 4, 4), ("inception_v3", 4, 4)]
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
RUNS = 7


@contextmanager
def keeping_everything():
    with mock.patch("taskrt.search.recompute_search.candidates", return_value=[]), \
            mock.patch("taskrt.search.recompute_tables.candidates", return_value=[]):
        yield


def least_peak(run) -> float:
    """The smallest peak the search finds (its MemoryBudgetError's) under a budget of one byte."""
    try:
        run(1)
    except search.MemoryBudgetError as error:
        number, unit = re.search(r"smallest peak found is ([\d.]+) (\w+)", str(error)).groups()
        return float(number) * UNITS[unit]
    raise AssertionError("a budget of one byte was met")


def simulated(picked, keep: bool) -> None:
    for name, nodes, per in picked:
        machine = Machine.simulated(nodes, per)
        graph = (models.vgg16(batch=16, image_size=32, num_classes=10) if "32px" in name
                 else models.get(name, batch=32 * nodes * per))
        context = keeping_everything if keep else nullcontext

        def run(memory, graph=graph, machine=machine, context=context):
            with context():
                return search.optimize(graph, machine, search.CostModel(machine, cache=False, progress=False),
                                       memory=memory)

        free = run(None)
        top = max(m["total"] for m in free.meta["memory_per_device"].values())
        least = least_peak(run)
        budget = int(least + 0.5 * (top - least))
        run(budget)  # warm-up
        cpu = {None: [], budget: []}
        for _ in range(RUNS):
            for memory in cpu:
                used = time.process_time()
                strategy = run(memory)
                cpu[memory].append(time.process_time() - used)
        c0, c1 = statistics.median(cpu[None]), statistics.median(cpu[budget])
        print(f"{name} on {nodes * per}: CPU {c0 * 1e3:.1f} -> {c1 * 1e3:.1f} ms, {c1 / c0:.2f}x; eq. 1 "
              f"{free.meta['predicted_step_s'] * 1e3:.3f} -> {strategy.meta['predicted_step_s'] * 1e3:.3f} ms; "
              f"recomputed {len(strategy.meta.get('recomputed', []))}; budget {budget / 2**20:.1f} MiB", flush=True)


def cluster() -> None:
    graph = models.vgg16(batch=64, image_size=32, num_classes=10)
    with Machine.local(2) as machine:
        cost_model = search.CostModel(machine)
        free = search.optimize(graph, machine, cost_model, memory=False)
        needed = max(p.needed for p in peak_memory(lower(graph, free), 4, 1).values())
        budgets = {"none": False, "the optimum fits": int(needed * 1.02), "binding": int(needed * 0.995)}
        for label, memory in budgets.items():
            times = []
            for _ in range(5):
                started = time.perf_counter()
                strategy = search.optimize(graph, machine, cost_model, memory=memory)
                times.append(time.perf_counter() - started)
            print(f"{label}: {statistics.median(times) * 1e3:.1f} ms (memory bound: "
                  f"{strategy.meta.get('memory_bound')}, searched against "
                  f"{(strategy.meta.get('memory_budget_searched') or 0) / 2**20:.1f} MiB)", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--keep"]
    if args[:1] == ["cluster"]:
        cluster()
    else:
        simulated([CASES[int(a)] for a in args[1:]] or CASES, keep="--keep" in sys.argv)
