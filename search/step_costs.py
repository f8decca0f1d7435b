"""The runtime's costs measured on real training steps: processor time per Dask task and per
message, and the latencies of a step's start, of each hop between tasks and of its end.

Costs measured on no-op tasks (`Machine.calibrate`) miss much of what a step's tasks cost:
dependent tasks scheduled one wave at a time, their specs, the exports of a fused run, each
step's graph built, submitted and taken in by the scheduler.  So a small calibration network,
none of the benchmark's, trains a few steps under data, model and OWT parallelism, a spatial
split and (with two devices or more) on one device alone, and the steps are measured as the
simulator sees them (`taskrt.planning.simulate.Runtime`):

- processor time (where devices share a host's cores with the runtime, CPU workers on one
  host): all processes' CPU time over the steps, less the workers' task threads' own and the
  share of their messages and bytes measured apart, fitted by non-negative least squares to
  each step's fused tasks;
- latencies, from the scheduler's task stream of a few more steps (`step_timings`): from a task's
  inputs being done to its start, on its own device and from another one beyond the link's time;
  from the step's start to its first task; from the runs computing its outputs ending to the
  client having them.

The steps run under the executor whose costs are fitted (`executor`): "tasks" (a Dask task per
fused run) or "programs" (one Dask task per device, `program_timings`: the scheduler sees no
hops inside a step, only its programs' starts and ends).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

STEPS, WARMUP, TIMED = 4, 2, 5  # steps per strategy: untimed first, CPU measured (a turn), task stream read
ROUNDS = 3  # turns per strategy of STEPS each, whose median is fitted
TRIM = 0.1  # latencies are means of the middle 80%: a device busy with another task, a slow moment


def calibration_network(batch: int = 32):
    """Two conv-pool stages and two fully-connected layers at 32x32: a step of tens of
    milliseconds on two CPU workers, with activations, weights and gradients all of a size
    that moves."""
    from taskrt.graph.graph import Graph

    g = Graph("calibration")
    x = g.input("image", (batch, 3, 32, 32))
    x = g.conv2d(x, 32, 3, padding=1, activation="relu", name="conv1")
    x = g.pool2d(x, 2, name="pool1")
    x = g.conv2d(x, 64, 3, padding=1, activation="relu", name="conv2")
    x = g.pool2d(x, 2, name="pool2")
    x = g.flatten(x, name="flatten")
    x = g.linear(x, 256, activation="relu", name="fc1")
    x = g.linear(x, 10, name="fc2")
    g.softmax_cross_entropy(x, name="loss")
    return g


def strategies(graph, machine) -> dict:
    """Data, model and OWT parallelism, conv and pool layers split in height (the rest over
    samples), and every layer on device 0: few tasks and many bytes, many tasks and few bytes,
    between, and one task (a step that fuses into a single run)."""
    from taskrt.graph.config import ParallelConfig
    from taskrt.graph.strategy import Strategy
    from taskrt.search.baselines import BASELINES

    d = machine.num_devices
    if d == 1:  # every strategy is the same one on a single device
        return {"one device": BASELINES["data"](graph, machine).validated(graph, machine)}
    out = {name: make(graph, machine) for name, make in BASELINES.items()}
    out["height"] = Strategy({
        layer.name: ParallelConfig(**{"h" if "h" in layer.dims else "n": d}, devices=tuple(range(d)))
        for layer in graph if not layer.is_input}, name="height")
    out["one device"] = Strategy({layer.name: ParallelConfig(devices=(0,)) for layer in graph if not layer.is_input},
                                 name="one device")
    return {name: s.validated(graph, machine) for name, s in out.items()}


def step_costs(machine, cpu_per_byte_s: float = 0.0, cpu_per_message_s: float = 0.0, fit_cpu: bool = True,
               steps: int = STEPS, warmup: int = WARMUP, timed: int = TIMED, rounds: int = ROUNDS,
               executor: str = "tasks") -> dict:
    """The runtime's costs measured on training steps of `calibration_network` (module docstring).

    With `fit_cpu`: {"cpu_per_task_s"} fitted to the steps' processor time (`runtime_cpu`, `rounds`
    of `steps` per strategy) less `cpu_per_byte_s`
    for each byte moved and `cpu_per_message_s` for each message between devices, and the rows
    fitted ("step_cpu_rows").  (The calibration network moves too few bytes to tell their cost
    apart from the noise, and its steps' messages come with their tasks, about one for every 2.5
    whatever the split, so a fit of both gave anything from 0 to 7 ms a message from run to run:
    `Machine.calibrate` measures both apart, on large messages and on small ones.)  Always the
    latencies, `step_timings` of `timed` more steps per strategy, pooled: {"step_gaps": {"same":
    [...], "cross": [...]}, "step_answers": [...]}, and per strategy its plan and the start of
    each step's first task ("step_starts": [(plan, [seconds])]; the cost model compares them with
    the start it models for the plan).  With `executor="programs"` the gaps stay empty (a program's
    hops never reach the scheduler) and the rows count Dask tasks: one program per device."""
    from taskrt.planning.fusion import fused_plan
    from taskrt.search.measured import random_batch

    graph = calibration_network()
    x, y = random_batch(graph, 0)
    client = machine.client
    client.get_task_stream(start=time.time())  # the first call starts the scheduler's recording
    trainers = calibration_trainers(machine, graph, x, y, warmup, executor)
    gaps, answers, starts = {"same": [], "cross": []}, [], []
    out = {}
    if fit_cpu:
        rows = runtime_cpu(trainers, x, y, steps, rounds)
        out.update({"cpu_per_task_s": fit_per_task(rows, cpu_per_byte_s, cpu_per_message_s),
                    "cpu_per_message_s": cpu_per_message_s, "step_cpu_rows": rows})
    for trainer in trainers.values():
        fused, _ = fused_plan(trainer.plan)
        firsts = []
        for _ in range(timed):
            measured = (_timed_programs(trainer, x, y, machine) if executor == "programs"
                        else _timed_step(trainer, x, y, fused, machine))
            if measured is None:
                continue
            for kind in gaps:
                gaps[kind] += measured["gaps"][kind]
            answers.append(measured["answer_s"])
            firsts.append(measured["first_start_s"])
        starts.append((trainer.plan, firsts))
    trainers.clear()
    out.update({"step_gaps": gaps, "step_answers": answers, "step_starts": starts})
    return out


def calibration_trainers(machine, graph, x, y, warmup: int, executor: str = "tasks") -> dict:
    """A Trainer per calibration strategy, each `warmup` steps in (compiled, memory touched)."""
    from taskrt.training.trainer import Trainer

    trainers = {}
    for name, strategy in strategies(graph, machine).items():
        # no snapshots: training takes one rarely enough to cost under 5%, not in every few steps
        trainers[name] = trainer = Trainer(graph, strategy, machine, lr=1e-4, momentum=0.9, snapshot_every=None,
                                           executor=executor)
        for _ in range(warmup):
            trainer.step(x, y)
    return trainers


def runtime_cpu(trainers: dict, x, y, steps: int, rounds: int) -> list[dict]:
    """Per strategy: its fused plan's tasks, messages and bytes, and the median over `rounds` of the
    runtime's processor time per step (all processes' less the workers' task threads', over
    `steps` steps).  The strategies take turns, each turn after one untimed step of its own, so a
    slow moment of the host hits them alike and no turn pays for the last one's freeing; one fit
    of four steps each moved from 2.9 to 4.5 ms per task between back-to-back runs."""
    from taskrt.planning.fusion import fused_plan

    seconds = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            trainer.step(x, y)
            total, task_threads, _ = processor_over_steps(trainer, x, y, steps)
            seconds[name].append(max(total - task_threads, 0.0))
    rows = []
    for name, trainer in trainers.items():
        fused, _ = fused_plan(trainer.plan)
        rows.append({"strategy": name, "tasks": dask_tasks(trainer), "messages": len(fused.transfers()),
                     "bytes": fused.bytes_moved, "runtime_cpu_s": float(np.median(seconds[name]))})
    return rows


def dask_tasks(trainer) -> int:
    """The Dask tasks of one of `trainer`'s steps: its fused plan's, or with programs one per device."""
    from taskrt.planning.fusion import fused_plan
    from taskrt.planning.programs import device_programs

    if trainer.executor_kind == "programs":
        return len(device_programs(trainer.plan))
    return len(fused_plan(trainer.plan)[0].tasks)


def fit_per_task(rows: list[dict], cpu_per_byte_s: float, cpu_per_message_s: float) -> float:
    """Processor seconds per task fitted by non-negative least squares to `rows` (`runtime_cpu`),
    less `cpu_per_byte_s` per byte and `cpu_per_message_s` per message."""
    from scipy.optimize import nnls

    tasks = np.array([[r["tasks"]] for r in rows], dtype=float)
    net = np.array([r["runtime_cpu_s"] - cpu_per_byte_s * r["bytes"] - cpu_per_message_s * r["messages"]
                    for r in rows])
    (per_task,), _ = nnls(tasks, np.maximum(net, 0.0))
    return float(per_task)


def _timed_step(trainer, x, y, fused, machine) -> dict | None:
    """One step of `trainer`, its tasks' times read from the scheduler's task stream (`step_timings`);
    None if the stream lacks some of them."""
    future, began, ended = recorded_step(trainer, x, y)
    return step_timings(fused, machine.client.get_task_stream(start=began), future.run.tag, began, ended,
                        machine.latency, machine.bandwidth)


def _timed_programs(trainer, x, y, machine) -> dict | None:
    """One step of `trainer` (executor "programs"), its programs' times read from the task stream
    (`program_timings`); None if the stream lacks one of them."""
    future, began, ended = recorded_step(trainer, x, y)
    return program_timings(machine.client.get_task_stream(start=began), future.run.tag, began, ended)


def program_timings(records, tag: str, began: float, ended: float) -> dict | None:
    """What one step run as programs took beyond them, from the scheduler's task stream `records`
    (keys 'dev<d>-program-it<tag>'), on its clock: "first_start_s" from `began` (the client starting
    the step) to its first program's start; "answer_s" from its last program's end to `ended` (the
    client having its values); no "gaps" (the hops inside a step never reach the scheduler).  None
    if the stream has no program of the step."""
    suffix = f"-program-it{tag}"
    spans = [span for record in records if isinstance(record["key"], str) and record["key"].endswith(suffix)
             for span in record["startstops"] if span["action"] == "compute"]
    if not spans:
        return None
    return {"gaps": {"same": [], "cross": []}, "first_start_s": min(s["start"] for s in spans) - began,
            "answer_s": ended - max(s["stop"] for s in spans)}


def recorded_step(trainer, x, y) -> tuple:
    """One step of `trainer` on a cluster whose task stream is recording: (its StepFuture, when the
    client began it, when the client had it), on the task stream's clock, once the scheduler has
    heard its runs end.  (A step's losses come straight from its workers, taskrt.transport.worker_reads,
    maybe before the scheduler has put its tasks in the task stream.)"""
    from distributed import wait

    client = trainer.machine.client
    began = time.time()
    future = trainer.submit(x, y)
    future.result()
    ended = time.time()
    with client.as_current(), contextlib.suppress(TimeoutError):
        wait(future.run.futures(), timeout=5.0)
    return future, began, ended


def step_timings(fused, records, tag: str, began: float, ended: float, latency, bandwidth) -> dict | None:
    """What one step took beyond its tasks, from the scheduler's task stream `records` of its
    `fused` plan's tasks (keys tagged `tag`), all on the task stream's clock; None if the stream
    lacks one of the plan's fused runs.

    - "gaps": (seconds, the task's phase) from a task's inputs being done (the last task it reads
      ending) to its start, where its device was not busy with another task meanwhile and the task
      did not start first (then the graph Dask ran did not have that dependency): "same"
      where all its inputs are on its device, "cross" (less the link's latency and bandwidth for
      what it reads from each other device, as the simulator books them) where some are not;
    - "first_start_s": from `began` (the client starting the step) to its first task's start;
    - "answer_s": from the last run computing one of the step's outputs ending to `ended` (the
      client having the values it waits for), as the simulator ends a step: negative where a
      device still updated its state after the client had the losses."""
    from taskrt.planning.plan import TASK, output_keys

    suffix = f"-it{tag}"
    spans = {}  # plan key -> (start, stop)
    for record in records:
        key = record["key"]
        if not (isinstance(key, tuple) and isinstance(key[0], str) and key[0].endswith(suffix)):
            continue
        for span in record["startstops"]:
            if span["action"] == "compute":
                spans[(key[0][: -len(suffix)], *key[1:])] = (span["start"], span["stop"])

    def span_of(key):  # an export missing from the stream: its run's
        if key not in spans and fused.by_key[key].phase == "export":
            key = fused.by_key[key].deps[0].key
        return spans.get(key)

    runs = [t for t in fused.tasks if t.phase == "fused"]
    if not runs or any(t.key not in spans for t in runs):
        return None
    on_device = {}  # device -> sorted stops of its tasks
    for task in fused.tasks:
        if task.key in spans:
            on_device.setdefault(task.device, []).append(spans[task.key][1])
    for stops in on_device.values():
        stops.sort()
    gaps = {"same": [], "cross": []}
    for task in fused.tasks:
        inputs = [d for d in task.deps if d.kind == TASK]
        if not inputs or task.key not in spans or any(span_of(d.key) is None for d in inputs):
            continue
        ready, start = max(span_of(d.key)[1] for d in inputs), spans[task.key][0]
        stops = on_device[task.device]
        before = stops[max(np.searchsorted(stops, start, side="right") - 1, 0)]
        if start < ready:  # not a dependency in the graph Dask ran (the executor sends some values itself)
            continue
        if ready < before <= start:  # its device ran another task after its inputs were done
            continue
        link = {}  # source device -> bytes read from it
        for dep in inputs:
            source = fused.by_key[dep.key].device
            if source != task.device:
                link[source] = link.get(source, 0) + (fused.nbytes_of(dep) or 0)
        if link:
            seconds = max(float(latency[s, task.device]) + n / float(bandwidth[s, task.device])
                          for s, n in link.items())
            gaps["cross"].append((start - ready - seconds, task.phase))
        else:
            gaps["same"].append((start - ready, task.phase))
    first = min(s for s, _ in spans.values())
    outputs = [k for k in output_keys(fused.outputs) if k in fused.by_key]
    computed = [span_of(fused.by_key[k].deps[0].key if fused.by_key[k].phase == "export" else k) for k in outputs]
    last = max((s[1] for s in computed if s is not None), default=max(s[1] for s in spans.values()))
    return {"gaps": gaps, "first_start_s": first - began, "answer_s": ended - last}


def trimmed_mean(values) -> float | None:
    """The mean of the middle 80% of `values` (None for none)."""
    from scipy.stats import trim_mean

    return float(trim_mean(np.asarray(values, dtype=float), TRIM)) if len(values) else None


def robust_line(x, y) -> tuple[float, float]:
    """(intercept, slope) of a line through the points, Theil-Sen: the median of the pairwise
    slopes, then of the residuals.  The start's fit has one point per calibration strategy, and
    one whose first tasks all started late (a one-task strategy, 67 ms late in one calibration of
    five) tilted a least-squares line to +54 ms and -1.2 ms per task; the medians ignore it.  All
    points at one x: their median, flat."""
    from scipy.stats import theilslopes

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if np.ptp(x) == 0:
        return float(np.median(y)), 0.0
    slope, intercept, _, _ = theilslopes(y, x, method="joint")
    return float(intercept), float(slope)


def processor_over_steps(trainer, x, y, steps: int) -> tuple[float, float, float]:
    """Per step, over `steps` more steps of `trainer`: the processor seconds of all processes and
    of the workers' task threads (`processor_time`), and the wall seconds."""
    client = trainer.machine.client
    before, start = processor_time(client), time.perf_counter()
    for _ in range(steps):
        trainer.step(x, y)
    wall = time.perf_counter() - start
    after = processor_time(client)
    total = (after[0] - before[0]) / steps
    # the runtime's own threads, those there at both ends: a task thread may have ended meanwhile
    # (a program that left its pool, `distributed.secede`, ends its thread), taking its time with it
    # (a thread id used again by a new thread: its time since it began, not a negative difference)
    others = sum(seconds - before[1].get(thread, 0.0) if seconds >= before[1].get(thread, 0.0) else seconds
                 for thread, seconds in after[1].items()) / steps
    return total, total - others, wall / steps


def processor_time(client) -> tuple[float, dict]:
    """Processor seconds of all the workers and this process (where a local scheduler runs), and
    of every other thread than the workers' task threads, by (worker, thread): kernels slowed by
    the runtime's work take no more processor time, only more wall time, so the task stream's
    durations would not do.  (A process's time keeps its ended threads'; a thread's goes with it.)"""
    from taskrt.machines.calibration import _process_cpu

    workers = client.run(_worker_cpu)
    own = _process_cpu()
    others = {(address, thread): seconds for address, w in workers.items() for thread, seconds in w[1].items()}
    others[("client", 0)] = own
    return sum(w[0] for w in workers.values()) + own, others


def _worker_cpu() -> tuple[float, dict]:
    """This worker process's processor seconds, and those of each thread not running its tasks."""
    import threading

    import psutil

    from taskrt.machines.calibration import _process_cpu

    runs_tasks = {t.native_id for t in threading.enumerate() if "Dask-Default-Threads" in t.name}
    return _process_cpu(), {t.id: t.user_time + t.system_time for t in psutil.Process().threads()
                            if t.id not in runs_tasks}
