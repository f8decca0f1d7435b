"""A step as one program per device (control replication): plain data, built once per plan.

Each device runs its part of the plan in the order the fused plan gives (`taskrt.planning.fusion.fused_plan`:
stage by stage, the values another device waits for first), and exchanges values with the other
devices itself: it receives each value another device computes for it (`Recv`), and sends each of
its own values another device reads as soon as the task computing it ends (`Send`).  Between
those, its tasks run as `FusedRun`s (`Compute`), so that a GPU worker replays each as a CUDA graph
(`taskrt.gpu.cuda_graphs`).  Every device takes its tasks in one order of dependencies and sends
without waiting, so no program waits for a value whose sender waits for it in turn.

A value is named by its plan dependency (`taskrt.planning.plan.Dep`): a task's output, a state chunk, a
data tile, a running-statistics group or the hyper-parameters.  Between devices it travels under
its key in the step (`value_key`), the key the per-task executor gives it, so that bytes are
counted per key as there (`taskrt.transport.mailbox`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from taskrt.planning.fusion import FusedRun, fused_plan
from taskrt.planning.plan import BUFFER, DATA, HYPER_DEP, STATE, TASK, Dep, Plan, keys_of
from taskrt.planning.tasks import Received

GIVEN = (STATE, DATA, BUFFER)  # what a step is given rather than computes


@dataclass(frozen=True)
class Recv:
    """Wait for value `name` from device `src`."""

    name: Dep
    src: int


@dataclass(frozen=True)
class Send:
    """Send value `name` to device `dst` (without waiting for it to arrive)."""

    name: Dep
    dst: int


@dataclass(frozen=True)
class Compute:
    """Run `run` on the values `inputs` (its ("in", i) arguments, in order); it gives the values
    `outputs` (its exports, in order)."""

    run: FusedRun
    inputs: tuple
    outputs: tuple


@dataclass(frozen=True)
class Output:
    """Value `name` is what the step gives as `key` of its output `output` ("state", "loss", ...)."""

    output: str
    key: object  # the plan's task key of the value
    name: Dep


@dataclass(frozen=True)
class DeviceProgram:
    """One device's part of a step.  `inputs`: the values it is given (its state, buffers and
    data tiles, and the hyper-parameters); `code`: what it does, in order; `drops[i]`: values no
    later instruction reads, forgotten after instruction i; `outputs`: the values it returns, in
    order; `peers`: the devices it exchanges values with; `gpu`: its device is a GPU (data
    converted on arrival, values the client reads brought to host memory)."""

    device: int
    inputs: tuple
    code: tuple
    drops: tuple
    outputs: tuple
    peers: tuple
    gpu: bool = False

    def __repr__(self):  # shown by Dask's dashboard and errors
        computed = sum(len(c.run.steps) for c in self.code if isinstance(c, Compute))
        return f"DeviceProgram(device {self.device}, {computed} tasks, {len(self.code)} instructions)"


def value_key(name: Dep, tag) -> tuple:
    """The key value `name` has in step `tag`, as the per-task executor names it: a task's key
    ('conv1-fwd-it7-ab', 0); a data tile ('image-data-it7-ab', part); running statistics
    ('bn-running-it7-ab', group)."""
    if name.kind == TASK:
        base = name.key
    elif name.kind == DATA:
        base = (f"{name.key[0]}-data", name.key[1])
    elif name.kind == BUFFER:
        base = (f"{name.key[0]}-running", name.key[1])
    else:
        raise ValueError(f"{name} never travels between devices")
    return (f"{base[0]}-it{tag}", *base[1:])


def device_order(plan: Plan) -> dict[int, list]:
    """{device: its tasks of `plan`, in the order of the fused plan} (each device's part of one
    order of dependencies)."""
    view, members = fused_plan(plan)
    order: dict[int, list] = {}
    for task in view.tasks:
        if task.phase == "fused":
            order.setdefault(task.device, []).extend(members[task.key])
        elif task.phase != "export":
            order.setdefault(task.device, []).append(task)
    return order


def device_programs(plan: Plan, gpu_devices=frozenset(), program_names: bool = False) -> dict[int, DeviceProgram]:
    """{device: its DeviceProgram} of every device with tasks in `plan`, found once per plan
    (`Plan.derived`).  `program_names`: each Compute's run on a GPU device is named, the same at
    every step, so that its worker replays it as a CUDA graph (`taskrt.gpu.cuda_graphs`)."""
    cache_key = ("programs", frozenset(gpu_devices), program_names)
    if cache_key not in plan.derived:
        plan.derived[cache_key] = _build(plan, frozenset(gpu_devices), program_names)
    return plan.derived[cache_key]


def _build(plan: Plan, gpu_devices: frozenset, program_names: bool) -> dict[int, DeviceProgram]:
    sends: dict[int, dict] = {}  # device -> {value: [devices reading it], in the plan's order}
    for t in plan.transfers():
        sends.setdefault(t.src, {}).setdefault(t.dep, []).append(t.dst)
    outputs: dict[int, list] = {}
    for output, value in plan.outputs.items():
        for key in keys_of(value):
            outputs.setdefault(plan.by_key[key].device, []).append(Output(output, key, Dep(TASK, key)))
    uid = plan.derived.setdefault("uid", uuid.uuid4().hex[:12])
    programs = {}
    order = device_order(plan)
    for device in sorted(set(order) | set(sends)):  # a device may only hold data another device reads
        tasks = order.get(device, [])
        name = (lambda i, d=device: f"{plan.mode}-{uid}/dev{d}/program{i}") if (
            program_names and device in gpu_devices) else None
        programs[device] = _program(plan, device, tasks, sends.get(device, {}), outputs.get(device, []),
                                    device in gpu_devices, name)
    return programs


def _program(plan, device, tasks, sends, outputs, gpu, name) -> DeviceProgram:
    inputs = {}  # values given to the program (and so there from its start)
    for task in tasks:
        for dep in task.deps:
            if dep == HYPER_DEP or (dep.kind in GIVEN and plan.device_of(dep) == device):
                inputs.setdefault(dep)
    for dep in sends:  # given values another device reads
        if dep.kind != TASK:
            inputs.setdefault(dep)
    code, have, pending = [], set(inputs), []
    code += [Send(dep, dst) for dep, dsts in sends.items() if dep.kind != TASK for dst in dsts]

    def flush():
        if pending:
            code.append(pending[:])
            pending.clear()

    for task in tasks:
        needed = [dep for dep in task.deps if dep not in have]  # from other devices: local ones came first
        if needed:
            flush()
            for dep in dict.fromkeys(needed):
                code.append(Recv(dep, plan.device_of(dep)))
                have.add(dep)
        pending.append(task)
        have.add(Dep(TASK, task.key))
        dsts = sends.get(Dep(TASK, task.key))
        if dsts:
            flush()
            code += [Send(Dep(TASK, task.key), dst) for dst in dsts]
    flush()
    wanted = {o.name for o in outputs}
    code = _computes(plan, device, code, wanted, name)
    peers = sorted({c.src for c in code if isinstance(c, Recv)} | {c.dst for c in code if isinstance(c, Send)})
    return DeviceProgram(device, tuple(inputs), tuple(code), _drops(code, wanted), tuple(outputs), tuple(peers), gpu)


def _computes(plan, device, code, wanted, name) -> list:
    """`code` with each list of tasks made a Compute: a FusedRun of them, exporting the values that
    a later instruction or the program's outputs read."""
    read_later: list[set] = [set() for _ in code]  # values read after instruction i
    seen = set(wanted)
    for i in range(len(code) - 1, -1, -1):
        read_later[i] = set(seen)
        item = code[i]
        if isinstance(item, Send):
            seen.add(item.name)
        elif isinstance(item, list):
            for task in item:
                seen.update(task.deps)
    out, index = [], 0
    for i, item in enumerate(code):
        if not isinstance(item, list):
            out.append(item)
            continue
        inside = {t.key for t in item}
        inputs, slot, steps = [], {}, []
        for task in item:
            refs = []
            for dep in task.deps:
                if dep.kind == TASK and dep.key in inside:
                    refs.append(("own", dep.key))
                else:
                    refs.append(("in", slot.setdefault(dep, len(inputs))))
                    if refs[-1][1] == len(inputs):
                        inputs.append(dep)
            spec = Received(task.spec) if any(_through_messages(plan, d, device) for d in task.deps) else task.spec
            steps.append((task.key, spec, tuple(refs)))
        exports = tuple(t.key for t in item if Dep(TASK, t.key) in read_later[i])
        run = FusedRun(tuple(steps), exports, (), name(index) if name else None)
        out.append(Compute(run, tuple(inputs), tuple(Dep(TASK, k) for k in exports)))
        index += 1
    return out


def _through_messages(plan: Plan, dep: Dep, device: int) -> bool:
    """Whether a value arrives in a message (from another device, or given to the step), and so may
    lie misaligned in the message's buffer (`taskrt.planning.tasks.Received`)."""
    if dep.kind == TASK:
        return plan.by_key[dep.key].device != device
    return dep.kind in GIVEN


def _drops(code, wanted) -> tuple:
    """For each instruction, the values read last there (never the program's outputs)."""
    last = {}
    for i, item in enumerate(code):
        names = item.inputs if isinstance(item, Compute) else (item.name,) if isinstance(item, Send) else ()
        for n in names:
            last[n] = i
        if isinstance(item, (Compute, Recv)):  # a value nothing reads is dropped where it is made
            for n in (item.outputs if isinstance(item, Compute) else (item.name,)):
                last.setdefault(n, i)
    drops = [[] for _ in code]
    for n, i in last.items():
        if n not in wanted:
            drops[i].append(n)
    return tuple(tuple(d) for d in drops)
