"""Training steps on one GPU against PyTorch eager: parts "training" and "bf16" of `bench gpu` (bf16's
precision check against fp32: bench.gpu_precision).

What a user waits for: `trainer.fit` over a synthetic dataset that the GPU worker generates itself
(`taskrt.data.datasets.Synthetic`: no batch crosses from the client), steps submitted ahead as `fit`
submits them, each device's run replayed as a CUDA graph after warm-up.  Beside it, where the
step's time goes: the graph's replay alone on the GPU (its kernels), copying its inputs in and its
outputs out, the rest (Dask, data reads, waiting), and the same steps launched kernel by kernel
(what the graphs save).  The PyTorch peer is the same network with the same initial parameters,
batch and precision, timed two ways: reading each step's loss (`loss.item()`, a wait per step) and
queueing its steps (reading the last loss only); the comparison takes the faster.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

from taskrt.bench.goals import GPU_STEP_FLOOR as FLOOR
from taskrt.bench.goals import GPU_STEP_GOAL as GOAL
from taskrt.bench.goals import MEMORY_GOAL

TIMELINE_STEPS = 4  # steps of fit under torch's profiler, per network and precision


# ---- on the worker ---------------------------------------------------------------------------------
def _cuda():
    """torch, where this process computes on a GPU (None on a CPU worker)."""
    from taskrt.gpu.device import is_gpu

    if not is_gpu():
        return None
    import torch

    return torch


def reset_peak_memory() -> None:
    torch = _cuda()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict:
    """Peak bytes since the last reset: allocated by arrays and reserved by torch's caching allocator
    (from which cupy allocates too, CUDA graphs' private pools included); zeros on a CPU worker."""
    torch = _cuda()
    if torch is None:
        return {"allocated": 0, "reserved": 0}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def graph_timings() -> dict:
    from taskrt.gpu import cuda_graphs

    return {"timings": cuda_graphs.timings(), "failed": cuda_graphs.stats()["failed"]}


def memory_parts(dask_worker=None) -> dict:
    """Where a GPU worker's memory is now, in bytes: arrays allocated, the CUDA graphs' static inputs
    and outputs and their private pools (reserved), and the device arrays Dask holds (the
    programs' results: each step's new state until the next has read it and the client let go)."""
    from taskrt.gpu import cuda_graphs

    torch = _cuda()
    out = {"allocated": 0, "graph_pools": 0, "held_by_dask": 0, **cuda_graphs.memory()}
    if torch is None:
        return out
    torch.cuda.synchronize()
    out["allocated"] = torch.cuda.memory_allocated()
    out["graph_pools"] = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                             if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))
    cupy = sys.modules.get("cupy")
    seen = set()

    def device_bytes(value):
        if isinstance(value, (tuple, list)):
            return sum(device_bytes(v) for v in value)
        if cupy is not None and isinstance(value, cupy.ndarray) and value.data.ptr not in seen:
            seen.add(value.data.ptr)
            return value.nbytes
        return 0

    if dask_worker is not None:
        out["held_by_dask"] = sum(device_bytes(v) for v in list(dask_worker.data.values()))
    return out


_profiler = []  # the worker's torch profiler between start_torch_profiler and stop_torch_profiler

# CUDA runtime and driver calls that make the host wait, allocate or launch (goal 2's categories)
CALL_KINDS = ("synchronization", "allocation", "launches")


def call_kind(name: str) -> str | None:
    if "Synchronize" in name or name in ("cudaMemcpy", "cudaMemcpy2D", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"):
        return "synchronization"  # the host waits for the GPU (a synchronous copy waits too)
    if name.startswith(("cudaMalloc", "cudaFree", "cudaHostAlloc", "cuMemAlloc", "cuMemFree")):
        return "allocation"
    if name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")):
        return "launches"
    return None


def start_torch_profiler() -> None:
    """On a worker: torch's profiler (host calls and, on a GPU, CUDA activity) from now on."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if _cuda() is not None:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    _profiler[:] = [profiler]


def stop_torch_profiler(path: str, steps: int) -> dict:
    """On a worker: stop the profiler, write its Chrome trace to `path`, and return per step the host
    milliseconds and counts of the CUDA calls that synchronize, allocate or launch, and the GPU's
    kernel milliseconds."""
    torch = _cuda()
    if torch is not None:
        torch.cuda.synchronize()
    profiler = _profiler.pop()
    profiler.stop()
    profiler.export_chrome_trace(path)
    out = {kind: {"ms": 0.0, "calls": 0} for kind in CALL_KINDS}
    gpu_us = 0.0
    for event in profiler.key_averages():
        kind = call_kind(event.key)
        if kind is not None:
            out[kind]["ms"] += event.cpu_time_total / 1e3 / steps
            out[kind]["calls"] += event.count / steps
        gpu_us += getattr(event, "self_device_time_total", 0.0) or 0.0
    out["gpu_kernels_ms"] = gpu_us / 1e3 / steps
    return out


# ---- taskrt ---------------------------------------------------------------------------------------
def synthetic_for(graph, steps: int, seed: int):
    """A synthetic dataset of `steps` batches of the graph's shapes."""
    from taskrt.data.datasets import Synthetic

    image = graph.inputs[0]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return Synthetic(image.shape[0] * steps, shape=image.shape[1:], classes=classes, seed=seed)


def fit_seconds(trainer, graph, steps: int, seed: int, steps_per_program="auto") -> tuple[float, list]:
    """Seconds per step of `trainer.fit` over `steps` batches, as the user waits for them (from the
    call to its return: the first step's start and the last one's end included), and the losses."""
    data = synthetic_for(graph, steps, seed)
    started = time.perf_counter()
    history = trainer.fit(data, epochs=1, shuffle=False, progress=False, steps_per_program=steps_per_program)
    return (time.perf_counter() - started) / steps, list(history.losses)


def measure_taskrt(machine, graph, strategy, x, y, precision, warmup: int, steps: int, lr, momentum,
                   cuda_graphs=True, trace=None, timeline=None) -> dict:
    """First loss (on the numpy batch), seconds per step of `fit`, peak memory and graph timings;
    with `trace` (a path), two more steps profiled into a Chrome trace there (`Trainer.profile`:
    kernels timed with CUDA events, task by task, so never replayed as graphs); with `timeline` (a
    path), TIMELINE_STEPS more steps of `fit` under torch's profiler on the worker, its Chrome trace
    there and the CUDA calls that synchronize, allocate and launch counted."""

    from taskrt.training.trainer import Trainer

    trainer = Trainer(graph, strategy, machine, lr=lr, momentum=momentum, precision=precision,
                      cuda_graphs=cuda_graphs)
    out = {"first_loss": trainer.step(x, y)}
    fit_seconds(trainer, graph, warmup, seed=1)  # warm-up: cuDNN's autotuner, then the graphs' capture
    machine.client.run(reset_peak_memory)
    snapshots = trainer.snapshots_taken
    out["step_s"], out["losses"] = fit_seconds(trainer, graph, steps, seed=2)
    out["snapshots"] = trainer.snapshots_taken - snapshots  # each brings every parameter to the client
    out["steps_per_program"] = trainer.steps_per_program(steps)  # what fit's "auto" runs in one program now
    [memory] = machine.client.run(peak_memory).values()
    out["memory"] = memory
    [out["memory_parts"]] = machine.client.run(memory_parts).values()
    if cuda_graphs:
        [graphs] = machine.client.run(graph_timings).values()
        out["graphs"], out["graphs_failed"] = graphs["timings"], graphs["failed"]
    if out["steps_per_program"] > 1:  # the same steps one to a program, as before windows: their share
        out["one_step_s"], _ = fit_seconds(trainer, graph, steps, seed=2, steps_per_program=1)
    if timeline is not None:  # a few more steps under torch's profiler on the worker
        machine.client.run(start_torch_profiler)
        fit_seconds(trainer, graph, TIMELINE_STEPS, seed=3)
        [calls] = machine.client.run(stop_torch_profiler, str(timeline), TIMELINE_STEPS).values()
        out["timeline"] = {"trace": Path(timeline).name, **calls}
    if trace is not None:
        profiled = trainer.profile(x, y, steps=2, path=str(trace), cost_model=False, reference=False)
        last = [r for r in profiled.rows() if r["source"] == "measured"]
        out["profile"] = {"trace": Path(trace).name, **{k: sum(r[k] for r in last) for k in
                                                  ("wall_s", "busy_s", "kernels_s", "data_s", "waiting_s")}}
    return out


# ---- PyTorch --------------------------------------------------------------------------------------
def measure_peer(graph, params, x, y, precision, warmup: int, steps: int, lr, momentum, device="cuda") -> dict:
    """First loss, seconds per step waiting for each loss and queueing the steps, peak memory."""
    import torch

    from taskrt.bench.torch_peer import TorchPeer, time_steps
    from taskrt.ops.precision import set_precision

    gpu = device == "cuda"
    set_precision("fp32" if precision == "bf16" else precision)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peer = TorchPeer(graph, params, lr=lr, momentum=momentum, device=device,
                     autocast="bf16" if precision == "bf16" else None)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    out = {"first_loss": peer.step(xt, yt)}
    out["step_s"], _ = time_steps(lambda: peer.step(xt, yt), warmup, steps, device=device if gpu else None)
    started = time.perf_counter()
    for _ in range(steps):
        loss = peer.step_queued(xt, yt)
    float(loss)
    out["queued_step_s"] = (time.perf_counter() - started) / steps
    out["memory"] = ({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
                     if gpu else {"allocated": 0, "reserved": 0})
    set_precision("fp32")
    return out


# ---- rows -----------------------------------------------------------------------------------------
def step_row(part, model, batch, precision, runtime: dict, peer: dict, eager: dict | None = None) -> dict:
    """One network at one precision: taskrt's `fit` step against PyTorch's faster timing, the step's
    parts, and memory.  `runtime`, `peer`, `eager` as `measure_taskrt` / `measure_peer` return them."""
    torch_s = min(peer["step_s"], peer["queued_step_s"])
    ratio = torch_s / runtime["step_s"]
    row = {"part": part, "model": model, "batch": batch, "precision": precision,
           "runtime_ms": runtime["step_s"] * 1e3, "runtime_images_per_s": batch / runtime["step_s"],
           "torch_ms": peer["step_s"] * 1e3, "torch_queued_ms": peer["queued_step_s"] * 1e3,
           "torch_images_per_s": batch / torch_s, "of_torch": ratio,
           "goal": "met" if ratio >= GOAL else f"missed ({'above' if ratio >= FLOOR else 'below'} {FLOOR}x)",
           "first_loss_runtime": runtime["first_loss"], "first_loss_torch": peer["first_loss"],
           "first_loss_rel_diff": abs(runtime["first_loss"] - peer["first_loss"]) / max(abs(peer["first_loss"]), 1e-30)}
    graphs = runtime.get("graphs") or {}
    for key in ("snapshots", "steps_per_program"):
        if key in runtime:
            row[key] = runtime[key]
    if "one_step_s" in runtime:
        row["one_step_ms"] = runtime["one_step_s"] * 1e3
    if runtime.get("graphs_failed"):  # runs that fell back to launching kernel by kernel, and why
        row["graphs_failed"] = runtime["graphs_failed"]
    if graphs:
        for key in ("replay_ms", "host_ms"):  # the GPU's replays (copies in and out inside), the host's calls
            row[key] = sum(g[key] for g in graphs.values())
        row["rest_ms"] = row["runtime_ms"] - row["replay_ms"]
    if eager is not None:
        row["eager_ms"] = eager["step_s"] * 1e3
        row["launches_ms"] = row["eager_ms"] - row["runtime_ms"]  # what replaying the graphs saves
        shared = min(len(runtime.get("losses", ())), len(eager.get("losses", ())))
        if shared:  # the same steps from the same start: graphs replayed against kernels launched one by one
            row["graph_loss_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in
                                             zip(runtime["losses"][:shared], eager["losses"][:shared]))
        if "profile" in eager:  # a profiled step, task by task: kernels (CUDA events), data, waiting
            profile = eager["profile"]
            row.update(trace=profile["trace"], **{f"profiled_{k[:-2]}_ms": profile[k] * 1e3 for k in
                                                  ("wall_s", "kernels_s", "data_s", "waiting_s")})
    timeline = runtime.get("timeline")
    if timeline:  # per step, from torch's profiler on the worker
        row["timeline"] = timeline["trace"]
        row["timeline_gpu_kernels_ms"] = timeline["gpu_kernels_ms"]
        for kind in CALL_KINDS:
            row[f"timeline_{kind}_ms"] = timeline[kind]["ms"]
            row[f"timeline_{kind}_calls"] = timeline[kind]["calls"]
    parts = runtime.get("memory_parts")
    if parts:  # after the timed steps: where the memory is
        row.update({f"now_{k}_gib": parts[k] / 2**30 for k in ("allocated", "static_inputs", "static_outputs",
                                                                  "graph_pools", "held_by_dask")},
                   graphs=parts["graphs"], graphs_most_per_run=parts["most_per_run"])
    memory, torch_memory = runtime["memory"], peer["memory"]
    row.update(memory_gib=memory["reserved"] / 2**30, memory_allocated_gib=memory["allocated"] / 2**30,
               torch_memory_gib=torch_memory["allocated"] / 2**30,
               torch_reserved_gib=torch_memory["reserved"] / 2**30,
               memory_of_torch=memory["reserved"] / max(torch_memory["allocated"], 1) if torch_memory["allocated"]
               else None)
    return row


def step_summary(rows) -> list[str]:
    lines = []
    for r in rows:
        if "runtime_ms" not in r:
            continue
        failed = f"; runs NOT replayed as graphs: {r['graphs_failed']}" if r.get("graphs_failed") else ""
        parts = (f"; its parts: graph replay (copies included) {r['replay_ms']:.1f} ms, the rest (Dask, data,"
                 f" waiting) {r['rest_ms']:.1f} ms; the host's call of the replays {r['host_ms']:.1f} ms"
                 if "host_ms" in r else "")
        eager = f"; kernel by kernel {r['eager_ms']:.0f} ms" if "eager_ms" in r else ""
        if "one_step_ms" in r:  # fit ran several steps to a program: the same steps one to a program
            eager += (f"; {r['steps_per_program']} steps to a program, against {r['one_step_ms']:.1f} ms with one "
                      "step to a program")
        if r["memory_of_torch"] is None:
            memory_line = ""
        else:
            verdict = "met" if r["memory_of_torch"] <= MEMORY_GOAL else "missed"
            memory_line = (f"; peak memory {r['memory_gib']:.1f} GiB against PyTorch's {r['torch_memory_gib']:.1f} "
                           f"GiB = {r['memory_of_torch']:.2f}x (goal {MEMORY_GOAL}x: {verdict})")
        if r.get("now_allocated_gib"):
            memory_line += (f" (after the steps: arrays {r['now_allocated_gib']:.1f} GiB, of them graphs' static "
                            f"inputs {r['now_static_inputs_gib']:.1f} and outputs {r['now_static_outputs_gib']:.1f}, "
                            f"held by Dask {r['now_held_by_dask_gib']:.1f}; graphs' pools "
                            f"{r['now_graph_pools_gib']:.1f} GiB reserved; {r['graphs']} graphs, at most "
                            f"{r['graphs_most_per_run']} per run)")
        if "timeline" in r:
            memory_line += ("; per step under torch's profiler: " + ", ".join(
                f"{kind} {r[f'timeline_{kind}_ms']:.1f} ms of host time in {r[f'timeline_{kind}_calls']:.0f} calls"
                for kind in CALL_KINDS) + f", GPU kernels {r['timeline_gpu_kernels_ms']:.1f} ms")
        lines.append(
            f"{r['part']}, {r['model']} batch {r['batch']} {r['precision']}: taskrt {r['runtime_ms']:.1f} ms "
            f"({r['runtime_images_per_s']:,.0f} images/s), PyTorch {min(r['torch_ms'], r['torch_queued_ms']):.1f} ms "
            f"= {r['of_torch']:.2f}x (goal {GOAL}x: {r['goal']}){parts}{eager}{memory_line}{failed}")
    checked = [r for r in rows if "graph_loss_rel_diff" in r]
    if checked:
        worst = max(checked, key=lambda r: r["graph_loss_rel_diff"])
        lines.append(f"losses of the timed steps, CUDA graphs replayed against kernels launched one by one: within "
                     f"{worst['graph_loss_rel_diff']:.1e} (relative; {worst['model']} {worst['precision']})")
    timed = [r for r in rows if "first_loss_rel_diff" in r]
    if timed:
        worst = max(timed, key=lambda r: r["first_loss_rel_diff"])
        lines.append(f"first-step losses of taskrt and PyTorch differ by at most {worst['first_loss_rel_diff']:.1e} "
                     f"(relative; {worst['model']} {worst['precision']})")
    return lines


# ---- parts ----------------------------------------------------------------------------------------
def steps_part(rows: list, part: str, networks: dict, precisions, warmup: int, steps: int, lr, momentum,
               eager_for=("fp32",), traces=None, device="cuda", on_row=None) -> None:
    """Each network at each precision: taskrt (`fit`, graphs; kernel by kernel at `eager_for`, with a
    profiled step's trace written into the folder `traces`) and PyTorch.  `device` "cpu": CPU workers
    and a PyTorch on the CPU (to try the part where there is no GPU).  `on_row()`: called after each
    row (to write the report as the part goes: a machine lent for minutes may stop it)."""
    from taskrt import search
    from taskrt.bench.gpu_common import log, random_batch, release_gpu_memory
    from taskrt.machines.machine import Machine
    from taskrt.planning.params import init_parameters

    if traces is not None:
        Path(traces).mkdir(parents=True, exist_ok=True)
    with Machine.local(1, gpu=device == "cuda") as machine:
        for model, make in networks.items():
            graph = make()
            strategy = search.data_parallel(graph, machine)
            x, y = random_batch(graph)
            params = init_parameters(graph, 0, "float32")  # what Trainer(seed=0) starts from
            batch = graph.inputs[0].shape[0]
            for precision in precisions:
                log(f"{part}: {model} batch {batch}, {precision}: taskrt")
                timeline = None if traces is None else Path(traces) / f"{model}_{precision}_timeline.json"
                runtime = measure_taskrt(machine, graph, strategy, x, y, precision, warmup, steps, lr, momentum,
                                         timeline=timeline)
                gc.collect()  # the trainer (in reference cycles) lets go of its state on the worker
                machine.client.run(release_gpu_memory)
                eager = None
                if precision in eager_for:
                    log(f"{part}: {model} {precision}: taskrt kernel by kernel")
                    trace = None if traces is None else Path(traces) / f"{model}_{precision}.json"
                    eager = measure_taskrt(machine, graph, strategy, x, y, precision, warmup, max(steps // 2, 3), lr,
                                           momentum, cuda_graphs=False, trace=trace)
                    gc.collect()
                    machine.client.run(release_gpu_memory)
                log(f"{part}: {model} {precision}: PyTorch")
                peer = measure_peer(graph, params, x, y, precision, warmup, steps, lr, momentum, device)
                release_gpu_memory()
                row = step_row(part, model, batch, precision, runtime, peer, eager)
                rows.append(row)
                log("  " + step_summary([row])[0])
                if on_row is not None:
                    on_row()
