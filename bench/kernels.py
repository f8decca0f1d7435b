"""Conv kernel speed: forward + backward GFLOP/s of VGG-16 and AlexNet conv layers next to the
float32 GEMM rate, all on one thread (one core is one device here).

Each layer's forward, backward and a 2048x2048 GEMM run in alternating rounds and each reports
its median, so the layer's fraction of the GEMM rate compares times taken under the same load.
Times are the CPU time of the measuring thread, which runs the kernels alone (one BLAS thread):
on a shared machine, time its core spends on other processes does not count, contention for
caches and memory still does.  Goal (issue 14): at least 50% of GEMM on every large layer, 70% as
the moonshot.  GFLOP/s counts the direct convolution's multiply-adds: layers that run Winograd's
F(2x2, 3x3) (`ops.winograd`) multiply fewer times, so theirs is an effective rate and can pass GEMM's."""

from __future__ import annotations

import time

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from taskrt import models
from taskrt.bench.goals import KERNELS_GOAL as GOAL
from taskrt.bench.goals import KERNELS_MOONSHOT as MOONSHOT
from taskrt.bench.measure import interleaved
from taskrt.bench.report import write_result
from taskrt.ops import conv_kernels, winograd
from taskrt.ops.rect import Rect


def gemm(size: int):
    """A size x size float32 matrix product, and its FLOPs."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    return (lambda: a @ b), 2 * size**3


def conv_layers(batch: int):
    for model in (models.alexnet, models.vgg16):
        graph = model(batch=batch)
        for layer in graph:
            if layer.kind == "conv2d":
                yield graph.name, layer


def layout(op, x) -> str:
    """Which kernels the layer runs: Winograd, or its column layout and how backward-data is computed."""
    out = Rect.full(op.out_shape)
    pads = op._pads(out)
    if winograd.applies(x, op.kernel, op.stride, min(x.shape[1], op.out_channels), op.out_shape[2:]):
        return "Winograd F(2x2, 3x3)"
    planes = conv_kernels.use_planes(x, x.shape[1], op.kernel, op.stride, op.out_shape[3])
    d = np.empty(op.out_shape, dtype=x.dtype)
    form = "gather" if conv_kernels.gathers(d, (op.out_channels, *op.in_shapes[0][1:2], *op.kernel), op.stride,
                                            pads) else "scatter"
    return f"{'planes' if planes else 'channels-last'}, {form}"


def measure_layer(layer, product, rounds: int, rng) -> dict:
    op = layer.op
    out = Rect.full(op.out_shape)
    x = rng.standard_normal(op.in_shapes[0], dtype=np.float32)
    params = {k: rng.standard_normal(s, dtype=np.float32) * 0.01 for k, s in op.param_shapes().items()}
    y = op.forward([x], params, out)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    multiply, gemm_flops = product
    med = interleaved({"gemm": lambda *_: multiply(),
                       "forward": lambda *_: op.forward([x], params, out),
                       "backward": lambda *_: op.backward(dy, [x], y, params, out, [True])},
                      None, None, rounds, layer.name, clock=time.thread_time, turn=1)
    flops = op.flops(out) + op.backward_flops(out)
    gflops = flops / (med["forward"] + med["backward"]) / 1e9
    gemm_gflops = gemm_flops / med["gemm"] / 1e9
    n, c, h, w = op.in_shapes[0]
    return {
        "input": f"{n}x{c}x{h}x{w}",
        "out_channels": op.out_channels,
        "kernel": f"{op.kernel[0]}x{op.kernel[1]}/{op.stride[0]}",
        "layout": layout(op, x),
        "gflop": flops / 1e9,
        "forward_ms": med["forward"] * 1e3,
        "backward_ms": med["backward"] * 1e3,
        "gflops": gflops,
        "gemm_gflops": gemm_gflops,
        "of_gemm": gflops / gemm_gflops,
        "large": c >= 64,
    }


def run(out_dir="results", quick=False):
    batch, rounds, gemm_size = (1, 3, 1024) if quick else (8, 5, 2048)
    rng = np.random.default_rng(0)
    rows = []
    with threadpool_limits(1):
        product = gemm(gemm_size)
        layers = list(conv_layers(batch))
        for model, layer in tqdm(layers, desc="conv layers", leave=False, disable=None):
            rows.append({"model": model, "layer": layer.name, **measure_layer(layer, product, rounds, rng)})
    large = [r["of_gemm"] for r in rows if r["large"]]
    gemm_rates = [r["gemm_gflops"] for r in rows]
    summary = [
        f"float32 GEMM ({gemm_size}x{gemm_size}, 1 thread), timed in the rounds of each layer: "
        f"{min(gemm_rates):.1f} to {max(gemm_rates):.1f} GFLOP/s, median {np.median(gemm_rates):.1f}",
        f"large conv layers (>= 64 input channels): {min(large):.0%} to {max(large):.0%} of GEMM, "
        f"median {np.median(large):.0%}; goal {GOAL:.0%}: "
        + ("met by all" if min(large) >= GOAL else f"missed by {sum(v < GOAL for v in large)} of {len(large)}")
        + f"; moonshot {MOONSHOT:.0%}: reached by {sum(v >= MOONSHOT for v in large)} of {len(large)}",
        "first layers (3 input channels) have a 27- or 363-long reduction: GEMM cannot run at full rate there",
        "GFLOP/s counts the direct convolution's FLOPs; Winograd F(2x2, 3x3) layers multiply 16 times per "
        "2x2 outputs instead of 36, so their rate is effective and can exceed GEMM's",
        f"medians of {rounds} rounds, each round one GEMM, one forward and one backward of the layer; "
        "times are the measuring thread's CPU time",
    ]
    columns = [("model", "model"), ("layer", "layer"), ("input", "input (NCHW)"), ("out_channels", "Cout"),
               ("kernel", "kernel/stride"), ("layout", "algorithm: columns, backward-data"), ("gflop", "GFLOP fwd+bwd"),
               ("forward_ms", "fwd ms"), ("backward_ms", "bwd ms"), ("gflops", "GFLOP/s"),
               ("gemm_gflops", "GEMM GFLOP/s"), ("of_gemm", "of GEMM")]
    for row in rows:
        row["of_gemm"] = round(row["of_gemm"], 3)
    md = write_result(out_dir, "kernels", rows, columns,
                      {"batch": batch, "threads": 1, "rounds": rounds, "gemm_size": gemm_size}, summary)
    _plot(rows, out_dir)
    print(md.read_text())
    return rows


def _plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['model']}.{r['layer']}" for r in rows]
    ax.bar(range(len(rows)), [r["of_gemm"] for r in rows], color="tab:blue", label="conv fwd+bwd")
    ax.axhline(1.0, color="tab:red", label="float32 GEMM (2048x2048), timed alongside each layer")
    ax.axhline(GOAL, color="tab:red", linestyle="--", label=f"goal {GOAL:.0%}")
    ax.axhline(MOONSHOT, color="tab:red", linestyle=":", label=f"moonshot {MOONSHOT:.0%}")
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("fraction of the GEMM rate (1 thread)")
    ax.set_title("Conv kernels (numpy: Winograd F(2x2, 3x3) or im2col + GEMM) against GEMM, direct-convolution FLOPs")
    ax.set_ylim(0, max(1.25, 1.1 * max(r["of_gemm"] for r in rows)))
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    fig.tight_layout()
    fig.savefig(f"{out_dir}/kernels.png", dpi=120)
    plt.close(fig)
