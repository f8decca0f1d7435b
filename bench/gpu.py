"""GPU benchmark (needs cupy, torch with CUDA and a CUDA device): three parts, each reporting on its own.

  a. kernels     forward + backward (input and weight gradients) of the large conv layers of AlexNet (224),
                 VGG-16 (224) and Inception-v3 (299): this runtime's kernel (the dispatch: torch path)
                 vs cuDNN called directly through torch vs the cupy im2col path, strict fp32 and TF32
  b. training    one training step on one GPU: this runtime (`Machine.local(1, gpu=True)`, data parallel
                 on one device) vs the PyTorch peer (same network, parameters, data and precision)
  c. strategies  data, model, OWT and the searched strategy on 2 and 4 workers sharing the one GPU:
                 loss against the single-device reference, bytes per step (plan vs workers' logs), step time

Writes results/gpu.json, gpu.md and gpu.png.  A part that fails is reported and the others still run.
"""

from __future__ import annotations

import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.report import markdown_table, write_result
from bench.torch_peer import TorchPeer, time_steps
from ops.rect import Rect
from taskrt import models

GOAL_KERNEL = 0.5  # each large conv layer: forward + backward at least half of cuDNN's rate
GOAL_TRAINING, MOONSHOT_TRAINING = 0.5, 0.8  # images/s against the PyTorch peer's
PRECISIONS = ("fp32", "tf32")
LARGE_MIN_CHANNELS = 64  # as bench/kernels.py: the first layers' short reductions cannot run GEMM at full rate
LARGE_MIN_GFLOP = 5.0  # forward GFLOP of the layer at the benchmark batch
LR, MOMENTUM = 1e-4, 0.9  # a small learning rate keeps random-data training finite
LOSS_RTOL = 1e-4  # float32: a strategy's loss against the single-device reference
CHECK_STEPS = 3  # steps whose losses are compared in part c

# The networks of parts a and b at the batch sizes of the PyTorch peer measurements.
NETWORKS = {
    "alexnet": lambda: models.alexnet(batch=128, image_size=224),
    "vgg16": lambda: models.vgg16(batch=64, image_size=224),
    "inception_v3": lambda: models.inception_v3(batch=64, image_size=299),
}
# Part c: small enough that search, four strategies and two machine sizes fit in a minute or two.
STRATEGY_NETWORK = {"vgg16_32": lambda: models.vgg16(batch=64, image_size=32, num_classes=10, width=0.5)}
QUICK_STRATEGY_NETWORK = {"lenet5": lambda: models.lenet5(batch=64)}

FULL = {"networks": list(NETWORKS), "kernel_warmup": 2, "kernel_repeats": 5, "step_warmup": 3, "step_repeats": 10,
        "workers": (2, 4), "strategy_network": STRATEGY_NETWORK, "strategy_repeats": 5}
QUICK = {"networks": ["alexnet"], "kernel_warmup": 1, "kernel_repeats": 2, "step_warmup": 2, "step_repeats": 3,
         "workers": (2,), "strategy_network": QUICK_STRATEGY_NETWORK, "strategy_repeats": 2}

CAVEAT = ("the workers of part c share one GPU and move data between them over TCP through host memory: "
          "their step times show the runtime's costs, not multi-GPU scaling")
DATA_NOTE = ("this runtime's step time includes sending the batch (numpy) from the client to the GPU worker; "
             "the PyTorch peer keeps its batch on the GPU")


def log(message: str) -> None:
    print(f"[bench gpu] {message}", flush=True)


# ---- the machine -------------------------------------------------------------------------------------
def missing_gpu_requirements() -> list[str]:
    """What this machine lacks for the benchmark (empty: nothing)."""
    missing = []
    try:
        import cupy

        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                missing.append("a CUDA device (cupy sees none)")
        except Exception as error:  # cupy raises its own CUDA errors without a driver or device
            missing.append(f"a CUDA device (cupy: {type(error).__name__}: {error})")
    except ImportError:
        missing.append("cupy (not installed)")
    try:
        import torch

        if not torch.cuda.is_available():
            missing.append(f"torch with CUDA (torch {torch.__version__} has none)")
    except ImportError:
        missing.append("torch (not installed)")
    return missing


def require_gpu() -> None:
    missing = missing_gpu_requirements()
    if missing:
        raise SystemExit("bench gpu runs on a machine with an NVIDIA GPU; missing here: " + "; ".join(missing))


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def gpu_description() -> dict:
    """GPU model, driver and library versions; a field that cannot be read says why."""
    info = {}

    def field(name, read):
        try:
            info[name] = read()
        except Exception as error:  # any failure is reported in the field, not raised
            info[name] = f"unavailable ({type(error).__name__}: {error})"

    def torch_module():
        import torch

        return torch

    def cupy_module():
        import cupy

        return cupy

    def cupy_runtime():
        return cupy_module().cuda.runtime

    field("gpu", lambda: cupy_runtime().getDeviceProperties(0)["name"].decode())
    field("gpu_memory_gib", lambda: round(cupy_runtime().getDeviceProperties(0)["totalGlobalMem"] / 2**30, 1))
    field("compute_capability", lambda: "{major}.{minor}".format(**cupy_runtime().getDeviceProperties(0)))
    field("driver", lambda: subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, check=True, timeout=30).stdout.strip())
    field("cuda_driver_api", lambda: _cuda_version(cupy_runtime().driverGetVersion()))
    field("cuda_runtime", lambda: _cuda_version(cupy_runtime().runtimeGetVersion()))
    field("cupy", lambda: cupy_module().__version__)
    field("torch", lambda: torch_module().__version__)
    field("torch_cuda", lambda: torch_module().version.cuda)
    field("cudnn", lambda: torch_module().backends.cudnn.version())
    return info


def release_gpu_memory() -> None:
    """Hand cached GPU memory back (cupy's pool, torch's cache): the next model starts from empty pools.
    Module-level, so `client.run` can run it on workers too."""
    gc.collect()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_part(name: str, errors: dict, fn, *args) -> float:
    """Run one part; a failure is printed and recorded in `errors`, not raised.  Returns its seconds."""
    started = time.perf_counter()
    log(f"part {name}: start")
    try:
        fn(*args)
    except Exception as error:  # one failing part must leave the others' results
        errors[name] = f"{type(error).__name__}: {error}"
        log(f"part {name} FAILED: {errors[name]}")
        traceback.print_exc()
    finally:
        from ops.precision import set_precision

        set_precision("fp32")  # a part that stopped half-way may have left TF32 on
        release_gpu_memory()
    seconds = time.perf_counter() - started
    log(f"part {name}: {seconds:.0f} s")
    return seconds


def random_batch(graph, seed=0):
    rng = np.random.default_rng(seed)
    image, labels = graph.inputs[0], graph.inputs[1]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(image.shape, dtype=np.float32), rng.integers(0, classes, labels.shape)


# ---- a. conv kernels ----------------------------------------------------------------------------------
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
    from ops import torch_kernels

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


def kernel_part(rows: list, networks, warmup: int, repeats: int) -> None:
    import cupy

    from ops.precision import set_precision

    for model in networks:
        graph = NETWORKS[model]()
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


# ---- b. one training step on one GPU ------------------------------------------------------------------
def training_row(model, batch, precision, runtime_s, torch_s, runtime_loss, torch_loss) -> dict:
    ratio = torch_s / runtime_s
    return {"part": "training", "model": model, "batch": batch, "precision": precision,
            "runtime_ms": runtime_s * 1e3, "runtime_images_per_s": batch / runtime_s,
            "torch_ms": torch_s * 1e3, "torch_images_per_s": batch / torch_s, "of_torch": ratio,
            "goal": "moonshot" if ratio >= MOONSHOT_TRAINING else "met" if ratio >= GOAL_TRAINING else "missed",
            "first_loss_runtime": runtime_loss, "first_loss_torch": torch_loss,
            "first_loss_rel_diff": abs(runtime_loss - torch_loss) / max(abs(torch_loss), 1e-30)}


def time_runtime(machine, graph, strategy, x, y, precision, warmup, repeats) -> tuple[float, float]:
    """(first step's loss, median step seconds) of this runtime; the first step counts as a warm-up."""
    from taskrt.trainer import Trainer

    trainer = Trainer(graph, strategy, machine, lr=LR, momentum=MOMENTUM, precision=precision)
    loss = trainer.step(x, y)
    seconds, _ = time_steps(lambda: trainer.step(x, y), warmup - 1, repeats)
    return loss, seconds


def time_batch_send(machine, x, repeats: int) -> float:
    """Median seconds to send the batch `x` from the client to device 0's worker, as a step sends
    its data: part of the runtime's step time that the PyTorch peer, its batch on the GPU, does not pay."""
    address = machine.addresses()[0]

    def send():
        [future] = machine.client.scatter([x], workers=[address], hash=False, direct=True)
        future.result()
        machine.client.cancel([future])

    seconds, _ = time_steps(send, 1, repeats)
    return seconds


def time_peer(graph, params, x, y, precision, warmup, repeats) -> tuple[float, float]:
    """(first step's loss, median step seconds) of the PyTorch peer, data already on the GPU as users keep it."""
    import torch

    from ops.precision import set_precision

    set_precision(precision)
    peer = TorchPeer(graph, params, lr=LR, momentum=MOMENTUM, device="cuda")
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    loss = peer.step(xt, yt)
    seconds, _ = time_steps(lambda: peer.step(xt, yt), warmup - 1, repeats, device="cuda")
    return loss, seconds


def training_part(rows: list, networks, warmup: int, repeats: int) -> None:
    import torch

    import search
    from taskrt.machine import Machine
    from taskrt.params import init_parameters

    torch.backends.cudnn.benchmark = True  # the peer as PyTorch users train fixed shapes; the runtime does the same
    with Machine.local(1, gpu=True) as machine:
        for model in networks:
            graph = NETWORKS[model]()
            strategy = search.data_parallel(graph, machine)
            x, y = random_batch(graph)
            params = init_parameters(graph, 0, "float32")  # what Trainer(seed=0) starts from
            batch = graph.inputs[0].shape[0]
            for precision in PRECISIONS:
                log(f"training: {model} batch {batch}, {precision}: this runtime")
                runtime_loss, runtime_s = time_runtime(machine, graph, strategy, x, y, precision, warmup, repeats)
                machine.client.run(release_gpu_memory)
                log(f"training: {model} batch {batch}, {precision}: PyTorch")
                torch_loss, torch_s = time_peer(graph, params, x, y, precision, warmup, repeats)
                release_gpu_memory()
                row = training_row(model, batch, precision, runtime_s, torch_s, runtime_loss, torch_loss)
                row["batch_send_ms"] = time_batch_send(machine, x, repeats) * 1e3
                rows.append(row)
                log(f"  {model} {precision}: runtime {row['runtime_images_per_s']:.0f} images/s, PyTorch "
                    f"{row['torch_images_per_s']:.0f} images/s: {row['of_torch']:.2f}x; sending the batch "
                    f"alone {row['batch_send_ms']:.1f} ms, the runtime's step {row['runtime_ms']:.1f} ms")


def training_summary(rows) -> list[str]:
    lines = [f"training, {r['model']} batch {r['batch']} {r['precision']}: this runtime "
             f"{r['runtime_images_per_s']:,.0f} images/s, PyTorch {r['torch_images_per_s']:,.0f} images/s = "
             f"{r['of_torch']:.2f}x (goal {GOAL_TRAINING}x: {r['goal']})"
             + (f"; sending the batch alone takes {r['batch_send_ms']:.0f} ms, "
                f"the runtime's step {r['runtime_ms']:.0f} ms"
                if "batch_send_ms" in r else "") for r in rows]
    if rows:
        worst = max(rows, key=lambda r: r["first_loss_rel_diff"])
        lines.append(f"training: first-step losses of runtime and PyTorch differ by at most "
                     f"{worst['first_loss_rel_diff']:.1e} (relative; {worst['model']} {worst['precision']})")
        lines.append(f"training: {DATA_NOTE}")
    return lines


# ---- c. strategies on workers sharing the GPU ------------------------------------------------------------
def strategy_row(model, workers, strategy, losses, reference_losses, planned: dict, measured: dict,
                 step_s: float, batch: int) -> dict:
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference_losses))

    def pairs(counts):
        return {f"{src}->{dst}": int(n) for (src, dst), n in sorted(counts.items())}

    return {"part": "strategies", "model": model, "workers": workers, "strategy": strategy,
            "losses": list(losses), "reference_losses": list(reference_losses), "loss_rel_diff": worst,
            "matches_one_device": worst <= LOSS_RTOL,
            "planned_bytes": sum(planned.values()), "measured_bytes": sum(measured.values()),
            "bytes_match": planned == measured, "planned_by_pair": pairs(planned), "measured_by_pair": pairs(measured),
            "step_ms": step_s * 1e3, "images_per_s": batch / step_s}


def strategy_part(rows: list, network: dict, worker_counts, repeats: int) -> None:
    import search
    from ops.precision import set_precision
    from taskrt.machine import Machine
    from taskrt.reference import SingleDeviceTrainer
    from taskrt.trainer import Trainer

    set_precision("fp32")  # the check against one device needs strict float32
    (model, make), = network.items()
    graph = make()
    x, y = random_batch(graph)
    batch = graph.inputs[0].shape[0]
    reference = SingleDeviceTrainer(graph, lr=LR, momentum=MOMENTUM, dtype="float32", seed=0)
    reference_losses = [reference.step(x, y) for _ in range(CHECK_STEPS)]
    for workers in worker_counts:
        with Machine.local(workers, gpu=True) as machine, tempfile.TemporaryDirectory() as tmp:
            strategies = dict(search.BASELINES)
            strategies["layer-wise"] = lambda g, m: search.optimize(
                g, m, search.CostModel(m, cache=f"{tmp}/costs.json", progress=False))
            for name, make_strategy in strategies.items():
                log(f"strategies: {model} on {workers} workers, {name}")
                try:
                    trainer = Trainer(graph, make_strategy(graph, machine), machine, lr=LR, momentum=MOMENTUM,
                                      precision="fp32")
                    losses = [trainer.step(x, y) for _ in range(CHECK_STEPS)]
                    planned, measured = trainer.stats.planned_bytes, trainer.stats.measured_bytes
                    step_s, _ = time_steps(lambda t=trainer: t.step(x, y), 0, repeats)
                    del trainer
                except Exception as error:  # one strategy failing leaves the others
                    rows.append({"part": "strategies", "model": model, "workers": workers, "strategy": name,
                                 "error": f"{type(error).__name__}: {error}"})
                    log(f"  FAILED: {rows[-1]['error']}")
                    continue
                row = strategy_row(model, workers, name, losses, reference_losses, planned, measured, step_s, batch)
                rows.append(row)
                log(f"  {row['step_ms']:.0f} ms/step, {row['planned_bytes']:,} bytes planned, "
                    f"{row['measured_bytes']:,} measured, loss within {row['loss_rel_diff']:.1e} of one device")


def strategy_summary(rows) -> list[str]:
    done = [r for r in rows if "error" not in r]
    lines = []
    if done:
        wrong = [f"{r['strategy']} on {r['workers']}" for r in done if not r["matches_one_device"]]
        lines.append(f"strategies: losses of the first {CHECK_STEPS} steps within {LOSS_RTOL:g} (relative) of the "
                     "single-device reference: " + ("all" if not wrong else "NOT " + ", ".join(wrong)))
        mismatched = [f"{r['strategy']} on {r['workers']}" for r in done if not r["bytes_match"]]
        lines.append("strategies: bytes per step, plan against the workers' transfer logs: "
                     + ("equal for all" if not mismatched else "DIFFER for " + ", ".join(mismatched)))
        for workers in sorted({r["workers"] for r in done}):
            mine = sorted((r for r in done if r["workers"] == workers), key=lambda r: r["step_ms"])
            lines.append(f"strategies on {workers} workers: " + ", ".join(
                f"{r['strategy']} {r['step_ms']:.0f} ms ({r['planned_bytes'] / 1e6:.1f} MB moved)" for r in mine))
    failed = [f"{r['strategy']} on {r['workers']}: {r['error']}" for r in rows if "error" in r]
    if failed:
        lines.append("strategies that failed: " + "; ".join(failed))
    if rows:
        lines.append("caveat: " + CAVEAT)
    return lines


# ---- report -----------------------------------------------------------------------------------------
KERNEL_COLUMNS = [("model", "model"), ("layer", "layer"), ("layers_of_this_shape", "layers"), ("input", "input (NCHW)"),
                  ("out_channels", "Cout"), ("kernel", "kernel/stride"), ("precision", "precision"),
                  ("gflop", "GFLOP fwd+bwd"), ("taskrt_tflops", "runtime TFLOP/s"), ("cudnn_tflops", "cuDNN TFLOP/s"),
                  ("cupy_im2col_tflops", "im2col TFLOP/s"), ("taskrt_of_cudnn", "runtime / cuDNN"),
                  ("cupy_im2col_of_cudnn", "im2col / cuDNN")]
TRAINING_COLUMNS = [("model", "model"), ("batch", "batch"), ("precision", "precision"), ("runtime_ms", "runtime ms"),
                    ("runtime_images_per_s", "runtime images/s"), ("torch_ms", "PyTorch ms"),
                    ("torch_images_per_s", "PyTorch images/s"), ("of_torch", "runtime / PyTorch"),
                    ("goal", "goal 0.5x"), ("batch_send_ms", "sending the batch alone ms"),
                    ("first_loss_rel_diff", "first-loss rel. diff")]
STRATEGY_COLUMNS = [("model", "model"), ("workers", "workers"), ("strategy", "strategy"), ("step_ms", "step ms"),
                    ("images_per_s", "images/s"), ("planned_bytes", "bytes planned"),
                    ("measured_bytes", "bytes measured"), ("bytes_match", "equal"),
                    ("loss_rel_diff", "loss rel. diff"), ("error", "error")]


def whole_numbers(rows, keys) -> list[dict]:
    """Copies of `rows` with the given fields as rounded integers (images/s read better so)."""
    return [{**r, **{k: round(r[k]) for k in keys if isinstance(r.get(k), float)}} for r in rows]


def write_report(out_dir, kernel_rows, training_rows, strategy_rows, meta: dict, errors: dict) -> Path:
    """results/gpu.json (every row of every part), gpu.md (the summary, then a table per part), gpu.png."""
    summary = kernel_summary(kernel_rows) + training_summary(training_rows) + strategy_summary(strategy_rows)
    summary += [f"part {name} FAILED: {error}" for name, error in errors.items()]
    meta = {**meta, "errors": errors, "kernels": kernel_rows, "strategies": strategy_rows}
    md = write_result(out_dir, "gpu", training_rows, TRAINING_COLUMNS, meta, summary)
    record = json.loads((Path(out_dir) / "gpu.json").read_text())
    gpu = meta.get("gpu", {})
    text = [
        "# gpu", "",
        f"{record['date']}, {gpu.get('gpu', 'GPU')}, driver {gpu.get('driver')}, torch {gpu.get('torch')} "
        f"(cuDNN {gpu.get('cudnn')}), cupy {gpu.get('cupy')}; host {record['machine']['cpu']}", "",
        *[f"- {line}" for line in summary], "",
        *([f"Measured: {', '.join(f'{part} {when}' for part, when in sorted(meta['measured'].items()))}.", ""]
          if meta.get("measured") else []),
        "## a. Conv layers: forward + backward (input and weight gradients)", "",
        markdown_table(KERNEL_COLUMNS, kernel_rows), "",
        "## b. One training step on one GPU: this runtime vs PyTorch", "",
        markdown_table(TRAINING_COLUMNS, whole_numbers(training_rows, ("runtime_images_per_s", "torch_images_per_s"))),
        "", "## c. Strategies on workers sharing one GPU", "",
        markdown_table(STRATEGY_COLUMNS, whole_numbers(strategy_rows, ("images_per_s",))), "",
        f"Caveat: {CAVEAT}.",
    ]
    md.write_text("\n".join(text) + "\n")
    plot(kernel_rows, training_rows, strategy_rows, Path(out_dir) / "gpu.png")
    return md


def plot(kernel_rows, training_rows, strategy_rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 8))
    for ax, precision in zip(axes[0], PRECISIONS):
        mine = [r for r in kernel_rows if r["precision"] == precision]
        labels = [f"{r['model']}.{r['layer']}" for r in mine]
        for k, (name, color) in enumerate(zip(IMPLEMENTATIONS, ("tab:blue", "tab:gray", "tab:orange"))):
            ax.bar(np.arange(len(mine)) + (k - 1) * 0.27, [r.get(f"{name}_tflops", 0.0) for r in mine], 0.27,
                   color=color, label=name)
        ax.set_xticks(range(len(mine)), labels, rotation=70, ha="right", fontsize=6)
        ax.set_ylabel("TFLOP/s (fwd+bwd)")
        ax.set_title(f"a. conv layers, {precision}")
        ax.legend(fontsize=7)
    ax = axes[1][0]
    labels = [f"{r['model']}\n{r['precision']}" for r in training_rows]
    ax.bar(np.arange(len(training_rows)) - 0.2, [r["runtime_images_per_s"] for r in training_rows], 0.4,
           color="tab:blue", label="this runtime")
    ax.bar(np.arange(len(training_rows)) + 0.2, [r["torch_images_per_s"] for r in training_rows], 0.4,
           color="tab:gray", label="PyTorch")
    ax.set_xticks(range(len(training_rows)), labels, fontsize=7)
    ax.set_ylabel("images / s")
    ax.set_title("b. training step on one GPU")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    done = [r for r in strategy_rows if "error" not in r]
    ax.bar(range(len(done)), [r["step_ms"] for r in done], color="tab:blue")
    ax.set_xticks(range(len(done)), [f"{r['strategy']}\n{r['workers']} workers" for r in done], fontsize=7)
    ax.set_ylabel("ms / step")
    ax.set_title("c. strategies, workers sharing one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PARTS = ("kernels", "training", "strategies")


def earlier_rows(out_dir) -> tuple[dict, dict]:
    """The rows of each part in `out_dir`/gpu.json and when they were measured ({} where none)."""
    path = Path(out_dir) / "gpu.json"
    if not path.exists():
        return {}, {}
    record = json.loads(path.read_text())
    rows = {"kernels": record.get("kernels", []), "training": record.get("rows", []),
            "strategies": record.get("strategies", [])}
    measured = record.get("measured") or {part: record["date"] for part in PARTS}
    return {part: r for part, r in rows.items() if r}, measured


def run(out_dir="results", quick=False, parts=PARTS):
    """`parts`: which parts to run; the others keep their rows from an earlier gpu.json in `out_dir`
    (a machine lent for minutes at a time can complete the report over several runs)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise SystemExit(f"bench gpu: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    require_gpu()
    config = QUICK if quick else FULL
    log(f"{'quick' if quick else 'full'} run; output in {out_dir}/gpu.*")
    meta = {"gpu": gpu_description(), "quick": quick, "lr": LR, "momentum": MOMENTUM,
            "settings": {k: v for k, v in config.items() if k != "strategy_network"},
            "strategy_network": list(config["strategy_network"]), "caveat": CAVEAT}
    log("; ".join(f"{k} {v}" for k, v in meta["gpu"].items()))
    kept, measured = earlier_rows(out_dir) if set(parts) != set(PARTS) else ({}, {})
    kernel_rows, training_rows, strategy_rows, errors = (kept.get("kernels", []), kept.get("training", []),
                                                        kept.get("strategies", []), {})
    meta["measured"] = {part: measured[part] for part in kept if part not in parts}
    steps = {
        "kernels": (kernel_part, kernel_rows, config["networks"], config["kernel_warmup"], config["kernel_repeats"]),
        "training": (training_part, training_rows, config["networks"], config["step_warmup"],
                     config["step_repeats"]),
        "strategies": (strategy_part, strategy_rows, config["strategy_network"], config["workers"],
                       config["strategy_repeats"]),
    }
    meta["seconds"] = {}
    for name, (fn, rows, *args) in steps.items():
        if name not in parts:
            continue
        rows.clear()
        meta["seconds"][name] = run_part(name, errors, fn, rows, *args)
        meta["measured"][name] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        # after every part, so that a run stopped later (a machine's time limit) keeps what it measured
        md = write_report(out_dir, kernel_rows, training_rows, strategy_rows, meta, errors)
    print(md.read_text())
    return {"kernels": kernel_rows, "training": training_rows, "strategies": strategy_rows, "errors": errors}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts to run; the others keep their rows from --out's gpu.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    run(args.out, args.quick, tuple(p.strip() for p in args.parts.split(",") if p.strip()))
