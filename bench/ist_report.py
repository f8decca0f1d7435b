"""results/ist.md and ist.png from bench ist's result (plain data, as in results/ist.json)."""

from __future__ import annotations

from taskrt.bench.ist_training import METHODS
from taskrt.bench.pages import header

COLORS = {"dp": "tab:orange", "local_sgd": "tab:green", "ist": "tab:blue"}


def markdown(result) -> str:
    lines = header("ist", result) + _traffic(result)
    if result["table1"]:
        lines += _table1(result["table1"])
    if result["ablation"]:
        lines += _ablation(result["ablation"], result["table1"]["setting"])
    return "\n".join(lines) + "\n"


def _traffic(result) -> list[str]:
    widths = "-".join(map(str, result["network"]))
    lines = ["## Traffic and FLOPs per gradient step (Sec. 3.4, Fig. 2)", "",
             f"Network {widths}, batch {result['batch']}, J = {result['local_steps']}; floats received by all sites "
             "per gradient step. IST from the round's plan: the floats of every site's slices / J. DP from the plan: "
             "ring all-reduce (reduce-scatter + all-gather) bytes / 4, which is 2 (n-1) P, where the seed's "
             "formula counts a broadcast of the parameters to every site, n P.", "",
             "| n | DP formula | DP plan (all-reduce) | IST formula | IST plan | DP FLOPs formula | DP FLOPs plan "
             "| IST FLOPs formula | IST FLOPs plan |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['dp_traffic']:,.0f} | {r['dp_traffic_plan']:,.0f} | {r['ist_traffic']:,.1f} | "
                     f"{r['ist_traffic_plan']:,.1f} | {r['dp_flops']:.4g} | {r['dp_flops_plan']:.4g} | "
                     f"{r['ist_flops']:.4g} | {r['ist_flops_plan']:.4g} |")
    lines += ["", "IST plan vs formula: equal where n divides 4000 (the hidden blocks are then 4000/n square); "
              "otherwise the partition's groups differ by one neuron and the plan counts sum_s |m_s^l| |m_s^(l-1)|.",
              "", "## Planned bytes against the workers' transfer logs", "",
              "| devices | network | IST round planned | logged | equal | DP step planned | logged | equal |",
              "|---|---|---|---|---|---|---|---|"]
    for c in result["measured"]:
        lines.append(f"| {c['devices']} | {'-'.join(map(str, c['network']))} (batch norm) | {c['ist_planned']:,} | "
                     f"{c['ist_logged']:,} | {c['ist_equal']} | {c['dp_planned']:,} | {c['dp_logged']:,} | "
                     f"{c['dp_equal']} |")
    return lines


def _fmt(seconds) -> str:
    if seconds is None:
        return "not reached"
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.3g}"


def _steps(curve, target):
    found = curve["reached"].get(str(target))
    return found[0] if found else None


def _table1(t) -> list[str]:
    s, task = t["setting"], t["task"]
    targets = s["targets"]
    top = targets[-1]
    widths = "-".join(map(str, s["widths"]))
    lines = ["", "## Time to fixed test accuracies (the seed's Table 1)", "",
             f"Generated speech-shaped task (`bench/ist_training.py`: {task.get('features', 4096)} features, "
             f"35 classes, "
             f"every class a mixture of Gaussian clusters seen through a random projection, a tanh and noise; "
             f"{task['train']:,} training and {task['test']:,} test samples), network {widths} with a batch norm "
             f"after each hidden layer (the seed's 2-layer speech network, Table 4), plain SGD from the same "
             f"initial parameters. Every site takes a batch of {s['site_batch']} per step (DP: one global batch of "
             f"n x {s['site_batch']} split over the devices); local SGD and IST synchronize every "
             f"J = {s['local_steps']} steps. Targets: the seed's {', '.join(map(str, targets))}. Test accuracy of the "
             f"whole network, batch-norm statistics recomputed on {task['calibrate']} training samples, every J "
             "steps up to 20 J, then every 5% of the steps so far. One run per cell (as the seed).", "",
             f"Learning rate: the same search for every method and site count, in this process: rungs "
             f"{', '.join(f'{v:g}' for v in s['ladder'])}, tried first {', '.join(f'{v:g}' for v in s['first'])}, "
             f"then one rung further out while the best is at an edge; the best reaches {top} in the fewest steps "
             f"(a run stops at {top}, or once it has taken as many steps as the best so far, or at "
             f"{s['max_steps']} steps).", "",
             "### The learning rates found", "",
             "| method | sites | lr | " + " | ".join(f"steps to {x}" for x in targets) + " | every run (lr: result) |",
             "|---|---|---|" + "---|" * len(targets) + "---|"]
    for found in t["search"].values():
        best = found["runs"][str(found["lr"])]
        runs = "; ".join(f"{lr}: " + (f"{top} at {_steps(c, top)}" if _steps(c, top) else
                                      f"{c['points'][-1][1]:.3f} at {c['points'][-1][0]}")
                         for lr, c in sorted(found["runs"].items(), key=lambda kv: float(kv[0])))
        lines.append(f"| {METHODS[found['method']]} | {found['sites']} | {found['lr']:g} | "
                     + " | ".join(str(_steps(best, x) or "not reached") for x in targets) + f" | {runs} |")
    lines += _measured(t, targets)
    if t["simulated"]:
        lines += _simulated(t, targets)
    return lines


def _measured(t, targets) -> list[str]:
    m = t["measured"]
    if not m:
        return []
    top = targets[-1]
    lines = ["", "### Measured on `Machine.local(2)`", "",
             "The three methods on the same two single-threaded Dask workers, interleaved a round (J steps) of each "
             "at a time; seconds are the wall time of their steps (each step's data sent, computed, synchronized), "
             "evaluations excluded (their time in the last column). The two workers and the client share the "
             f"machine's 2 cores; the three runs took {m['wall_s']:.0f} s of wall time in all.", "",
             "| method | lr | " + " | ".join(f"steps to {x} | s to {x}" for x in targets)
             + " | s per step | steps to " + str(top) + " in this process | evaluation s |",
             "|---|---|" + "---|---|" * len(targets) + "---|---|---|"]
    inproc = {f["method"]: f for f in t["search"].values() if f["sites"] == 2}
    for method, run in m["runs"].items():
        cells = []
        for x in targets:
            found = run["reached"].get(str(x))
            cells += [str(found[0]) if found else "not reached", _fmt(found[1]) if found else "-"]
        last_steps, _, last_s = run["points"][-1]
        best = inproc[method]["runs"][str(inproc[method]["lr"])]
        lines.append(f"| {METHODS[method]} | {run['lr']:g} | " + " | ".join(cells)
                     + f" | {last_s / last_steps:.3f} | {_steps(best, top) or 'not reached'} | {run['eval_s']:.0f} |")
    lines.append("")
    for x in targets:
        dp, ist = m["runs"]["dp"]["reached"].get(str(x)), m["runs"]["ist"]["reached"].get(str(x))
        if dp and ist:
            lines.append(f"- To {x}: IST {ist[1]:.1f} s, DP {dp[1]:.1f} s: IST {dp[1] / ist[1]:.1f}x sooner "
                         f"(goal at least 2x: {'met' if dp[1] >= 2 * ist[1] else 'missed'}); local SGD "
                         + (f"{m['runs']['local_sgd']['reached'][str(x)][1]:.1f} s."
                            if str(x) in m["runs"]["local_sgd"]["reached"] else "did not reach it."))
        else:
            lines.append(f"- To {x}: " + ", ".join(f"{METHODS[k]} did not reach it" for k, v in
                                                   (("dp", dp), ("ist", ist)) if not v) + ".")
    return lines


def _simulated(t, targets) -> list[str]:
    s = t["setting"]
    devices = s["devices"]
    rows = {(r["method"], r["sites"]): r for r in t["simulated"]}
    gbps = s["link_bandwidth"] * 8 / 1e9
    head = "| accuracy | " + " | ".join(f"{METHODS[m]} {n}" for m in METHODS for n in devices) + " |"
    rule = "|---|" + "---|" * (len(METHODS) * len(devices))
    lines = ["", f"### By simulation on {', '.join(map(str, devices))} devices ({gbps:g} Gb/s)", "",
             f"Seconds to each target: the steps found at n sites (above) times the simulated time of a step: the "
             f"method's plan (a DP step; a local SGD or IST round / J) on n machines of one device each, every link "
             f"and every machine's network interface {gbps:g} Gb/s (the seed's EC2 instances: \"up to 10 Gbps\"), "
             f"{s['link_latency'] * 1e6:g} us latency, each task its kernel time measured in this process with one "
             "thread (a device is one core of this machine, as a `Machine.local` worker; the seed's m5.2xlarge has "
             "8 vCPUs), no runtime overhead. DP's all-reduce is a ring; local SGD and IST move blocks from and to "
             "device 0, where the whole network stays between rounds (the seed shards it over all workers)."
             + (" Kernel times measured again after the run (`python -m taskrt.bench.ist`), from the same searches."
                if t.get("resimulated") else ""), "",
             "This benchmark:", "", head, rule]
    for x in targets:
        cells = [_fmt(rows[(m, n)]["seconds"][str(x)]) if (m, n) in rows else "-" for m in METHODS for n in devices]
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    seed = t["seed_table_1"]
    if tuple(devices) == (2, 4, 8):
        lines += ["", "The seed's Table 1, Google Speech 2-layer (seconds on 2, 4, 8 m5.2xlarge, 10 Gbps):", "", head,
                  rule]
        for x in ("0.63", "0.75"):
            lines.append(f"| {x} | " + " | ".join(str(v) for m in METHODS for v in seed[m][x]) + " |")
    lines += ["", "| method | sites | lr | " + " | ".join(f"steps to {x}" for x in targets)
              + " | simulated ms per step | of it, busiest device's kernels | MB moved per step |",
              "|---|---|---|" + "---|" * len(targets) + "---|---|---|"]
    for (m, n), r in rows.items():
        lines.append(f"| {METHODS[m]} | {n} | {r['lr']:g} | " + " | ".join(str(r["steps"][str(x)] or "not reached")
                                                                       for x in targets)
                     + f" | {r['step_s'] * 1e3:.1f} | {r['busiest_device_compute_s'] * 1e3:.1f} | "
                     f"{r['bytes_per_step'] / 1e6:.1f} |")
    lines += ["", "### Trends, this benchmark against the seed", ""]
    lines += trends(t)
    lines += [""]
    for x in targets:
        ist = [rows[("ist", n)]["seconds"][str(x)] for n in devices]
        dp = [rows[("dp", n)]["seconds"][str(x)] for n in devices]
        met = _direction(ist).split(", ") == ["falls"] * (len(devices) - 1) and \
            _direction(dp).split(", ") == ["rises"] * (len(devices) - 1)
        lines.append(f"Goal at {x} (IST falls as devices are added, DP rises): IST {_direction(ist)}, DP "
                     f"{_direction(dp)}: {'met' if met else 'missed'}.")
    return lines


def _direction(values) -> str:
    if any(v is None for v in values):
        return "n/a"
    return ", ".join("falls" if b < a else "rises" if b > a else "equal" for a, b in zip(values, values[1:]))


def trends(t) -> list[str]:
    """How each method's time changes from 2 to 4 to 8 devices, and which method is fastest, ours
    beside the seed's (the same targets where the setting uses the seed's)."""
    s = t["setting"]
    rows = {(r["method"], r["sites"]): r for r in t["simulated"]}
    devices = s["devices"]
    out = []
    for x in s["targets"]:
        for m in METHODS:
            ours = [rows[(m, n)]["seconds"][str(x)] if (m, n) in rows else None for n in devices]
            line = f"- {METHODS[m]}, {x}: " + " -> ".join(_fmt(v) for v in ours) + f" s ({_direction(ours)})"
            seed = t["seed_table_1"][m].get(str(x))
            if seed and tuple(devices) == (2, 4, 8):
                line += f"; seed {' -> '.join(map(str, seed))} s ({_direction(seed)})"
            out.append(line)
        for i, n in enumerate(devices):
            ours = {m: rows[(m, n)]["seconds"][str(x)] for m in METHODS if (m, n) in rows}
            order = " < ".join(METHODS[m] for m in sorted(ours, key=lambda m: (ours[m] is None, ours[m] or 0)))
            line = f"- {x} on {n}: fastest first {order}"
            seed = t["seed_table_1"]["dp"].get(str(x))
            if seed and tuple(devices) == (2, 4, 8):
                seed_times = {m: t["seed_table_1"][m][str(x)][i] for m in METHODS}
                line += "; seed " + " < ".join(METHODS[m] for m in sorted(seed_times, key=seed_times.get))
            out.append(line)
    return out


def _ablation(rows, setting) -> list[str]:
    lines = ["", "## Normalization ablation (Sec. 3.3)", "",
             f"IST in this process on the speech-shaped task and network ({'-'.join(map(str, setting['widths']))}), "
             f"batch {setting['site_batch']} per site, J = {setting['local_steps']}: with a batch norm after each "
             "hidden layer (bias-free linear layers), and without normalization (linear layers with a bias, as "
             "PyTorch's default). Each at the best learning rate of the same search (best final test accuracy; "
             f"{', '.join(f'{lr:g}' for lr in rows[0].get('first', ()))} first, then one rung "
             "further out while the best is at an edge), test accuracy of the whole network after the last step:", "",
             "| sites | network | lr | steps | whole network, statistics recomputed with it | "
             "whole network, the subnets' running statistics | grid (lr: accuracy) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        final = r["final"]
        grid = "; ".join(f"{lr}: {c[-1]['accuracy']:.3f}" for lr, c in r["curves"].items())
        running = f"{final['running_statistics']:.3f}" if "running_statistics" in final else "-"
        label = "batch norm" if r["variant"] == "batch_norm" else "no normalization (bias)"
        calibrated = f"{final['accuracy']:.3f}" if r["variant"] == "batch_norm" else "-"
        plain = f"{final['accuracy']:.3f}" if r["variant"] != "batch_norm" else running
        lines.append(f"| {r['sites']} | {label} | {r['lr']:g} | {r['steps']} | {calibrated} | {plain} | {grid} |")
    lines += ["", "(Without batch norm there are no statistics to recompute: its accuracy is in the running-"
              "statistics column, the whole network as trained.)"]
    return lines


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = result["table1"]
    s = t["setting"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    for method, run in t["measured"]["runs"].items():
        steps, acc, secs = zip(*run["points"])
        ax.plot(secs, acc, color=COLORS[method], marker=".", label=f"{METHODS[method]} (lr {run['lr']:g})")
    for x in s["targets"]:
        ax.axhline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("training seconds on Machine.local(2) (evaluation excluded)")
    ax.set_ylabel("test accuracy (whole network)")
    ax.set_title("Measured: 2 local Dask workers")
    ax.legend(fontsize=8)
    for ax, source, title in ((axes[0][1], "ours", f"Simulated ({s['link_bandwidth'] * 8 / 1e9:g} Gb/s, "
                               "one core per device)"), (axes[1][0], "seed", "The seed's Table 1 (Speech 2-layer)")):
        for method in METHODS:
            for x, style in zip(s["targets"], (":", "-")):
                if source == "ours":
                    rows = sorted((r for r in t["simulated"] if r["method"] == method), key=lambda r: r["sites"])
                    ns = [r["sites"] for r in rows]
                    ys = [r["seconds"][str(x)] for r in rows]
                else:
                    values = t["seed_table_1"][method].get(str(x))
                    if not values:
                        continue
                    ns, ys = [2, 4, 8], values
                pairs = [(n, y) for n, y in zip(ns, ys) if y is not None]
                if pairs:
                    ax.plot(*zip(*pairs), color=COLORS[method], linestyle=style, marker="o",
                            label=f"{METHODS[method]}, {x}")
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["devices"] if source == "ours" else [2, 4, 8])
        ax.set_xticklabels(map(str, s["devices"] if source == "ours" else [2, 4, 8]))
        ax.set_xlabel("devices")
        ax.set_ylabel("seconds to the accuracy")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    ax = axes[1][1]
    for r in result["ablation"] or []:
        points = r["curves"][str(r["lr"])]
        style = "-" if r["variant"] == "batch_norm" else "--"
        ax.plot([p["steps"] for p in points], [p["accuracy"] for p in points], linestyle=style, marker=".",
                label=f"{r['sites']} sites, {'batch norm' if r['variant'] == 'batch_norm' else 'no norm'}")
    ax.set_xlabel("steps")
    ax.set_ylabel("test accuracy (whole network)")
    ax.set_title("IST with and without batch norm")
    if result["ablation"]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
