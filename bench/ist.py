"""Seed 004 (IST): traffic and FLOPs per gradient step of data parallelism and IST (Sec. 3.4, Fig. 2)
from the seed's formulas and from the runtime's plans, and planned bytes against the workers'
transfer logs on local clusters.

Network of Fig. 2: 1000 - 4000 - 4000 - 4000 - 200 (bias-free linear layers), batch 512, J = 10.
IST: every site trains on its own batch of 512; data parallelism splits one batch of 512 over the
sites (the seed's FLOP formulas count it so: DP's FLOPs do not change with n).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from search.baselines import data_parallel
from taskrt import Graph, Machine, Strategy, lower
from taskrt.ist import ISTTrainer, partition, plan_round, units_of

WIDTHS = (1000, 4000, 4000, 4000, 200)
BATCH, J = 512, 10


def mlp(widths=WIDTHS, batch=BATCH, norm=False) -> Graph:
    g = Graph("ist_fig2")
    x = g.input("x", (batch, widths[0]))
    for i, width in enumerate(widths[1:-1], start=1):
        x = g.linear(x, width, bias=False, name=f"fc{i}")
        if norm:
            x = g.batch_norm(x, name=f"bn{i}")
        x = g.relu(x, name=f"relu{i}")
    g.softmax_cross_entropy(g.linear(x, widths[-1], bias=False, name="out"), name="loss")
    return g


def formulas(widths, n, batch, j) -> dict:
    """Sec. 3.4: floats received per gradient step (all sites) and FLOPs per gradient step."""
    pairs = list(zip(widths[:-1], widths[1:]))
    hidden = pairs[1:-1]
    return {
        "dp_traffic": sum(n * a * b for a, b in pairs),
        "ist_traffic": (widths[0] * widths[1] + widths[-2] * widths[-1]) / j + sum(a * b / (n * j) for a, b in hidden),
        "dp_flops": 4 * sum(batch * a * b for a, b in pairs),
        "ist_flops": 4 * batch * widths[0] * widths[1] + 4 * batch * widths[-2] * widths[-1]
        + 4 * batch * sum(a * b / n for a, b in hidden),
    }


def dp_strategy(graph, machine) -> Strategy:
    dp = data_parallel(graph, machine)
    return Strategy({name: replace(config, sync="allreduce") for name, config in dp.configs.items()},
                    name="data parallel, ring all-reduce")


def from_plans(widths, n, batch, j) -> dict:
    """The same quantities read off the runtime's plans (4-byte floats)."""
    machine = Machine.simulated(nodes=1, devices_per_node=n)
    dp_graph = mlp(widths, batch)
    dp_plan = lower(dp_graph, dp_strategy(dp_graph, machine), "train", 4)
    dp_flops = sum(2 * t.flops for t in dp_plan.tasks if t.phase == "fwd" and dp_graph[t.layer].kind == "linear")
    g = mlp(widths, batch)
    units = units_of(g)
    plan = plan_round(g, units, n, j, partition(g, units, n, 0, 0), 0.01, 4)
    received = sum(t.nbytes for t in plan.tasks if t.phase == "slice") / 4  # every site's blocks
    ist_flops = sum(2 * sum(t.spec.graph[u.linear].op.flops(_full(t.spec.graph[u.linear])) for u in units)
                    for t in plan.tasks if t.phase == "local") / j
    return {"dp_traffic_plan": dp_plan.bytes_moved / 4, "dp_flops_plan": dp_flops,
            "ist_traffic_plan": received / j, "ist_cross_device_bytes_per_round": plan.bytes_moved,
            "ist_flops_plan": ist_flops}


def _full(layer):
    from ops.rect import Rect

    return Rect.full(layer.shape)


def measured(devices: int, widths=(100, 400, 400, 400, 20), batch=64, j=2) -> dict:
    """One IST round and one data-parallel step on local(devices): planned vs logged bytes."""
    from taskrt import Trainer

    machine = Machine.local(devices, probe=False)
    try:
        g = mlp(widths, batch, norm=True)
        rng = np.random.default_rng(0)
        ist = ISTTrainer(g, machine, local_steps=j, lr=0.01, seed=0)
        data = [[(rng.standard_normal((batch, widths[0])), rng.integers(0, widths[-1], batch)) for _ in range(j)]
                for _ in range(devices)]
        ist.round(data)
        dp = Trainer(g, dp_strategy(g, machine), machine, lr=0.01)
        dp.step(*data[0][0])
        return {"devices": devices, "network": list(widths), "batch": batch, "local_steps": j,
                "ist_planned": sum(ist.stats.planned_bytes.values()),
                "ist_logged": sum(ist.stats.measured_bytes.values()),
                "ist_equal": ist.stats.planned_bytes == ist.stats.measured_bytes,
                "dp_planned": sum(dp.stats.planned_bytes.values()), "dp_logged": sum(dp.stats.measured_bytes.values()),
                "dp_equal": dp.stats.planned_bytes == dp.stats.measured_bytes}
    finally:
        machine.close()


def generated_task(features=64, classes=8, samples=4096, seed=0):
    """Gaussian clusters around random class means, with a nonlinear twist (a tanh of a random
    projection added), split into training and test halves."""
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((classes, features))
    y = rng.integers(0, classes, samples)
    x = means[y] + 1.5 * rng.standard_normal((samples, features))
    x += np.tanh(x @ rng.standard_normal((features, features)) / np.sqrt(features))
    half = samples // 2
    return (x[:half], y[:half]), (x[half:], y[half:])


def ablation(devices=2, rounds=30, j=5, batch=64, hidden=256, seed=0) -> dict:
    """IST with and without batch norm on the generated task, evaluated with the whole network."""
    (xt, yt), (xv, yv) = generated_task(seed=seed)
    widths = (xt.shape[1], hidden, hidden, int(yt.max()) + 1)
    machine = Machine.local(devices, probe=False)
    out = {"devices": devices, "rounds": rounds, "local_steps": j, "batch": batch, "network": list(widths)}
    try:
        for norm in (True, False):
            g = mlp(widths, batch, norm=norm)
            ist = ISTTrainer(g, machine, local_steps=j, lr=0.05, seed=seed)
            rng = np.random.default_rng(seed + 1)
            for _ in range(rounds):
                data = []
                for _s in range(devices):
                    picks = [rng.integers(0, len(xt), batch) for _ in range(j)]
                    data.append([(xt[p], yt[p]) for p in picks])
                ist.round(data)
            key = "batch_norm" if norm else "no_norm"
            out[f"{key}_accuracy"] = float((ist.predict(xv).argmax(axis=1) == yv).mean())
            if norm:
                calibrated = ist.predict(xv, calibrate=xt[:512])
                out["batch_norm_calibrated_accuracy"] = float((calibrated.argmax(axis=1) == yv).mean())
    finally:
        machine.close()
    return out


def run(out="results", quick=False):
    """Writes results/ist.json and .md after each part, so a part cut short leaves the ones before it."""
    rows = []
    for n in range(2, 9):
        f, p = formulas(WIDTHS, n, BATCH, J), from_plans(WIDTHS, n, BATCH, J)
        rows.append({"n": n, **f, **p})
    result = {"network": list(WIDTHS), "batch": BATCH, "local_steps": J, "rows": rows, "measured": [],
              "ablation": None}
    _write(out, result)
    for d in (2,) if quick else (2, 4):
        result["measured"].append(measured(d))
        _write(out, result)
    result["ablation"] = ablation(rounds=5 if quick else 30)
    _write(out, result)


def _write(out, result):
    rows, checks, a = result["rows"], result["measured"], result["ablation"]
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "ist.json").write_text(json.dumps(result, indent=1))
    lines = ["# IST (seed 004): traffic and FLOPs per gradient step (Sec. 3.4, Fig. 2)", "",
             f"Network {'-'.join(map(str, WIDTHS))}, batch {BATCH}, J = {J}; floats received by all sites per "
             "gradient step. IST from the round's plan: the floats of every site's slices / J. DP from the plan: "
             "ring all-reduce (reduce-scatter + all-gather) bytes / 4, which is 2 (n-1) P, where the seed's "
             "formula counts a broadcast of the parameters to every site, n P.", "",
             "| n | DP formula | DP plan (all-reduce) | IST formula | IST plan | DP FLOPs formula | DP FLOPs plan "
             "| IST FLOPs formula | IST FLOPs plan |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['dp_traffic']:,.0f} | {r['dp_traffic_plan']:,.0f} | {r['ist_traffic']:,.1f} | "
                     f"{r['ist_traffic_plan']:,.1f} | {r['dp_flops']:.4g} | {r['dp_flops_plan']:.4g} | "
                     f"{r['ist_flops']:.4g} | {r['ist_flops_plan']:.4g} |")
    lines += ["", "IST plan vs formula: equal where n divides 4000 (the hidden blocks are then 4000/n square); "
              "otherwise the partition's groups differ by one neuron and the plan counts sum_s |m_s^l| |m_s^(l-1)|.",
              "", "## Planned bytes against the workers' transfer logs", "",
              "| devices | network | IST round planned | logged | equal | DP step planned | logged | equal |",
              "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['devices']} | {'-'.join(map(str, c['network']))} (batch norm) | {c['ist_planned']:,} | "
                     f"{c['ist_logged']:,} | {c['ist_equal']} | {c['dp_planned']:,} | {c['dp_logged']:,} | "
                     f"{c['dp_equal']} |")
    if a:
        lines += ["", "## Normalization ablation (Sec. 3.3)", "",
                  f"IST on `local({a['devices']})`, {a['rounds']} rounds of J = {a['local_steps']}, "
                  f"batch {a['batch']}, "
                  f"network {'-'.join(map(str, a['network']))}, generated task (`generated_task`), test accuracy of "
                  "the whole network:", "",
                  "| batch norm, running statistics | batch norm, statistics recomputed with the whole network | "
                  "no normalization |", "|---|---|---|",
                  f"| {a['batch_norm_accuracy']:.3f} | {a['batch_norm_calibrated_accuracy']:.3f} "
                  f"| {a['no_norm_accuracy']:.3f} |"]
    Path(out, "ist.md").write_text("\n".join(lines) + "\n")
