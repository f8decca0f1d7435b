"""The runtime's own costs as the cost model prices them.

A cluster is calibrated once (`Machine.calibrate`: Dask's time per task and per hop, a graph's
submission and intake, scatters, the client's bandwidth, the processor time the runtime spends
per task, message and byte) and the result is cached beside the part timings.  On CPU workers
the latencies of real training steps are fitted on top (`search.step_costs`: a small calibration
network's steps under a few strategies), and where the devices share the host's cores, the
processor time per task too.  `runtime` turns a calibration into the simulator's
`taskrt.planning.simulate.Runtime` for one plan.
"""

from __future__ import annotations

import os

import numpy as np

from taskrt.machines.device_kinds import DEVICE_KINDS
from taskrt.ops import reuse
from taskrt.search.step_costs import robust_line, step_costs, trimmed_mean

# Machine.calibrate's costs: hops between computing tasks, across devices, a graph's intake; CPU per byte moved,
# per message; CPU per task fitted to training steps where devices share cores; the scheduler's
# answer to which workers there are; on CPU workers, the latencies of training steps' hops, start and answer
# (the start's line fitted by Theil-Sen)
# ...; for the programs executor, the mailbox hop, its processor time, a program's time per task, the
# scheduler's time per task, and the start, answer and processor time of training steps run as programs;
# the mailbox hop on one host over the local link (taskrt.transport.local_link), and as between hosts (its TCP
# sockets, or distributed's comms on a TLS cluster)
CALIBRATION_FORMAT = 16
# what `fit_to_steps` measures on training steps: the latencies, the rows they and the processor
# time per task are fitted to (that time only where devices share the host's cores; elsewhere
# `cpu_per_task_s` is the no-op tasks')
STEP_LATENCIES = ("step_dispatch_s", "step_fetch_s", "step_answer_s", "step_start_extra_s",
                  "step_start_extra_per_task_s", "program_step_answer_s", "program_step_start_extra_s")
STEP_FITTED = (*STEP_LATENCIES, "step_start_rows", "step_cpu_rows", "program_cpu_per_task_s",
               "program_step_start_rows", "program_step_cpu_rows")
EXECUTORS = ("programs", "tasks")  # taskrt.execution.program_executor.make_executor's; "programs" the Trainer's default


def cpu_workers(machine) -> bool:
    """Whether the devices are CPU workers (of a Dask cluster)."""
    return all(d.kind.startswith("cpu:") for d in machine.devices)


def shared_cores(machine) -> bool:
    """Whether the devices are CPU workers on one host, sharing its cores with the runtime."""
    return cpu_workers(machine) and len({d.node for d in machine.devices}) == 1


def calibration(machine, cache, corun: bool, progress: bool = True) -> dict:
    """The cluster's runtime costs (`Machine.calibrate`), from `cache` (a CostCache) or measured
    and put there.  Where devices share the host's cores (`corun`), the processor time per task
    is fitted to training steps instead, the no-op tasks' kept beside; on CPU workers the
    latencies come from training steps too (`fit_to_steps`).  A simulated machine: none but its
    device kind's memory bandwidth."""
    if machine.is_simulated:
        kind = machine.devices[0].kind
        return {"per_task_s": 0.0, "per_hop_s": 0.0, "memory_bandwidth": DEVICE_KINDS[kind]["memory_bandwidth"]}
    key = calibration_key(machine)
    cached = cache.data["overhead"].get(key)
    if cached is None or cached.get("format") != CALIBRATION_FORMAT:
        from taskrt.observing.progress import phase

        timed = cpu_workers(machine)  # training steps measure the latencies (`fit_to_steps`)
        # about 8 s, and 11 s more of training steps: once per cluster, then cached
        what = (f"calibrating the runtime's costs on {machine.num_devices} {machine.devices[0].kind} device(s): "
                "Dask's time per task and hop" + (", then training steps" if timed else ""))
        with phase(what, 2 if timed else 1, cache.path, progress) as advance:
            cached = {**machine.calibrate(), "format": CALIBRATION_FORMAT}
            advance(1)
            if timed:
                fitted = fit_to_steps(machine, cached, corun)
                if "cpu_per_task_s" in fitted:  # the no-op tasks' kept beside the steps' fit
                    cached["noop_cpu_per_task_s"] = cached["cpu_per_task_s"]
                cached.update(fitted)
                advance(1)
        cache.data["overhead"][key] = cached
        cache.save()
    return cached


def calibration_key(machine) -> str:
    """Where a cost cache keeps `machine`'s calibration."""
    return f"{machine.devices[0].kind}|{machine.num_devices} devices"


def fit_to_steps(machine, calibration: dict, corun: bool) -> dict:
    """What `calibration()` fits to training steps of the calibration network, measured now
    (`search.step_costs`) on `calibration`'s other costs: where devices share the host's cores
    (`corun`), the processor time per task (and the rows it is fitted to); the latencies of
    steps (`step_latencies`).  On CPU workers only: elsewhere no-op tasks measure them ({})."""
    if not cpu_workers(machine):
        return {}
    measured = step_costs(machine, calibration["cpu_per_byte_s"], calibration["cpu_per_message_s"], fit_cpu=corun,
                          executor="tasks")
    out = {k: measured[k] for k in ("cpu_per_task_s", "step_cpu_rows")} if corun else {}
    # the start is fitted beyond what `runtime` models without an earlier fit's
    unfitted = {k: v for k, v in calibration.items() if k not in STEP_FITTED}
    out.update(step_latencies(machine, {**unfitted, **out}, measured, corun))
    out.update(program_step_costs(machine, unfitted, corun))
    return out


def program_step_costs(machine, calibration: dict, corun: bool) -> dict:
    """What training steps run as programs (`search.step_costs`, executor "programs") give the
    programs' Runtime: where devices share the host's cores, the processor time per Dask task (a
    program), less each message's and byte's measured apart; the answer (median); the start beyond
    what `runtime` models (the median over strategies: every one has a program per device)."""
    from taskrt.planning.simulate import program_devices

    per_message = calibration.get("program_cpu_per_message_s", calibration["cpu_per_message_s"])
    measured = step_costs(machine, calibration["cpu_per_byte_s"], per_message, fit_cpu=corun, executor="programs")
    out = {}
    if corun:
        out.update(program_cpu_per_task_s=measured["cpu_per_task_s"], program_step_cpu_rows=measured["step_cpu_rows"])
    if measured["step_answers"]:
        out["program_step_answer_s"] = max(float(np.median(measured["step_answers"])), 0.0)
    unfitted = {**calibration, **out}
    rows = []
    for plan, firsts in measured["step_starts"]:
        if firsts:
            modeled = runtime(machine, unfitted, plan, corun=corun, executor="programs")
            programs = len(program_devices(plan))
            start = modeled.start_s + modeled.per_task_submit_s * programs + modeled.dispatch_s
            rows.append((programs, float(np.median(firsts)) - start))
    if rows:
        out["program_step_start_extra_s"] = float(np.median([extra for _, extra in rows]))
        out["program_step_start_rows"] = [[int(p), float(e)] for p, e in rows]
    return out



def step_latencies(machine, calibration: dict, measured: dict, corun: bool) -> dict:
    """The simulator's latencies from training steps (`search.step_costs`), as `runtime` uses
    them: the dispatch of a task whose inputs are on its device and the fetch beyond it of one
    reading another device (each gap less the device's own time per task, which the simulator
    charges inside the task), the answer, and the start beyond what `runtime` models, fitted
    as a + b * tasks to the steps' first task (Theil-Sen: robust to one strategy far off)."""
    from taskrt.planning.fusion import fused_plan

    def net(gaps):
        return [g - (calibration["export_s"] if phase == "export" else calibration["per_task_s"])
                for g, phase in gaps]

    out = {}
    same, cross = (trimmed_mean(net(measured["step_gaps"][k])) for k in ("same", "cross"))
    if same is not None:
        out["step_dispatch_s"] = max(same, 0.0)
    if cross is not None:
        dispatch = out.get("step_dispatch_s", noop_dispatch(calibration))
        out["step_fetch_s"] = max(cross - dispatch, 0.0)
    if measured["step_answers"]:  # the median: a few steps, one of them may be slow
        out["step_answer_s"] = max(float(np.median(measured["step_answers"])), 0.0)
    unfitted = {**calibration, **out}  # the start as modeled without a fitted extra
    rows = []
    for plan, firsts in measured["step_starts"]:
        if firsts:
            modeled_runtime = runtime(machine, unfitted, plan, corun=corun, executor="tasks")
            tasks = len(fused_plan(plan)[0].tasks)
            modeled = (modeled_runtime.start_s + modeled_runtime.per_task_submit_s * tasks
                       + modeled_runtime.dispatch_s + modeled_runtime.task_s)
            rows.append((tasks, float(np.median(firsts)) - modeled))
    if rows:
        intercept, slope = robust_line(*np.array(rows).T)
        out.update({"step_start_extra_s": float(intercept), "step_start_extra_per_task_s": float(slope),
                    "step_start_rows": [[int(t), float(e)] for t, e in rows]})
    return out


def noop_dispatch(calibration: dict) -> float:
    """A dependent task's dispatch between no-op tasks: a hop less the device's time per task."""
    return max(calibration["per_hop_s"] - calibration["per_task_s"], 0.0)


def runtime(machine, c: dict, plan, fused: bool = True, corun: bool = False, executor: str = "programs",
            dataset: bool = False, steps_ahead: bool = False):
    """The runtime's costs for `plan` on a Dask cluster under the calibration `c` (scheduler round
    trip per dependent task, worker time per task, a fetch from another device beyond the link,
    graph submission per task and the scheduler taking a graph in, one scatter call per device
    that receives data, the data the graph carries at its measured rate), for the executor
    `executor`: "programs" (the Trainer's default: one program per device, `program_runtime`) or
    "tasks", whose tasks are fused runs (its default) or one per plan task.  `corun`: parts are
    timed beside each other too (see below).  `dataset`: the devices read their data from a
    dataset, ahead of the step (nothing sent from the client).  `steps_ahead`: the programs'
    steady state as `Trainer.fit` sends steps (`taskrt.planning.simulate.Runtime.steps_ahead`)."""
    from taskrt.execution.executor import gpu_devices, graph_seconds
    from taskrt.planning.simulate import Runtime

    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "programs":
        return program_runtime(machine, c, plan, corun, dataset, steps_ahead)

    # a hop between devices beyond one on a device: the link's latency, and the rest is the fetch
    cross = c.get("per_cross_hop_s")
    link = float(machine.latency[1, 0]) if machine.num_devices > 1 else 0.0
    fetch = 0.0 if cross is None else max(cross - c["per_hop_s"] - link, 0.0)
    dispatch = noop_dispatch(c)
    # what a one-task graph waits for its task beyond submitting one task and sending it out: the
    # scheduler taking the graph in, once a step
    intake = max(c["first_start_s"] - c["submit_per_task_s"] - dispatch, 0.0)
    # before the graph leaves, the client asks which devices have a worker, then builds and
    # serializes the step's graph; on its way the graph is read and written again (beyond a
    # one-task graph's way, in first_start_s): timed here on this plan
    graph = graph_seconds(plan, gpu_devices(machine), machine.tag, fused)
    client = c.get("check_s", 0.0) + graph.client_s + graph.transit_s
    start = client + data_seconds(c, plan, dataset) + intake
    # Measured on training steps where there are (CPU workers): what no-op tasks miss of a
    # real step's hops, its answer and its start (`step_latencies`).  The start and the answer
    # are read off the same steps, and where the task stream places a run early, time moves
    # from one to the other (one device: answers of 3 to 20 ms, starts 1 ms late to 19 early);
    # a start fitted below zero takes the rest off the answer, so their sum stays as measured.
    start += c.get("step_start_extra_s", 0.0)
    answer = c.get("step_answer_s", c.get("answer_s", c["per_hop_s"]))
    if start < 0 and "step_answer_s" in c:
        answer = max(answer + start, 0.0)
    cores = _cores(machine, c, corun)
    return Runtime(dispatch_s=c.get("step_dispatch_s", dispatch), task_s=c["per_task_s"],
                   fetch_s=c.get("step_fetch_s", fetch), export_s=c["export_s"],
                   answer_s=answer, start_s=max(start, 0.0),
                   per_task_submit_s=max(c["submit_per_task_s"] + c.get("step_start_extra_per_task_s", 0.0), 0.0),
                   cores=cores,
                   cpu_per_task_s=c["cpu_per_task_s"], cpu_per_message_s=c.get("cpu_per_message_s", 0.0),
                   cpu_per_byte_s=c["cpu_per_byte_s"], fused=fused,
                   scheduler_per_task_s=c.get("scheduler_per_task_s", 0.0))


def program_runtime(machine, c: dict, plan, corun: bool = False, dataset: bool = False, steps_ahead: bool = False):
    """The programs executor's costs for `plan` (taskrt.execution.program_executor): the client's question
    for the workers, the data sent, the scheduler taking the graph in and sending each device its
    program (one Dask task per device: `dispatch_s` once, through the one scheduler), a program's
    own time per task, each value's message latency (half a mailbox ping-pong), the answer; on
    shared cores, the processor time per program, message and byte.
    What training steps run as programs measured (`program_step_costs`) is added where there."""
    from taskrt.planning.simulate import Runtime

    dispatch = noop_dispatch(c)
    intake = max(c["first_start_s"] - c["submit_per_task_s"] - dispatch, 0.0)
    message = c.get("program_hop_s", 0.0)  # in place of the link's latency (Dask's fetch where probed)
    one_host = shared_cores(machine)
    start = c.get("check_s", 0.0) + data_seconds(c, plan, dataset) + intake + c.get("program_step_start_extra_s", 0.0)
    answer = c.get("program_step_answer_s", c.get("answer_s", c["per_hop_s"]))
    if start < 0 and "program_step_answer_s" in c:  # as for the tasks executor: their sum stays as measured
        answer = max(answer + start, 0.0)
    return Runtime(programs=True, steps_ahead=steps_ahead, dispatch_s=dispatch, task_s=c.get("program_task_s", 0.0),
                   message_s=message, remote_message_s=c.get("program_remote_hop_s"), answer_s=answer,
                   start_s=max(start, 0.0), per_task_submit_s=c["submit_per_task_s"],
                   scheduler_per_task_s=c.get("scheduler_per_task_s", 0.0), cores=_cores(machine, c, corun),
                   cpu_per_task_s=c.get("program_cpu_per_task_s", c.get("noop_cpu_per_task_s", c["cpu_per_task_s"])),
                   cpu_per_message_s=c.get("program_cpu_per_message_s", c.get("cpu_per_message_s", 0.0)),
                   # CPU workers on one host send large values through shared memory, at its own rate
                   cpu_per_byte_s=c.get("program_cpu_per_byte_s", c["cpu_per_byte_s"]) if one_host
                   else c["cpu_per_byte_s"],
                   message_bandwidth=c.get("program_bandwidth", 0.0) if one_host else 0.0,
                   # there, weights and gradients made on reused memory go without a copy
                   lent_min_bytes=reuse.MIN_BYTES if one_host else 0)


def data_seconds(c: dict, plan, dataset: bool) -> float:
    """The client's time sending a step's data: one scatter call per device that receives tiles too
    large to carry in the graph, at the client's bandwidth, the rest carried; none where the devices
    read it from a dataset (its reads run ahead, while the step before computes)."""
    from taskrt.execution.executor import data_bytes_by_device, inline_data_devices

    if dataset:
        return 0.0
    by_device, inline = data_bytes_by_device(plan), inline_data_devices(plan)  # carried, or scattered
    receivers = set(by_device) - inline
    return (len(receivers) * c["scatter_s"] + sum(by_device[d] for d in receivers) / c["client_bandwidth"]
            + sum(by_device[d] for d in inline) * c["inline_per_byte_s"])


def _cores(machine, c: dict, corun: bool) -> float:
    if corun:
        # Parts are timed beside each other too: their slow-down is in those timings.
        # `Machine.calibrate`'s effective cores, lowered by a reference kernel's slow-down beside
        # another, would count it a second time.
        return float(os.cpu_count() or 1)
    return c["cores"] if shared_cores(machine) else 0
