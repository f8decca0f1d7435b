"""A step as a per-device timeline: what each device did when, measured or simulated.

    StepTimeline(source, step, start_s, wall_s, devices, spans)

Each span lies on one device's lane:

    kernels        the plan's tasks (a profiled step times each on its worker: taskrt.observing.task_timing)
    data           a device reading or receiving its data tiles (the '-data', '-todevice', '-read' tasks)
    transfers in   values arriving from another device (the receiving worker's transfer log)
    transfers out  values leaving for another device (the sending worker's transfer log)
    waiting        the rest of the step: neither computing, reading data nor transferring
    dask tasks     the Dask tasks the device ran (fused runs, their exports, unfused tasks): a view of
                   the same time, not counted again

A device is busy while any of kernels, data or transfers has a span (their union: a worker moves
bytes on its event loop while its thread computes); each stretch of the step when it is not is one
waiting span, named by what it waits for:

    waiting for the step to start   no task has started anywhere yet: the client checks the
                                    devices, sends the data and the graph, the scheduler takes it in
    waiting for a dependency        a value the next task or transfer needs is still being computed
    waiting for the runtime         its inputs are there, the task has not started: the scheduler
                                    has yet to hear of them and send the task, or the worker to take it
    waiting for other devices       nothing of its own is left to run (or nothing before another
                                    device asks for its values): other devices are still working
    waiting for the step to end     every device's work is done: the client reads the step's results

so busy plus waiting is the step's wall time on every device.  Times are seconds from the
timeline's origin (the first profiled step's start).
"""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.planning.fusion import export_source

KERNELS, DATA, TRANSFERS_IN, TRANSFERS_OUT, WAITING, DASK = (
    "kernels", "data", "transfers in", "transfers out", "waiting", "dask tasks")
LANES = (KERNELS, DATA, TRANSFERS_IN, TRANSFERS_OUT, WAITING, DASK)
BUSY_LANES = (KERNELS, DATA, TRANSFERS_IN, TRANSFERS_OUT)
DATA_TASKS = ("-data", "-todevice", "-read")  # key name endings of the tasks giving a device its data tiles
WAIT_START, WAIT_DEPENDENCY, WAIT_RUNTIME, WAIT_OTHERS, WAIT_END = (
    "waiting for the step to start", "waiting for a dependency", "waiting for the runtime",
    "waiting for other devices", "waiting for the step to end")
WAITS = (WAIT_START, WAIT_DEPENDENCY, WAIT_RUNTIME, WAIT_OTHERS, WAIT_END)


@dataclass(frozen=True)
class Span:
    device: int
    lane: str  # one of LANES
    name: str
    start_s: float
    end_s: float
    detail: tuple = ()  # ((name, value), ...): the event's arguments in a trace

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepTimeline:
    """One step: `spans` on `devices`, from `start_s` for `wall_s` seconds."""

    source: str  # "measured" or "simulated"
    step: int
    start_s: float
    wall_s: float
    devices: tuple
    spans: tuple

    @property
    def end_s(self) -> float:
        return self.start_s + self.wall_s

    def on(self, device: int, *lanes) -> list[Span]:
        return [s for s in self.spans if s.device == device and s.lane in lanes]

    def busy_s(self, device: int) -> float:
        """Seconds the device computed, read data or transferred (their union)."""
        return union_s([(s.start_s, s.end_s) for s in self.on(device, *BUSY_LANES)])

    def lane_s(self, device: int, *lanes) -> float:
        """Seconds covered by the device's spans on `lanes` (their union)."""
        return union_s([(s.start_s, s.end_s) for s in self.on(device, *lanes)])

    def waiting_s(self, device: int, name: str | None = None) -> float:
        return sum(s.seconds for s in self.on(device, WAITING) if name is None or s.name == name)

    def kernel_s(self, device: int) -> float:
        """Total seconds of the device's kernels (each task's own time)."""
        return sum(s.seconds for s in self.on(device, KERNELS))

    def shifted(self, start_s: float, step: int | None = None) -> StepTimeline:
        """The same step starting at `start_s`."""
        delta = start_s - self.start_s
        spans = tuple(Span(s.device, s.lane, s.name, s.start_s + delta, s.end_s + delta, s.detail) for s in self.spans)
        return StepTimeline(self.source, self.step if step is None else step, start_s, self.wall_s, self.devices,
                            spans)


def union_s(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@dataclass(frozen=True)
class Busy:
    """A busy span with what it waited for: its inputs were there at `ready_s` (None: unknown or
    from the step's start), the last of them `on` (a name).  `passive`: the device did not start it
    (a value another device asked for)."""

    span: Span
    ready_s: float | None = None
    on: str = ""
    passive: bool = False


def waiting_spans(device: int, busy: list[Busy], start_s: float, end_s: float, first_s: float,
                  last_s: float) -> list[Span]:
    """The stretches of [start_s, end_s] no busy span of `device` covers, each split and named by
    what it waits for (see the module's docstring); `first_s`, `last_s`: when the step's first task
    anywhere started and its last ended."""
    out = []

    def add(name, a, b, detail=()):
        if b > a:
            out.append(Span(device, WAITING, name, a, b, detail))
        return max(a, b)

    cursor = start_s
    for item in sorted(busy, key=lambda b: (b.span.start_s, -(b.ready_s or 0.0))):
        s = item.span
        if s.start_s > cursor:
            a = add(WAIT_START, cursor, min(s.start_s, first_s))
            if item.passive:
                a = add(WAIT_OTHERS, a, s.start_s, (("next", s.name),))
            elif item.ready_s is not None:
                a = add(WAIT_DEPENDENCY, a, min(s.start_s, item.ready_s), (("for", item.on), ("next", s.name)))
            add(WAIT_RUNTIME, a, s.start_s, (("next", s.name),))
        cursor = max(cursor, s.end_s)
    if cursor < end_s:
        a = add(WAIT_START, cursor, min(end_s, first_s))
        a = add(WAIT_OTHERS, a, min(end_s, last_s))
        add(WAIT_END, a, end_s)
    return out


def short_name(key, tag: str | None = None) -> str:
    """('conv1-fwd-it7-ab12', 0) with tag '7-ab12' -> 'conv1-fwd 0'; ('fc1-update', 0, 0) -> 'fc1-update 0,0'."""
    if not isinstance(key, tuple):
        return str(key)
    name = str(key[0])
    if tag is not None:
        name = name.removesuffix(f"-it{tag}")
    return f"{name} {','.join(map(str, key[1:]))}" if len(key) > 1 else name


def lane_of(name: str) -> str:
    """The lane of a timed task by its short name: data tiles, or kernels."""
    return DATA if name.split(" ")[0].endswith(DATA_TASKS) else KERNELS


def with_waiting(source: str, step: int, start_s: float, wall_s: float, devices, busy: list[Busy],
                 other: list[Span]) -> StepTimeline:
    """A StepTimeline of the busy spans, their waits and `other` spans (views like 'dask tasks')."""
    end_s = start_s + wall_s
    work = [b.span for b in busy if b.span.lane in (KERNELS, DATA)] or [b.span for b in busy]
    first_s = min((s.start_s for s in work), default=end_s)
    last_s = max((s.end_s for s in work), default=start_s)
    spans = [b.span for b in busy] + list(other)
    for device in devices:
        spans += waiting_spans(device, [b for b in busy if b.span.device == device], start_s, end_s, first_s, last_s)
    spans.sort(key=lambda s: (s.device, LANES.index(s.lane), s.start_s))
    return StepTimeline(source, step, start_s, wall_s, tuple(devices), tuple(spans))


# ---- measured -------------------------------------------------------------------------------------
def measured_step(step: int, tag: str, window: tuple, graph: dict, device_of: dict, records: list,
                  stream: list, transfers: list, devices, origin: float = 0.0) -> StepTimeline:
    """A profiled step's timeline from what the cluster recorded (times on one clock, in seconds;
    `origin` is subtracted from all of them).

    window: (start, end) of the step as the client saw it.  graph, device_of: the step's graph
    (key -> (callable, *args)) and each key's device.  records: (Dask key, task key, start, end) of
    each timed task (taskrt.observing.task_timing).  stream: the scheduler's task stream records (key,
    startstops).  transfers: (receiving device, sending device or None, start, end, {key: bytes},
    direction 'in' or 'out' as the logging worker saw it).  Spans are clipped to the window."""
    begin, finish = window[0] - origin, window[1] - origin

    def clip(a, b):
        a, b = a - origin, b - origin
        return max(a, begin), min(b, finish)

    ended = {}  # Dask key -> when its task ended (the task stream)
    other = []
    for record in stream:
        key = record["key"]
        if key not in graph:
            continue
        for ss in record["startstops"]:
            if ss["action"] == "compute":
                ended[key] = ss["stop"] - origin
                a, b = clip(ss["start"], ss["stop"])
                if b > a:
                    other.append(Span(device_of[key], DASK, short_name(key, tag), a, b))
            elif ss["action"] == "disk-read":
                a, b = clip(ss["start"], ss["stop"])
                if b > a:
                    other.append(Span(device_of[key], DATA, "disk read", a, b, (("key", short_name(key, tag)),)))
    # A fused run's value exists when the run ends; the export naming it runs when the scheduler
    # sends it (a wait for the runtime, not for the value)
    for key in graph:
        run, index = export_source(graph, key)
        if index is not None and run in ended:
            ended[key] = ended[run]
    arrived = {}  # (Dask key, device) -> when the value was there (the receiver's transfer log)
    busy = []
    for device, peer, start, stop, keys, direction in transfers:
        a, b = clip(start, stop)
        if b <= a:
            continue
        names = [short_name(k, tag) for k in keys]
        detail = (("bytes", sum(keys.values())), ("keys", ", ".join(names)))
        if direction == "in":
            for k in keys:
                arrived[(k, device)] = b
            producers = [ended[k] for k in keys if k in ended]
            ready = max(producers, default=None)
            on = names[producers.index(ready)] if producers else ""
            name = "from the client" if peer is None else f"from device {peer}"
            span = Span(device, TRANSFERS_IN, name, a, b, detail)
            busy.append(Busy(span, ready, on))
        else:
            span = Span(device, TRANSFERS_OUT, "to the client" if peer is None else f"to device {peer}", a, b, detail)
            busy.append(Busy(span, passive=True))
    first_in_run = {}
    for dask_key, task_key, start, stop in sorted(records, key=lambda r: r[2]):
        if dask_key not in graph:
            continue
        a, b = clip(start, stop)
        if b < a:
            continue
        device, name = device_of[dask_key], short_name(task_key, tag)
        span = Span(device, lane_of(name), name, a, b, (("dask task", short_name(dask_key, tag)),))
        ready, on = None, ""
        if dask_key not in first_in_run:  # what the run waited for comes before its first task
            first_in_run[dask_key] = span
            ready, on = _inputs_ready(dask_key, graph, device_of, ended, arrived, tag)
        busy.append(Busy(span, ready, on))
    return with_waiting("measured", step, begin, finish - begin, devices, busy, other)


def _inputs_ready(key, graph, device_of, ended, arrived, tag) -> tuple:
    """(when the last input of Dask task `key` was on its device, its name): a value from its own
    device when the task computing it ended, from another when its transfer ended."""
    device = device_of[key]
    ready, on = None, ""
    for arg in graph[key][1:]:
        try:
            if arg not in graph:
                continue
        except TypeError:  # an unhashable literal (a data tile, the step's hyper-parameters)
            continue
        when = arrived.get((arg, device)) if device_of[arg] != device else ended.get(arg)
        when = ended.get(arg) if when is None else when
        if when is not None and (ready is None or when > ready):
            ready, on = when, short_name(arg, tag) + (f" (device {device_of[arg]})" if device_of[arg] != device else "")
    return ready, on


# ---- simulated ------------------------------------------------------------------------------------
def simulated_step(plan, simulation, devices, start_s: float = 0.0, step: int = 0, runs: dict | None = None,
                   ) -> StepTimeline:
    """The simulator's timeline of one step of `plan` (`taskrt.planning.simulate.simulate`'s result), from
    `start_s`.  runs: {Dask task key: plan tasks it runs} of the fused view (`fused_plan`), shown on
    the 'dask tasks' lane.  A task's kernel starts after the runtime's own time for its Dask task."""
    from taskrt.planning.plan import TASK

    busy, other = [], []
    finish = simulation.finish
    inside = {t.key for members in (runs or {}).values() for t in members}
    for task in plan.tasks:
        if task.key not in simulation.start:
            continue
        name = short_name(task.key)
        # a run's tasks are placed inside it already (`simulate`), one of its own by its kernel's start
        begin = simulation.start[task.key] if task.key in inside else simulation.kernel_start[task.key]
        span = Span(task.device, lane_of(name), name, start_s + min(begin, finish[task.key]),
                    start_s + finish[task.key])
        deps = [(finish[d.key], d.key) for d in task.deps if d.kind == TASK and d.key in finish]
        ready, on = max(deps, default=(None, None))
        busy.append(Busy(span, None if ready is None else start_s + ready, short_name(on) if on else ""))
    for src, dst, begin, end, nbytes, reader in simulation.transfers:
        detail = (("bytes", int(nbytes)), ("for", short_name(reader)))
        busy.append(Busy(Span(dst, TRANSFERS_IN, f"from device {src}", start_s + begin, start_s + end, detail)))
        busy.append(Busy(Span(src, TRANSFERS_OUT, f"to device {dst}", start_s + begin, start_s + end, detail),
                         passive=True))
    by_key = {t.key: t for t in plan.tasks}
    for key, inside in (runs or {}).items():
        if key in simulation.start:
            other.append(Span(inside[0].device, DASK, short_name(key), start_s + simulation.start[key],
                              start_s + finish[key]))
    for key, task in by_key.items():  # tasks the runtime runs on their own
        if key not in inside and key in simulation.start:
            other.append(Span(task.device, DASK, short_name(key), start_s + simulation.start[key],
                              start_s + finish[key]))
    return with_waiting("simulated", step, start_s, simulation.step_s, devices, busy, other)
