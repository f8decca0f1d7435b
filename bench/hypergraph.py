"""Seed 003 (hypergraph-partitioned model parallelism) on VGG-16 at batch 32, beside the thesis.

  Tables 5.1-5.12  work balance and forward communication volume of every method at N = 2..128:
                   layer-wise, filter-wise horizontal and incremental, channel-wise incremental,
                   coarse- and fine-grain hypergraphs partitioned by Mt-KaHyPar (epsilon 0.1); a
                   lower bound on any coarse-grain partition's volume at that balance beside them
  Table 5.14       one epoch of 64,000 images: data parallel 2 (N-1) p per step (formula and the
                   runtime's all-reduce plan) against the hypergraph partition (2x its forward volume,
                   and the runtime's plan)
  Appendix A       final imbalance 0.03, 0.15 and 0.2
  Table 5.15-like  time per epoch of 10,240 images by simulation on nodes like the thesis's:
                   data parallel, layer-wise, hypergraph and the search's strategy, bytes beside

Work is forward + backward FLOPs (the thesis profiled time and FLOPs; its units are its own), so
its work columns compare as ratios.  Communication is given in MiB (bytes) and in MV, 2^20 values:
the thesis's "MB" counts values, not bytes (its Table 5.13 lists a 56x56x256 map as "800K").  The
layer-wise partition shows it: its volume, max and avg communication equal the thesis's in MV at
every N (the same cut points), and are 4x them in MiB.  Thesis figures are compared in MV.
`optimal` (an exact mixed-integer program) gives the least volume any coarse-grain partition can
have at N = 2 and 4 under these weights.  Writes results/hypergraph.json, .md and .png.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from taskrt import models, search
from taskrt.bench.goals import THESIS_VOLUME
from taskrt.bench.pages import header
from taskrt.bench.report import machine_description, markdown_table
from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.search import hypergraph as hg
from taskrt.search.cost import CostModel

MIB = 2 ** 20
MV = 4 * 2 ** 20  # bytes of 2^20 float32 values: the thesis's "MB"
BATCH = 32

# ... and their work max/avg (Tables 5.1, 5.3, 5.5, 5.11; Table 5.9 is not in the text)
THESIS_MAX_AVG = {
    "layer-wise": {2: 22757 / 21500, 4: 12827 / 10750, 8: 7253 / 5375, 16: 6624 / 2687},
    "horizontal": {n: 1.0 for n in (2, 4, 8, 16, 32, 64, 128)},
    "filter-wise incremental": {2: 21524 / 21510, 4: 10767 / 10755, 8: 5419 / 5377, 16: 2720 / 2688,
                                32: 1362 / 1344, 64: 919 / 682, 128: 715 / 352},
    "fine hypergraph": {2: 21761 / 21369, 4: 11262 / 10684, 8: 5516 / 5342, 16: 2807 / 2671, 32: 1552 / 1335,
                        64: 690 / 667, 128: 546 / 333},
}
# ... and layer-wise max and avg communication (Table 5.2), which pin down the unit
THESIS_LAYER_WISE_COMM = {2: (24.5, 12.2), 4: (49.0, 21.4), 8: (49.0, 16.4), 16: (98.0, 17.0)}
THESIS_IMBALANCE = {  # Appendix A: forward volume (MV) at final imbalance 0.03, 0.15, 0.2
    ("coarse hypergraph", 0.03): {2: 27.5, 4: 63.4, 8: 303.1, 16: 659.5, 32: 1302.1, 64: 2477.8, 128: 4634.2},
    ("coarse hypergraph", 0.15): {2: 27.5, 4: 59.8, 8: 293.1, 16: 655.7, 32: 1288.9, 64: 2430.8, 128: 4582.7},
    ("coarse hypergraph", 0.2): {2: 27.5, 4: 58.4, 8: 282.4, 16: 629.9, 32: 1284.0, 64: 2479.5, 128: 4510.6},
    ("fine hypergraph", 0.03): {2: 26.6, 4: 61.2, 8: 288.9, 16: 540.0, 32: 812.9, 64: 1344.0, 128: 2114.1},
    ("fine hypergraph", 0.15): {2: 15.3, 4: 61.0, 8: 260.0, 16: 426.2, 32: 891.2, 64: 1382.8, 128: 1971.1},
    ("fine hypergraph", 0.2): {2: 24.5, 4: 72.8, 8: 303.2, 16: 532.6, 32: 851.4, 64: 1410.2, 128: 2123.8},
}
# (N, batch) -> (data parallel GB, hypergraph GB): the first is GiB of bytes (2 (N-1) p, truncated), the
# second 2^30 values (twice the forward volume in MV per step, e.g. 27.5 * 2 * 2000 / 1024 = 107 at N = 2)
THESIS_TABLE_5_14 = {
    (2, 16): (4123, 107), (2, 32): (2061, 107), (2, 64): (1030, 107), (4, 16): (12370, 239), (4, 32): (6185, 239),
    (4, 64): (3092, 239), (8, 16): (28863, 1167), (8, 32): (14431, 1167), (8, 64): (7215, 1167),
}
THESIS_TABLE_5_15 = {  # seconds per epoch: (N, method) -> {batch: s}
    (2, "layer-wise"): {16: 5431, 32: 4718, 64: 3831}, (2, "coarse hypergraph"): {16: 5630, 32: 4754, 64: 4012},
    (2, "sync data parallel"): {16: 10140, 32: 6906, 64: 4979},
    (4, "layer-wise"): {16: 3263, 32: 2801, 64: 2478}, (4, "coarse hypergraph"): {16: 3306, 32: 2662, 64: 2050},
    (4, "sync data parallel"): {16: 5898, 32: 3855, 64: 2628},
}
EPOCH_5_14, EPOCH_5_15 = 64_000, 10_240
# The thesis's nodes: two 28-core Skylake Xeons (112 threads), Omni-Path 100 between nodes
OPA_BANDWIDTH, OPA_LATENCY = 100e9 / 8, 1e-6


def lower_bound(model: hg.CoarseModel, k: int, epsilon: float) -> int:
    """No coarse-grain partition with every part's work within (1 + epsilon) of the average moves
    less: a reader layer of work W spans at least ceil(W / ((1 + epsilon) avg)) parts, and each map
    it reads reaches all of them, its producer's part at most excepted."""
    cap = (1 + epsilon) * model.total_work / k
    bound = 0
    for net in model.nets:
        span = max(math.ceil(model.layers[r].size * model.layers[r].work / cap - 1e-9) for r in net.readers)
        bound += net.cost * model.layers[net.producer].size * (span - 1)
    return bound


def _row(part: hg.Partition, method: str, n: int, **extra) -> dict:
    m = part.metrics()
    return {"N": n, "method": method, "max_gflop": round(m.max_work / 1e9), "min_gflop": round(m.min_work / 1e9),
            "avg_gflop": round(m.avg_work / 1e9), "max_min": round(m.max_min, 2), "max_avg": round(m.max_avg, 3),
            "thesis_max_avg": round(THESIS_MAX_AVG.get(method, {}).get(n, 0), 2) or "",
            "volume_mib": round(m.volume / MIB, 1), "volume_mv": round(m.volume / MV, 3),
            "thesis_mv": THESIS_VOLUME.get(method, {}).get(n, ""), "max_comm_mv": round(m.max_comm / MV, 3),
            "avg_comm_mv": round(m.avg_comm / MV, 3), "max_avg_comm": round(m.max_avg_comm, 1),
            "seconds": round(part.seconds, 3), **extra}


TIMING_RUNS = 5  # the coarse-grain partition's seconds: median of this many calls
# Mt-KaHyPar's strongest setting here: deterministic quality preset, 5 more V-cycles, 128 atoms a layer
QUALITY = {"preset": "deterministic_quality", "vcycles": 5, "atoms": 128}


def balance_tables(coarse, fine, ns, epsilon=0.1, seed=0, quality_upto=32, optimal_upto=4) -> list[dict]:
    rows = []
    for n in ns:
        print(f"  N={n}", flush=True)
        if n <= 16:
            rows.append(_row(hg.layer_wise(coarse, n), "layer-wise", n))
        rows.append(_row(hg.horizontal(coarse, n), "horizontal", n))
        rows.append(_row(hg.incremental(coarse, n), "filter-wise incremental", n))
        rows.append(_row(hg.incremental(fine, n), "channel-wise incremental", n))
        bound = round(lower_bound(coarse, n, epsilon) / MV, 1)
        part = hg.partition(coarse, n, epsilon=epsilon, seed=seed)
        startup = part.info["startup_s"]  # once per process: the first call pays it
        again = [hg.partition(coarse, n, epsilon=epsilon, seed=seed).seconds for _ in range(TIMING_RUNS - 1)]
        part = dataclasses.replace(part, seconds=statistics.median([part.seconds, *again]))
        rows.append(_row(part, "coarse hypergraph", n, bound_mv=bound, startup_s=round(startup, 3)))
        if n <= quality_upto:
            rows.append(_row(hg.partition(coarse, n, epsilon=epsilon, seed=seed, **QUALITY),
                             "coarse hypergraph, quality", n, bound_mv=bound))
        if n <= optimal_upto:
            exact = hg.optimal(coarse, n, epsilon=epsilon, time_limit=120)
            rows.append(_row(exact, "coarse optimum (MILP)" if exact.info["optimal"] else "coarse MILP, stopped", n,
                             bound_mv=round(exact.info["bound"] / MV, 1)))
        rows.append(_row(hg.partition(fine, n, epsilon=epsilon, seed=seed), "fine hypergraph", n))
    return rows


def imbalance_rows(coarse, fine, ns, seed=0) -> list[dict]:
    rows = []
    for epsilon in (0.03, 0.15, 0.2):
        for n in ns:
            for method, model in (("coarse hypergraph", coarse), ("fine hypergraph", fine)):
                m = hg.partition(model, n, epsilon=epsilon, seed=seed).metrics()
                rows.append({"epsilon": epsilon, "N": n, "method": method, "max_avg": round(m.max_avg, 3),
                             "volume_mv": round(m.volume / MV, 1),
                             "thesis_mv": THESIS_IMBALANCE[(method, epsilon)].get(n, ""),
                             "bound_mv": round(lower_bound(coarse, n, epsilon) / MV, 1)
                             if method == "coarse hypergraph" else ""})
    return rows


def data_parallel(graph, n: int) -> Strategy:
    return Strategy({layer.name: ParallelConfig(n=n, sync="allreduce") for layer in graph if not layer.is_input},
                    f"data parallel x{n}").validated(graph, Machine.simulated(1, n))


def epoch_rows(ns, batches) -> list[dict]:
    """Table 5.14: the data-parallel volume from its formula and from the runtime's all-reduce plan;
    the hypergraph's as twice its forward volume and from its plan, in bytes and (as the thesis
    counts it) in values."""
    rows = []
    for n in ns:
        graph = models.vgg16(batch=BATCH)
        p = graph.num_params() * 4
        coarse = hg.coarse_grain(graph)
        part = hg.partition(coarse, n)
        forward = coarse.volume(part.counts)
        plan_bytes = lower(graph, hg.to_strategy(graph, part)).bytes_moved
        dp_plan = lower(graph, data_parallel(graph, n)).bytes_moved
        for batch in batches:
            steps = EPOCH_5_14 // batch
            dp, hp = 2 * (n - 1) * p * steps, 2 * forward * batch // BATCH * steps  # per epoch, bytes
            thesis_dp, thesis_hp = THESIS_TABLE_5_14.get((n, batch), ("", ""))
            # activation traffic scales with the batch, steps inversely: per epoch it does not depend on it
            rows.append({"N": n, "batch": batch, "dp_gib": round(dp / 2 ** 30, 1), "thesis_dp_gib": thesis_dp,
                         "dp_plan_gib": round(dp_plan * steps / 2 ** 30, 1), "hp_gib": round(hp / 2 ** 30, 1),
                         "hp_plan_gib": round(plan_bytes * batch / BATCH * steps / 2 ** 30, 1),
                         "hp_gv": round(hp / 4 / 2 ** 30, 1), "thesis_hp_gv": thesis_hp,
                         "reduction": f"{1 - hp / dp:.1%}", "reduction_as_thesis": f"{1 - hp / 4 / dp:.1%}",
                         "thesis_reduction": f"{1 - thesis_hp / thesis_dp:.0%}" if thesis_dp else ""})
    return rows


def skylake_machine(n: int) -> Machine:
    return Machine.simulated(n, 1, inter_bandwidth=OPA_BANDWIDTH, latency=OPA_LATENCY, device_kind="SKL-8180x2")


def runtime_rows(ns, batches) -> list[dict]:
    """Table 5.15-like: seconds per epoch of 10,240 images by simulation (synchronous steps, no
    pipelining across steps: the thesis's threaded model parallelism overlaps them)."""
    rows = []
    for n in ns:
        machine = skylake_machine(n)
        for batch in batches:
            graph = models.vgg16(batch=batch)
            cm = CostModel(machine)
            coarse = hg.coarse_grain(graph)
            t0 = time.perf_counter()
            searched = search.optimize(graph, machine, cm)
            search_s = time.perf_counter() - t0
            strategies = {"sync data parallel": data_parallel(graph, n),
                          "layer-wise": hg.to_strategy(graph, hg.layer_wise(coarse, n), machine),
                          "coarse hypergraph": hg.to_strategy(graph, hg.partition(coarse, n), machine),
                          "searched": searched}
            for method, strategy in strategies.items():
                plan = lower(graph, strategy.validated(graph, machine))
                step = cm.simulate(plan).step_s
                thesis = THESIS_TABLE_5_15.get((n, method), {}).get(batch, "")
                rows.append({"N": n, "batch": batch, "method": method,
                             "epoch_s": round(float(step) * EPOCH_5_15 / batch, 1), "thesis_epoch_s": thesis,
                             "step_ms": round(float(step) * 1e3, 1), "mib_per_step": round(plan.bytes_moved / MIB, 1),
                             **({"search_s": round(search_s, 2)} if method == "searched" else {})})
    return rows


def run(out_dir="results", quick=False):
    ns = (2, 8) if quick else (2, 4, 8, 16, 32, 64, 128)
    graph = models.vgg16(batch=BATCH)
    coarse = hg.coarse_grain(graph)
    fine = hg.fine_grain(graph, max_atoms=16 if quick else 32)
    print("tables 5.1-5.12", flush=True)
    tables = balance_tables(coarse, fine, ns)
    print("appendix A", flush=True)
    imbalance = imbalance_rows(coarse, fine, (2, 8) if quick else (2, 8, 32, 128))
    print("table 5.14", flush=True)
    epoch = epoch_rows((2,) if quick else (2, 4, 8), (32,) if quick else (16, 32, 64))
    print("table 5.15 by simulation", flush=True)
    runtime = runtime_rows((2,) if quick else (2, 4), (32,) if quick else (16, 32, 64))
    record = {"name": "hypergraph", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_description(),
              "quick": quick, "tables": tables, "imbalance": imbalance, "epoch": epoch, "runtime": runtime}
    write(out_dir, record)


def write(out_dir, record):
    """results/hypergraph.json, .md and .png from the record's rows (the summary is derived here)."""
    tables, imbalance, epoch, runtime = (record[k] for k in ("tables", "imbalance", "epoch", "runtime"))
    timing = [r for r in tables if r["method"] == "coarse hypergraph"]
    lines = _summary(tables, imbalance, epoch, runtime, timing)
    record = {**record, "summary": lines}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hypergraph.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    md = header("hypergraph", record)
    md += [f"- {line}" for line in lines] + [""]
    md += ["## Tables 5.1-5.12: work (GFLOP, forward + backward) and forward communication", "",
           "Volumes in MiB (bytes) and MV (2^20 values, the thesis's \"MB\"); thesis_mv is the thesis's figure, "
           "bound_mv a lower bound on any coarse-grain partition at this balance (for the MILP rows: the solver's "
           "bound); seconds: time to partition, building the input included (for the coarse hypergraph the median of "
           f"{TIMING_RUNS} calls); startup_s: starting Mt-KaHyPar's thread pool, once per process, paid by the "
           "first call (N = 2) on top.", "",
           _table(("N", "method", "max_gflop", "min_gflop", "avg_gflop", "max_min", "max_avg", "thesis_max_avg",
                   "volume_mib", "volume_mv", "thesis_mv", "bound_mv", "max_comm_mv", "avg_comm_mv", "max_avg_comm",
                   "seconds", "startup_s"), tables), ""]
    md += ["## Appendix A: final imbalance", "", _table(tuple(imbalance[0]), imbalance), ""]
    md += ["## Table 5.14: one epoch of 64,000 images", "",
           "GiB of bytes, and GV (2^30 values) for the hypergraph column as the thesis counts it; reduction: bytes "
           "against bytes; reduction_as_thesis: data-parallel bytes against hypergraph values, as the thesis's "
           "93% is computed.", "", _table(tuple(epoch[0]), epoch), ""]
    md += ["## Table 5.15-like: seconds per epoch of 10,240 images, by simulation", "",
           _table(("N", "batch", "method", "epoch_s", "thesis_epoch_s", "step_ms", "mib_per_step", "search_s"),
                  runtime), ""]
    (out / "hypergraph.md").write_text("\n".join(md) + "\n")
    _plot(tables, out / "hypergraph.png")
    print((out / "hypergraph.md").read_text())


def _table(keys, rows) -> str:
    def cell(v):
        return f"{v:,.1f}" if isinstance(v, float) and abs(v) >= 100 else v
    return markdown_table([(k, k) for k in keys], [{k: cell(v) for k, v in r.items()} for r in rows])


def _summary(tables, imbalance, epoch, runtime, timing) -> list[str]:
    lines = []
    exact = all(math.floor(r["dp_gib"]) == r["thesis_dp_gib"] for r in epoch if r["thesis_dp_gib"] != "")
    same = all(r["dp_plan_gib"] == r["dp_gib"] for r in epoch)
    lines.append(f"Table 5.14 data parallel, 2 (N-1) p per step: {'equal to' if exact else 'NOT equal to'} the "
                 "thesis's GB (GiB, which it truncates to whole numbers) in every row; the runtime's all-reduce "
                 f"plan moves {'the same' if same else 'DIFFERENT'} bytes per step (dp_plan_gib)")
    layer_wise = [r for r in tables if r["method"] == "layer-wise" and r["N"] in THESIS_LAYER_WISE_COMM]
    def truncated(ours, thesis):  # the thesis cuts to one decimal: 12.25 -> 12.2, 273.58 -> 273.5
        return -1e-9 <= ours - thesis < 0.1

    unit = all(truncated(r["volume_mv"], r["thesis_mv"]) and truncated(r["max_comm_mv"], THESIS_LAYER_WISE_COMM[
        r["N"]][0]) and truncated(r["avg_comm_mv"], THESIS_LAYER_WISE_COMM[r["N"]][1]) for r in layer_wise)
    lines.append(f"the thesis's \"MB\" is 2^20 values: layer-wise volume, max and avg communication "
                 f"{'equal' if unit else 'do NOT equal'} the thesis's in MV (cut to one decimal, as it does) at N = "
                 f"{', '.join(str(r['N']) for r in layer_wise)}; in MiB of bytes they are 4x; volumes are "
                 "compared in MV")
    for method in ("coarse hypergraph", "coarse hypergraph, quality", "fine hypergraph"):
        rows = [r for r in tables if r["method"] == method]
        thesis = THESIS_VOLUME["fine hypergraph" if method.startswith("fine") else "coarse hypergraph"]
        above = [f"N={r['N']}: {r['volume_mv']} vs {thesis[r['N']]}" for r in rows if r["volume_mv"] > thesis[r["N"]]]
        where = f"; above it at {', '.join(above)}" if above else ""
        lines.append(f"{method} (epsilon 0.1): volume at most the thesis's (MV) at {len(rows) - len(above)} of "
                     f"{len(rows)} N{where}")
    for r in tables:
        if r["method"].startswith("coarse optimum") or r["method"].startswith("coarse MILP"):
            best = min(x["volume_mv"] for x in tables if x["N"] == r["N"] and x["method"].startswith("coarse hyper"))
            lines.append(f"N={r['N']}: the least volume of any coarse-grain partition at balance 0.1 under these "
                         f"weights is {r['volume_mv']} MV ({r['method']}, {r['seconds']} s; bound {r['bound_mv']}); "
                         f"Mt-KaHyPar's best here {best}, the thesis's (PaToH, its own weights) "
                         f"{THESIS_VOLUME['coarse hypergraph'][r['N']]}")
    worst = max(timing, key=lambda r: r["N"])
    lines.append(f"Mt-KaHyPar on the coarse-grain model: {worst['seconds']} s at N={worst['N']} "
                 f"(goal: under 1 s: {'met' if worst['seconds'] < 1 else 'MISSED'}); slowest over all N: "
                 f"{max(r['seconds'] for r in timing)} s (medians of {TIMING_RUNS} calls); starting its thread pool "
                 f"{max(r['startup_s'] for r in timing)} s, once per process")
    bound_ok = all(r["volume_mv"] >= r.get("bound_mv", 0) - 0.05 for r in tables if r["method"] == "coarse hypergraph")
    lines.append(f"every coarse-grain hypergraph volume is at or above the lower bound for its balance: {bound_ok}")
    mean = np.mean([float(r["reduction"].rstrip("%")) for r in epoch])
    as_thesis = np.mean([float(r["reduction_as_thesis"].rstrip("%")) for r in epoch])
    lines.append(f"Table 5.14 reduction by the hypergraph: {mean:.1f}% on average, bytes against bytes; "
                 f"{as_thesis:.1f}% counted as the thesis does (its hypergraph column in values, its data-parallel "
                 "column in bytes; thesis 93%)")
    return lines


def _plot(tables, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in tables):
        rows = [r for r in tables if r["method"] == method]
        ax[0].plot([r["N"] for r in rows], [r["volume_mv"] for r in rows], marker="o", label=method)
        ax[1].plot([r["N"] for r in rows], [r["max_avg"] for r in rows], marker="o", label=method)
        thesis = THESIS_VOLUME.get(method, {})
        if thesis:
            ax[0].plot(list(thesis), list(thesis.values()), ls=":", color=ax[0].lines[-1].get_color())
    for a, label in ((ax[0], "forward volume (MV, 2^20 values); dotted: the thesis"), (ax[1], "work max/avg")):
        a.set_xscale("log", base=2)
        a.set_xlabel("N")
        a.set_ylabel(label)
    ax[0].set_yscale("log")
    ax[1].legend(fontsize=7)
    fig.suptitle("VGG-16, batch 32: partitions of seed 003")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
