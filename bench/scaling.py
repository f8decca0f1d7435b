"""The paper's Figures 7 and 8 by simulation: throughput and bytes moved per step for data, model,
OWT and layer-wise parallelism on 1, 2, 4 (one node), 8 (two nodes) and 16 (four nodes)
simulated P100s (NVLink within a node, 100 Gb/s InfiniBand between nodes, one network interface
per node), batch 32 per device, AlexNet, VGG-16, Inception-v3 and ResNet-50 at ImageNet size.

Everything here is SIMULATED: kernel times are roofline estimates from the P100 data sheet.  Each
step is simulated with the runtime assumed free (the paper's assumption) and with taskrt's own
runtime under both executors, "programs" (one program per device and step, values sent between
them directly) and "tasks" (a Dask task per fused run, every hop through Dask's one scheduler),
its costs those measured on this host (`host_calibration`: Machine.local(2)'s calibration of
no-op tasks, mailbox messages and the scheduler; not the fits to CPU training steps, whose
kernels share the cores with the runtime as GPU kernels do not).  Layer-wise is the optimum of
equation 1 (node and edge elimination) under the free runtime; its step time, like every other,
is then the simulator's.
"""

from __future__ import annotations

from dataclasses import replace

from tqdm import tqdm

from taskrt import models, search
from taskrt.bench.report import write_result
from taskrt.execution.program_executor import auto_steps_per_program
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.search.runtime_costs import EXECUTORS, STEP_FITTED, runtime

SHAPES = {1: (1, 1), 2: (1, 2), 4: (1, 4), 8: (2, 4), 16: (4, 4)}
STRATEGIES = ["data", "model", "owt", "layer-wise"]
GOAL_RATIO = 1.3  # the free runtime's throughput over taskrt's with programs, at 16 devices, for every model
# where each of taskrt's runtime costs comes from (the page says it)
SOURCES = [
    "per task, per hop and per export of Dask, the scheduler's processor time per task (on Machine.local the "
    "scheduler runs in the client's process, so the client's share of a task counts too), a graph's submission "
    "per task and intake, the question for the live workers, the end of a run to the client: no-op tasks on "
    "Machine.local(2) of this host (`Machine.calibrate`)",
    "a value's message between two programs: half the median round trip of a small value between two workers' "
    "mailboxes on this host, within a node over their Unix sockets (taskrt.transport.local_link), between nodes over "
    "their TCP sockets (on loopback here; a TLS cluster's go over distributed's comms), in place of the link's "
    "latency; bytes at the simulated links' bandwidth",
    "steps sent ahead, as `Trainer.fit` sends them: with programs, the client's and the scheduler's work on a step "
    "happens while the steps before run, bounding the step only where it is longer (`Runtime.steps_ahead`), and "
    "short steps run several to a program as `fit` runs them (`auto_steps_per_program`: about a quarter of a "
    "second's worth), sharing that work; the tasks executor's steps wait for the scheduler between runs",
    "a program's own time per task: a run of no-op tasks on a worker of this host; a GPU task's launch cost "
    "is not measured here (a GPU worker replays a run's kernels as one CUDA graph)",
    "kernels: the P100 roofline; data read on the devices from a dataset, ahead of the step (nothing sent "
    "from the client); the client's graph for the tasks executor built and serialized on this host",
]
PAPER = {  # section 6.1: layer-wise over the best other strategy at 16 GPUs, and speedup 1 -> 16
    "alexnet": {"over_best": 2.2, "speedup": 12.2, "best_other_speedup": 6.1},
    "vgg16": {"over_best": 1.5, "speedup": 14.8, "best_other_speedup": 10.2},
    "inception_v3": {"over_best": 1.4, "speedup": 15.5, "best_other_speedup": 11.2},
}


def host_calibration() -> dict:
    """What taskrt's runtime costs on this host, without the fits to CPU training steps: Machine.local(2)'s
    calibration from the cost cache (`search.CostModel`), or measured now (about a minute)."""
    with Machine.local(2) as machine:
        calibration = search.CostModel(machine).calibration
        kind = machine.devices[0].kind
    return {"device": kind, **{k: v for k, v in calibration.items() if k not in STEP_FITTED}}


def run(out_dir="results", quick=False):
    names = ["alexnet"] if quick else ["alexnet", "vgg16", "inception_v3", "resnet50"]
    device_counts = [1, 4, 16] if quick else [1, 2, 4, 8, 16]
    calibration = host_calibration()
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
            row = {
                "model": name, "devices": devices, "strategy": strategy_name, "batch": 32 * devices,
                "step_s": result.step_s, "images_per_s": 32 * devices / result.step_s,
                "bytes_per_step": plan.bytes_moved, "tasks": len(plan.tasks),
                "additive_s": cost_model.breakdown(graph, strategy).total,
            }
            for executor in EXECUTORS:  # taskrt's own runtime, as measured on this host
                costs = runtime(machine, calibration, plan, executor=executor, dataset=True,
                                steps_ahead=executor == "programs")
                step = cost_model.simulate(plan, runtime=costs).step_s
                if executor == "programs":  # as fit runs them: several short steps to a program
                    costs, step = fit_steps_per_program(cost_model, plan, costs, step)
                    row["programs_steps_per_program"] = costs.steps_per_program
                row[f"{executor}_step_s"] = step
                row[f"{executor}_images_per_s"] = 32 * devices / step
            rows.append(row)
    ratios = runtime_ratios(rows, names, max(device_counts))
    summary = _summary(rows, names, device_counts) + _runtime_summary(ratios, calibration)
    columns = [("model", "model"), ("devices", "devices"), ("strategy", "strategy"),
               ("images_per_s", "images/s (simulated, free runtime)"), ("step_s", "step s"),
               ("programs_images_per_s", "images/s, taskrt programs"),
               ("programs_steps_per_program", "steps a program (fit)"),
               ("tasks_images_per_s", "images/s, taskrt tasks"),
               ("additive_s", "eq. 1 s"), ("bytes_per_step", "bytes/step"), ("tasks", "tasks")]
    md = write_result(out_dir, "scaling", rows, columns,
                      {"simulated": "P100 (9.3 TFLOP/s, 732 GB/s), NVLink 20 GB/s, 100 Gb/s between nodes, "
                                    "roofline kernels; the runtime free, and taskrt's as measured on this host",
                       "batch_per_device": 32, "goal_ratio": GOAL_RATIO, "ratios": ratios,
                       "calibration": calibration, "sources": SOURCES}, summary)
    _plot(rows, names, device_counts, out_dir)
    print(md.read_text())
    return rows


def fit_steps_per_program(cost_model, plan, costs, step_s: float):
    """(costs, step seconds) with the steps per program `fit` settles on ("auto": from the steps'
    time, which shortens as a program takes more of them; `auto_steps_per_program`)."""
    for _ in range(4):
        k = auto_steps_per_program(step_s)
        if k == costs.steps_per_program:
            break
        costs = replace(costs, steps_per_program=k)
        step_s = cost_model.simulate(plan, runtime=costs).step_s
    return costs, step_s


def runtime_ratios(rows, names, devices) -> dict:
    """Per model, at `devices`: the free runtime's throughput over taskrt's, for each executor, of the
    layer-wise strategy (the search's pick)."""
    out = {}
    for name in names:
        lw = _get(rows, name, devices, "layer-wise")
        out[name] = {executor: lw["images_per_s"] / lw[f"{executor}_images_per_s"] for executor in EXECUTORS}
        # beside it, the best of the four strategies under each runtime (the search compares them without it)
        mine = [r for r in rows if (r["model"], r["devices"]) == (name, devices)]
        best = max(r["images_per_s"] for r in mine)
        for executor in EXECUTORS:
            pick = max(mine, key=lambda r, e=executor: r[f"{e}_images_per_s"])
            out[name][f"best_{executor}"] = best / pick[f"{executor}_images_per_s"]
            out[name][f"best_{executor}_strategy"] = pick["strategy"]
    return out


def _runtime_summary(ratios, calibration) -> list[str]:
    c = calibration
    lines = ["layer-wise at the most devices, the free runtime's throughput over taskrt's: " + "; ".join(
        f"{name} programs {r['programs']:.2f}x, tasks {r['tasks']:.2f}x" for name, r in ratios.items())
        + f" (goal: programs within {GOAL_RATIO}x for every model)",
        "the same, the best of the four strategies under each runtime: " + "; ".join(
            f"{name} programs {r['best_programs']:.2f}x ({r['best_programs_strategy']}), tasks {r['best_tasks']:.2f}x "
            f"({r['best_tasks_strategy']})" for name, r in ratios.items()),
        f"taskrt's costs, measured on this host ({c['device']}, Machine.local(2)): Dask per task "
        f"{c['per_task_s'] * 1e3:.2f} ms, per hop {c['per_hop_s'] * 1e3:.2f} ms, the scheduler's processor time "
        f"per task {c.get('scheduler_per_task_s', 0) * 1e3:.2f} ms (one scheduler for every device); a program's "
        f"message {c.get('program_hop_s', 0) * 1e3:.3f} ms within a node (Unix socket), "
        f"{c.get('program_remote_hop_s', c.get('program_hop_s', 0)) * 1e3:.3f} ms between nodes (TCP), "
        f"its time per task "
        f"{c.get('program_task_s', 0) * 1e6:.1f} µs"]
    return lines + [f"where each cost comes from: {source}" for source in SOURCES]


def _get(rows, model, devices, strategy):
    return next(r for r in rows if r["model"] == model and r["devices"] == devices and r["strategy"] == strategy)


def _summary(rows, names, device_counts) -> list[str]:
    lines = ["SIMULATED: roofline kernel times for P100, links as in the paper's cluster; the strategies compared "
             "under the free runtime (the paper's assumption)"]
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
        paper = PAPER.get(name, {"over_best": "-", "speedup": "-", "best_other_speedup": "-"})  # not in the paper
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
        for executor, style in (("programs", "s:"), ("tasks", "x:")):  # taskrt's own runtime, measured here
            if f"{executor}_images_per_s" in rows[0]:
                ys = [_get(rows, name, d, "layer-wise")[f"{executor}_images_per_s"] for d in device_counts]
                ax.plot(device_counts, ys, style, color=colors["layer-wise"], label=f"layer-wise, taskrt {executor}")
        one = _get(rows, name, 1, "layer-wise")["images_per_s"]
        ax.plot(device_counts, [one * d for d in device_counts], "r--", label="linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(device_counts, [str(d) for d in device_counts])
        ax.set_yscale("log")
        ax.set_xlabel("P100 devices (4 per node)")
        ax.set_ylabel("images / s")
        ax.set_title(f"{name}, batch 32 per device")
        ax.legend(fontsize=7)
    fig.suptitle("Training throughput, SIMULATED (roofline P100, paper's cluster links; solid: the runtime free, "
                 "dotted: taskrt's, costs measured on this host) - cf. paper Fig. 7")
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
