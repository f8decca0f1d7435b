"""Strategies measured on more CPU cores than two: `Machine.local(n)` single-threaded workers for n
in 1, 2, 4 and 8 on a host with at least n cores (the GPU machine has 16), each strategy's step
measured beside the simulator's prediction (costs measured on that machine, in the same run).

Per device count: the searched strategy (`search.optimize`, which may use fewer devices), data
parallelism and OWT, for AlexNet-32 and VGG-16-32 at the batches the two-core benchmarks use;
rounds interleaved (`bench.measure`), medians reported.  Throughput is against `local(1)`'s
single-device step.  The record is written after each device count, so a run stopped by a time
limit keeps what it measured; device counts above the host's cores are skipped and said so.

What a user would run instead (a comparison, no goal): per device count N, PyTorch
DistributedDataParallel on N one-thread processes over gloo at the same global batch
(bench/torch_ddp.py), measured right after that count's machine has stopped (bench.measure steps
Trainers only, so not interleaved with them), rank 0's step times, their median reported; the
summary gives the searched strategy's throughput against it.  Its rows are the record's
"ddp_rows", apart from "rows", which the verdict judges.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np

from taskrt import search
from taskrt.bench import measure as measured
from taskrt.bench.measure import LOCAL_MODELS, measure
from taskrt.bench.report import markdown_table, write_result
from taskrt.bench.torch_ddp import DDPUnavailable, ddp_step_times
from taskrt.bench.verdicts import searched_behind
from taskrt.machines.machine import Machine

DEVICES = (1, 2, 4, 8)
MODELS = {name: LOCAL_MODELS[name] for name in ("alexnet32", "vgg16_32")}
QUICK_MODELS = {"alexnet32": LOCAL_MODELS["alexnet32"]}
KEPT = ("single device", "data", "owt", "searched")  # of bench.measure's strategies
DDP = "PyTorch DDP (gloo)"
HYPER = {"lr": 1e-4, "momentum": 0.9}  # as bench.measure's Trainers


def strategies_for(graph, machine, cost_model) -> dict:
    """bench.measure's strategies, the searched one ("layer-wise" there) by that name, model
    parallelism left out."""
    out = measured.strategies_for(graph, machine, cost_model)
    if "layer-wise" in out:
        out["searched"] = out.pop("layer-wise")
    return {name: s for name, s in out.items() if name in KEPT}


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row's throughput against its network's single-device step (measured and simulated)."""
    one = {r["model"]: r for r in rows if r["devices"] == 1}
    for r in rows:
        base = one.get(r["model"])
        r["speedup"] = base["measured_ms"] / r["measured_ms"] if base else None
        r["simulated_speedup"] = base["simulated_ms"] / r["simulated_ms"] if base else None
    return rows


def ddp_row(graph, label: str, devices: int, rounds: int, rows: list[dict]) -> dict:
    """DDP on `devices` one-thread processes at the graph's global batch: its median step (rank 0's
    times), and the searched strategy's throughput against it (from `rows`, the same count's; on
    one device, the single device's); where it cannot run, why ("skipped")."""
    row = {"model": label, "devices": devices, "strategy": DDP, "batch": graph.inputs[0].shape[0]}
    try:
        times = ddp_step_times(graph, devices, rounds, warmup=2, **HYPER)
    except (DDPUnavailable, ValueError) as e:
        return {**row, "skipped": str(e)}
    measured = statistics.median(times)
    q1, q3 = np.percentile(times, [25, 75])
    searched = next((r for r in rows if (r["model"], r["devices"]) == (label, devices)
                     and r["strategy"] in ("searched", "single device")), None)  # on one device, every one
    return {**row, "skipped": None, "measured_ms": measured * 1e3, "iqr_ms": (q3 - q1) * 1e3,
            "images_per_s": row["batch"] / measured, "step_times_ms": [t * 1e3 for t in times],
            "searched_ms": searched["measured_ms"] if searched else None,
            "searched_vs_ddp": measured * 1e3 / searched["measured_ms"] if searched else None}


def ddp_lines(ddp_rows: list[dict]) -> list[str]:
    """Per network, the searched strategy's throughput against DDP's on as many processes."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in ddp_rows):
        parts = [f"{r['devices']}: skipped ({r['skipped']})" if r["skipped"] else
                 f"{r['devices']}: DDP {r['measured_ms']:.0f} ms, searched "
                 + (f"{r['searched_vs_ddp']:.2f}x DDP's throughput" if r["searched_vs_ddp"] else "not measured")
                 for r in ddp_rows if r["model"] == model]
        lines.append(f"{model}, the searched strategy against {DDP} on as many one-thread processes, same global "
                     "batch (a comparison, no goal), by device count: " + "; ".join(parts))
    return lines


def summary_lines(rows: list[dict], skipped: list[int], cores: int, ddp_rows: list[dict] = ()) -> list[str]:
    lines = [f"{cores} cores on this host; workers single-threaded, one per device"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        parts = []
        for devices in sorted({r["devices"] for r in mine}):
            at = {r["strategy"]: r for r in mine if r["devices"] == devices}
            parts.append(f"{devices}: " + ", ".join(
                f"{name} {r['speedup']:.2f}x (simulated {r['simulated_speedup']:.2f}x)" if r["speedup"] else
                f"{name} {r['measured_ms']:.0f} ms" for name, r in at.items()))
        lines.append(f"{model}, throughput against one device, measured (simulated), by device count: "
                     + "; ".join(parts))
        behind = [f"{devices} devices ({ratio:.2f}x of the best)" for _, devices, ratio in searched_behind(mine)]
        if any(r["devices"] > 1 for r in mine):
            lines.append(f"{model}: the searched strategy measured fastest at every device count"
                         if not behind else f"{model}: the searched strategy measured slower than another at "
                         + ", ".join(behind))
    if rows:
        errors = [abs(r["simulated_error"]) for r in rows]
        lines.append(f"simulated against measured step time: median |error| {statistics.median(errors):.1%}, "
                     f"largest {max(errors):.1%}")
    lines += ddp_lines(ddp_rows)
    if skipped:
        lines.append(f"not run: {', '.join(map(str, skipped))} devices (more than the host's {cores} cores), nor DDP "
                     "on as many processes")
    return lines


COLUMNS = [("devices", "devices"), ("model", "model"), ("strategy", "strategy"), ("measured_ms", "measured ms"),
           ("iqr_ms", "IQR ms"), ("simulated_ms", "simulated ms"), ("simulated_error", "simulated error"),
           ("speedup", "vs one device"), ("simulated_speedup", "simulated vs one device"),
           ("images_per_s", "images/s"), ("bytes_per_step", "bytes per step"), ("search_pick", "search picked")]
DDP_COLUMNS = [("devices", "processes"), ("model", "model"), ("measured_ms", "measured ms"), ("iqr_ms", "IQR ms"),
               ("images_per_s", "images/s"), ("searched_ms", "searched ms"),
               ("searched_vs_ddp", "searched / DDP throughput"), ("skipped", "skipped")]


def run(out_dir="results", quick=False, devices=DEVICES):
    cores = os.cpu_count() or 1
    chosen = QUICK_MODELS if quick else MODELS
    rounds = 3 if quick else 7
    run_here = [n for n in devices if n <= cores]
    if not run_here:
        raise RuntimeError(f"no device count of {list(devices)} fits this host's {cores} cores")
    skipped = [n for n in devices if n > cores]
    meta = {"rounds": rounds, "cores": cores, "devices": list(devices), "skipped": skipped}
    rows, ddp_rows = [], []
    for n in run_here:
        with Machine.local(n) as machine, tempfile.TemporaryDirectory() as tmp:
            cost_model = search.CostModel(machine, cache=f"{tmp}/costs.json", progress=False)
            for label, make in chosen.items():
                graph = make()
                rows += measure(machine, graph, strategies_for(graph, machine, cost_model), cost_model, rounds,
                                label)
        ddp_rows += [ddp_row(make(), label, n, rounds, rows) for label, make in chosen.items()]
        # after each device count: a run stopped by a time limit keeps what it measured
        md = write_result(out_dir, "scaling_measured", with_speedups(rows), COLUMNS, {**meta, "ddp_rows": ddp_rows},
                          summary_lines(rows, skipped, cores, ddp_rows))
        with md.open("a") as f:
            f.write(f"\n## {DDP}, one-thread processes, the same global batch\n\n"
                    + markdown_table(DDP_COLUMNS, ddp_rows) + "\n")
    print(md.read_text())
    return rows
