"""Seed 004 (IST): traffic and FLOPs per gradient step of data parallelism and IST (Sec. 3.4, Fig. 2)
from the seed's formulas and from the runtime's plans, planned bytes against the workers'
transfer logs, Table 1's time to fixed test accuracies and the normalization ablation of
Sec. 3.3 on a generated speech-shaped task (bench/ist_training.py); the page and figure are
bench/ist_report.py's.

Fig. 2's network: 1000 - 4000 - 4000 - 4000 - 200 (bias-free linear layers), batch 512, J = 10.
IST: every site trains on its own batch of 512; data parallelism splits one batch of 512 over the
sites (the seed's FLOP formulas count it so: DP's FLOPs do not change with n).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from taskrt import Graph, Machine, lower
from taskrt.bench import ist_training
from taskrt.bench.ist_training import dp_strategy, network, speech_like
from taskrt.bench.report import machine_description
from taskrt.training.ist import ISTTrainer, partition, plan_round, units_of

WIDTHS = (1000, 4000, 4000, 4000, 200)
BATCH, J = 512, 10


def mlp(widths=WIDTHS, batch=BATCH, norm=False) -> Graph:
    return network(widths, batch, norm=norm, name="ist_fig2")


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
    from taskrt.ops.rect import Rect

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


def run(out="results", quick=False):
    """Writes results/ist.json, .md and .png after each part, so a part cut short leaves the ones before it."""
    rows = []
    for n in range(2, 9):
        f, p = formulas(WIDTHS, n, BATCH, J), from_plans(WIDTHS, n, BATCH, J)
        rows.append({"n": n, **f, **p})
    result = {"name": "ist", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_description(),
              "network": list(WIDTHS), "batch": BATCH, "local_steps": J, "rows": rows, "measured": [],
              "table1": None, "ablation": None, "quick": quick}
    _write(out, result)
    for d in (2,) if quick else (2, 4):
        result["measured"].append(measured(d))
        _write(out, result)
    setting = ist_training.QUICK if quick else ist_training.FULL

    def progress(table):
        result["table1"] = table
        _write(out, result)

    ist_training.table1(setting, write=progress)
    result["ablation"] = ablation(setting)
    _write(out, result)


def ablation(setting, known=()) -> list[dict]:
    quick = setting is ist_training.QUICK
    return ist_training.ablation(setting, speech_like(**setting.task), (2,) if quick else (2, 8), 60 if quick else 400,
                             setting.first if quick else (0.03, 0.1, 0.3), known=known)


def _write(out, result):
    from taskrt.bench.ist_report import markdown, plot

    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "ist.json").write_text(json.dumps(result, indent=1))
    Path(out, "ist.md").write_text(markdown(result))
    if result["table1"] and result["table1"]["measured"]:
        plot(result, Path(out, "ist.png"))


def _saved(out) -> tuple:
    """out/ist.json's result, its Table 1 and the setting it was made with (this file's)."""
    result = json.loads(Path(out, "ist.json").read_text())
    table = result["table1"]
    setting = ist_training.QUICK if result["quick"] else ist_training.FULL
    if table is None:
        raise SystemExit(f"{out}/ist.json has no Table 1: run bench ist")
    if table["setting"] != ist_training.setting_dict(setting):
        raise SystemExit(f"{out}/ist.json was made with another setting than bench/ist_training.py's: run bench ist")
    return result, table, setting


def complete(out="results"):
    """From out/ist.json: Table 1's simulated rows again (the searches' steps do not change; kernel
    times measured now), and the ablation's learning rates that it lacks (its curves reused):
    `python -m taskrt.bench.ist [DIR]`, minutes instead of hours."""
    result, table, setting = _saved(out)
    if len(table["search"]) < len(setting.devices) * len(ist_training.METHODS):
        raise SystemExit(f"{out}/ist.json has no complete learning-rate search to simulate from")
    ist_training.simulate_all(table, setting, speech_like(**setting.task))
    table["resimulated"] = True
    _write(out, result)
    result["ablation"] = ablation(setting, known=result["ablation"] or ())
    _write(out, result)


def remeasure(out="results"):
    """From out/ist.json: Table 1's runs on local(2) again, with the learning rates and step limits
    its searches found (`python -m taskrt.bench.ist --measure [DIR]`: after a change to the runtime)."""
    result, table, setting = _saved(out)
    if any(f"{m}@2" not in table["search"] for m in ist_training.METHODS):
        raise SystemExit(f"{out}/ist.json has no learning-rate search for 2 sites to measure with")
    table["measured"] = ist_training.measure_local(setting, speech_like(**setting.task), table["search"])
    _write(out, result)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if args[:1] == ["--measure"]:
        remeasure(*args[1:2])
    else:
        complete(*args[:1])
