"""Data, model, OWT and the searched layer-wise strategy trained side by side on Machine.local(2):
images/s, bytes moved per step, predicted (additive and simulated) and measured step time.  Beside
them, the search's pick when it also times its result and the baselines on the machine
(`optimize(check_by_measurement=True)`, "layer-wise, measured")."""

from __future__ import annotations

import tempfile

from taskrt import search
from taskrt.bench.measure import LOCAL_MODELS, QUICK_MODELS, measure, strategies_for
from taskrt.bench.report import write_result
from taskrt.bench.verdicts import MEASURED, verdicts
from taskrt.machines.machine import Machine

ORDER = ["data", "model", "owt", "layer-wise", MEASURED]


def run(out_dir="results", quick=False):
    chosen = QUICK_MODELS if quick else LOCAL_MODELS
    rounds = 4 if quick else 12
    rows = []
    with Machine.local(2) as machine, tempfile.TemporaryDirectory() as tmp:
        # part timings and the runtime's costs measured now, on this machine, for these predictions
        cost_model = search.CostModel(machine, cache=f"{tmp}/costs.json")
        for label, make in chosen.items():
            graph = make()
            strategies = strategies_for(graph, machine, cost_model)
            strategies[MEASURED] = search.optimize(graph, machine, cost_model, check_by_simulation=True,
                                                   check_by_measurement=True)
            found = measure(machine, graph, strategies, cost_model, rounds, label)
            for row in found:
                if row["strategy"] == MEASURED:
                    row["measured_pick"] = strategies[MEASURED].meta["chosen_by_measurement"]["chosen"]
            rows += found
    summary = verdicts(rows)
    summary.append("bytes moved per step equal the workers' transfer logs for every strategy: "
                   f"{all(r['bytes_match_logs'] for r in rows)}")
    summary.append(f"{rounds} interleaved rounds after 2 warm-up steps; medians; 2 single-threaded workers on "
                   "this machine's 2 cores")
    columns = [("model", "model"), ("strategy", "strategy"), ("images_per_s", "images/s"),
               ("measured_ms", "measured ms"), ("iqr_ms", "IQR ms"), ("simulated_ms", "simulated ms"),
               ("additive_ms", "additive (eq. 1) ms"), ("bytes_per_step", "bytes/step"), ("tasks", "tasks"),
               ("measured_pick", "picked by measuring"), ("verdict", "searched vs best baseline")]
    md = write_result(out_dir, "strategies", rows, columns, {"devices": 2, "rounds": rounds}, summary)
    _plot(rows, out_dir)
    print(md.read_text())
    return rows


def _plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 3.6), squeeze=False)
    for ax, model in zip(axes[0], labels):
        mine = {r["strategy"]: r for r in rows if r["model"] == model}
        names = [s for s in ORDER if s in mine]
        measured = [mine[s]["images_per_s"] for s in names]
        simulated = [mine[s]["batch"] / (mine[s]["simulated_ms"] / 1e3) for s in names]
        ax.bar(range(len(names)), measured,
               color=["tab:gray", "tab:gray", "tab:gray", "tab:blue", "tab:cyan"][: len(names)],
               label="measured (median)")
        ax.plot(range(len(names)), simulated, "kD", label="simulated")
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
        ax.set_ylabel("images / s")
        ax.set_title(f"{model} on 2 local devices")
        ax.legend(fontsize=8)
    fig.suptitle("Training throughput by strategy (Dask, 2 CPU workers)")
    fig.tight_layout()
    fig.savefig(f"{out_dir}/strategies.png", dpi=120)
    plt.close(fig)


