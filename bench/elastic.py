"""What surviving lost workers costs: LeNet-5 on 2 local devices under the hand-written mixed
strategy of `taskrt run`, with snapshots off and with the default ("auto": at most 5% of the step
time), in interleaved rounds (medians); then a worker killed with SIGKILL between steps: the time
of the recovery and of the step that recovered, and how far the final parameters are from the
uninterrupted run's."""

from __future__ import annotations

import os
import signal
import statistics
import time
import warnings

import numpy as np

from taskrt import models
from taskrt.bench.report import write_result
from taskrt.cli import lenet_mixed_strategy
from taskrt.machines.machine import Machine
from taskrt.training.trainer import Trainer, WorkerLostWarning

HYPER = {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4}


def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, shape[0])) for _ in range(count)]


def train(trainer, data) -> float:
    """Seconds for the steps, submitted as `taskrt run` does (the next before waiting)."""
    start, pending = time.perf_counter(), None
    for x, y in data:
        future = trainer.submit(x, y)
        if pending is not None:
            pending.result()
        pending = future
    pending.result()
    return time.perf_counter() - start


def max_relative_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for layer in a:
        for name in a[layer]:
            scale = np.maximum(np.abs(b[layer][name]), 1e-6)
            worst = max(worst, float(np.max(np.abs(a[layer][name] - b[layer][name]) / scale)))
    return worst


def run(out_dir="results", quick=False):
    rounds, steps = (2, 10) if quick else (5, 40)
    graph = models.lenet5(batch=64)
    data = batches(graph, steps)
    with Machine.local(2, probe=False) as machine:
        strategy = lenet_mixed_strategy(graph)
        off = Trainer(graph, strategy, machine, snapshot_every=None, **HYPER)
        auto = Trainer(graph, strategy, machine, **HYPER)
        train(off, data[:3]), train(auto, data[:3])  # warm up both
        times = {"off": [], "auto": []}
        for _ in range(rounds):
            times["off"].append(train(off, data))
            times["auto"].append(train(auto, data))
        off_s, auto_s = statistics.median(times["off"]), statistics.median(times["auto"])

        # one worker killed between steps, against the same steps uninterrupted
        reference = Trainer(graph, strategy, machine, **HYPER)
        train(reference, data)
        trainer = Trainer(graph, strategy, machine, **HYPER)
        half = steps // 2
        train(trainer, data[:half])
        address = machine.addresses()[1]
        os.kill(machine.client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
        time.sleep(0.5)  # the scheduler notices the closed connection
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", WorkerLostWarning)
            start = time.perf_counter()
            trainer.step(*data[half])
            recovering_step_s = time.perf_counter() - start
            train(trainer, data[half + 1:])
        [record] = trainer.recoveries
        difference = max_relative_difference(trainer.parameters(), reference.parameters())
    row = {
        "steps_per_round": steps, "rounds": rounds,
        "step_ms_snapshots_off": off_s / steps * 1e3, "step_ms_snapshots_auto": auto_s / steps * 1e3,
        "snapshot_overhead_pct": (auto_s / off_s - 1) * 100,
        "snapshot_every": auto.snapshot_every, "snapshot_ms": auto.snapshot.seconds * 1e3,
        "recovery_s": record["seconds"], "recovering_step_s": recovering_step_s,
        "replayed_steps": len(record["replayed"]), "devices_after": str(record["devices"]),
        "max_rel_difference": difference, "warnings": len(caught),
    }
    summary = [
        f"snapshots every {auto.snapshot_every} step(s) (auto), one costs {row['snapshot_ms']:.1f} ms; median "
        f"step {row['step_ms_snapshots_auto']:.1f} ms with them, {row['step_ms_snapshots_off']:.1f} ms without "
        f"({row['snapshot_overhead_pct']:+.1f}%, medians of {rounds} interleaved rounds of {steps} steps)",
        f"a worker killed (SIGKILL) after step {half}: recovery {record['seconds']:.2f} s (re-plan on "
        f"{record['devices']}, restore the snapshot of step {record['snapshot_step']}, replay "
        f"{len(record['replayed'])} step(s)); the step that recovered took {recovering_step_s:.2f} s",
        f"final parameters against the uninterrupted run: max relative difference {difference:.2e} (float32)",
    ]
    columns = [("step_ms_snapshots_off", "step ms, no snapshots"), ("step_ms_snapshots_auto", "step ms, auto"),
               ("snapshot_overhead_pct", "overhead %"), ("snapshot_every", "snapshot every"),
               ("snapshot_ms", "snapshot ms"), ("recovery_s", "recovery s"),
               ("recovering_step_s", "recovering step s"), ("replayed_steps", "replayed"),
               ("max_rel_difference", "max rel. diff. vs uninterrupted")]
    md = write_result(out_dir, "elastic", [row], columns, {"devices": 2, "model": "lenet5", "batch": 64}, summary)
    print(md.read_text())
    return [row]
