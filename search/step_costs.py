"""The runtime's processor time per Dask task and per message, fitted to real training steps.

Where devices share a host's cores with the runtime (CPU workers on one host), the scheduler,
the client and the workers' event loops take processor time from the kernels
(taskrt.simulate: the background).  Costs measured on no-op tasks submitted all at once
(`Machine.calibrate`) miss most of what a step's tasks cost: dependent tasks scheduled one
wave at a time, their specs, the exports of a fused run, each step's graph built and
submitted.  So a small calibration network, none of the benchmark's, trains a few steps under
data, model and OWT parallelism and a spatial split; all processes' CPU time over the steps,
less the workers' task threads' own, is fitted by non-negative least squares to each
step's fused tasks and messages between devices: the quantities the simulator
charges (`taskrt.simulate.Runtime`), less the bytes' share measured apart.
"""

from __future__ import annotations

import numpy as np

STEPS, WARMUP = 4, 2


def calibration_network(batch: int = 32):
    """Two conv-pool stages and two fully-connected layers at 32x32: a step of tens of
    milliseconds on two CPU workers, with activations, weights and gradients all of a size
    that moves."""
    from taskrt.graph import Graph

    g = Graph("calibration")
    x = g.input("image", (batch, 3, 32, 32))
    x = g.conv2d(x, 32, 3, padding=1, activation="relu", name="conv1")
    x = g.pool2d(x, 2, name="pool1")
    x = g.conv2d(x, 64, 3, padding=1, activation="relu", name="conv2")
    x = g.pool2d(x, 2, name="pool2")
    x = g.flatten(x, name="flatten")
    x = g.linear(x, 256, activation="relu", name="fc1")
    x = g.linear(x, 10, name="fc2")
    g.softmax_cross_entropy(x, name="loss")
    return g


def strategies(graph, machine) -> dict:
    """Data, model and OWT parallelism, and conv and pool layers split in height (the rest over
    samples): few tasks and many bytes, many tasks and few bytes, and between."""
    from search.baselines import BASELINES
    from taskrt.config import ParallelConfig
    from taskrt.strategy import Strategy

    out = {name: make(graph, machine) for name, make in BASELINES.items()}
    d = machine.num_devices
    out["height"] = Strategy({
        layer.name: ParallelConfig(**{"h" if "h" in layer.dims else "n": d}, devices=tuple(range(d)))
        for layer in graph if not layer.is_input}, name="height")
    return {name: s.validated(graph, machine) for name, s in out.items()}


def step_cpu_costs(machine, cpu_per_byte_s: float, steps: int = STEPS, warmup: int = WARMUP) -> dict:
    """{"cpu_per_task_s", "cpu_per_message_s"} fitted to training steps of `calibration_network`
    (module docstring) less `cpu_per_byte_s` for each byte moved, and the rows fitted
    ("step_cpu_rows").  The calibration network moves too few bytes to tell their cost apart
    from the noise: `Machine.calibrate` measures it on large messages."""
    from scipy.optimize import nnls

    from search.measured import random_batch
    from taskrt.fusion import fused_plan
    from taskrt.trainer import Trainer

    graph = calibration_network()
    x, y = random_batch(graph, 0)
    client = machine.client
    rows = []
    for name, strategy in strategies(graph, machine).items():
        # no snapshots: training takes one rarely enough to cost under 5%, not in every few steps
        trainer = Trainer(graph, strategy, machine, lr=1e-4, momentum=0.9, snapshot_every=None)
        for _ in range(warmup):
            trainer.step(x, y)
        before = _cpu(client)
        for _ in range(steps):
            trainer.step(x, y)
        total, task_threads = (after - start for after, start in zip(_cpu(client), before))
        fused, _ = fused_plan(trainer.plan)
        rows.append({"strategy": name, "tasks": len(fused.tasks), "messages": len(fused.transfers()),
                     "bytes": fused.bytes_moved, "runtime_cpu_s": max(total - task_threads, 0.0) / steps})
        del trainer
    features = np.array([[r["tasks"], r["messages"]] for r in rows], dtype=float)
    scale = np.maximum(features.max(axis=0), 1.0)  # columns of comparable size for nnls
    net = np.array([r["runtime_cpu_s"] - cpu_per_byte_s * r["bytes"] for r in rows])
    coef, _ = nnls(features / scale, np.maximum(net, 0.0))
    per_task, per_message = (coef / scale).tolist()
    return {"cpu_per_task_s": per_task, "cpu_per_message_s": per_message, "step_cpu_rows": rows}


def _cpu(client) -> tuple[float, float]:
    """Processor seconds of all the workers and this process (where a local scheduler runs), and
    of the workers' task threads alone: kernels slowed by the runtime's work take no more
    processor time, only more wall time, so the task stream's durations would not do."""
    from taskrt.machine import _process_cpu

    workers = client.run(_worker_cpu).values()
    return sum(w[0] for w in workers) + _process_cpu(), sum(w[1] for w in workers)


def _worker_cpu() -> tuple[float, float]:
    """This worker process's processor seconds, and those of the threads running its tasks."""
    import threading

    import psutil

    from taskrt.machine import _process_cpu

    runs_tasks = {t.native_id for t in threading.enumerate() if "Dask-Default-Threads" in t.name}
    return _process_cpu(), sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in runs_tasks)
