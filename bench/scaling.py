"""The paper's Figures 7 and 8 by simulation: throughput and bytes moved per step for data, model,
OWT and layer-wise parallelism on 1, 2, 4 (one node), 8 (two nodes) and 16 (four nodes)
simulated P100s (NVLink within a node, 100 Gb/s InfiniBand between nodes, one network interface
per node), batch 32 per device, AlexNet, VGG-16 and Inception-v3 at ImageNet size.

Everything here is SIMULATED: kernel times are roofline estimates from the P100 data sheet and
the runtime is assumed free (the paper's assumption).  Layer-wise is the optimum of equation 1
(node and edge elimination); its step time, like every other, is then the simulator's.
"""

from __future__ import annotations

from tqdm import tqdm

import search
from bench.report import write_result
from taskrt import models
from taskrt.lowering import lower
from taskrt.machine import Machine

SHAPES = {1: (1, 1), 2: (1, 2), 4: (1, 4), 8: (2, 4), 16: (4, 4)}
STRATEGIES = ["data", "model", "owt", "layer-wise"]
PAPER = {  # section 6.1: layer-wise over the best other strategy at 16 GPUs, and speedup 1 -> 16
    "alexnet": {"over_best": 2.2, "speedup": 12.2, "best_other_speedup": 6.1},
    "vgg16": {"over_best": 1.5, "speedup": 14.8, "best_other_speedup": 10.2},
    "inception_v3": {"over_best": 1.4, "speedup": 15.5, "best_other_speedup": 11.2},
}


def run(out_dir="results", quick=False):
    names = ["alexnet"] if quick else ["alexnet", "vgg16", "inception_v3"]
    device_counts = [1, 4, 16] if quick else [1, 2, 4, 8, 16]
    rows = []
    cases = [(name, d) for name in names for d in device_counts]
    for name, devices in tqdm(cases, desc="scaling (simulated)", leave=False, disable=None):
        machine = Machine.simulated(*SHAPES[devices])
        graph = models.get(name, batch=32 * devices)
        cost_model = search.CostModel(machine, cache=False)
        strategies = {s: search.BASELINES[s](graph, machine) for s in STRATEGIES[:3]}
        strategies["layer-wise"] = search.optimize(graph, machine, cost_model)
        for strategy_name, strategy in strategies.items():
            plan = lower(graph, strategy.validated(graph, machine))
            result = cost_model.simulate(plan)
            rows.append({
                "model": name, "devices": devices, "strategy": strategy_name, "batch": 32 * devices,
                "step_s": result.step_s, "images_per_s": 32 * devices / result.step_s,
                "bytes_per_step": plan.bytes_moved, "tasks": len(plan.tasks),
                "additive_s": cost_model.breakdown(graph, strategy).total,
            })
    summary = _summary(rows, names, device_counts)
    columns = [("model", "model"), ("devices", "devices"), ("strategy", "strategy"),
               ("images_per_s", "images/s (simulated)"), ("step_s", "step s"), ("additive_s", "eq. 1 s"),
               ("bytes_per_step", "bytes/step"), ("tasks", "tasks")]
    md = write_result(out_dir, "scaling", rows, columns,
                      {"simulated": "P100 (9.3 TFLOP/s, 732 GB/s), NVLink 20 GB/s, 100 Gb/s between nodes, "
                                    "roofline kernels, no runtime overhead", "batch_per_device": 32}, summary)
    _plot(rows, names, device_counts, out_dir)
    print(md.read_text())
    return rows


def _get(rows, model, devices, strategy):
    return next(r for r in rows if r["model"] == model and r["devices"] == devices and r["strategy"] == strategy)


def _summary(rows, names, device_counts) -> list[str]:
    lines = ["SIMULATED: roofline kernel times for P100, links as in the paper's cluster, no runtime overhead"]
    top = max(device_counts)
    for name in names:
        lw = _get(rows, name, top, "layer-wise")
        others = [_get(rows, name, top, s) for s in ("data", "model", "owt")]
        best = max(others, key=lambda r: r["images_per_s"])
        one = _get(rows, name, 1, "layer-wise")["images_per_s"]
        speedup = lw["images_per_s"] / one
        best_other_speedup = max(r["images_per_s"] for r in others) / max(
            _get(rows, name, 1, s)["images_per_s"] for s in ("data", "model", "owt"))
        reduction = {s: _get(rows, name, top, s)["bytes_per_step"] / max(lw["bytes_per_step"], 1)
                     for s in ("data", "model")}
        paper = PAPER[name]
        lines.append(
            f"{name} on {top} devices: layer-wise {lw['images_per_s']:.0f} images/s = "
            f"{lw['images_per_s'] / best['images_per_s']:.2f}x the best other ({best['strategy']}; paper "
            f"{paper['over_best']}x); speedup 1->{top}: {speedup:.1f}x (paper {paper['speedup']}x; best other "
            f"{best_other_speedup:.1f}x, paper {paper['best_other_speedup']}x); bytes moved: "
            f"{_fewer(reduction['data'])} than data, {_fewer(reduction['model'])} than model parallelism "
            "(paper 1.3-23x fewer)")
    return lines


def _fewer(ratio: float) -> str:
    return f"{ratio:.1f}x fewer" if ratio >= 1 else f"{1 / ratio:.1f}x MORE"


def _plot(rows, names, device_counts, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"data": "tab:orange", "model": "tab:green", "owt": "tab:purple", "layer-wise": "tab:blue"}
    fig, axes = plt.subplots(1, len(names), figsize=(4.8 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for strategy in STRATEGIES:
            ys = [_get(rows, name, d, strategy)["images_per_s"] for d in device_counts]
            ax.plot(device_counts, ys, "o-", color=colors[strategy], label=strategy)
        one = _get(rows, name, 1, "layer-wise")["images_per_s"]
        ax.plot(device_counts, [one * d for d in device_counts], "r--", label="linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(device_counts, [str(d) for d in device_counts])
        ax.set_xlabel("P100 devices (4 per node)")
        ax.set_ylabel("images / s")
        ax.set_title(f"{name}, batch 32 per device")
        ax.legend(fontsize=7)
    fig.suptitle("Training throughput, SIMULATED (roofline P100, paper's cluster links) - cf. paper Fig. 7")
    fig.tight_layout()
    fig.savefig(f"{out_dir}/scaling.png", dpi=120)
    plt.close(fig)

    top = max(device_counts)
    fig, ax = plt.subplots(figsize=(1.8 + 2.4 * len(names), 3.6))
    width = 0.2
    for i, strategy in enumerate(STRATEGIES):
        ys = [_get(rows, name, top, strategy)["bytes_per_step"] / 1e9 for name in names]
        ax.bar([j + (i - 1.5) * width for j in range(len(names))], ys, width, color=colors[strategy], label=strategy)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GB moved between devices per step")
    ax.set_title(f"Communication per step on {top} devices, SIMULATED plans - cf. paper Fig. 8")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out_dir}/scaling_bytes.png", dpi=120)
    plt.close(fig)
