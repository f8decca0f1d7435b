"""Part "kernels" of `bench gpu`: forward + backward (input and weight gradients) of the large conv
layers of AlexNet (224), VGG-16 (224) and Inception-v3 (299): taskrt's kernel (the dispatch: the torch
path) against cuDNN called directly through torch and the cupy im2col path, strict fp32 and TF32."""

from __future__ import annotations

import statistics

import numpy as np

from taskrt.bench.gpu_common import log
from taskrt.bench.torch_peer import time_steps
from taskrt.ops.rect import Rect

GOAL_KERNEL = 0.5  # each large conv layer: forward + backward at least half of cuDNN's rate
PRECISIONS = ("fp32", "tf32")
LARGE_MIN_CHANNELS = 64  # as bench/kernels.py: the first layers' short reductions cannot run GEMM at full rate
LARGE_MIN_GFLOP = 5.0  # forward GFLOP of the layer at the benchmark batch


IMPLEMENTATIONS = ("taskrt", "cudnn", "cupy_im2col")


def large_conv_layers(graph, min_channels=LARGE_MIN_CHANNELS, min_gflop=LARGE_MIN_GFLOP):
    """The distinct large conv layers of a graph: (first layer of each shape, how many layers share it)."""
    shapes = {}
    for layer in graph:
        if layer.kind != "conv2d":
            continue
        op = layer.op
        if op.in_shapes[0][1] < min_channels or op.flops(Rect.full(op.out_shape)) < min_gflop * 1e9:
            continue
        key = (op.in_shapes, op.out_channels, op.kernel, op.stride, op.padding, op.activation, op.bias)
        first, count = shapes.get(key, (layer, 0))
        shapes[key] = (first, count + 1)
    return list(shapes.values())


def _conv_timers(op, implementation, cupy, seed=0):
    """(forward, backward) callables of one implementation on random float32 GPU data of the layer's shape."""
    import torch

    cupy.random.seed(seed)
    x = cupy.random.standard_normal(op.in_shapes[0], dtype=cupy.float32)
    fan_in = np.prod(op.param_shapes()["weight"][1:])
    params = {k: cupy.random.standard_normal(s, dtype=cupy.float32) * np.float32(np.sqrt(2 / fan_in))
              for k, s in op.param_shapes().items()}
    dy = cupy.random.standard_normal(op.out_shape, dtype=cupy.float32)
    whole = Rect.full(op.out_shape)
    if implementation == "cudnn":  # torch's own calls, as autograd makes them; no fused relu
        xt, dyt = torch.from_dlpack(x), torch.from_dlpack(dy)
        wt = torch.from_dlpack(params["weight"])
        bt = torch.from_dlpack(params["bias"]) if "bias" in params else None
        stride, padding = list(op.stride), list(op.padding)

        def forward():
            return torch.nn.functional.conv2d(xt, wt, bt, stride, padding)

        def backward():
            return torch.ops.aten.convolution_backward(dyt, xt, wt, [op.out_channels] if op.bias else None, stride,
                                                       padding, [1, 1], False, [0, 0], 1, [True, True, op.bias])
        return forward, backward
    from taskrt.ops import torch_kernels

    backend = "auto" if implementation == "taskrt" else "reference"
    with torch_kernels.backend(backend):
        if implementation == "taskrt" and not torch_kernels.use_torch(x):
            raise RuntimeError("the dispatch does not choose the torch path for cupy arrays here")
        y = op.forward([x], params, whole)

    def forward():
        with torch_kernels.backend(backend):
            return op.forward([x], params, whole)

    def backward():
        with torch_kernels.backend(backend):
            return op.backward(dy, [x], y, params, whole, [True])
    return forward, backward


def kernel_row(model, layer, count, precision, times: dict, errors: dict | None = None) -> dict:
    """One layer at one precision: `times[implementation] = (forward s, backward s)`; derived rates and ratios."""
    op = layer.op
    n, c, h, w = op.in_shapes[0]
    whole = Rect.full(op.out_shape)
    gflop = (op.flops(whole) + op.backward_flops(whole)) / 1e9
    row = {"part": "kernels", "model": model, "layer": layer.name, "layers_of_this_shape": count,
           "input": f"{n}x{c}x{h}x{w}", "out_channels": op.out_channels,
           "kernel": f"{op.kernel[0]}x{op.kernel[1]}/{op.stride[0]}", "precision": precision, "gflop": gflop}
    for name in IMPLEMENTATIONS:
        if name in times:
            fwd, bwd = times[name]
            row[f"{name}_forward_ms"], row[f"{name}_backward_ms"] = fwd * 1e3, bwd * 1e3
            row[f"{name}_tflops"] = gflop / (fwd + bwd) / 1e3
        elif errors and name in errors:
            row[f"{name}_error"] = errors[name]
    if "cudnn_tflops" in row:
        for name in ("taskrt", "cupy_im2col"):
            if f"{name}_tflops" in row:
                row[f"{name}_of_cudnn"] = row[f"{name}_tflops"] / row["cudnn_tflops"]
    return row


def kernel_part(rows: list, networks: dict, warmup: int, repeats: int) -> None:
    import cupy

    from taskrt.bench.gpu_common import release_gpu_memory
    from taskrt.ops.precision import set_precision

    for model, make in networks.items():
        graph = make()
        layers = large_conv_layers(graph)
        log(f"kernels: {model}, {len(layers)} distinct large conv layers")
        for layer, count in layers:
            for precision in PRECISIONS:
                set_precision(precision)
                times, errors = {}, {}
                for name in IMPLEMENTATIONS:
                    try:
                        forward, backward = _conv_timers(layer.op, name, cupy)
                        times[name] = (time_steps(forward, warmup, repeats, device="cuda")[0],
                                       time_steps(backward, warmup, repeats, device="cuda")[0])
                    except Exception as error:  # e.g. out of memory: the other implementations still count
                        errors[name] = f"{type(error).__name__}: {error}"
                    finally:
                        forward = backward = None
                        release_gpu_memory()
                row = kernel_row(model, layer, count, precision, times, errors)
                rows.append(row)
                log(f"  {model}.{layer.name} {precision}: " + ", ".join(
                    f"{name} {row[f'{name}_tflops']:.1f}" for name in IMPLEMENTATIONS if f"{name}_tflops" in row)
                    + " TFLOP/s")


def kernel_summary(rows) -> list[str]:
    lines = []
    for precision in PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision and "taskrt_of_cudnn" in r]
        if not mine:
            continue
        ratios = [r["taskrt_of_cudnn"] for r in mine]
        met = sum(v >= GOAL_KERNEL for v in ratios)
        verdict = "met by all" if met == len(mine) else f"met by {met} of {len(mine)}"
        lines.append(
            f"kernels, {precision}: this runtime's conv forward+backward reaches {min(ratios):.0%} to "
            f"{max(ratios):.0%} of cuDNN's rate (median {statistics.median(ratios):.0%}) over {len(mine)} large "
            f"layers; goal {GOAL_KERNEL:.0%}: {verdict}")
        im2col = [r["cupy_im2col_of_cudnn"] for r in rows
                  if r["precision"] == precision and "cupy_im2col_of_cudnn" in r]
        if im2col:
            lines.append(f"kernels, {precision}: the cupy im2col path reaches median {statistics.median(im2col):.0%} "
                         "of cuDNN's rate")
    failed = [f"{r['model']}.{r['layer']} ({r['precision']}, {name})" for r in rows for name in IMPLEMENTATIONS
              if f"{name}_error" in r]
    if failed:
        lines.append("kernels that failed: " + ", ".join(failed))
    return lines
