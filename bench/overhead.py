"""Scheduling overhead per step: measured step time minus the kernel time on the critical path,
for LeNet-5 and a small VGG under data parallelism on 2 local devices, next to Dask's own
per-task cost measured in the same run on trivial tasks."""

from __future__ import annotations

import statistics
import time

import numpy as np
from tqdm import tqdm

from bench.report import write_result
from taskrt import models
from taskrt.config import ParallelConfig
from taskrt.executor import step_key
from taskrt.machine import Machine
from taskrt.strategy import Strategy
from taskrt.trainer import Trainer


def data_parallel(graph, devices):
    return Strategy({l.name: ParallelConfig(n=devices) for l in graph if not l.is_input}, name="data parallel")


def compute_times(client, keys: set, since: float) -> dict:
    """Compute seconds of each task from the scheduler's task stream."""
    out = {}
    for record in client.get_task_stream(start=since):
        key = record["key"]
        if key in keys:
            out[key] = sum(s["stop"] - s["start"] for s in record["startstops"] if s["action"] == "compute")
    return out


def measure_model(machine, name, graph, steps, warmup=2):
    trainer = Trainer(graph, data_parallel(graph, machine.num_devices), machine, lr=1e-4, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(graph.inputs[0].shape).astype(np.float32)
    y = rng.integers(0, graph[graph.losses[0].inputs[0]].shape[1], graph.inputs[1].shape)
    for _ in range(warmup):
        trainer.step(x, y)
    rows = []
    for _ in tqdm(range(steps), desc=name, leave=False, disable=None):
        since = time.time()
        future = trainer.submit(x, y)
        future.result()
        run = future.run
        times = compute_times(machine.client, run.keys, since - 1)
        kernel, path = run.plan.critical_path(lambda t, times=times, tag=run.tag: times.get(step_key(t.key, tag), 0))
        rows.append({"step_s": trainer.stats.wall_s, "critical_kernel_s": kernel, "critical_tasks": len(path),
                     "all_kernel_s": sum(times.values())})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    overhead = med["step_s"] - med["critical_kernel_s"]
    return {
        "model": name,
        "batch": graph.inputs[0].shape[0],
        "tasks": len(trainer.plan.tasks),
        "phases": ", ".join(f"{c} {p}" for p, c in sorted(trainer.plan.phase_counts().items())),
        "step_ms": med["step_s"] * 1e3,
        "kernel_ms_all": med["all_kernel_s"] * 1e3,
        "critical_tasks": int(med["critical_tasks"]),
        "critical_kernel_ms": med["critical_kernel_s"] * 1e3,
        "overhead_ms": overhead * 1e3,
        "overhead_per_task_ms": overhead / len(trainer.plan.tasks) * 1e3,
        "overhead_per_hop_ms": overhead / med["critical_tasks"] * 1e3,
    }


def run(out_dir="results", quick=False):
    steps = 3 if quick else 15
    configs = [
        ("lenet5", models.lenet5(batch=64)),
        ("vgg16-small", models.vgg16(batch=16, image_size=32, num_classes=10, width=0.125)),
    ]
    with Machine.local(2, probe=False) as machine:
        costs = machine.task_overhead(independent=300, chain=60)
        per_task, per_hop = costs["per_task_s"], costs["per_hop_s"]
        rows = [measure_model(machine, name, graph, steps) for name, graph in configs]
    for row in rows:
        row["dask_hops_equivalent"] = row["overhead_ms"] / (per_hop * 1e3)
    summary = [
        f"Dask on trivial tasks, same cluster: {per_task * 1e3:.2f} ms per independent task, "
        f"{per_hop * 1e3:.2f} ms per dependent hop (pinned to one device)",
        "overhead = measured step time - kernel time on the critical path (task stream compute times); "
        "medians over the measured steps",
        "every step creates only the tasks listed: one fwd and one bwd per part, one loss per part, and for "
        "each parameter shard: a grad extraction per remote replica, one update, weight fetches to replicas",
    ]
    columns = [("model", "model"), ("batch", "batch"), ("tasks", "tasks/step"), ("step_ms", "step ms"),
               ("kernel_ms_all", "all kernels ms"), ("critical_tasks", "critical-path tasks"),
               ("critical_kernel_ms", "critical-path kernels ms"), ("overhead_ms", "overhead ms"),
               ("overhead_per_hop_ms", "overhead per critical hop ms"),
               ("dask_hops_equivalent", "overhead / Dask hop"), ("phases", "tasks by phase")]
    md = write_result(out_dir, "overhead", rows, columns,
                      {"devices": 2, "strategy": "data parallel", "steps": steps,
                       "dask_per_task_ms": per_task * 1e3, "dask_per_hop_ms": per_hop * 1e3}, summary)
    print(md.read_text())
    return rows
