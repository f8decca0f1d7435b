"""Datasets read by the workers against batches sent from the client (issue 38): bytes from the
client per step and step time, LeNet-5 (batch 64), AlexNet at 64 px (batch 32) and VGG-16 at 64
px (batch 16) on Machine.local(2) under the searched strategy (search.optimize, costs from the
default cost cache, measured where missing).

Both paths train on the same batches of one ArrayDataset (SAMPLES samples of seeded synthetic
values), from the same initial parameters, so their losses must be equal: the numpy path indexes
the arrays on the client and sends the batch (`Trainer.submit`), the dataset path sends only the
batch's indices (`Trainer.submit_from`: each device reads its own part of the copy placed on it
once).  Beside them, the time to generate one batch of the Synthetic source on one core (what a
device spends when it generates its tiles instead of reading them).  Each path runs `STEPS` steps
with PREFETCH in flight (as `fit` does with its default), rounds interleaved with the order
alternating; a round's time per step is its wall time over its steps; medians.

Bytes come from Dask's own counters: `Client.scheduler_comm.byte_count` (the client's batched
stream to the scheduler: each step's graph, with the tiles or indices it carries) and the
scheduler's `stream_comms[worker].byte_count` (its batched streams to the workers), read before
and after the timed steps; tiles too large to ride in the graph go straight to their workers
(`taskrt.execution.executor.INLINE_DATA_BYTES`), which no Dask counter counts: those are the sizes the
scheduler records for the scattered keys (`TaskState.nbytes`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np
from tqdm import tqdm

from taskrt import models, search
from taskrt.bench.goals import GOAL_BYTES
from taskrt.bench.report import markdown_table, write_result
from taskrt.data.datasets import ArrayDataset, Synthetic
from taskrt.machines.machine import Machine
from taskrt.training.trainer import Trainer

MODELS = {
    "lenet5": lambda: models.lenet5(batch=64),
    "alexnet64": lambda: models.alexnet(batch=32, image_size=64, num_classes=10),
    "vgg16_64": lambda: models.vgg16(batch=16, image_size=64, num_classes=10),
}
QUICK = ("lenet5",)
HYPER = {"lr": 1e-4, "momentum": 0.9}  # small: random data stays finite

STEPS, PREFETCH = 8, 3  # as fit's default
POOL = 8  # distinct batches, used in turn
SAMPLES = 512


def _stream_bytes(dask_scheduler=None) -> int:
    return sum(stream.byte_count for stream in dask_scheduler.stream_comms.values())


def _scattered_nbytes(keys, dask_scheduler=None) -> int:
    return sum(dask_scheduler.tasks[k].nbytes for k in keys if k in dask_scheduler.tasks)


class Counters:
    """Bytes the client sent the scheduler and the scheduler sent the workers, since `start`."""

    def __init__(self, client):
        self.client = client
        self.sent = {"client_to_scheduler": 0, "scheduler_to_workers": 0}

    def __enter__(self):
        self._start = (self.client.scheduler_comm.byte_count, self.client.run_on_scheduler(_stream_bytes))
        return self

    def __exit__(self, *exc):
        time.sleep(0.05)  # the batched streams send at most every few ms
        self.sent["client_to_scheduler"] += self.client.scheduler_comm.byte_count - self._start[0]
        self.sent["scheduler_to_workers"] += self.client.run_on_scheduler(_stream_bytes) - self._start[1]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pipelined(submit, count: int, first: int) -> tuple[float, list]:
    """Seconds per step of `count` steps (`submit(k)` for k from `first`), PREFETCH in flight; their losses."""
    pending, losses = deque(), []
    start = time.perf_counter()
    for k in range(first, first + count):
        if len(pending) >= PREFETCH:
            losses.append(pending.popleft().result())
        pending.append(submit(k))
    while pending:
        losses.append(pending.popleft().result())
    return (time.perf_counter() - start) / count, losses


def measure(machine, name, graph, strategy, rounds: int) -> dict:
    image = graph.inputs[0]
    batch = image.shape[0]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    source = Synthetic(SAMPLES, shape=image.shape[1:], classes=classes, seed=1)
    everything = (slice(None),) * (len(image.shape) - 1)
    every = np.arange(SAMPLES)
    x, y = source.read("images", every, everything), source.read("labels", every, ())
    dataset = ArrayDataset({"images": x, "labels": y}, name="synthetic-arrays")
    rng = np.random.default_rng(0)
    pool = [rng.choice(SAMPLES, batch, replace=False).astype(np.int64) for _ in range(POOL)]
    generate_s = min(_timed(lambda: source.read("images", pool[0], everything)) for _ in range(3))
    trainers = {"numpy": Trainer(graph, strategy, machine, seed=0, **HYPER),
                "dataset": Trainer(graph, strategy, machine, seed=0, **HYPER)}
    submit = {"numpy": lambda k: trainers["numpy"].submit(x[pool[k % POOL]], y[pool[k % POOL]]),
              "dataset": lambda k: trainers["dataset"].submit_from(dataset, pool[k % POOL])}
    losses = {path: [] for path in trainers}
    for path in trainers:  # warm-up: kernels, placement, first-touch memory
        losses[path] += pipelined(submit[path], 2, 0)[1]
    # what the numpy path scatters straight to workers (no Dask counter sees it): the scheduler's sizes
    future = submit["numpy"](2)
    scattered_keys = [k for k in future.run.keys if isinstance(k, str) and k.startswith("ndarray-")]
    scattered = machine.client.run_on_scheduler(_scattered_nbytes, scattered_keys)
    losses["numpy"].append(future.result())
    losses["dataset"].append(submit["dataset"](2).result())
    times = {path: [] for path in trainers}
    counters = {path: Counters(machine.client) for path in trainers}
    step = 3
    for r in tqdm(range(rounds), desc=f"{name}, numpy and dataset paths", leave=False, disable=None):
        for path in (("numpy", "dataset") if r % 2 == 0 else ("dataset", "numpy")):
            with counters[path]:
                seconds, got = pipelined(submit[path], STEPS, step)
            times[path].append(seconds)
            losses[path] += got
        step += STEPS
    steps = rounds * STEPS
    from distributed.protocol import pickle

    plan = trainers["numpy"].plan
    row = {"model": name, "batch": batch, "strategy": strategy.name or "searched",
           "input_split": str(strategy[image.name]), "plan_data_bytes": sum(plan.data_nbytes.values()),
           "index_bytes": len(pickle.dumps(pool[0])), "numpy_scattered_bytes": scattered,
           "losses_equal": losses["numpy"] == losses["dataset"], "rounds": rounds, "steps_per_round": STEPS,
           "synthetic_batch_ms": generate_s * 1e3}
    for path in trainers:
        sent = counters[path].sent
        row[f"{path}_client_to_scheduler_bytes"] = round(sent["client_to_scheduler"] / steps)
        row[f"{path}_scheduler_to_workers_bytes"] = round(sent["scheduler_to_workers"] / steps)
        median = statistics.median(times[path])
        q1, q3 = np.percentile(times[path], [25, 75])
        row[f"{path}_ms"], row[f"{path}_iqr_ms"] = median * 1e3, (q3 - q1) * 1e3
        row[f"{path}_step_ms_rounds"] = [t * 1e3 for t in times[path]]
    row["numpy_client_bytes"] = row["numpy_client_to_scheduler_bytes"] + scattered
    row["dataset_client_bytes"] = row["dataset_client_to_scheduler_bytes"]
    # the sample data the counters saw leave: what the numpy path sent beyond the dataset path
    row["counted_data_bytes"] = row["numpy_client_bytes"] - row["dataset_client_bytes"] + row["index_bytes"]
    row["time_ratio"] = row["dataset_ms"] / row["numpy_ms"]
    row["noise"] = max(row["numpy_iqr_ms"] / row["numpy_ms"], row["dataset_iqr_ms"] / row["dataset_ms"], 0.03)
    return row


def verdicts(rows) -> tuple[list[str], dict]:
    """One line per model, and each goal met or not: at most GOAL_BYTES of sample data per step
    from the client on the dataset path ("bytes"); no slower anywhere beyond the noise ("no
    slower"); faster beyond the noise where the batch is largest ("faster", with one model: None)."""
    lines = []
    largest = max(rows, key=lambda r: r["plan_data_bytes"])
    goals = {"bytes": all(r["index_bytes"] <= GOAL_BYTES for r in rows),
             "no slower": all(r["time_ratio"] <= 1 + r["noise"] for r in rows),
             "faster": largest["time_ratio"] < 1 - largest["noise"] if len(rows) > 1 else None}
    for row in rows:
        slower = row["time_ratio"] > 1 + row["noise"]
        faster = row["time_ratio"] < 1 - row["noise"]
        timing = "faster" if faster else "SLOWER" if slower else "the same within the noise"
        lines.append(
            f"{row['model']} (batch {row['batch']}, input {row['input_split']}): sample data from the client "
            f"{row['index_bytes']:,} B per step (the indices) against {row['plan_data_bytes']:,} B (the batch); "
            f"client bytes per step {row['dataset_client_bytes']:,.0f} against {row['numpy_client_bytes']:,.0f}, "
            f"so the counters saw {row['counted_data_bytes']:,.0f} B of batch leave the client on the numpy path "
            f"({row['counted_data_bytes'] / row['plan_data_bytes']:.1%} of the plan's data bytes); step "
            f"{row['dataset_ms']:.1f} ms against {row['numpy_ms']:.1f} ms = {row['time_ratio']:.2f}x, "
            f"noise +-{row['noise']:.0%}: {timing}; losses equal: {row['losses_equal']}")
    return lines, goals


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, path, color in ((-0.2, "numpy", "tab:gray"), (0.2, "dataset", "tab:blue")):
        left.bar(x + offset, [r[f"{path}_ms"] for r in rows], 0.4, yerr=[r[f"{path}_iqr_ms"] / 2 for r in rows],
                 label=f"{path} path", color=color)
        right.bar(x + offset, [r[f"{path}_client_bytes"] for r in rows], 0.4, label=f"{path} path", color=color)
    right.scatter(x, [r["plan_data_bytes"] for r in rows], marker="_", s=400, color="k", label="the batch (plan)")
    right.scatter(x, [r["index_bytes"] for r in rows], marker="_", s=400, color="tab:red", label="the indices")
    left.set(xticks=x, xticklabels=names, ylabel=f"ms per step (median, {PREFETCH} in flight)",
             title="step time on Machine.local(2)")
    right.set(xticks=x, xticklabels=names, ylabel="bytes per step", yscale="log",
              title="bytes from the client per step (Dask's counters)")
    left.legend()
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{out_dir}/data.png", dpi=120)
    plt.close(fig)


def run(out_dir="results", quick=False):
    chosen = QUICK if quick else tuple(MODELS)
    rounds = 3 if quick else 7
    rows = []
    with Machine.local(2) as machine:
        cost_model = search.CostModel(machine, progress=False)
        for name in chosen:
            graph = MODELS[name]()
            strategy = search.optimize(graph, machine, cost_model)
            rows.append(measure(machine, name, graph, strategy, rounds))
    report(out_dir, rows, rounds)
    return rows


def report(out_dir, rows, rounds):
    """results/data.json, .md (bench.pages says first what it measures, how to rerun it, the goals
    and this run's verdicts) and .png."""
    lines, goals = verdicts(rows)
    columns = [("model", "model"), ("batch", "batch"), ("input_split", "input split"),
               ("plan_data_bytes", "batch bytes (plan)"), ("index_bytes", "index bytes"),
               ("numpy_client_bytes", "client B/step, numpy"), ("dataset_client_bytes", "client B/step, dataset"),
               ("numpy_scheduler_to_workers_bytes", "scheduler->workers B/step, numpy"),
               ("dataset_scheduler_to_workers_bytes", "scheduler->workers B/step, dataset"),
               ("numpy_ms", "step ms, numpy"), ("dataset_ms", "step ms, dataset"),
               ("time_ratio", "dataset / numpy time"), ("losses_equal", "losses equal")]
    meta = {"devices": 2, "steps_per_round": STEPS, "prefetch": PREFETCH, "rounds": rounds, "goal_bytes": GOAL_BYTES,
            "goals": goals}
    md = write_result(out_dir, "data", rows, columns, meta, lines)
    md.write_text(md.read_text() + "\n## Bytes and times per model\n\n" + markdown_table(
        [("model", "model"), ("numpy_client_to_scheduler_bytes", "client->scheduler, numpy"),
         ("numpy_scattered_bytes", "scattered, numpy"),
         ("dataset_client_to_scheduler_bytes", "client->scheduler, dataset"),
         ("counted_data_bytes", "batch bytes the counters saw"), ("numpy_iqr_ms", "IQR ms, numpy"),
         ("dataset_iqr_ms", "IQR ms, dataset"), ("synthetic_batch_ms", "Synthetic batch ms (one core)"),
         ("strategy", "strategy")], rows) + "\n")
    plot(rows, out_dir)
    print(md.read_text())
