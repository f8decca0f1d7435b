"""Control replication (issue 39): what a step costs when each device runs one program per step
(`Trainer(executor="programs")`) against a Dask task per fused run (`executor="tasks"`).

- Dask tasks per training step and device, counted by a scheduler plugin (every task the scheduler
  sends to a worker), for several strategies on Machine.local(2) (goal: at most 2).
- A value's hop from one device's program to another's on loopback: half a ping-pong's round trip
  between two programs (goal: at most 1 ms; moonshot 0.3 ms), beside Dask's dependent hop between
  two devices measured on the same cluster.
- A 64 MB tile from one program to another (goal: at least 5 GB/s): made on the heap, as kernels
  make activations (copied once into shared memory), and made on reused memory, as kernels make
  weights and gradients (lent in place: `taskrt.transport.shared_memory.Blocks`).
- Step times of both executors, interleaved rounds, on local(2); and the programs' step with steps
  sent ahead, as `Trainer.fit` sends them (a device's program reads the step before on its worker,
  so it starts as that one ends: `taskrt.execution.program_executor`).
- `fit` end to end with one step to a program against several (`steps_per_program="auto"`): seconds
  per step of a whole `fit` (what a user waits for) and the Dask tasks per step and device, for
  short steps (LeNet-5) on local(1) and local(2), beside the same steps in-process (moonshot of
  goal 1: the scheduler sees almost none in the steady state).
"""

from __future__ import annotations

import statistics
import time

from distributed.diagnostics.plugin import SchedulerPlugin

from taskrt import models
from taskrt.bench.goals import HOP_GOAL_S, HOP_MOONSHOT_S, TASKS_GOAL
from taskrt.bench.goals import PROGRAMS_RATE_GOAL as RATE_GOAL
from taskrt.bench.measure import LOCAL_MODELS, interleaved
from taskrt.bench.overhead import data_parallel
from taskrt.bench.report import markdown_table, write_result
from taskrt.data.datasets import Synthetic
from taskrt.machines.calibration import _ping_pong
from taskrt.machines.machine import Machine
from taskrt.search.baselines import model_parallel, owt
from taskrt.search.measured import random_batch
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer

LARGE = 64 * 2**20
HYPER = {"lr": 1e-4, "momentum": 0.9}


class TaskCounter(SchedulerPlugin):
    """Counts the tasks the scheduler sends to workers (each transition to 'processing')."""

    name = "taskrt-task-counter"

    def __init__(self):
        self.count = 0

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            self.count += 1


def _count(dask_scheduler=None) -> int:
    return dask_scheduler.plugins[TaskCounter.name].count


def tasks_per_step(machine, trainer, x, y, steps: int = 6) -> float:
    """Dask tasks the scheduler sent per training step (steps one after another)."""
    client = machine.client
    trainer.step(x, y)
    before = client.run_on_scheduler(_count)
    for _ in range(steps):
        trainer.step(x, y)
    return (client.run_on_scheduler(_count) - before) / steps


def ahead_step_s(trainer, x, y, rounds: int, steps: int = 4) -> float:
    """Median seconds per step with `steps` steps submitted before the first is waited for."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for future in [trainer.submit(x, y) for _ in range(steps)]:
            future.result()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


FIT_CASES = [(1, 8), (1, 64), (2, 64)]  # (devices, LeNet-5 batch), data parallel


def fit_rows(rounds: int, steps: int) -> list[dict]:
    """`fit` of `steps` steps (a Synthetic dataset read on the workers) with one step to a program
    and with `steps_per_program="auto"`, interleaved, per case of FIT_CASES; seconds per step (the
    whole `fit`, medians), Dask tasks per step and device, the steps per program `auto` chose."""
    rows = []
    for devices, batch in FIT_CASES:
        graph = models.lenet5(batch=batch)
        x, y = random_batch(graph)
        reference = SingleDeviceTrainer(graph, **HYPER)
        inprocess = interleaved({"in-process": reference.step}, x, y, rounds, "in-process")["in-process"]
        with Machine.local(devices) as machine:
            machine.client.register_plugin(TaskCounter())
            strategy = data_parallel(graph, devices)
            trainers = {per: Trainer(graph, strategy, machine, **HYPER) for per in (1, "auto")}
            times, tasks, chosen = {per: [] for per in trainers}, {per: [] for per in trainers}, []
            for trainer in trainers.values():  # warm-up: compiled kernels, placed datasets, timed steps
                trainer.fit(Synthetic(batch * 8, shape=graph.inputs[0].shape[1:], classes=10), progress=False)
            for r in range(rounds):
                dataset = Synthetic(batch * steps, shape=graph.inputs[0].shape[1:], classes=10, seed=r)
                for per, trainer in trainers.items():
                    before, start = machine.client.run_on_scheduler(_count), time.perf_counter()
                    trainer.fit(dataset, progress=False, steps_per_program=per)
                    times[per].append((time.perf_counter() - start) / steps)
                    tasks[per].append((machine.client.run_on_scheduler(_count) - before) / steps / devices)
                chosen.append(trainers["auto"].steps_per_program(steps))
        one, auto = statistics.median(times[1]), statistics.median(times["auto"])
        rows.append({"devices": devices, "batch": batch, "steps": steps, "inprocess_ms": inprocess * 1e3,
                     "one_ms": one * 1e3, "auto_ms": auto * 1e3, "speedup": one / auto,
                     "one_tasks": statistics.median(tasks[1]), "auto_tasks": statistics.median(tasks["auto"]),
                     "auto_steps_per_program": statistics.median(chosen)})
    return rows


def hop_rows(machine, rounds: int, large_rounds: int) -> dict:
    """One-way time of a small value and of a 64 MB tile between two programs; Dask's hop too."""
    client = machine.client
    address = machine.addresses()
    out = {}
    for what, nbytes, count, reused in (("small", 8, rounds, False), ("large", LARGE, large_rounds, False),
                                        ("lent", LARGE, large_rounds, True)):
        tag = f"bench-{what}-{time.time_ns()}"
        a, b = (client.submit(_ping_pong, role, address[1 - i], count, nbytes, tag, "auto", reused,
                              resources={machine.tag(i): 1}, pure=False) for i, role in enumerate("ab"))
        times = a.result()
        b.result()
        out[what] = statistics.median(times[1:] if len(times) > 1 else times)
    hop = out["small"] / 2
    large = out["large"] - hop  # the answer back is a small value
    lent = max(out["lent"] - hop, 1e-9)
    dask = machine.task_overhead(independent=50, chain=30, repeats=2)
    return {"hop_s": hop, "large_s": large, "large_rate": LARGE / large, "lent_s": lent, "lent_rate": LARGE / lent,
            "dask_cross_hop_s": dask.get("per_cross_hop_s"), "dask_hop_s": dask.get("per_hop_s")}


def strategies_of(graph, machine) -> dict:
    return {"data parallel": data_parallel(graph, 2), "model parallel": model_parallel(graph, machine),
            "owt": owt(graph, machine)}


def run(out_dir="results", quick=False):
    rounds = 3 if quick else 7
    names = ["lenet5"] if quick else ["lenet5", "alexnet32", "vgg16_32"]
    rows = []
    with Machine.local(2) as machine:
        machine.client.register_plugin(TaskCounter())
        hops = hop_rows(machine, 20 if quick else 200, 3 if quick else 9)
        for name in names:
            graph = LOCAL_MODELS[name]()
            x, y = random_batch(graph)
            for strategy_name, strategy in strategies_of(graph, machine).items():
                # no snapshots: the tasks counted are the steps' own
                trainers = {executor: Trainer(graph, strategy, machine, executor=executor, snapshot_every=None,
                                              **HYPER)
                            for executor in ("programs", "tasks")}
                counts = {e: tasks_per_step(machine, t, x, y, 3 if quick else 6) for e, t in trainers.items()}
                times = interleaved({e: t.step for e, t in trainers.items()}, x, y, rounds,
                                    f"programs {name} {strategy_name}")
                ahead = ahead_step_s(trainers["programs"], x, y, rounds)
                rows.append({"model": name, "strategy": strategy_name, "programs_ahead_ms": ahead * 1e3,
                             "programs_tasks_per_device": counts["programs"] / 2,
                             "tasks_tasks_per_device": counts["tasks"] / 2,
                             "programs_ms": times["programs"] * 1e3, "tasks_ms": times["tasks"] * 1e3,
                             "speedup": times["tasks"] / times["programs"]})
                del trainers
    fits = fit_rows(3 if quick else 5, 48 if quick else 120)
    worst = max(r["programs_tasks_per_device"] for r in rows)
    summary = [
        f"Dask tasks per step and device, executor 'programs': at most {worst:g} over {len(rows)} cases "
        f"(goal <= {TASKS_GOAL}: {'met' if worst <= TASKS_GOAL else 'NOT met'}); executor 'tasks': "
        f"{min(r['tasks_tasks_per_device'] for r in rows):g}-{max(r['tasks_tasks_per_device'] for r in rows):g}",
        f"a value from one device's program to another's: {hops['hop_s'] * 1e3:.3f} ms (half a ping-pong's "
        f"round trip; goal <= {HOP_GOAL_S * 1e3:g} ms: {'met' if hops['hop_s'] <= HOP_GOAL_S else 'NOT met'}, "
        f"moonshot {HOP_MOONSHOT_S * 1e3:g} ms: {'met' if hops['hop_s'] <= HOP_MOONSHOT_S else 'not met'}); "
        f"Dask's dependent hop between the two devices on the same cluster: "
        f"{(hops['dask_cross_hop_s'] or float('nan')) * 1e3:.2f} ms",
        f"a 64 MB tile between two programs, made on reused memory as weights and gradients are (lent in "
        f"place): {hops['lent_s'] * 1e3:.2f} ms = {hops['lent_rate'] / 1e9:.1f} GB/s (goal >= {RATE_GOAL / 1e9:g} "
        f"GB/s: {'met' if hops['lent_rate'] >= RATE_GOAL else 'NOT met'}); made on the heap as activations are "
        f"(copied once into shared memory): {hops['large_s'] * 1e3:.1f} ms = {hops['large_rate'] / 1e9:.2f} GB/s "
        f"({'met' if hops['large_rate'] >= RATE_GOAL else 'NOT met'})",
        "step times: medians of interleaved rounds on Machine.local(2), each executor's own trainer, one step "
        "at a time; 'sent ahead': the programs' trainer with 4 steps submitted before the first is waited for "
        "(as `Trainer.fit` runs), seconds per step",
        *[f"fit, LeNet-5 batch {f['batch']} on local({f['devices']}) (data parallel, {f['steps']} steps a fit): "
          f"{f['auto_ms']:.1f} ms a step with steps_per_program='auto' ({f['auto_steps_per_program']:g} steps to a "
          f"program, {f['auto_tasks']:.2g} Dask tasks per step and device) against {f['one_ms']:.1f} ms with one "
          f"({f['one_tasks']:.2g} tasks) = {f['speedup']:.2f}x; the same step in-process {f['inprocess_ms']:.1f} ms"
          for f in fits],
    ]
    columns = [("model", "model"), ("strategy", "strategy"),
               ("programs_tasks_per_device", "programs: Dask tasks/step/device"),
               ("tasks_tasks_per_device", "tasks: Dask tasks/step/device"),
               ("programs_ms", "programs: step ms"), ("programs_ahead_ms", "programs, sent ahead: step ms"),
               ("tasks_ms", "tasks: step ms"),
               ("speedup", "tasks / programs step time")]
    fit_columns = [("devices", "devices"), ("batch", "batch"), ("inprocess_ms", "in-process ms"),
                   ("one_ms", "fit, one step a program: ms/step"), ("one_tasks", "one: Dask tasks/step/device"),
                   ("auto_ms", "fit, steps_per_program='auto': ms/step"),
                   ("auto_tasks", "auto: Dask tasks/step/device"),
                   ("auto_steps_per_program", "steps a program"), ("speedup", "one / auto step time")]
    md = write_result(out_dir, "programs", rows, columns, {"hops": hops, "fit": fits}, summary)
    with open(md, "a") as f:
        f.write("\n## fit: LeNet-5, data parallel, a whole fit timed\n\n" + markdown_table(fit_columns, fits) + "\n")
    print(md.read_text())
    return rows

