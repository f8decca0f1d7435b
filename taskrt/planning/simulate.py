"""Task-graph simulator: list scheduling of one step's plan on a machine.

    result = simulate(plan, costs, machine)
    result.step_s, result.busy_s, result.idle_s

Every device runs one task at a time, in the order tasks become ready.  A task is ready when
its inputs are on its device: a dependency on the same device is there when it finishes; one on
another device then travels over the link between the two (latency plus bytes over
bandwidth), one transfer at a time per link, and traffic between nodes also passes each node's
shared network interface.  On a runtime that schedules centrally (Dask), each task also waits
for the scheduler to hear that its inputs are done and to send it to its device (`dispatch_s`),
then for its device to fetch what it reads from other devices (`fetch_s` per message, beyond the
link), and costs its device some time beyond its kernel (`task_s`); a step starts after the
client's own work on it (asking which devices have a worker, building and serializing its graph),
its data sent and its graph submitted (`start_s`), and ends when the client has the values it reads,
`answer_s` after the runs computing them end (taskrt.transport.worker_reads).  Dask's scheduler is one
server for every device: each task it sends out occupies it for `scheduler_per_task_s`, so
dispatches of many devices wait for each other.

With `programs` (taskrt.execution.program_executor, the Trainer's default) the scheduler sends each device
one program per step, once, at its start; the program then runs the device's tasks in its fixed
order (taskrt.planning.programs.device_order), each costing `task_s` beyond its kernel, and sends each value
another device reads as soon as the task computing it ends, one message per value and reader,
which arrives `message_s` (in place of the link's latency) after its bytes crossed the link; no
scheduler between runs.
Which bytes move comes from the plan itself, as in the executor.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from taskrt.planning.fusion import fused_plan
from taskrt.planning.plan import HYPER, PARAMETER_PHASES, STATE, TASK, Dep, Plan, output_keys
from taskrt.planning.programs import device_order


@dataclass(frozen=True)
class Runtime:
    """What the runtime adds to kernels and transfers (all zero for an ideal runtime)."""

    dispatch_s: float = 0.0  # from the last input being ready to the task being sent to its device
    # a device's time to fetch a value from another device beyond the link's latency and bandwidth
    # (its worker asks the other for it and waits), per message
    fetch_s: float = 0.0
    answer_s: float = 0.0  # from the last run the client reads ending to the client having its values
    task_s: float = 0.0  # device time per task beyond its kernel
    # device time of an export (a value taken out of a fused run), which workers run on their event
    # loop (taskrt.machines.worker_setup.InlineExecutor); None: the same as any task
    export_s: float | None = None
    # before the first task: the client's own work on the step, sending its data, submitting its graph
    start_s: float = 0.0
    per_task_submit_s: float = 0.0  # submission time per Dask task (graph serialization, scheduler ingestion)
    # Devices that share a host's processor cores with the runtime (CPU workers): the step can be
    # no shorter than all the processor time it needs divided by the cores.
    cores: int = 0  # 0: devices do not compete for processor time (GPUs, simulated hardware)
    cpu_per_task_s: float = 0.0  # processor time the runtime spends per task (scheduler and worker)
    cpu_per_message_s: float = 0.0  # processor time per message between devices, beyond its bytes
    cpu_per_byte_s: float = 0.0  # processor time per byte moved between devices (both ends)
    # The runtime runs each device's run of tasks between two waits for another device as one
    # task, and each of its values read elsewhere as a small task of its own (taskrt.planning.fusion)
    fused: bool = False
    # Dask's scheduler is one server shared by every device: each dispatch occupies it this long
    scheduler_per_task_s: float = 0.0
    # Each device runs its part of the step as one program (taskrt.planning.programs): one dispatch per device
    # and step, values pushed to their readers' mailboxes (`message_s` each beyond the link)
    programs: bool = False
    # With programs, a message's latency in place of the link's: a value's one-way time between two
    # programs through the mailboxes (taskrt.transport.mailbox), measured with the wire's latency in it.  (A
    # link's latency probed on a Dask cluster is Dask's fetch: a request and its answer.)
    message_s: float = 0.0
    # With programs, a message's latency between nodes, where it is not `message_s` (on one host
    # programs message each other over Unix sockets, between hosts over TCP ones: taskrt.transport.local_link;
    # on a TLS cluster over distributed's comms); None: `message_s`
    remote_message_s: float | None = None
    # With programs, the bytes per second of a large value between two programs where that is not
    # the link's (on one host they go through shared memory: taskrt.transport.shared_memory); 0: the link's
    message_bandwidth: float = 0.0
    # With programs on one host, a parameter-sized value (a shard's weights or gradient: `lent`) of
    # at least this many bytes is lent where it lies (taskrt.transport.shared_memory.Blocks): no bytes copied,
    # the message's latency only; 0: none is
    lent_min_bytes: int = 0
    # With programs, steps sent ahead as `Trainer.fit` sends them: a device's program is on its
    # worker before the one of the step before ends there (it reads that one's state on the worker:
    # taskrt.execution.program_executor), so the client's work on a step, its graph's intake, the dispatch and
    # the answer happen while earlier steps run.  A step then lasts as long as the longest of the
    # devices' work with every program starting at once, the scheduler's time sending the step's
    # programs (`scheduler_per_task_s` each) and the client's own time on it (`start_s`).
    steps_ahead: bool = False
    # With steps sent ahead, the steps each program runs (`Trainer.fit`'s steps_per_program): the
    # client's, the scheduler's and the runtime's work per program is shared by that many steps
    steps_per_program: int = 1


def lent(plan, transfer, runtime: Runtime, machine) -> bool:
    """Whether a program lends `transfer`'s value in place (see `Runtime.lent_min_bytes`): a
    shard's weights or gradient, which the kernels make on `ops.reuse`'s memory, to a device on
    the same node."""
    if not runtime.programs or not runtime.lent_min_bytes or transfer.nbytes < runtime.lent_min_bytes:
        return False
    if machine.devices[transfer.src].node != machine.devices[transfer.dst].node:
        return False
    dep = transfer.dep
    return dep.kind == STATE or (dep.kind == TASK and plan.by_key[dep.key].phase in PARAMETER_PHASES)


@dataclass
class Simulation:
    step_s: float
    busy_s: np.ndarray  # per device: time running tasks
    idle_s: np.ndarray  # per device: the rest of the step
    start: dict = field(repr=False)  # task key -> start time (after the step's start overhead)
    finish: dict = field(repr=False)
    bytes_moved: int = 0
    cpu_s: float = 0.0  # processor time the step needs, where devices share cores (0: not modeled)
    # each message between devices: (source, destination, start, end on its link, bytes, reading task)
    transfers: list = field(repr=False, default_factory=list)
    # task key -> when its kernel started, after the runtime's own time for the task (`Runtime.task_s`)
    kernel_start: dict = field(repr=False, default_factory=dict)

    @property
    def critical_device(self) -> int:
        return int(np.argmax(self.busy_s))


def simulate(plan: Plan, task_time, machine, runtime: Runtime = Runtime(), corun_time=None) -> Simulation:
    """Predicted time of one step of `plan`; `task_time(task)` gives each task's kernel seconds.

    Where devices share a host's processor cores with the runtime (`runtime.cores`), running
    kernels share the cores with each other and with the runtime's own work (scheduler, worker
    event loops moving bytes): each task hands the runtime its share of that processor time as it
    starts (where the scheduler sends it and its worker takes it in), which the runtime's threads,
    one per device, work off while any is left.  Kernels and those threads each run at
    min(1, cores / (kernels running + threads busy)); the step lasts at least until the runtime
    has done all its work.  Kernels running at the same time also slow each other beyond that
    share (the host's memory bandwidth and last-level cache are shared too): `corun_time(task)`
    gives a task's seconds while another kernel runs (default: `task_time`), and a task runs at
    task_time / corun_time (at most 1: a faster timing beside others is the host's noise) of its
    share whenever another one runs beside it.

    With `runtime.fused` the tasks scheduled are those the executor submits fused (one per
    group, one per value read outside it); each plan task's start and finish are then placed
    inside its group's run, in order."""
    members, kernels = {}, {}
    if runtime.programs and runtime.fused:
        raise ValueError("Runtime: programs run a device's plan tasks themselves; fused is the other executor's")
    if runtime.steps_ahead and not runtime.programs:
        raise ValueError("Runtime: steps_ahead models programs (the tasks executor's steps wait for the scheduler)")
    if runtime.steps_per_program != 1 and not (runtime.steps_ahead and runtime.steps_per_program > 1):
        raise ValueError(f"Runtime: steps_per_program must be 1, or more with steps_ahead (several steps to a program "
                         f"are sent ahead by Trainer.fit), got {runtime.steps_per_program!r}")
    if runtime.fused:
        plan, members = fused_plan(plan)
        kernel, kernel_corun = task_time, corun_time or task_time
        kernels = {key: [kernel(t) for t in inside] for key, inside in members.items()}  # once, not per schedule
        run_s = {key: sum(times) for key, times in kernels.items()}
        run_corun_s = {key: sum(kernel_corun(t) for t in inside) for key, inside in members.items()}

        def task_time(task):
            if task.phase == "export":
                return 0.0
            return run_s[task.key] if task.phase == "fused" else kernel(task)

        def corun_time(task):
            if task.phase == "export":
                return 0.0
            return run_corun_s[task.key] if task.phase == "fused" else kernel_corun(task)

    unknown = {d.key for t in plan.tasks for d in t.deps if d.kind == TASK} - plan.by_key.keys()
    if unknown:
        raise AssertionError(f"the plan has tasks depending on tasks it lacks: {sorted(unknown, key=repr)[:3]}")
    # The runtime's processor time while tasks run: scheduling them and moving bytes between devices.
    # (Sending the data and submitting the graph happen before the first task: not counted here.)
    # With programs, Dask sees one task per device (its program), not one per plan task.
    # (Several steps to a program share its Dask task: its share per step.)
    dask_tasks = (len(program_devices(plan)) / runtime.steps_per_program) if runtime.programs else len(plan.tasks)
    copied = sum(t.nbytes for t in plan.transfers() if not lent(plan, t, runtime, machine))
    runtime_cpu = (runtime.cpu_per_task_s * dask_tasks + runtime.cpu_per_message_s * len(plan.transfers())
                   + runtime.cpu_per_byte_s * copied)
    # the step sent (the client's work on a program shared by its steps)
    origin = runtime.start_s / runtime.steps_per_program + runtime.per_task_submit_s * dask_tasks
    per_task_cpu = runtime_cpu / len(plan.tasks) if runtime.cores and plan.tasks else 0.0
    result = _schedule(plan, task_time, corun_time or task_time, machine, runtime, per_task_cpu,
                       0.0 if runtime.steps_ahead else origin)
    if runtime.steps_ahead:  # the client and the scheduler work on this step while earlier ones run
        result.step_s = max(result.step_s, origin, runtime.scheduler_per_task_s * dask_tasks)
        result.idle_s = result.step_s - result.busy_s
    if runtime.cores:
        result.cpu_s = origin + runtime_cpu + sum(task_time(t) + _task_overhead(t, runtime) for t in plan.tasks)
    for key, inside in members.items():  # each member's share of its run, in order
        begin, end = result.start[key] + runtime.task_s, result.finish[key]
        scale = (end - begin) / run_s[key] if run_s[key] > 0 else 0.0
        for t, seconds in zip(inside, kernels[key]):
            result.start[t.key], begin = begin, begin + seconds * scale
            result.finish[t.key] = begin
    return result


def _schedule(plan: Plan, task_time, corun_time, machine, runtime: Runtime, per_task_cpu: float,
              origin: float) -> Simulation:
    """Event-driven list scheduling from `origin` (the step sent): each device runs its ready tasks
    in the order they became ready; with shared cores, running kernels and the runtime's threads
    working off what tasks handed them as they started (`per_task_cpu` each) progress at the
    processor-sharing rate, slowed by `corun_time` / `task_time` while another kernel runs."""
    n = machine.num_devices
    node = np.array([d.node for d in machine.devices])
    bandwidth = np.asarray(machine.bandwidth, dtype=float)
    latency = np.asarray(machine.latency, dtype=float)
    nic = getattr(machine, "nic_bandwidth", None)

    busy = np.zeros(n)
    link_free: dict[tuple[int, int], float] = defaultdict(lambda: origin)
    nic_in_free = defaultdict(lambda: origin)
    nic_out_free = defaultdict(lambda: origin)
    finish: dict[tuple, float] = {}
    start: dict[tuple, float] = {}
    arrived: dict[tuple, float] = {}  # (dependency, device) -> when its value is there

    booked, reader = [], [None]  # messages as booked; the task whose inputs are being booked

    def transfer(src, dst, nbytes, at, latency_s=None, rate=0.0):
        """Book one message on the link (and the nodes' interfaces); returns its arrival time
        (`latency_s` after its last byte left: by default the link's latency; `rate`: bytes per
        second in place of the link's)."""
        seconds = nbytes / (rate or bandwidth[src, dst])
        begin = max(at, link_free[(src, dst)])
        if nic and node[src] != node[dst]:
            seconds = max(seconds, nbytes / nic)
            begin = max(begin, nic_out_free[node[src]], nic_in_free[node[dst]])
            nic_out_free[node[src]] = nic_in_free[node[dst]] = begin + seconds
        link_free[(src, dst)] = begin + seconds
        booked.append((src, dst, begin, begin + seconds, nbytes, reader[0]))
        return begin + seconds + (latency[src, dst] if latency_s is None else latency_s)

    scheduler_free = [origin]

    def dispatched(ready):
        """When the scheduler has sent out a task it can send from `ready` on: it sends one at a time."""
        begin = max(ready, scheduler_free[0])
        scheduler_free[0] = begin + runtime.scheduler_per_task_s
        return begin + runtime.dispatch_s

    # With programs: each device's program reaches it once (the scheduler sends them one after
    # another), runs its tasks in its order and sends each value as soon as it is computed.
    def push(t, at):
        reader[0] = t.reader
        same_node = node[t.src] == node[t.dst]
        message_s = runtime.message_s if same_node or runtime.remote_message_s is None else runtime.remote_message_s
        nbytes = 0 if lent(plan, t, runtime, machine) else t.nbytes
        arrived[(t.dep, t.dst)] = transfer(t.src, t.dst, nbytes, at, message_s,
                                           runtime.message_bandwidth if same_node else 0.0)

    program_start, position, sends = {}, {}, defaultdict(list)
    if runtime.programs:
        for tasks in device_order(plan).values():
            position.update((t.key, i) for i, t in enumerate(tasks))
        for d in program_devices(plan):  # sent ahead: there as the step before ends on the device
            program_start[d] = origin if runtime.steps_ahead else dispatched(origin)
        for t in plan.transfers():
            sends[t.dep].append(t)
        for dep, messages in sends.items():  # values given to the step go out as its program starts
            if dep.kind != TASK:
                for t in messages:
                    push(t, program_start[t.src])
    next_position = [0] * n

    def inputs_ready(task):
        if runtime.programs:
            return _program_inputs_ready(task, plan, finish, arrived, program_start[task.device])
        reader[0] = task.key
        return _inputs_ready(task, plan, finish, arrived, transfer, origin, runtime, dispatched)

    waiting, dependents = {}, defaultdict(list)
    order = {t.key: i for i, t in enumerate(plan.tasks)}
    pending = []  # (time the task's inputs are on its device, plan order, task)
    for task in plan.tasks:
        deps = {d.key for d in task.deps if d.kind == TASK}
        waiting[task.key] = len(deps)
        for d in deps:
            dependents[d].append(task)
        if not deps:
            heapq.heappush(pending, (inputs_ready(task), order[task.key], task))
    queued = [[] for _ in range(n)]  # per device, tasks whose inputs are there
    # device -> [task, remaining seconds of work (run alone), start, slow-down beside another kernel,
    # the kernel's share of the work]
    running: dict[int, list] = {}
    kernel_start = {}
    now = origin

    # The runtime's work left to do, and its threads: one per device (each worker's event loop takes
    # in its tasks and moves their values; the scheduler's work comes and goes with theirs).
    backlog, threads = 0.0, n

    def share():  # of a core, for each kernel running and each busy runtime thread
        sharing = len(running) + (threads if backlog > 0 else 0)
        return min(1.0, runtime.cores / sharing) if runtime.cores and sharing else 1.0

    while pending or running or any(queued) or backlog > 0:
        while pending and pending[0][0] <= now:  # before devices choose: ties go by plan order
            ready, rank, task = heapq.heappop(pending)
            # a program takes its tasks in its own order; Dask's workers, in the order they arrive
            heapq.heappush(queued[task.device], (position[task.key], ready, task) if runtime.programs
                           else (ready, rank, task))
        for d in range(n):  # idle devices take their earliest ready task (a program: its next one)
            if d not in running and queued[d] and (not runtime.programs or queued[d][0][0] == next_position[d]):
                _, _, task = heapq.heappop(queued[d])
                next_position[d] += 1
                alone = task_time(task)
                beside = corun_time(task) / alone if alone > 0 else 1.0
                work = _task_overhead(task, runtime) + alone
                running[d] = [task, work, now, max(beside, 1.0), alone / work if work > 0 else 1.0]
                start[task.key] = now
                backlog += per_task_cpu
        speed = share()
        # of each running task's work done per second
        rate = {d: speed / item[3] if len(running) > 1 else speed for d, item in running.items()}
        next_finish = min((now + item[1] / rate[d] for d, item in running.items()), default=np.inf)
        worked_off = now + backlog / (threads * speed) if backlog > 0 else np.inf
        next_ready = pending[0][0] if pending else np.inf
        later = min(next_finish, worked_off, next_ready)
        if later == np.inf:  # a program waits for a task that never comes: the order is not one of dependencies
            raise AssertionError(f"programs stuck: devices wait for tasks out of their order {queued}")
        for d, item in running.items():  # a task due by `later` is done (no rounding residue left)
            item[1] = 0.0 if now + item[1] / rate[d] <= later else item[1] - (later - now) * rate[d]
        if backlog > 0:
            backlog = 0.0 if worked_off <= later else backlog - (later - now) * speed * threads
        now = later
        for d in [d for d, item in running.items() if item[1] <= 1e-12]:
            task, _, began, _, kernel_share = running.pop(d)
            kernel_start[task.key] = now - (now - began) * kernel_share
            finish[task.key] = now
            busy[d] += now - began
            for t in sends.get(Dep(TASK, task.key), ()):  # a program sends as soon as it has the value
                push(t, now)
            for consumer in dependents[task.key]:
                waiting[consumer.key] -= 1
                if waiting[consumer.key] == 0:
                    heapq.heappush(pending, (inputs_ready(consumer), order[consumer.key], consumer))
    if len(finish) != len(plan.tasks):
        stuck = [t.key for t in plan.tasks if t.key not in finish]
        raise AssertionError(f"the plan has a dependency cycle: {len(stuck)} tasks never ran, e.g. {stuck[:3]}"
                             if stuck else "the plan has several tasks with the same key")
    # A step in training is the time from one step to the next.  The client has the step when it
    # has read its outputs on their workers, `answer_s` after the runs computing them end
    # (taskrt.transport.worker_reads), and sends the next step.  The getitems naming each value end later,
    # while that step is being sent: its runs, which read them, start `origin` after it does, so
    # only what is left of them beyond that lengthens the step.
    # So does what is left after the last task ends of the runtime's work (`now`: when it is done).
    if runtime.programs:  # the client reads a program's result: it ends after its last task and send
        read = max([*finish.values(), *(b[3] for b in booked), origin]) + (0.0 if runtime.steps_ahead
                                                                          else runtime.answer_s)
    else:
        read = max((finish[_computed_by(plan, key)] for key in _outputs(plan)), default=origin) + runtime.answer_s
    end = max(read, now - origin)
    return Simulation(end, busy, end - busy, start, finish, plan.bytes_moved, transfers=booked,
                      kernel_start=kernel_start)


def _task_overhead(task, runtime: Runtime) -> float:
    """The device time a task costs beyond its kernel."""
    if task.phase == "export" and runtime.export_s is not None:
        return runtime.export_s
    return runtime.task_s


def _outputs(plan: Plan) -> list:
    return output_keys(plan.outputs) or [t.key for t in plan.tasks]


def _computed_by(plan: Plan, key) -> tuple:
    """The task whose end makes output `key` readable: the run an export names a value of, or itself."""
    task = plan.by_key[key]
    return task.deps[0].key if task.phase == "export" else key


def program_devices(plan: Plan) -> list:
    """The devices a step runs a program on: those with tasks, and those only holding data another reads."""
    return sorted({t.device for t in plan.tasks} | {t.src for t in plan.transfers()})


def _program_inputs_ready(task, plan, finish, arrived, started) -> float:
    """When all of `task`'s inputs are on its device, in a program that started at `started`: its
    own device's values when computed, others' when their message arrived (sent as computed)."""
    ready = started
    for dep in task.deps:
        if dep.kind == HYPER:
            continue
        if plan.device_of(dep) != task.device:
            ready = max(ready, arrived[(dep, task.device)])
        elif dep.kind == TASK:
            ready = max(ready, finish[dep.key])
    return ready


def _inputs_ready(task, plan, finish, arrived, transfer, origin, runtime, dispatched) -> float:
    """When all of `task`'s inputs are on its device.  The scheduler hears the last one is done and
    sends the task out; its device then fetches what lives elsewhere, one message per source
    device (as Dask batches them), each value once per device."""
    ready = origin
    remote: dict[int, list] = defaultdict(list)
    for dep in task.deps:
        if dep.kind == HYPER:
            continue
        ready = max(ready, finish[dep.key] if dep.kind == TASK else origin)
        src = plan.device_of(dep)
        if src != task.device:
            remote[src].append(dep)
    ready = dispatched(ready)
    arrival = ready
    for src, deps in remote.items():
        missing = [d for d in deps if (d, task.device) not in arrived]
        if missing:
            when = transfer(src, task.device, sum(plan.nbytes_of(d) for d in missing), ready) + runtime.fetch_s
            for d in missing:
                arrived[(d, task.device)] = when
        arrival = max(arrival, max(arrived[(d, task.device)] for d in deps))
    return arrival
