"""Profiling training steps into per-device timelines, measured beside simulated.

    profile = trainer.profile(images, labels, steps=3, path="trace.json",   # and trace.png
                              cost_model=search.CostModel(machine))        # the simulated timeline
    print(profile.summary())

The steps are ordinary training steps (they update the parameters as any step does), sent one at a
time so that each one's timeline is its own, with every task timed on its worker
(`taskrt.observing.task_timing`); the transfers come from the workers' transfer logs, the Dask tasks from the
scheduler's task stream.  The same plan's step as a cost model given by the caller simulates it
is laid beside each measured step.  Later steps are not profiled.  The trace opens in Perfetto (ui.perfetto.dev) or
chrome://tracing (`taskrt.observing.trace`); the PNG (`taskrt.observing.gantt`) shows the last step.
Each device's memory comes with them: the peak of a step its worker measured in each profiled step,
beside the predicted one (`taskrt.planning.peak`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from pathlib import Path

from taskrt.observing.timeline import TRANSFERS_IN, TRANSFERS_OUT, WAITS, StepTimeline, measured_step, simulated_step

__all__ = ["Profile", "profile"]


@dataclass(frozen=True)
class Profile:
    """Profiled steps: `measured` (one timeline per step, on one time axis from the first step's
    start) and `simulated` (one step of the same plan as the cost model predicts it, from 0; None
    without a cost model); `reference_kernel_s`: per device, the step's kernels timed one after
    another on one worker, alone (`taskrt.planning.inprocess.run_plan`; None on GPU devices);
    `memory`: per device, {"predicted": the predicted peak of a step, "measured": the peak its
    worker measured in each profiled step (None where a step was not measured)}, bytes."""

    graph: str
    strategy: str
    machine: str
    device_names: tuple  # per device of the plan, e.g. "0 (cpu:...)"
    losses: tuple
    measured: tuple
    simulated: StepTimeline | None = None
    reference_kernel_s: dict | None = None
    path: str | None = None
    png: str | None = None
    memory: dict | None = None

    @property
    def last(self) -> StepTimeline:
        return self.measured[-1]

    def simulated_at(self, step: StepTimeline) -> StepTimeline | None:
        """The simulated step laid where measured `step` starts."""
        return None if self.simulated is None else self.simulated.shifted(step.start_s, step.step)

    def rows(self, step: StepTimeline | None = None) -> list[dict]:
        """Per device and source (measured, simulated) of `step` (default: the last), seconds."""
        step = step or self.last
        out = []
        for timeline in (step, self.simulated):
            if timeline is None:
                continue
            for device in timeline.devices:
                out.append({
                    "device": device, "source": timeline.source, "wall_s": timeline.wall_s,
                    "busy_s": timeline.busy_s(device), "kernels_s": timeline.kernel_s(device),
                    "data_s": timeline.lane_s(device, "data"),
                    "transfers_s": timeline.lane_s(device, TRANSFERS_IN, TRANSFERS_OUT),
                    "waiting_s": timeline.waiting_s(device),
                    **{name: timeline.waiting_s(device, name) for name in WAITS},
                })
        return sorted(out, key=lambda r: (r["device"], r["source"] != "measured"))

    def summary(self) -> str:
        """A short per-device table of the last step: busy (kernels, data, transfers) and waiting,
        measured against simulated."""
        last = self.last
        walls = ", ".join(f"{s.wall_s * 1e3:.1f}" for s in self.measured)
        lines = [f"{self.graph} under {self.strategy or 'its strategy'} on {self.machine}: "
                 f"{len(self.measured)} profiled step(s) of {walls} ms"
                 + (f"; simulated step {self.simulated.wall_s * 1e3:.1f} ms" if self.simulated else ""),
                 f"step {last.step}, per device (ms): busy = the union of kernels, data and transfers; "
                 "waiting for: start = the step to start, dep = a dependency, rt = the runtime, "
                 "others = other devices, end = the step to end"]
        header = (f"{'device':<8}{'':<10}{'wall':>8}{'busy':>8}{'kernels':>9}{'data':>7}{'transfers':>10}"
                  f"{'waiting':>9}{'start':>8}{'dep':>7}{'rt':>7}{'others':>8}{'end':>7}")
        lines.append(header)
        for r in self.rows(last):
            waits = "".join(f"{r[name] * 1e3:{w}.1f}" for name, w in zip(WAITS, (8, 7, 7, 8, 7)))
            lines.append(f"{r['device']:<8}{r['source']:<10}{r['wall_s'] * 1e3:8.1f}{r['busy_s'] * 1e3:8.1f}"
                         f"{r['kernels_s'] * 1e3:9.1f}{r['data_s'] * 1e3:7.1f}{r['transfers_s'] * 1e3:10.1f}"
                         f"{r['waiting_s'] * 1e3:9.1f}{waits}")
        if self.reference_kernel_s is not None:
            measured = ", ".join(f"{last.kernel_s(d) * 1e3:.1f}" for d in last.devices)
            reference = ", ".join(f"{self.reference_kernel_s.get(d, 0.0) * 1e3:.1f}" for d in last.devices)
            lines.append(f"kernels per device: {measured} ms in the step, {reference} ms one after another "
                         "on one worker (taskrt.planning.inprocess.run_plan)")
        if self.memory:
            lines.append("memory per device (MiB): predicted peak, measured in each profiled step: " + "; ".join(
                f"{d}: {m['predicted'] / 2**20:.2f}, " + ", ".join(
                    "-" if v is None else f"{v / 2**20:.2f}" for v in m["measured"]) for d, m in self.memory.items()))
        if self.path or self.png:
            lines.append("written: " + ", ".join(p for p in (self.path, self.png) if p))
        return "\n".join(lines)

    def check(self, tolerance: float = 0.05) -> list[str]:
        """What is inconsistent in the measured steps (empty when nothing): per device, busy plus
        waiting off the step's wall time by more than `tolerance`, or two kernels overlapping."""
        problems = []
        for step in self.measured:
            for device in step.devices:
                total = step.busy_s(device) + step.waiting_s(device)
                if abs(total - step.wall_s) > tolerance * step.wall_s:
                    problems.append(f"step {step.step}, device {device}: busy {step.busy_s(device) * 1e3:.2f} + "
                                    f"waiting {step.waiting_s(device) * 1e3:.2f} ms against a wall time of "
                                    f"{step.wall_s * 1e3:.2f} ms")
                kernels = sorted((s.start_s, s.end_s, s.name) for s in step.on(device, "kernels", "data"))
                for (_, end, a), (start, _, b) in zip(kernels, kernels[1:]):
                    if start < end - 1e-9:
                        problems.append(f"step {step.step}, device {device}: {a} and {b} overlap")
        return problems


def profile(trainer, data: tuple, steps: int = 3, path="trace.json", png=None, cost_model=None,
            reference: bool = True) -> Profile:
    """`steps` training steps of `trainer` on the batch `data`, profiled (see the module's
    docstring); writes the trace to `path` (None: none) and the Gantt chart to `png` (None: beside
    the trace, as .png; False: none).  `cost_model`: what simulates the plan (anything with
    `simulate(plan, fused)`, e.g. `search.CostModel(machine)`, which the caller, above the
    runtime, builds; None or False: no simulated timeline).  `reference`: time the
    step's kernels one after another on a worker too (CPU devices only)."""
    from taskrt.data.arrays import bind_inputs

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    path = None if path is None else Path(path)
    png = (path.with_suffix(".png") if path is not None else None) if png is None else (Path(png) if png else None)
    for target in (path, png):
        if target is not None and not target.parent.is_dir():
            raise FileNotFoundError(f"cannot write {target}: the directory {target.parent} does not exist")
    if not data:
        raise ValueError("profile needs the batch to train on: trainer.profile(images, labels, steps=...)")
    arrays = bind_inputs(trainer.graph, data, trainer.dtype)  # a clear error before any step
    trainer.wait()  # steps sent before belong to no profiled step
    client = trainer.machine.client
    client.get_task_stream(start=time.time())  # the scheduler keeps a task stream from now on
    shift = time.time() - time.perf_counter()  # the client's clock: perf_counter -> wall clock
    recoveries = len(trainer.recoveries)
    executor = trainer.executor
    runs, losses = [], []
    executor.profiling = True
    try:
        for _ in range(steps):
            future = trainer.submit(*data)
            losses.append(future.result())
            runs.append(future.run)
    finally:
        executor.profiling = False
    if len(trainer.recoveries) != recoveries or any(run.profiled is None for run in runs):
        raise RuntimeError("a worker was lost while profiling and the steps since were replayed unprofiled; "
                           "profile again")
    windows = [(run.submitted + shift, run.finished + shift) for run in runs]
    measured = _measured(trainer, runs, windows)
    simulated = _simulated(trainer, cost_model)
    plan = trainer.plan
    devices = tuple(range(trainer.machine.num_devices))
    kinds = {d.id: d.kind for d in trainer.machine.devices}
    out = Profile(trainer.graph.name, trainer.strategy.name, trainer.machine.description,
                  tuple(f"{trainer.devices_in_use[d]} ({kinds[d]})" for d in devices), tuple(losses), tuple(measured),
                  simulated, _reference(trainer, plan, arrays) if reference else None,
                  None if path is None else str(path), None if png is None else str(png), _memory(trainer, runs))
    if path is not None:
        from taskrt.observing.trace import write_trace

        write_trace(out, path)
    if png is not None:
        from taskrt.observing.gantt import write_gantt

        write_gantt(out, png)
    trainer.publisher.profiled(out)
    return out


def _memory(trainer, runs) -> dict:
    """Per device: the predicted peak, and the peak measured in each of `runs` (`Profile.memory`)."""
    out = {}
    for device, use in trainer.memory().items():
        measured = [(run.memory or {}).get(device) for run in runs]
        out[device] = {"predicted": use.predicted.total,
                       "measured": [None if m is None else (m[1] if m[1] is not None else m[0]) for m in measured]}
    return out


def _measured(trainer, runs, windows) -> list[StepTimeline]:
    """Each profiled step's timeline from the workers' records, their transfer logs and the task
    stream, all on the client's clock (`WorkerClocks`)."""
    client = trainer.machine.client
    device_at = {address: device for device, address in trainer.machine.addresses().items()}
    taken = client.run(_take_records)
    clocks = WorkerClocks.of(client, taken)
    records = []
    for address, (_, kept) in taken.items():
        records += [(key, task, clocks.own(address, a), clocks.own(address, b)) for key, task, a, b, _ in kept]
    begin, end = windows[0][0], windows[-1][1]
    stream = [{**r, "startstops": [{**ss, "start": clocks.dask(r["worker"], ss["start"]),
                                    "stop": clocks.dask(r["worker"], ss["stop"])} for ss in r["startstops"]]}
              for r in client.get_task_stream(start=begin - 1.0)]
    transfers = []
    for address, (incoming, outgoing) in client.run(_transfer_logs, begin - 1.0, end + 1.0).items():
        device = device_at.get(address)
        if device is None:
            continue
        for direction, entries in (("in", incoming), ("out", outgoing)):
            transfers += [(device, device_at.get(e["who"]), clocks.dask(address, e["start"]),
                           clocks.dask(address, e["stop"]), e["keys"], direction) for e in entries]
    devices = tuple(range(trainer.machine.num_devices))
    out = []
    for run, window in zip(runs, windows):
        graph, device_of = run.profiled["graph"], run.profiled["device"]
        inside = [t for t in transfers if t[2] < window[1] and t[3] > window[0]]
        out.append(measured_step(run.step, run.tag, window, graph, device_of,
                                 [r for r in records if r[0] in graph], [r for r in stream if r["key"] in graph],
                                 inside, devices, origin=begin))
    return out


@dataclass(frozen=True)
class WorkerClocks:
    """Puts the workers' times on the client's clock.  Their own records (taskrt.observing.task_timing) are
    their wall clock, Dask's are that plus the `scheduler_delay` the worker estimated then, which
    each of their runs kept beside its times: the estimate of the run nearest in time is taken off.
    offsets: address -> the worker's wall clock less the client's (0 on the client's host)."""

    offsets: dict
    delays: dict  # address -> sorted ((wall-clock seconds, scheduler_delay), ...) of its runs and now

    @classmethod
    def of(cls, client, taken: dict) -> WorkerClocks:
        delays = {}
        for address, (now, kept) in taken.items():
            marks = {(end / 1e9, delay) for *_, end, delay in kept} | {(now["time"], now["delay"])}
            delays[address] = tuple(sorted(marks))
        return cls(_offsets(client, list(taken)), delays)

    def own(self, address, ns: int) -> float:
        return ns / 1e9 - self.offsets.get(address, 0.0)

    def dask(self, address, t: float) -> float:
        marks = self.delays.get(address)
        if not marks:
            return t - self.offsets.get(address, 0.0)
        i = bisect.bisect_left(marks, (t,))
        near = min(marks[max(i - 1, 0):i + 1], key=lambda m: abs(m[0] - t))
        return t - near[1] - self.offsets.get(address, 0.0)


def _offsets(client, addresses) -> dict:
    """Each worker's wall clock less the client's: 0 on the client's host (one clock), else the
    estimate of the quickest of three round trips."""
    import socket

    hosts = client.run(socket.gethostname, workers=addresses)
    here = socket.gethostname()
    out = {address: 0.0 for address, host in hosts.items() if host == here}
    elsewhere = [a for a in addresses if a not in out]
    best = {}
    for _ in range(3 if elsewhere else 0):
        before = time.time()
        there = client.run(time.time, workers=elsewhere)
        after = time.time()
        for address, t in there.items():
            if address not in best or after - before < best[address][0]:
                best[address] = (after - before, t - (before + after) / 2)
    out.update({address: offset for address, (_, offset) in best.items()})
    return out


def _take_records(dask_worker=None):
    from taskrt.observing.task_timing import take_records

    return take_records(dask_worker)


def _transfer_logs(begin: float, end: float, dask_worker=None) -> tuple[list, list]:
    """The worker's incoming and outgoing transfers that overlap [begin, end] (Dask's clock)."""
    def within(log):
        return [{k: e[k] for k in ("start", "stop", "who", "keys")} for e in log
                if e["start"] < end and e["stop"] > begin]

    return within(dask_worker.transfer_incoming_log), within(dask_worker.transfer_outgoing_log)


def _simulated(trainer, cost_model) -> StepTimeline | None:
    """The plan's step as `cost_model` simulates it (see `profile`)."""
    if cost_model is None or cost_model is False:
        return None
    from taskrt.planning.fusion import fused_plan

    plan, fused = trainer.plan, trainer.executor.fused
    simulation = cost_model.simulate(plan, fused, executor=trainer.executor_kind)
    runs = fused_plan(plan)[1] if fused and trainer.executor_kind == "tasks" else {}
    return simulated_step(plan, simulation, tuple(range(trainer.machine.num_devices)), 0.0, 0, runs)


def _reference(trainer, plan, arrays) -> dict | None:
    """Per device, the seconds of the step's kernels run one after another on device 0's worker (the
    faster of two runs of each; `taskrt.planning.inprocess.run_plan`), nothing else running there; None on GPU
    devices."""
    if trainer.executor.gpu_devices:
        return None
    client, machine = trainer.machine.client, trainer.machine
    future = client.submit(_plan_seconds, trainer.graph, plan, arrays, trainer.hyper(), trainer.dtype.name,
                           resources={machine.tag(0): 1}, pure=False)
    seconds = future.result()
    out = {}
    for task in plan.tasks:
        out[task.device] = out.get(task.device, 0.0) + seconds[task.key]
    return out


def _plan_seconds(graph, plan, arrays, hyper, dtype, repeats: int = 2) -> dict:
    """{task key: seconds} of `plan` run in this process (the fastest of `repeats`), on the graph's
    initial parameters (a kernel's time does not depend on the values)."""
    import numpy as np

    from taskrt.planning.inprocess import buffer_tiles, data_tiles, run_plan, shard_states
    from taskrt.planning.params import init_buffers, init_parameters

    params = init_parameters(graph, 0, np.dtype(dtype))
    from taskrt.ops.optim import OPTIMIZERS

    slots = [{name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
             for _ in OPTIMIZERS[hyper["rule"]].slots]
    state = shard_states(plan, params, *slots)
    buffers = buffer_tiles(plan, init_buffers(graph, np.dtype(dtype)))
    tiles = data_tiles(plan, arrays)
    best = {}
    for _ in range(repeats):
        seconds = {}
        run_plan(plan, state, tiles, hyper, buffers, seconds=seconds)
        best = {k: min(v, best.get(k, v)) for k, v in seconds.items()}
    return best
