"""GPU benchmark (needs cupy, torch with CUDA and a CUDA device): five parts, each reporting on its own.

  a. kernels     forward + backward of the large conv layers of AlexNet, VGG-16 and Inception-v3: taskrt's
                 kernel against cuDNN through torch and the cupy im2col path (bench.gpu_kernels)
  b. training    training steps on one GPU, AlexNet, VGG-16, Inception-v3 and ResNet-50, fp32 and TF32:
                 taskrt's `fit` (data generated on the worker, CUDA graphs) against PyTorch eager, where the
                 step's time goes, peak GPU memory (bench.gpu_steps)
  c. bf16        the same steps in bf16 against PyTorch's autocast, and bf16 against fp32 after 200 steps of
                 LeNet-5 on the digits: held-out accuracy and loss curve, beside another fp32 run's
                 (bench.gpu_precision)
  d. strategies  data, model, OWT and the searched strategy on 2 and 4 workers sharing the one GPU:
                 loss against the single-device reference, bytes per step (plan vs workers' logs), step time
  e. transfer    a 64 MB device array between two workers sharing the GPU, through CUDA IPC and through
                 host memory (bench.gpu_transfer)

Writes results/gpu.json, gpu.md and gpu.png after each part.  A part that fails is reported and the
others still run; `--parts` runs some and keeps the others' rows from the last gpu.json.
"""

from __future__ import annotations

import datetime
import functools
import json
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from taskrt import models
from taskrt.bench import gpu_precision, gpu_steps
from taskrt.bench.gpu_common import log, random_batch, release_gpu_memory
from taskrt.bench.gpu_kernels import IMPLEMENTATIONS, kernel_part, kernel_summary
from taskrt.bench.gpu_transfer import transfer_part, transfer_summary
from taskrt.bench.pages import header
from taskrt.bench.report import markdown_table, write_result
from taskrt.bench.torch_peer import time_steps

LR, MOMENTUM = 1e-4, 0.9  # a small learning rate keeps random-data training finite
LOSS_RTOL = 1e-4  # float32: a strategy's loss against the single-device reference
CHECK_STEPS = 3  # steps whose losses are compared in part d
PRECISIONS = ("fp32", "tf32")

# The networks of parts a-c at the batch sizes of the PyTorch peer measurements.
NETWORKS = {
    "alexnet": lambda: models.alexnet(batch=128, image_size=224),
    "inception_v3": lambda: models.inception_v3(batch=64, image_size=299),
    "resnet50": lambda: models.resnet50(batch=64, image_size=224),
    "vgg16": lambda: models.vgg16(batch=64, image_size=224),
}
KERNEL_NETWORKS = ("alexnet", "vgg16", "inception_v3")  # part a's, in this order
# Part d: small enough that search, four strategies and two machine sizes fit in a minute or two.
STRATEGY_NETWORK = {"vgg16_32": lambda: models.vgg16(batch=64, image_size=32, num_classes=10, width=0.5)}
QUICK_STRATEGY_NETWORK = {"lenet5": lambda: models.lenet5(batch=64)}
QUICK_NETWORK = {"alexnet_64": lambda: models.alexnet(batch=32, image_size=64)}

FULL = {"networks": list(NETWORKS), "kernel_warmup": 2, "kernel_repeats": 5, "step_warmup": 3, "steps": 20,
        "workers": (2, 4), "strategy_network": STRATEGY_NETWORK, "strategy_repeats": 5,
        "transfer_rounds": 12}
QUICK = {"networks": list(QUICK_NETWORK), "kernel_warmup": 1, "kernel_repeats": 2, "step_warmup": 3, "steps": 5,
         "workers": (2,), "strategy_network": QUICK_STRATEGY_NETWORK, "strategy_repeats": 2,
         "transfer_rounds": 4}

CAVEAT = ("the workers of parts d and e share one GPU (large device arrays between them through CUDA IPC, the "
          "rest through host memory): their step times show the runtime's costs, not multi-GPU scaling")


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
        from taskrt.ops.precision import set_precision

        set_precision("fp32")  # a part that stopped half-way may have left TF32 on
        release_gpu_memory()
    seconds = time.perf_counter() - started
    log(f"part {name}: {seconds:.0f} s")
    return seconds


# ---- d. strategies on workers sharing the GPU ------------------------------------------------------------
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
    from taskrt import search
    from taskrt.machines.machine import Machine
    from taskrt.ops.precision import set_precision
    from taskrt.training.reference import SingleDeviceTrainer
    from taskrt.training.trainer import Trainer

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
STEP_COLUMNS = [("model", "model"), ("batch", "batch"), ("precision", "precision"), ("runtime_ms", "taskrt ms"),
                ("runtime_images_per_s", "taskrt images/s"), ("torch_ms", "PyTorch ms (loss read each step)"),
                ("torch_queued_ms", "PyTorch ms (steps queued)"), ("of_torch", "taskrt / PyTorch"),
                ("goal", f"goal {gpu_steps.GOAL}x"), ("first_loss_rel_diff", "first-loss rel. diff")]
PARTS_COLUMNS = [("model", "model"), ("precision", "precision"), ("runtime_ms", "taskrt step ms"),
                 ("replay_ms", "graph replay ms (copies in it)"), ("host_ms", "host's call of it ms"),
                 ("rest_ms", "the rest ms"), ("steps_per_program", "steps a program"),
                 ("one_step_ms", "one step a program ms"),
                 ("snapshots", "snapshots taken"), ("eager_ms", "kernel by kernel ms"),
                 ("launches_ms", "saved by graphs ms"), ("profiled_kernels_ms", "profiled: kernels ms"),
                 ("profiled_waiting_ms", "profiled: waiting ms"), ("memory_gib", "peak GiB (reserved)"),
                 ("memory_allocated_gib", "peak GiB (arrays)"), ("torch_memory_gib", "PyTorch peak GiB"),
                 ("memory_of_torch", "memory / PyTorch")]
STRATEGY_COLUMNS = [("model", "model"), ("workers", "workers"), ("strategy", "strategy"), ("step_ms", "step ms"),
                    ("images_per_s", "images/s"), ("planned_bytes", "bytes planned"),
                    ("measured_bytes", "bytes measured"), ("bytes_match", "equal"),
                    ("loss_rel_diff", "loss rel. diff"), ("error", "error")]
TRANSFER_COLUMNS = [("path", "through"), ("one_way_ms", "one way ms"), ("gb_s", "GB/s"), ("goal", "goal 10 GB/s"),
                    ("round_trip_ms", "round trip ms"), ("hop_ms", "a small value's hop ms"),
                    ("arrived_equal", "arrived equal"), ("through_ipc", "went through IPC")]
PARTS = ("kernels", "training", "bf16", "strategies", "transfer")
RECORD_KEYS = {"kernels": "kernels", "training": "rows", "bf16": "bf16", "strategies": "strategies",
               "transfer": "transfer"}


def whole_numbers(rows, keys) -> list[dict]:
    """Copies of `rows` with the given fields as rounded integers (images/s read better so)."""
    return [{**r, **{k: round(r[k]) for k in keys if isinstance(r.get(k), float)}} for r in rows]


def write_report(out_dir, rows: dict, meta: dict, errors: dict) -> Path:
    """results/gpu.json (every row of every part), gpu.md (what it measures, the summary, a table per
    part) and gpu.png.  `rows`: part -> its rows."""
    kernel_rows, training_rows = rows.get("kernels", []), rows.get("training", [])
    bf16_rows, strategy_rows = rows.get("bf16", []), rows.get("strategies", [])
    transfer_rows = rows.get("transfer", [])
    summary = (kernel_summary(kernel_rows) + gpu_steps.step_summary(training_rows)
               + gpu_steps.step_summary(bf16_rows) + gpu_precision.precision_summary(bf16_rows)
               + strategy_summary(strategy_rows)
               + transfer_summary(transfer_rows))
    summary += [f"part {name} FAILED: {error}" for name, error in errors.items()]
    meta = {**meta, "errors": errors, "kernels": kernel_rows, "bf16": bf16_rows, "strategies": strategy_rows,
            "transfer": transfer_rows}
    md = write_result(out_dir, "gpu", training_rows, STEP_COLUMNS, meta, summary)
    record = json.loads((Path(out_dir) / "gpu.json").read_text())
    steps = [r for r in bf16_rows if "runtime_ms" in r]
    text = [
        *header("gpu", record),
        *[f"- {line}" for line in summary], "",
        *([f"Measured: {', '.join(f'{part} {when}' for part, when in sorted(meta['measured'].items()))}.", ""]
          if meta.get("measured") else []),
        "## a. Conv layers: forward + backward (input and weight gradients)", "",
        markdown_table(KERNEL_COLUMNS, kernel_rows), "",
        "## b. Training steps on one GPU: taskrt's `fit` against PyTorch eager", "",
        markdown_table(STEP_COLUMNS, whole_numbers(training_rows, ("runtime_images_per_s",))), "",
        "Where taskrt's step goes: the CUDA graph's replay (its kernels, copying the step's inputs in and "
        "its outputs out included, on the GPU), the host's time to call it, and the rest of the step (Dask, "
        "the data read, the GPU waiting); the same steps launched kernel by kernel, and what replaying saves; "
        "a profiled step "
        "kernel by kernel (`Trainer.profile`, CUDA events around each task: a task's kernels include the GPU "
        "waiting for its launches), whose Chrome trace is in gpu_traces/. "
        "Peak memory: what torch's caching allocator (which serves cupy too) reserved, against PyTorch's "
        "peak of allocated tensors.", "",
        markdown_table(PARTS_COLUMNS, training_rows + steps), "",
        "## c. bf16: taskrt's bf16 against PyTorch's autocast (bfloat16)", "",
        markdown_table(STEP_COLUMNS, whole_numbers(steps, ("runtime_images_per_s",))), "",
        "## d. Strategies on workers sharing one GPU", "",
        markdown_table(STRATEGY_COLUMNS, whole_numbers(strategy_rows, ("images_per_s",))), "",
        "## e. A device array between two workers sharing the GPU", "",
        markdown_table(TRANSFER_COLUMNS, transfer_rows), "",
        f"Caveat: {CAVEAT}.",
    ]
    md.write_text("\n".join(text) + "\n")
    plot(kernel_rows, training_rows + steps, strategy_rows, Path(out_dir) / "gpu.png")
    return md


def plot(kernel_rows, step_rows, strategy_rows, path) -> None:
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
    labels = [f"{r['model']}\n{r['precision']}" for r in step_rows]
    ax.bar(np.arange(len(step_rows)) - 0.2, [r["runtime_images_per_s"] for r in step_rows], 0.4,
           color="tab:blue", label="taskrt (fit)")
    ax.bar(np.arange(len(step_rows)) + 0.2, [r["torch_images_per_s"] for r in step_rows], 0.4,
           color="tab:gray", label="PyTorch eager")
    ax.set_xticks(range(len(step_rows)), labels, fontsize=7)
    ax.set_ylabel("images / s")
    ax.set_title("b, c. training steps on one GPU")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    done = [r for r in strategy_rows if "error" not in r]
    ax.bar(range(len(done)), [r["step_ms"] for r in done], color="tab:blue")
    ax.set_xticks(range(len(done)), [f"{r['strategy']}\n{r['workers']} workers" for r in done], fontsize=7)
    ax.set_ylabel("ms / step")
    ax.set_title("d. strategies, workers sharing one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def earlier_rows(out_dir) -> tuple[dict, dict]:
    """The rows of each part in `out_dir`/gpu.json and when they were measured ({} where none)."""
    path = Path(out_dir) / "gpu.json"
    if not path.exists():
        return {}, {}
    record = json.loads(path.read_text())
    rows = {part: record.get(key, []) for part, key in RECORD_KEYS.items()}
    measured = record.get("measured") or {part: record["date"] for part in PARTS}
    device = (record.get("gpu") or {}).get("gpu")
    if device:  # parts kept from a run on another GPU say so
        measured = {part: when if "(" in when else f"{when} ({device})" for part, when in measured.items()}
    return {part: r for part, r in rows.items() if r}, measured


def run(out_dir="results", quick=False, parts=PARTS, steps=None, eager=True):
    """`parts`: which parts to run; the others keep their rows from an earlier gpu.json in `out_dir`
    (a machine lent for minutes at a time can complete the report over several runs).  `steps`:
    timed steps per measurement (default the configuration's); `eager`: also time the steps kernel
    by kernel and profile one (part training)."""
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
    rows = {part: kept.get(part, []) for part in PARTS}
    errors = {}
    meta["measured"] = {part: measured[part] for part in kept if part not in parts}
    networks = QUICK_NETWORK if quick else {name: NETWORKS[name] for name in config["networks"]}
    step_args = (config["step_warmup"], steps or config["steps"], LR, MOMENTUM)

    def report():
        return write_report(out_dir, rows, meta, errors)

    steps = {
        "kernels": (kernel_part, {name: NETWORKS[name] for name in KERNEL_NETWORKS if name in networks}
                    or networks, config["kernel_warmup"], config["kernel_repeats"]),
        "training": (functools.partial(gpu_steps.steps_part, on_row=report), "training", networks, PRECISIONS,
                     *step_args, ("fp32",) if eager else (), Path(out_dir) / "gpu_traces"),
        "bf16": (functools.partial(bf16_part, on_row=report), networks, *step_args),
        "strategies": (strategy_part, config["strategy_network"], config["workers"], config["strategy_repeats"]),
        "transfer": (transfer_part, config["transfer_rounds"]),
    }
    meta["seconds"] = {}
    for name, (fn, *args) in steps.items():
        if name not in parts:
            continue
        rows[name].clear()
        meta["seconds"][name] = run_part(name, errors, fn, rows[name], *args)
        meta["measured"][name] = (datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
                                  + f" ({meta['gpu'].get('gpu')})")
        # after every part, so that a run stopped later (a machine's time limit) keeps what it measured
        md = report()
    print(md.read_text())
    return {**rows, "errors": errors}


def bf16_part(rows: list, networks: dict, warmup: int, steps: int, lr, momentum, on_row=None) -> None:
    log("bf16: LeNet-5 on the digits, fp32 and bf16")
    row = gpu_precision.precision_row()
    rows.append(row)
    log("  " + gpu_precision.precision_summary([row])[-1])
    if on_row is not None:
        on_row()
    gpu_steps.steps_part(rows, "bf16", networks, ("bf16",), warmup, steps, lr, momentum, eager_for=(), on_row=on_row)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m taskrt.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts to run; the others keep their rows from --out's gpu.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="results")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement")
    parser.add_argument("--no-eager", action="store_true",
                        help="part training: skip timing the steps kernel by kernel and profiling one")
    args = parser.parse_args()
    run(args.out, args.quick, tuple(p.strip() for p in args.parts.split(",") if p.strip()), args.steps,
        not args.no_eager)
