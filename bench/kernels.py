"""Conv kernel speed: forward + backward GFLOP/s of VGG-16 and AlexNet conv layers next to the
float32 GEMM rate measured in the same run, all on one thread (one core is one device here)."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from bench.report import median_time, write_result
from ops.rect import Rect
from taskrt import models

GOAL = 0.5  # large conv layers should reach half the GEMM rate


def gemm_rate(size: int, repeats: int) -> float:
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    return 2 * size**3 / median_time(lambda: a @ b, repeats) / 1e9


def conv_layers(batch: int):
    for model in (models.alexnet, models.vgg16):
        graph = model(batch=batch)
        for layer in graph:
            if layer.kind == "conv2d":
                yield graph.name, layer


def measure_layer(layer, repeats: int, rng) -> dict:
    op = layer.op
    out = Rect.full(op.out_shape)
    x = rng.standard_normal(op.in_shapes[0], dtype=np.float32)
    params = {k: rng.standard_normal(s, dtype=np.float32) * 0.01 for k, s in op.param_shapes().items()}
    y = op.forward([x], params, out)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    t_fwd = median_time(lambda: op.forward([x], params, out), repeats)
    t_bwd = median_time(lambda: op.backward(dy, [x], y, params, out, [True]), repeats)
    flops = op.flops(out) + op.backward_flops(out)
    n, c, h, w = op.in_shapes[0]
    return {
        "input": f"{n}x{c}x{h}x{w}",
        "out_channels": op.out_channels,
        "kernel": f"{op.kernel[0]}x{op.kernel[1]}/{op.stride[0]}",
        "gflop": flops / 1e9,
        "forward_ms": t_fwd * 1e3,
        "backward_ms": t_bwd * 1e3,
        "gflops": flops / (t_fwd + t_bwd) / 1e9,
        "large": c >= 64,
    }


def run(out_dir="results", quick=False):
    batch, repeats, gemm_size = (1, 2, 1024) if quick else (8, 3, 2048)
    rng = np.random.default_rng(0)
    rows = []
    with threadpool_limits(1):
        gemm = gemm_rate(gemm_size, repeats + 2)
        layers = list(conv_layers(batch))
        for model, layer in tqdm(layers, desc="conv layers", leave=False, disable=None):
            row = {"model": model, "layer": layer.name, **measure_layer(layer, repeats, rng)}
            row["of_gemm"] = row["gflops"] / gemm
            rows.append(row)
        gemm_after = gemm_rate(gemm_size, repeats + 2)
    large = [r["of_gemm"] for r in rows if r["large"]]
    summary = [
        f"float32 GEMM ({gemm_size}x{gemm_size}, 1 thread): {gemm:.1f} GFLOP/s before the layers, "
        f"{gemm_after:.1f} after",
        f"large conv layers (>= 64 input channels): {min(large):.0%} to {max(large):.0%} of GEMM, "
        f"median {np.median(large):.0%}; goal {GOAL:.0%}: "
        + ("met by all" if min(large) >= GOAL else f"missed by {sum(v < GOAL for v in large)} of {len(large)}"),
        "first layers (3 input channels) have a 27- or 363-long reduction: GEMM cannot run at full rate there",
    ]
    columns = [("model", "model"), ("layer", "layer"), ("input", "input (NCHW)"), ("out_channels", "Cout"),
               ("kernel", "kernel/stride"), ("gflop", "GFLOP fwd+bwd"), ("forward_ms", "fwd ms"),
               ("backward_ms", "bwd ms"), ("gflops", "GFLOP/s"), ("of_gemm", "of GEMM")]
    for row in rows:
        row["of_gemm"] = round(row["of_gemm"], 3)
    md = write_result(out_dir, "kernels", rows, columns,
                      {"batch": batch, "threads": 1, "gemm_gflops": gemm, "gemm_gflops_after": gemm_after},
                      summary)
    _plot(rows, gemm, out_dir)
    print(md.read_text())
    return rows


def _plot(rows, gemm, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['model']}.{r['layer']}" for r in rows]
    ax.bar(range(len(rows)), [r["gflops"] for r in rows], color="tab:blue", label="conv fwd+bwd")
    ax.axhline(gemm, color="tab:red", label=f"float32 GEMM {gemm:.0f} GFLOP/s")
    ax.axhline(gemm * GOAL, color="tab:red", linestyle="--", label="50% of GEMM")
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s (1 thread)")
    ax.set_title("Conv kernels (im2col + GEMM, numpy) vs GEMM, measured in the same run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{out_dir}/kernels.png", dpi=120)
    plt.close(fig)
