"""Memory per device (issue 54): predicted against measured, the fastest strategy under shrinking
budgets, a network trained where data parallelism does not fit, and recomputation's cost.

  A. Predicted against measured peak per device: bench accuracy's networks (LeNet-5, AlexNet-32,
     VGG-16-32) under its strategies (data, model, OWT and the search's) on Machine.local(1) and
     local(2), a few steps each; the predicted peak is `taskrt.planning.peak` (each device's program
     replayed), the measured one what the worker held at most in the last step (`execution.held`).
  B. The time-memory curve (`bench.memory_curve`): the budgeted search under shrinking budgets on
     local(2), beside data parallelism, OWT and SplitBrain; results/memory.png.
  C. The demonstration: VGG-16-32 at batch 64 in float64 on Machine.local(2) with each worker's Dask
     memory_limit at DEMO_LIMIT, below what data parallelism's step needs: the Trainer refuses it
     before any step; `search.optimize(graph, machine)` (the budget: the devices' memory) returns a
     strategy that trains DEMO_STEPS steps to the single-device trainer's losses, its measured
     peak under the devices' memory.
  D. Recomputation (`bench.memory_recompute`): a budget only recomputation meets, its strategy
     trained exactly, its time cost measured against the simulator's.

Every section rewrites results/memory.{json,md} as it ends, so a crash loses nothing measured.  The
part timings are taken on workers without a memory limit (A, B and D, one cost cache for the run):
timing kernels leaves a worker's process larger, which on C's limited workers counts against their limit.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

import taskrt as tr
from taskrt import models, search
from taskrt.bench import memory_curve, memory_recompute
from taskrt.bench.goals import MEMORY_EXACT, MEMORY_PEAK_GOAL
from taskrt.bench.measure import LOCAL_MODELS, QUICK_MODELS, strategies_for
from taskrt.bench.report import markdown_table, write_result
from taskrt.machines.machine import Machine
from taskrt.search.measured import random_batch
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer

MIB = 2**20
PEAK_STEPS = 3
# each worker's Dask memory_limit in C: about 920 MiB for a step's arrays and kernels' scratch (the rest is the
# worker's own, the freed arrays and free heap it keeps, and the nanny's margin), below data parallelism's 1200
DEMO_LIMIT = "1.8GiB"
DEMO_STEPS = 12
# float64, so that "the same loss as one device" is judged at 1e-9: in float32 a 13-convolution VGG without batch
# norm on random labels multiplies a sum order's rounding about tenfold a step (1.8e-3 apart after 12 steps)
DEMO_HYPER = {"lr": 1e-3, "momentum": 0.9, "seed": 0, "dtype": "float64"}
DEMO_GRAPH = lambda batch=64: models.vgg16(batch=batch, image_size=32, num_classes=10)  # noqa: E731
CURVES = {"vgg16_32": lambda: models.vgg16(batch=64, image_size=32, num_classes=10),
          "alexnet32": lambda: models.alexnet(batch=128, image_size=32, num_classes=10)}
RECOMPUTE = CURVES  # the curves' batches: recomputation costs more there than timing noise
PEAK_COLUMNS = [("model", "model"), ("devices", "devices"), ("strategy", "strategy"), ("device", "device"),
                ("predicted_mib", "predicted MiB"), ("measured_mib", "measured MiB"), ("ratio", "measured / predicted"),
                ("within_goal", "within 10%")]


# ---- A: predicted against measured -----------------------------------------------------------------
def peaks(machine, cost_model, chosen: dict, steps: int = PEAK_STEPS) -> list[dict]:
    rows = []
    for label, make in chosen.items():
        graph = make()
        x, y = random_batch(graph, 0)
        for name, strategy in strategies_for(graph, machine, cost_model).items():
            trainer = Trainer(graph, strategy, machine, lr=1e-4, momentum=0.9, seed=0)
            for _ in range(steps):
                trainer.step(x, y)
            for device, use in trainer.memory().items():
                ratio = use.measured / use.predicted.total
                rows.append({"model": label, "devices": machine.num_devices, "strategy": name, "device": device,
                             "batch": graph.inputs[0].shape[0], "predicted_mib": use.predicted.total / MIB,
                             "measured_mib": use.measured / MIB, "measured_max_mib": use.measured_max / MIB,
                             "ratio": ratio, "within_goal": abs(ratio - 1) <= MEMORY_PEAK_GOAL,
                             "predicted_bytes": use.predicted.total, "measured_bytes": use.measured,
                             "predicted_by_kind_mib": {k: v / MIB for k, v in use.predicted.kinds()}})
    return rows


# ---- C: the demonstration --------------------------------------------------------------------------
def demonstration(cache: str, limit: str = DEMO_LIMIT, steps: int = DEMO_STEPS, batch: int = 64) -> dict:
    graph = DEMO_GRAPH(batch)
    rng = np.random.default_rng(3)
    batches = [random_batch(graph, int(seed)) for seed in rng.integers(0, 2**31, steps)]
    out = {"model": "vgg16_32", "batch": batch, "memory_limit": limit, "steps": steps, "hyper": DEMO_HYPER}
    with Machine.local(2, memory_limit=limit) as machine:
        out["device_memory_mib"] = [d.memory / MIB for d in machine.devices]
        cost_model = search.CostModel(machine, cache=cache, dtype=DEMO_HYPER["dtype"])
        data = search.data_parallel(graph, machine)
        try:
            Trainer(graph, data, machine, **DEMO_HYPER)
            out["data_parallel"] = {"refused": False}
        except tr.DeviceMemoryError as error:
            out["data_parallel"] = {"refused": True, "message": str(error)}
        out["data_parallel"]["predicted_peak_mib"] = memory_recompute.memory_of(
            graph, data, machine, itemsize=np.dtype(DEMO_HYPER["dtype"]).itemsize)["schedule"] / MIB
        start = time.perf_counter()
        strategy = search.optimize(graph, machine, cost_model)
        out["search_s"] = time.perf_counter() - start
        out["strategy"] = strategy.to_dict()
        out["memory_bound"] = strategy.meta.get("memory_bound")
        out["memory_budget_mib"] = (strategy.meta.get("memory_budget") or 0) / MIB
        out["recomputed"] = sorted(n for n, c in strategy.items() if c.recompute)
        out["device_count"] = strategy.meta.get("device_count")
        trainer = Trainer(graph, strategy, machine, **DEMO_HYPER)
        machine.client.run(_reset_max_rss)
        out["losses"] = [trainer.step(x, y) for x, y in batches]
        memory = trainer.memory()
        out["devices"] = [{"device": d, "predicted_mib": u.predicted.total / MIB, "measured_mib": u.measured / MIB,
                           "measured_max_mib": u.measured_max / MIB, "capacity_mib": u.capacity / MIB}
                          for d, u in memory.items()]
        out["worker_limit_mib"] = min(machine.client.run(_limit).values()) / MIB
        # the process's high-water mark (kernels' temporaries and the allocator's kept memory included)
        out["worker_rss_max_mib"] = max(machine.client.run(_max_rss).values()) / MIB
    reference = SingleDeviceTrainer(graph, **DEMO_HYPER)
    out["single_device_losses"] = [reference.step(x, y) for x, y in batches]
    base = np.array(out["single_device_losses"])
    out["max_rel_difference"] = float(np.max(np.abs(np.array(out["losses"]) - base) / np.abs(base)))
    out["same_loss"] = out["max_rel_difference"] <= MEMORY_EXACT
    out["under_memory"] = all(d["measured_max_mib"] <= min(d["capacity_mib"], out["worker_limit_mib"])
                              for d in out["devices"])
    return out


def _limit(dask_worker=None):
    return dask_worker.memory_manager.memory_limit


def _max_rss(dask_worker=None) -> int:
    """The process's resident high-water mark since `_reset_max_rss` (Linux's VmHWM)."""
    from pathlib import Path

    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def _reset_max_rss(dask_worker=None) -> None:
    """Start the high-water mark again from what the process holds now (the search's kernel timings
    before training, on these workers, reach past the step's own needs)."""
    from pathlib import Path

    Path("/proc/self/clear_refs").write_text("5")


# ---- the record and the page -----------------------------------------------------------------------
def summary(record: dict) -> list[str]:
    lines = []
    rows = record.get("rows") or []
    if rows:
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        exact = sum(r["measured_bytes"] == r["predicted_bytes"] for r in rows)
        lines.append(f"A: {len(rows)} devices' peaks ({len({(r['model'], r['devices'], r['strategy']) for r in rows})} "
                     f"cases), {exact} measured equal to the prediction to the byte; the largest difference "
                     f"{worst['ratio'] - 1:+.2%} ({worst['model']}, {worst['strategy']} on {worst['devices']}, device "
                     f"{worst['device']})")
    for c in record.get("curves") or []:
        fits = [p for p in c["points"] if p["kind"] == "searched" and "peak_mib" in p]
        again = [p for p in fits if p["recomputed"]]
        took = (f"{c['bound_search_ratio']:.2f}x the unconstrained search's {c['unconstrained_search_s']:.2f} s "
                f"(median; at most {c['bound_search_ratio_max']:.2f}x)" if c["bound_search_ratio"]
                else "no time: no budget bound")
        free = next(p for p in c["points"] if p["kind"] == "unconstrained")
        lines.append(f"B: {c['model']} (batch {c['batch']}): the search met budgets down to "
                     f"{c['least_budget_mib']:.1f} MiB (held against the peak under the runtime's schedule, kernels' "
                     f"scratch included; the unconstrained strategy's: {free['peak_mib']:.1f} MiB held, its sum "
                     f"{c['unconstrained_sum_mib']:.1f} MiB), simulated step "
                     f"{min(p['simulated_ms'] for p in fits):.0f} to {max(p['simulated_ms'] for p in fits):.0f} ms; "
                     f"{len(again)} of {len(fits)} searched points recompute; a search under a binding budget: {took}")
    demo = record.get("demonstration")
    if demo:
        lines.append(f"C: data parallelism predicted {demo['data_parallel']['predicted_peak_mib']:.0f} MiB on a device "
                     f"of {min(demo['device_memory_mib']):.0f} MiB: "
                     + ("refused before any step" if demo["data_parallel"]["refused"] else "NOT refused")
                     + f"; the search (budget {demo['memory_budget_mib']:.0f} MiB, bound: {demo['memory_bound']}, "
                     f"{len(demo['recomputed'])} layers recomputed) trained {demo['steps']} steps, largest "
                     f"relative loss difference from one device {demo['max_rel_difference']:.1e}; measured peaks "
                     + ", ".join(f"{d['measured_max_mib']:.0f}" for d in demo["devices"])
                     + f" MiB against {', '.join(f'{d:.0f}' for d in demo['device_memory_mib'])} MiB of device memory "
                     f"and a {demo['worker_limit_mib']:.0f} MiB worker limit"
                     + (f" (the workers' processes at most {demo['worker_rss_max_mib']:.0f} MiB while training, "
                        "kernels' temporaries and the allocator's kept memory included)"
                        if "worker_rss_max_mib" in demo else ""))
    for r in record.get("recompute") or []:
        if not r["found"]:
            lines.append(f"D: {r['model']}: no budget only recomputation meets ({r['why']})")
            continue
        lines.append(f"D: {r['model']}: budget {r['budget'] / MIB:.1f} MiB (without recomputation the search meets "
                     f"{r['keep_budget'] / MIB:.1f}, everything recomputed needs "
                     f"{max(r['all_recomputed_memory'].values()) / MIB:.1f}); {len(r['recomputed'])} layers recomputed "
                     f"({r['source']}); float64 against one device {r['float64_max_rel_difference']:.1e}, float32 "
                     f"equal to no recomputation bit for bit: {r['float32_bitwise_equal']}; increase measured "
                     f"{r['measured_increase_ms']:.1f} ms (IQR {r['measured_increase_iqr_ms'][0]:.1f} to "
                     f"{r['measured_increase_iqr_ms'][1]:.1f}), simulated {r['simulated_increase_ms']:.1f} ms "
                     f"({r['increase_error']:+.1%}); the recomputing step simulated {r['step_error']:+.1%} off")
    return lines


def save(out_dir, record: dict) -> Path:
    meta = {k: v for k, v in record.items() if k != "rows"}
    md = write_result(out_dir, "memory", record.get("rows") or [], PEAK_COLUMNS, meta, summary(record))
    text = md.read_text()
    curves = record.get("curves") or []
    if curves:
        text += "\n## B. The fastest strategy under shrinking budgets\n\n" + (
            f"On {record.get('curve_machine')}; time: the simulator's step with this host's measured costs (and "
            "equation 1's sum); peak: the most a device holds under the runtime's schedule, and with the kernels' "
            "scratch on top, which a budget holds on a cluster (the search's own sum beside it). "
            "![time against memory](memory.png)\n\n")
        columns = [("model", "model"), ("kind", "kind"), ("strategy", "strategy"), ("budget_mib", "budget MiB"),
                   ("peak_mib", "peak MiB"), ("needed_mib", "with scratch MiB"), ("sum_mib", "sum MiB"),
                   ("simulated_ms", "simulated ms"),
                   ("equation1_ms", "equation 1 ms"), ("devices_used", "devices used"), ("n_recomputed", "recomputed"),
                   ("search_ms", "search ms")]
        table = [{**p, "model": c["model"], "n_recomputed": len(p.get("recomputed") or []),
                  "search_ms": p["search_s"] * 1e3 if p.get("search_s") else ""} for c in curves for p in c["points"]]
        text += markdown_table(columns, table) + "\n"
    for r in record.get("recompute") or []:
        if r.get("found"):
            text += (f"\n## D. {r['model']}: recomputed layers\n\n{', '.join(r['recomputed'])}; losses in float32 "
                     f"{', '.join(f'{v:.6f}' for v in r['float32_losses'][:6])} ...\n")
    md.write_text(text)
    return md


def run(out_dir="results", quick=False):
    chosen = QUICK_MODELS if quick else LOCAL_MODELS
    record: dict = {"rows": [], "peak_steps": PEAK_STEPS, "goal_peak": MEMORY_PEAK_GOAL,
                    "goal_demo_tolerance": MEMORY_EXACT}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = f"{tmp}/costs.json"
        for devices in (1, 2):
            with Machine.local(devices) as machine:
                cost_model = search.CostModel(machine, cache=cache)
                record["rows"] += peaks(machine, cost_model, chosen)
                save(out_dir, record)
                if devices == 1:
                    continue
                record["curve_machine"] = f"Machine.local(2), {machine.devices[0].kind} workers"
                record["curves"] = []
                for label, make in ({"vgg16_32": CURVES["vgg16_32"]} if quick else CURVES).items():
                    record["curves"].append(memory_curve.curve(label, make(), machine, cost_model))
                    save(out_dir, record)
                memory_curve.draw(record["curves"], f"{out_dir}/memory.png", record["curve_machine"])
                record["recompute"] = []
                for label, make in ({"vgg16_32": RECOMPUTE["vgg16_32"]} if quick else RECOMPUTE).items():
                    record["recompute"].append(memory_recompute.case(label, make(), machine, cost_model,
                                                                     rounds=5 if quick else 15))
                    save(out_dir, record)
                # C's costs, for every device count its search tries, on workers without a limit
                costs = search.CostModel(machine, cache=cache, dtype=DEMO_HYPER["dtype"])
                search.optimize(DEMO_GRAPH(), machine, costs, memory=False)
        record["demonstration"] = demonstration(cache, steps=4 if quick else DEMO_STEPS)
    md = save(out_dir, record)
    print(md.read_text())
    return record
