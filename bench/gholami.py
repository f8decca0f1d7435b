"""The paper's Figures 6 and 7 (Gholami et al., SPAA 2018) from its analytic model (search.analytic):
strong scaling of AlexNet at B = 2048 on P = 8 to 512 processes, alpha = 2 us, 1/beta = 6 GB/s (Table 1).

  Fig. 6  every layer on the same Pr x Pc grid (some model parallelism in the conv layers when Pr > 1)
  Fig. 7  conv layers pure batch parallel (1 x P), fc layers on the Pr x Pc grid

Everything here is ANALYTIC: communication from Eq. 8 with a grid per layer (the layout change before
fc1 in Fig. 7 counted in Eq. 6's form, and also reported without it), computation a lower bound from
the KNL's data-sheet peak (the paper measured it and gives no number), no overlap.  Nothing is fitted
to the paper's figures; its reported values are shown beside ours.
"""

from __future__ import annotations

import dataclasses

from taskrt import models
from taskrt.bench.report import markdown_table, write_result
from taskrt.search.analytic import (
    ACTIVATION_TERMS,
    ALLREDUCE_DW,
    KNL_7250_PEAK_FLOPS,
    PAPER_EQ5_BATCH_LIMIT,
    REDISTRIBUTE,
    TABLE1,
    SweepPoint,
    eq5_batch_threshold,
    grid_sweep,
    implied_compute_s,
    knl_compute_s,
    layer_dims,
    training_flops,
)

BATCH = 2048
PROCESSES = (8, 16, 32, 64, 128, 256, 512)
QUICK_PROCESSES = (8, 64, 512)
FIGURES = {"fig6": "grid", "fig7": "batch"}  # figure -> where the conv layers go
PAPER_P = 512
PAPER = {  # Section 3, the text on Figs. 6-d and 7-d; other bars are only in the figures' images
    "fig6": {"grid": "16x32", "total_speedup": 2.1, "comm_speedup": 5.0},
    "fig7": {"grid": "not given", "total_speedup": 2.5, "comm_speedup": 9.7},
}


def _alexnet():
    graph = models.alexnet(batch=BATCH, image_size=224, num_classes=1000)
    return graph, layer_dims(graph)


def _activation_s(result) -> float:
    return sum(result.comm.term(name).total_s for name in ACTIVATION_TERMS)


def _grid_rows(figure: str, points: tuple[SweepPoint, ...]) -> list[dict]:
    rows = []
    for point in points:
        best = point.best
        for r in point.grids:
            rows.append({
                "figure": figure, "P": point.processes, "Pr": r.grid.pr, "Pc": r.grid.pc, "grid": str(r.grid),
                "comm_s": r.comm_s, "activation_comm_s": _activation_s(r), "batch_comm_s": r.batch_comm_s,
                "redistribute_s": r.comm.term(REDISTRIBUTE).total_s, "latency_s": r.comm.latency_s,
                "bandwidth_s": r.comm.bandwidth_s, "words_per_process": r.comm.words, "compute_s": r.compute_s,
                "total_s": r.total_s, "best": r is best,
                "total_speedup": point.baseline.total_s / r.total_s,
                "comm_speedup": point.baseline.comm_s / r.comm_s if r.comm_s else 1.0,
            })
    return rows


def _best_rows(figure: str, points, points_without_redistribution) -> list[dict]:
    rows = []
    for point, bare in zip(points, points_without_redistribution):
        paper = PAPER[figure] if point.processes == PAPER_P else {}
        rows.append({
            "figure": figure, "P": point.processes, "best_grid": str(point.best.grid),
            "comm_ms": point.best.comm_s * 1e3, "total_ms": point.best.total_s * 1e3,
            "batch_comm_ms": point.baseline.comm_s * 1e3,
            "total_speedup": point.total_speedup, "comm_speedup": point.comm_speedup,
            "best_grid_no_redistribution": str(bare.best.grid), "comm_speedup_no_redistribution": bare.comm_speedup,
            "paper_grid": paper.get("grid", "-"), "paper_total_speedup": paper.get("total_speedup", "-"),
            "paper_comm_speedup": paper.get("comm_speedup", "-"),
        })
    return rows


def activation_scale_interval(point: SweepPoint, grid: str) -> tuple[float, float] | None:
    """The factors s > 0 for which `grid` would be the best of `point` if every activation term (all-gathers,
    input-gradient all-reduces, layout changes) were s times ours and the weight all-reduces unchanged.
    None when no s makes it the best.  An explanation of a difference, never an input."""
    target = next(r for r in point.grids if str(r.grid) == grid)
    a_t, w_t = _activation_s(target), target.comm_s - _activation_s(target)
    lo, hi = 0.0, float("inf")
    for r in point.grids:
        a, w = _activation_s(r), r.comm_s - _activation_s(r)
        if a_t > a:      # s (a_t - a) <= w - w_t
            hi = min(hi, (w - w_t) / (a_t - a))
        elif a_t < a:
            lo = max(lo, (w - w_t) / (a_t - a))
        elif w_t > w:
            return None
    return (lo, hi) if lo <= hi else None


def _comm_speedup_scaled(point: SweepPoint, grid: str, scale: float) -> float:
    """Communication speedup of `grid` over pure batch with the activation terms scaled by `scale`."""
    def scaled(r):
        return scale * _activation_s(r) + r.comm_s - _activation_s(r)
    target = next(r for r in point.grids if str(r.grid) == grid)
    return scaled(point.baseline) / scaled(target)


def _pooled(layers):
    """d_i taken after pooling: a conv layer's output as the next layer reads it (the paper's chain has
    X_{i+1} of Y_i's shape).  Only d_i changes; the weights stay."""
    return tuple(dataclasses.replace(layer, Y_H=nxt.X_H, Y_W=nxt.X_W) if layer.kind == "conv" else layer
                 for layer, nxt in zip(layers, layers[1:])) + layers[-1:]


def run_fig6_fig7(quick: bool) -> dict:
    """Figs. 6 and 7: every grid's communication and total time, the best grid per P and its speedups."""
    graph, layers = _alexnet()
    processes = QUICK_PROCESSES if quick else PROCESSES
    compute_s = knl_compute_s(layers, BATCH)
    sweeps, bare = {}, {}
    for figure, conv in FIGURES.items():
        sweeps[figure] = grid_sweep(layers, BATCH, processes, conv, compute_s, count_redistribution=True)
        bare[figure] = grid_sweep(layers, BATCH, processes, conv, compute_s, count_redistribution=False)
    rows = [row for figure in FIGURES for row in _grid_rows(figure, sweeps[figure])]
    best = [row for figure in FIGURES for row in _best_rows(figure, sweeps[figure], bare[figure])]
    eq5 = [{"layer": layer.name, "kernel": f"{layer.kh}x{layer.kw}", "input": f"{layer.X_H}x{layer.X_W}x{layer.X_C}",
            "output": f"{layer.Y_H}x{layer.Y_W}x{layer.Y_C}", "threshold": eq5_batch_threshold(layer)}
           for layer in layers if layer.kind == "conv"]
    summary = _summary(graph, layers, compute_s, sweeps, bare, eq5)
    meta = {
        "analytic": "Eq. 8 per layer (search.analytic), no overlap; compute = FLOPs / KNL 7250 peak (lower bound)",
        "batch": BATCH, "processes": list(processes),
        "interconnect": dataclasses.asdict(TABLE1), "knl_peak_flops": KNL_7250_PEAK_FLOPS,
        "training_flops_per_iteration": training_flops(layers, BATCH), "compute_s_one_process": compute_s,
        "layers": [dataclasses.asdict(layer) | {"d_in": layer.d_in, "d_out": layer.d_out} for layer in layers],
        "eq5": eq5, "paper_eq5_batch_limit": PAPER_EQ5_BATCH_LIMIT, "paper": PAPER,
    }
    return {"rows": rows, "best": best, "summary": summary, "meta": meta}


def _point(points, p) -> SweepPoint:
    return next(point for point in points if point.processes == p)


def _summary(graph, layers, compute_s, sweeps, bare, eq5) -> list[str]:
    weights, biases = sum(layer.weights for layer in layers), sum(layer.biases for layer in layers)
    fig6, fig7 = _point(sweeps["fig6"], PAPER_P), _point(sweeps["fig7"], PAPER_P)
    fig7_bare = _point(bare["fig7"], PAPER_P)
    paper6, paper7 = PAPER["fig6"], PAPER["fig7"]
    ours6_paper_grid = next(r for r in fig6.grids if str(r.grid) == paper6["grid"])
    lines = [
        f"ANALYTIC (Eqs. 6 and 8 of the paper), not measured: AlexNet of the model zoo (torchvision variant, 224x224, "
        f"1000 classes: {weights:,} weights + {biases:,} biases = {graph.num_params():,}; the paper's Table 1: 61M), "
        f"B = {BATCH}, alpha = {TABLE1.alpha_s * 1e6:g} us, 1/beta = {TABLE1.bandwidth_bytes_per_s / 1e9:g} GB/s, "
        f"{TABLE1.word_bytes}-byte words, no overlap",
        f"Fig. 6 (same grid for all layers), P = {PAPER_P}: best {fig6.best.grid}, {fig6.total_speedup:.1f}x total, "
        f"{fig6.comm_speedup:.1f}x communication over pure batch; paper: {paper6['grid']}, "
        f"{paper6['total_speedup']}x total, {paper6['comm_speedup']}x communication.  Our {paper6['grid']} gives "
        f"{fig6.baseline.comm_s / ours6_paper_grid.comm_s:.1f}x communication, "
        f"{ours6_paper_grid.comm_s / fig6.best.comm_s:.2f}x the time of our best",
        f"Fig. 7 (conv layers batch parallel, grid on fc layers), P = {PAPER_P}: best {fig7.best.grid}, "
        f"{fig7.total_speedup:.1f}x total, {fig7.comm_speedup:.1f}x communication with the layout change before "
        f"fc1 counted ({fig7_bare.best.grid}, {fig7_bare.comm_speedup:.1f}x without it); paper: "
        f"{paper7['total_speedup']}x total, {paper7['comm_speedup']}x communication "
        f"(grid {paper7['grid']} in the text)",
    ]
    small = _point(sweeps["fig6"], min(point.processes for point in sweeps["fig6"]))
    verdict = "agrees" if small.best.grid.pr == 1 else "disagrees"
    lines.append(f"Fig. 6 at P = {small.processes}: our best is {small.best.grid} "
                 f"({'pure batch' if small.best.grid.pr == 1 else f'{small.comm_speedup:.2f}x communication'}); "
                 f"the paper: no benefit from the integrated approach at P = 8 ({verdict})")
    lines += _why_fig6(layers, fig6)
    lines += _why_fig7(fig7, fig7_bare)
    lines += _why_total(layers, compute_s, fig6, fig7)
    eq5_4 = next((row for row in eq5 if row["kernel"] == "3x3" and row["input"] == "13x13x384"), None)
    if eq5_4:
        lines.append(f"Eq. 5 for {eq5_4['layer']} (3x3 filters on 13x13x384): B* = 2*3*3*384 / (3*13*13) = "
                     f"{eq5_4['threshold']:.2f}, model parallelism moves fewer words for B <= "
                     f"{int(eq5_4['threshold'])}; the paper's text says B <= {PAPER_EQ5_BATCH_LIMIT}, which the "
                     f"formula does not give for these dimensions.  All conv layers: "
                     + ", ".join(f"{row['layer']} {row['threshold']:.1f}" for row in eq5))
    return lines


def _why_fig6(layers, fig6: SweepPoint) -> list[str]:
    per_sample = sum(layer.d_out for layer in layers) + 2 * sum(layer.d_in for layer in layers[1:])
    conv12 = sum(layer.d_out for layer in layers[:2]) + 2 * layers[1].d_in
    grid = PAPER["fig6"]["grid"]
    lines = [f"Why Fig. 6 differs: Eq. 8 trades the activation terms (B/Pc (Pr-1)/Pr d per all-gather and "
             f"input-gradient all-reduce) against the weight all-reduce (|W|/Pr).  Our activations are "
             f"sum d_i + 2 sum_(i>=2) d_(i-1) = {per_sample:,} words per sample, {100 * conv12 / per_sample:.0f}% "
             f"of it from conv1 and conv2"]
    interval = activation_scale_interval(fig6, grid)
    if interval is None:
        lines.append(f"No scaling of our activation terms makes {grid} the best grid at P = {PAPER_P}")
    else:
        lo, hi = interval
        fast, slow = _comm_speedup_scaled(fig6, grid, lo), _comm_speedup_scaled(fig6, grid, hi)
        matches = slow <= PAPER["fig6"]["comm_speedup"] <= fast
        lines.append(
            f"{grid} would be our best at P = {PAPER_P} only with every activation term scaled by s in "
            f"[{lo:.3f}, {hi:.3f}] (weights unchanged), where it gives {slow:.1f}x to {fast:.1f}x communication: "
            + ("the paper's grid and its 5.0x fit one such scaling" if matches else
               f"not {PAPER['fig6']['comm_speedup']}x, so no uniform change of activation sizes (AlexNet variant, "
               "d_i convention, pooling) reproduces both the paper's grid and its speedup with these weights"))
    pooled = grid_sweep(_pooled(layers), BATCH, [PAPER_P], "grid", 0.0, count_redistribution=False)[0]
    lines.append(f"With d_i taken after pooling (what the next layer reads; the paper's chain has no pooling) "
                 f"Fig. 6's best at P = {PAPER_P} is {pooled.best.grid} with {pooled.comm_speedup:.1f}x communication")
    return lines


def _why_fig7(fig7: SweepPoint, fig7_bare: SweepPoint) -> list[str]:
    best = fig7.best
    conv_dw = sum(cost.term(ALLREDUCE_DW).total_s for cost in best.comm.layers if cost.layer.startswith("conv"))
    return [f"Why Fig. 7 differs: its grid only moves the fc layers' terms; the conv layers' weight all-reduce "
            f"({conv_dw * 1e3:.2f} ms) is the same for every grid, the layout change before fc1 costs "
            f"{best.comm.term(REDISTRIBUTE).total_s * 1e3:.2f} ms at {best.grid}, and the fc activations "
            f"{_activation_s(best) * 1e3 - best.comm.term(REDISTRIBUTE).total_s * 1e3:.2f} ms.  The paper does not "
            f"say whether it counts the layout change (it calls it asymptotically free); without it we get "
            f"{fig7_bare.comm_speedup:.1f}x against its {PAPER['fig7']['comm_speedup']}x"]


def _why_total(layers, compute_s, fig6: SweepPoint, fig7: SweepPoint) -> list[str]:
    per_process = compute_s / PAPER_P
    lines = [f"Computation: {compute_s:.2f} s per iteration of B = {BATCH} on one process = "
             f"{training_flops(layers, BATCH) / 1e12:.2f} TFLOP (3 x 2 x MACs of the conv and fc layers) / "
             f"{KNL_7250_PEAK_FLOPS / 1e12:.2f} TFLOP/s (Xeon Phi 7250 peak): a LOWER BOUND; "
             f"{per_process * 1e3:.2f} ms per process at P = {PAPER_P} against {fig6.baseline.comm_s * 1e3:.1f} ms "
             f"of pure-batch communication"
             + (", so our total speedups stay close to our communication speedups"
                if per_process < 0.1 * fig6.baseline.comm_s else "")]
    implied = []
    for name, point in (("fig6", fig6), ("fig7", fig7)):
        paper = PAPER[name]
        c = implied_compute_s(point.baseline.comm_s, paper["total_speedup"], paper["comm_speedup"])
        implied.append(f"{paper['total_speedup']}x / {paper['comm_speedup']}x of Fig. {name[-1]} imply "
                       f"{c * 1e3:.1f} ms per process ({c * PAPER_P:.1f} s per iteration on one process, "
                       f"{c / per_process:.0f}x our bound)")
    lines.append("Why total speedups differ: the paper measured compute (Intel Caffe, one KNL) and gives no "
                 "number; with our pure-batch communication its pairs " + "; ".join(implied)
                 + ".  An explanation only, not an input")
    return lines


def write(out_dir, quick: bool) -> dict:
    """results: gholami.json, gholami.md (best grid per P beside the paper, every grid at P = 512), gholami.png."""
    result = run_fig6_fig7(quick)
    columns = [("figure", "figure"), ("P", "P"), ("best_grid", "best Pr x Pc"), ("comm_ms", "comm ms"),
               ("total_ms", "total ms"), ("batch_comm_ms", "pure batch comm ms"),
               ("total_speedup", "total speedup"), ("comm_speedup", "comm speedup"),
               ("best_grid_no_redistribution", "best, no layout change"),
               ("comm_speedup_no_redistribution", "comm speedup, no layout change"),
               ("paper_grid", "paper grid"), ("paper_total_speedup", "paper total"),
               ("paper_comm_speedup", "paper comm")]
    md = write_result(out_dir, "gholami", result["best"], columns, result["meta"] | {"grids": result["rows"]},
                      result["summary"])
    grid_columns = [("grid", "Pr x Pc"), ("comm_s", "comm s"), ("activation_comm_s", "activations s"),
                    ("batch_comm_s", "weight all-reduce s"), ("redistribute_s", "layout change s"),
                    ("compute_s", "compute s"), ("total_s", "total s"), ("comm_speedup", "comm speedup"),
                    ("total_speedup", "total speedup"), ("best", "best")]
    text = []
    for figure in FIGURES:
        rows = [row for row in result["rows"] if row["figure"] == figure and row["P"] == PAPER_P]
        text += ["", f"## {figure}: every grid at P = {PAPER_P}", "", markdown_table(grid_columns, rows)]
    with md.open("a") as f:
        f.write("\n".join(text) + "\n")
    _plot(result["rows"], out_dir)
    return result


def _plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"fig6": "same grid for all layers (cf. Fig. 6-d)", "fig7": "conv batch parallel (cf. Fig. 7-d)"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for ax, figure in zip(axes, FIGURES):
        points = [row for row in rows if row["figure"] == figure and row["P"] == PAPER_P]
        xs = range(len(points))
        top = 1.4 * points[0]["total_s"]  # pure batch sets the scale; taller bars are cut and labelled
        ax.bar([x - 0.2 for x in xs], [r["compute_s"] for r in points], 0.4, color="tab:blue",
               label="computation (KNL peak, lower bound)")
        ax.bar([x + 0.2 for x in xs], [r["batch_comm_s"] for r in points], 0.4, color="tab:orange",
               edgecolor="black", hatch="//", linewidth=0, label="communication: weight all-reduce")
        ax.bar([x + 0.2 for x in xs], [r["comm_s"] - r["batch_comm_s"] for r in points], 0.4,
               bottom=[r["batch_comm_s"] for r in points], color="tab:orange",
               label="communication: activations, layout change")
        for x, r in zip(xs, points):
            if r["comm_s"] > top:
                ax.text(x + 0.2, 0.97 * top, f"{r['comm_s']:.2f} s", ha="center", va="top", rotation=90, fontsize=7)
        best = next(r for r in points if r["best"])
        ax.annotate(f"{best['total_speedup']:.1f}x ({best['comm_speedup']:.1f}x)",
                    (points.index(best) + 0.2, best["comm_s"]), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontweight="bold", fontsize=8)
        ax.set_ylim(0, top)
        ax.set_xticks(list(xs), [r["grid"] for r in points], rotation=45, fontsize=7)
        ax.set_xlabel("Pr x Pc")
        ax.set_ylabel("seconds per iteration")
        ax.set_title(f"AlexNet, B = {BATCH}, P = {PAPER_P}: {titles[figure]}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("ANALYTIC (Eq. 8 per layer, alpha = 2 us, 1/beta = 6 GB/s); speedups over pure batch: "
                 "total (communication)", fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{out_dir}/gholami.png", dpi=120)
    plt.close(fig)


def run(out_dir="results", quick=False):
    """The benchmark runner's entry point (python -m taskrt.bench gholami, once it is listed there)."""
    result = write(out_dir, quick)
    print("\n".join(f"- {line}" for line in result["summary"]))
    return result["rows"]
