"""Training steps of several strategies on one machine, side by side, with their predictions.

Strategies are interleaved (two steps of each, the second timed, then the next round), so a
slow minute of the machine hits them all alike; each reports the median of its rounds.
Predictions come from the cost model measured in the same run: the paper's additive equation 1
and the task-graph simulator.
"""

from __future__ import annotations

import copy
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from taskrt import models, search
from taskrt.search.measured import random_batch
from taskrt.search.step_costs import processor_over_steps, recorded_step
from taskrt.training.trainer import Trainer

# CIFAR-size networks at batch sizes a 2-core machine trains in about a second per step
LOCAL_MODELS = {
    "lenet5": lambda: models.lenet5(batch=64),
    "alexnet32": lambda: models.alexnet(batch=32, image_size=32, num_classes=10),
    "vgg16_32": lambda: models.vgg16(batch=16, image_size=32, num_classes=10),
}
QUICK_MODELS = {"lenet5": LOCAL_MODELS["lenet5"]}


def interleaved(runners: dict, x, y, rounds: int, desc: str, clock=time.perf_counter, turn: int = 2) -> dict:
    """Median seconds per step of each runner (`interleaved_times`)."""
    return {label: statistics.median(t) for label, t in interleaved_times(runners, x, y, rounds, desc, clock,
                                                                          turn).items()}


def interleaved_times(runners: dict, x, y, rounds: int, desc: str, clock=time.perf_counter,
                      turn: int = 2) -> dict:
    """Seconds of each runner's timed step per round, one turn of each per round after one warm-up
    step.  `clock`: wall time by default; `time.thread_time` counts only the calling thread's CPU time.
    A turn is `turn` steps in a row, the last one timed: it follows a step of its own, as in
    training.  A Trainer's step returns with work left on the workers and in this process's event
    loop (the getitems naming the new state, freeing the last step's values), which slowed
    whichever runner came next when each turn was one step (an in-process LeNet-5 step after
    local(1): 15 ms instead of 9-11)."""
    for step in runners.values():  # first-touch memory, caches, numba
        step(x, y)
    times = {label: [] for label in runners}
    for _ in tqdm(range(rounds), desc=desc, leave=False, disable=None):
        for label, step in runners.items():
            for _ in range(turn - 1):
                step(x, y)
            start = clock()
            step(x, y)
            times[label].append(clock() - start)
    return times


def strategies_for(graph, machine, cost_model) -> dict:
    out = {name: make(graph, machine) for name, make in search.BASELINES.items()}
    out["layer-wise"] = search.optimize(graph, machine, cost_model, check_by_simulation=True)
    if machine.num_devices == 1:  # every strategy is the same one on a single device
        out = {"single device": out["data"]}
    return {name: s.validated(graph, machine) for name, s in out.items()}


def compute_times(client, keys: set, since: float) -> dict:
    """Compute seconds of each task from the scheduler's task stream."""
    out = {}
    for record in client.get_task_stream(start=since):
        key = record["key"]
        if key in keys:
            out[key] = sum(s["stop"] - s["start"] for s in record["startstops"] if s["action"] == "compute")
    return out


def kernels_in_a_step(machine, trainer, x, y) -> float:
    """Seconds the workers spent computing one more step of `trainer` (all its Dask tasks, from the
    scheduler's task stream)."""
    machine.client.get_task_stream(start=time.time())  # the first call starts the scheduler's recording
    future, since, _ = recorded_step(trainer, x, y)
    return sum(compute_times(machine.client, future.run.keys, since - 1).values())


def kernel_seconds(cost_model, plan, corun: bool = False) -> float:
    """The sum of `plan`'s tasks' times under `cost_model` (kernels alone, no runtime; with `corun`,
    each while kernels run on the other devices too)."""
    task_time = cost_model.timer(plan, corun)
    return sum(task_time(task) for task in plan.tasks)


def on_calibration_of(cost_model, path, parts: dict, repeats: int | None = None):
    """A cost model cached at `path` (a new file) with `parts` as its timings, on `cost_model`'s
    runtime calibration (not measured again) and timing as it does (with `repeats`, that
    many timings of each part)."""
    cache = search.cost.CostCache(path)
    cache.data.update(parts=parts, overhead=cost_model.cache.data["overhead"])
    cache.save()
    return search.CostModel(cost_model.machine, cache=path, repeats=repeats or cost_model.repeats,
                            dtype=cost_model.dtype, progress=False)


def retimed(cost_model, plans, path, refit: bool = True, repeats: int | None = None):
    """One more session of the part and synchronization timings the tasks of `plans` use, by a
    cost model of its own (`on_calibration_of`, cached at `path`, `repeats` timings of each part);
    with `refit`, on CPU workers, what `cost_model`'s calibration fitted to training steps is
    measured again too (`search.CostModel.fit_to_steps`: the latencies of steps and, where devices
    share the host's cores, the processor time per task).  Returns that cost model."""
    fresh = on_calibration_of(cost_model, path, {}, repeats)
    for plan in plans:
        kernel_seconds(fresh, plan)  # times what the plan's tasks run
    fitted = fresh.fit_to_steps(fresh.calibration) if refit else {}
    if fitted:
        fresh.calibration.update(fitted)
        fresh.cache.save()
    return fresh


def refitted(calibration: dict) -> dict:
    """The values of `calibration` fitted to training steps that a prediction takes the median of."""
    keys = [k for k in search.cost.STEP_LATENCIES if k in calibration]
    if "noop_cpu_per_task_s" in calibration:  # the processor time per task fitted to steps, not no-op tasks'
        keys.append("cpu_per_task_s")
    if "program_cpu_per_task_s" in calibration:  # the same for steps run as programs
        keys.append("program_cpu_per_task_s")
    return {k: calibration[k] for k in keys}


def median_timings(cost_model, sessions: list, directory, fits: list = ()):
    """A cost model on `cost_model`'s calibration and timings, where each timing found in every one
    of `sessions` (cost models, `retimed`) is the median of those and `cost_model`'s own, and each
    value fitted to training steps (`refitted`) the median of `cost_model`'s and those in `fits`
    (those fitted again)."""
    parts = copy.deepcopy(cost_model.cache.data["parts"])
    for kind, timings in parts.items():
        for signature, seconds in timings.items():
            found = [session.cache.get(kind, signature) for session in sessions]
            if all(f is not None for f in found):
                timings[signature] = np.median([seconds, *found], axis=0).tolist()
    merged = on_calibration_of(cost_model, Path(directory) / "median.json", parts)
    for key, value in refitted(cost_model.calibration).items():
        merged.calibration[key] = float(np.median([value, *(f[key] for f in fits if key in f)]))
    return merged


def spread(rounds: int, count: int) -> set:
    """`count` of the rounds 0..rounds-1, evenly spaced, the last among them."""
    return {round(rounds * (k + 1) / count) - 1 for k in range(count)} if count else set()


def retiming_rounds(rounds: int, retimings: int, refits: int) -> tuple[set, set]:
    """The rounds after which the parts are timed again (`retimings` of them, spread), and those of
    them after which what the calibration fitted to training steps is fitted again too (`refits`,
    spread over those)."""
    retime = sorted(spread(rounds, retimings))
    return set(retime), {retime[k] for k in spread(len(retime), min(refits, len(retime)))}


def measure(machine, graph, strategies: dict, cost_model, rounds: int, label: str, warmup: int = 2,
            seed: int = 0, retimings: int = 0, refits: int = 0, retime_repeats: int | None = None) -> list[dict]:
    """One row per strategy: measured step time (median of `rounds`), predictions, bytes moved.

    With `retimings`, the parts the strategies' tasks run are timed that many times more (each
    `retime_repeats` times), spread over the rounds, and in `refits` of those sessions what the
    calibration fitted to training steps (`refitted`: the latencies of steps and, where devices
    share the host's cores, the processor time per task); each prediction takes the median of
    those and `cost_model`'s.  The host's speed drifts (on a shared 2-core machine,
    the same VGG-16-32 step took 552, then 826, then 651 ms a few seconds apart, and in one run the
    calibration's fit gave 4.1 ms per task, then 3.1 ms in the next): costs measured at a few
    moments would compare with steps taken over many."""
    with tempfile.TemporaryDirectory() as directory:  # the timings' caches
        return _measure(machine, graph, strategies, cost_model, rounds, label, warmup, seed, retimings, refits,
                        retime_repeats, directory)


def _measure(machine, graph, strategies, cost_model, rounds, label, warmup, seed, retimings, refits, retime_repeats,
             directory) -> list[dict]:
    image = graph.inputs[0]
    x, y = random_batch(graph, seed)
    # a small learning rate keeps random-data training finite: inf and NaN would change kernel speed
    trainers = {name: Trainer(graph, s, machine, lr=1e-4, momentum=0.9, seed=seed) for name, s in strategies.items()}
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step(x, y)
    times = {name: [] for name in trainers}
    matches = {name: True for name in trainers}
    retime_after, refit_after = retiming_rounds(rounds, retimings, refits)
    sessions, fits = [], []
    for i in tqdm(range(rounds), desc=f"{label} on {machine.num_devices} devices", leave=False, disable=None):
        for name, trainer in trainers.items():
            # Two steps in a row, the second timed: it follows a step of its own, as in training,
            # not another strategy's (whose freeing of memory and keys would overlap with it)
            trainer.step(x, y)
            trainer.step(x, y)
            times[name].append(trainer.stats.wall_s)
        if i in retime_after:
            path = Path(directory) / f"retimed{len(sessions)}.json"
            sessions.append(retimed(cost_model, [t.plan for t in trainers.values()], path, i in refit_after,
                                    retime_repeats))
            if i in refit_after:
                fits.append(refitted(sessions[-1].calibration))
    sessions.insert(0, cost_model)
    first = refitted(cost_model.calibration)
    if len(sessions) > 1:
        cost_model = median_timings(cost_model, sessions[1:], directory, fits)
    for name, trainer in trainers.items():  # bytes: the plan's count against the workers' logs
        matches[name] = trainer.stats.measured_bytes == trainer.stats.planned_bytes
    in_step = {name: kernels_in_a_step(machine, trainer, x, y) for name, trainer in trainers.items()}
    # over about half a second of steps: reading the processes' times costs a round trip to each
    cpu = {name: processor_over_steps(trainer, x, y, min(20, max(2, math.ceil(0.5 / min(times[name])))))
           for name, trainer in trainers.items()}
    rows = []
    batch = image.shape[0]
    for name, trainer in trainers.items():
        plan = trainer.plan
        runtime = cost_model.runtime(plan, trainer.executor.fused, trainer.executor_kind)
        simulated = cost_model.simulate(plan, trainer.executor.fused, runtime)
        cores = runtime.cores
        alone = kernel_seconds(cost_model, plan)
        beside = kernel_seconds(cost_model, plan, corun=True) if cost_model.corun else None
        additive = cost_model.breakdown(graph, strategies[name]).total
        measured = statistics.median(times[name])
        q1, q3 = np.percentile(times[name], [25, 75])
        rows.append({
            "model": label, "devices": machine.num_devices, "strategy": name,
            "batch": batch, "tasks": len(plan.tasks), "bytes_per_step": plan.bytes_moved,
            "bytes_match_logs": matches[name],
            "measured_ms": measured * 1e3, "iqr_ms": (q3 - q1) * 1e3,
            "images_per_s": batch / measured,
            "simulated_ms": simulated.step_s * 1e3, "additive_ms": additive * 1e3,
            "simulated_error": (simulated.step_s - measured) / measured,
            "additive_error": (additive - measured) / measured,
            "step_times_ms": [t * 1e3 for t in times[name]],
            "search_pick": strategies[name].meta.get("chosen_by_simulation", ""),
            # where a prediction's error comes from: the tasks' compute time inside a step (Dask's
            # task stream) against the part timings the simulator adds up
            "kernels_in_step_ms": in_step[name] * 1e3, "kernels_alone_ms": alone * 1e3,
            "kernels_in_step_vs_alone": in_step[name] / alone if alone else None,
            # the same sum, each part timed while every device ran it at once (the simulator's
            # kernels while another one runs beside them), where devices share the host's cores
            "kernels_beside_ms": beside * 1e3 if beside is not None else None,
            # the same sum under each session of part timings (the first: the search's), which the
            # prediction takes the median of: how far the host's speed moved over the rounds
            "kernels_alone_sessions_ms": [kernel_seconds(session, plan) * 1e3 for session in sessions],
            # and what the calibration fitted to training steps (the same way): the runtime's processor
            # time per task, where devices share the host's cores, and the latencies of steps
            "step_fits_ms": {key: [value * 1e3, *(f[key] * 1e3 for f in fits if key in f)]
                             for key, value in first.items()},
            # where devices share the host's cores: the processor time of a step (all processes)
            # against the simulator's, and the cores' idle time in a step, measured (over the same
            # steps as the processor time) and simulated
            "cpu_ms": cpu[name][0] * 1e3, "simulated_cpu_ms": simulated.cpu_s * 1e3 if simulated.cpu_s else None,
            "idle_core_ms": (cores * cpu[name][2] - cpu[name][0]) * 1e3 if cores else None,
            "simulated_idle_core_ms": (cores * simulated.step_s - simulated.cpu_s) * 1e3 if cores else None,
        })
    return rows
