"""Fusing a step's tasks: every run of work a device can do without waiting for another device
becomes one Dask task, so a step pays Dask's per-task cost once per run, not once per task.

Each task gets a stage: the most device changes on any path of tasks leading to it.  Tasks on one
device with the same stage form a group, and a group is convex: a path that leaves its device
raises the stage, so no path leaves a group and comes back into it, and a group's task can run
as soon as the group's outside inputs are there.  A Dask task gives its values only when it
ends, so each group is split in two, the tasks whose values another device reads together with
all of the group they need first, then the rest: otherwise a data-parallel replica would wait
for the whole forward and backward of the device that sends it the weights.  (Both halves stay
convex: the first holds every ancestor in the group of its tasks.)  A group runs as one
`FusedRun` task; each of its values that something outside the group reads (a task on another
device or stage, or the client) is taken out of the result by a small task under its original
key on the same device.
A group where that would not make fewer tasks (nearly all its values are read outside) stays
as it is.  Keys, bytes moved and the values the client sees are those of the
unfused graph; only the group's inner values never become Dask keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import getitem


@dataclass(frozen=True)
class FusedRun:
    """Runs `steps` in order; returns the values of `exports` as a tuple.

    steps: ((key, callable, args), ...) where each arg is ("in", i) for the i-th outside input,
    ("item", (i, j)) for value j of the i-th outside input (a `RunValue`: another run's result),
    ("own", key) for an earlier step's value, or ("lit", value).  after: keys of the same device
    this run waits for without reading them (they are its last inputs).  program: a name the run
    keeps from step to step (None: none), under which a GPU worker replays it as a CUDA graph
    (`taskrt.gpu.cuda_graphs`); the same name always names the same steps."""

    steps: tuple
    exports: tuple
    after: tuple = ()
    program: object = None

    def __call__(self, *inputs):
        if self.program is not None:
            from taskrt.gpu import cuda_graphs

            return cuda_graphs.call(self, inputs)
        return self.run(inputs)

    def run(self, inputs, watch=None, held=None):
        """The steps, one after another, on `inputs`; `watch(key)`, when given, after each step
        (a CUDA graph's capture checks there which step, if any, broke it); `held`: a
        `taskrt.execution.held.Held` that counts each value as it is made and let go."""
        last_use, keep = self._last_use, self._keep
        values = {}
        for n, (key, fn, args) in enumerate(self.steps):
            resolved = [inputs[ref] if kind == "in" else values[ref] if kind == "own"
                        else inputs[ref[0]][ref[1]] if kind == "item" else ref for kind, ref in args]
            try:
                values[key] = fn(*resolved)
            except Exception as error:
                error.add_note(f"in task {key} (fused with {len(self.steps) - 1} others on its device)")
                raise
            if watch is not None:
                watch(key)
            if held is not None:
                held.add(values[key])
            for kind, ref in args:  # an inner value no later step reads is dropped now: memory as unfused
                if kind == "own" and last_use[ref] == n and ref not in keep:
                    if held is not None:
                        held.drop(values[ref])
                    del values[ref]
        return tuple(values[key] for key in self.exports)

    @cached_property
    def _last_use(self) -> dict:
        """The last step reading each inner value (once per run: a program's runs are called every step)."""
        last_use = {}
        for n, (_, _, args) in enumerate(self.steps):
            for kind, ref in args:
                if kind == "own":
                    last_use[ref] = n
        return last_use

    @cached_property
    def _keep(self) -> frozenset:
        return frozenset(self.exports)

    def __getstate__(self):  # sent without what it computes for itself
        return {k: v for k, v in self.__dict__.items() if k not in ("_last_use", "_keep")}

    def __repr__(self):  # shown by Dask's dashboard and errors
        return f"FusedRun({len(self.steps)} tasks, {len(self.exports)} outputs)"


@dataclass(frozen=True)
class RunValue:
    """Value `index` of the result of `run` (the future or key of a fused run): how the trainer
    holds the new state a run computed, with no task to name each value (`fuse`'s `held`).  As a
    task's argument in a step's graph, `export` is the key that names the value where it must be
    a key of its own: a fused task on the run's device reads the value out of the run, a task
    left unfused reads `export`, which `fuse` then adds (a getitem on the same device).  Between
    steps `export` is None: each step names the value afresh."""

    export: object
    run: object
    index: int


def given_elsewhere(dsk: dict, device: dict, given=frozenset()) -> set:
    """The tasks of `given` that a task on another device reads.  `given`: tasks that read no other
    task and stand for what the plan has as data and state (a data tile the step's graph carries,
    `taskrt.execution.executor.INLINE_DATA_BYTES`; a value taken out of an earlier step's run).  Each of
    these stays a task of its own, there from the step's start like the data and state a step is
    given as futures, so reading it raises no stage: the groups are those of the plan, which the
    simulator schedules (`fused_plan`).  (Fused into its device's first run, its readers elsewhere
    would wait for that run's first half.)  No path leads into such a task, so none leaves a group
    through it and comes back."""
    return {a for key, (_, *args) in dsk.items() for a in args
            if _is_key(a, dsk) and a in given and device[a] != device[key]}


def run_of(value):
    """What holds a value: for a `RunValue` the run that keeps it, else the value itself (a key or
    a future of its own)."""
    return value.run if isinstance(value, RunValue) else value


def stages(dsk: dict, device: dict, given=frozenset()) -> dict:
    """key -> the most device changes on a path of tasks to it, not counting a change after a task
    of `given` (see `given_elsewhere`); `dsk` in dependency order."""
    stage, readers, late = {}, {}, []
    for key, (fn, *args) in dsk.items():
        stage[key] = max((stage[a] + (device[a] != device[key] and a not in given) for a in args
                          if _is_key(a, stage)), default=0)
        if getattr(fn, "late", False):
            late.append(key)
        for a in args:
            if _is_key(a, stage):
                readers.setdefault(a, []).append(key)
    # A late task (a forward value computed again for backward: taskrt.planning.recompute) runs in
    # the stage of its earliest reader, as late as it can without a reader's stage below its own
    # (one less for a reader on another device); readers first, so a chain of them moves together
    for key in reversed(late):
        stage[key] = max(stage[key], min((stage[r] - (device[r] != device[key]) for r in readers.get(key, ())),
                                         default=stage[key]))
    return stage


def groups_of(dsk: dict, device: dict, given=frozenset(), apart=frozenset()) -> dict:
    """key -> its group (device, 2 * stage + 0 for the half whose values another device reads,
    with what it needs in the group, 1 for the rest; -1 for the tasks `given_elsewhere` and those
    of `apart` (tasks of `given` kept as tasks of their own wherever they are read), which stay as
    they are); `dsk` in dependency order."""
    stage, given = stages(dsk, device, given), given_elsewhere(dsk, device, given) | (set(apart) & set(given))
    remote = set()  # values a task on another device reads
    for key, (_, *args) in dsk.items():
        remote.update(a for a in args if _is_key(a, dsk) and device[a] != device[key])
    first = set()
    for key in reversed(dsk):  # consumers before producers: each adds the parents of its group
        if key in remote or key in first:
            first.add(key)
            _, *args = dsk[key]
            first.update(a for a in args if _is_key(a, dsk) and (device[a], stage[a]) == (device[key], stage[key]))
    return {key: (device[key], -1 if key in given else 2 * stage[key] + (key not in first)) for key in dsk}


def fuse(dsk: dict, device: dict, outputs: set, name, held=frozenset(), given=frozenset(),
         apart=frozenset(), program=None) -> tuple[dict, dict, dict]:
    """(fused graph, device of each of its keys, {held key: (run, index)}).  `dsk` maps key ->
    (callable, *args) in dependency order, args being keys of `dsk`, `RunValue`s or values;
    `outputs`: keys the client reads; `name(device, index)` gives a group's key.  The fused graph
    lists its groups by stage, the half another device reads first, each group's tasks in `dsk`
    order: an order of dependencies that the executor gives Dask as priorities (and the simulator
    follows).

    `held`: outputs the client may keep as values of their run (`held_outputs`).  A fused group
    none of whose values another group of the step reads keeps them in its result, with no task
    to name each: a Dask key costs the scheduler, the worker and the client's reports about 0.8 ms
    on Machine.local(1) (a LeNet-5 step with its state and loss kept: 19.3 against 24.5 ms with
    each named).  They are returned as (run, index).  `given`: see `given_elsewhere`; `apart`:
    tasks of `given` never fused, even where only their own device reads them (a step's reads
    from a dataset, which then run as soon as the step is submitted: `taskrt.data.reading`).
    `program(device, index)`: the run's `FusedRun.program` (None where not given)."""
    groups: dict[tuple, list] = {}
    for key, group in groups_of(dsk, device, given, apart).items():
        groups.setdefault(group, []).append(key)
    group_of = {key: g for g, keys in groups.items() for key in keys}
    read_by_tasks = set()
    for key, (_, *args) in dsk.items():
        read_by_tasks.update(a for a in args if _is_key(a, dsk) and group_of[a] != group_of[key])
    read_outside = read_by_tasks | set(outputs)
    fused, where, kept = {}, {}, {}
    first_half = {}  # (device, stage) -> the keys of its first half's tasks in the fused graph
    for g, keys in sorted(groups.items(), key=lambda item: item[0][1]):  # stable: by first task within
        # a run whose values other tasks read stays alive until they have: keep values in it only
        # where the client alone reads it, so holding it holds nothing more
        keep = () if any(k in read_by_tasks for k in keys) else tuple(k for k in keys if k in held)
        exports = tuple(k for k in keys if k in read_outside and k not in keep)
        # fusing would not make fewer tasks: keep the group as it is.  Counted over the plan's own
        # tasks, so a data tile carried in the step's graph (a task of `given`) decides nothing and the
        # runs are the plan's (`fused_plan`, which the simulator schedules, has no such task)
        if len(exports) + 1 >= sum(k not in given for k in keys):
            for key in keys:
                fn, *args = dsk[key]
                for a in args:
                    if isinstance(a, RunValue) and a.export not in fused:  # named where it is
                        fused[a.export], where[a.export] = (getitem, a.run, a.index), g[0]
                fused[key] = (fn, *[a.export if isinstance(a, RunValue) else a for a in args])
                where[key] = g[0]
            if g[1] % 2 == 0:
                first_half[(g[0], g[1] // 2)] = tuple(keys)
            continue
        inside = set(keys)
        inputs, index, steps = [], {}, []
        for key in keys:
            fn, *args = dsk[key]
            refs = []
            for a in args:
                if _is_key(a, inside):
                    refs.append(("own", a))
                elif isinstance(a, RunValue):  # read out of an earlier run: one input for all its values
                    slot = index.setdefault(_identity(a.run), len(inputs))
                    if slot == len(inputs):
                        inputs.append(a.run)
                    refs.append(("item", (slot, a.index)))
                elif _is_key(a, dsk) or not isinstance(a, dict):  # another group's key, or a future
                    slot = index.setdefault(_identity(a), len(inputs))
                    if slot == len(inputs):
                        inputs.append(a)
                    refs.append(("in", slot))
                else:
                    refs.append(("lit", a))
            steps.append((key, fn, tuple(refs)))
        run_key = name(*g)
        # A second half runs after its first: a worker starts whichever task reaches it first,
        # priorities notwithstanding, and would keep another device waiting for the whole stage
        after = first_half.get((g[0], g[1] // 2), ()) if g[1] % 2 else ()
        run = FusedRun(tuple(steps), exports + keep, after, program(*g) if program else None)
        fused[run_key], where[run_key] = (run, *inputs, *after), g[0]
        if g[1] % 2 == 0:
            first_half[(g[0], g[1] // 2)] = (run_key,)
        for i, key in enumerate(exports):
            fused[key], where[key] = (getitem, run_key, i), g[0]
        kept.update((key, (run_key, i)) for i, key in enumerate(keep, len(exports)))
    return fused, where, kept


def export_source(dsk: dict, key) -> tuple:
    """(run, index) when `key` names value `index` of a fused run (`fuse` made it a getitem task),
    else (key, None): the key is computed by its own task."""
    spec = dsk.get(key)
    return (spec[1], spec[2]) if isinstance(spec, tuple) and spec and spec[0] is getitem else (key, None)


def step_done_keys(outputs: dict, source) -> list:
    """The keys whose ends make a step done: each output the client reads, except that the new
    state and statistics (read by the next step, not the client) count as done when the run that
    computed them ends, not the task that names each value after it (one worker task per value,
    about 1 ms each, that the next step waits for anyway).  `outputs`: name -> keys (a list or a
    dict's values, or `RunValue`s of values kept in their run); `source(key)`: the run an export
    takes its value from; None or the key itself for any other."""
    from taskrt.planning.plan import keys_of

    keys = []
    for name, value in outputs.items():
        for key in keys_of(value):
            if isinstance(key, RunValue):  # kept in its run (`fuse`'s `held`)
                keys.append(key.run)
            else:
                keys.append((source(key) if name in ("state", "buffers") else None) or key)
    return list(dict.fromkeys(keys))


def _is_key(value, keys) -> bool:
    return isinstance(value, tuple) and value in keys


def _identity(value):
    """A hashable name for an outside input: its key, or for a future its key too."""
    return value if isinstance(value, tuple) else ("future", getattr(value, "key", id(value)))


def fused_plan(plan) -> tuple:
    """`plan` as the executor submits it fused, for the simulator: (plan of Dask tasks, members).

    The same `fuse` groups the plan's tasks: each group becomes one task (phase "fused", its
    callable the FusedRun, its dependencies those of its members from outside the group), each
    of its values read outside a getitem task under the original key (phase "export", on the
    same device, the original size), except values kept in their run (`fuse`'s `held`), which the
    view's outputs name by their run; tasks left unfused stay.  `members[key]` lists the plan
    tasks a fused task runs, in order.  Bytes moved between devices are those of `plan`."""
    from taskrt.planning.plan import TASK, Dep, Plan, Task, map_outputs, output_keys

    skeleton, device = _skeleton(plan)
    dsk, where, kept = fuse(skeleton, device, set(output_keys(plan.outputs)), _run_name,
                            held_outputs(plan.outputs) - state_read_as_keys(plan))
    tasks, members = [], {}
    for key, (fn, *args) in dsk.items():
        if isinstance(fn, FusedRun):
            inside = [plan.by_key[k] for k, _, _ in fn.steps]
            names = {t.key for t in inside}
            deps = dict.fromkeys(d for t in inside for d in t.deps if not (d.kind == TASK and d.key in names))
            deps.update(dict.fromkeys(Dep(TASK, k) for k in fn.after))
            members[key] = inside
            tasks.append(Task(key, "fused", inside[0].layer, where[key], fn, tuple(deps), None,
                              sum(t.flops for t in inside)))
        elif fn is getitem:
            original = plan.by_key[key]
            tasks.append(Task(key, "export", original.layer, where[key], getitem, (Dep(TASK, args[0]),),
                              original.nbytes))
        else:
            tasks.append(plan.by_key[key])
    outputs = map_outputs(plan.outputs, lambda k: kept.get(k, (k,))[0])  # a kept value: read when its run ends
    view = Plan(plan.mode, tasks, plan.shards, plan.data, plan.data_nbytes, outputs, plan.buffers)
    return view, members


# outputs read by the next step, or read on the workers (taskrt.transport.worker_reads)
HELD = ("state", "buffers", "loss")


def state_read_as_keys(plan) -> frozenset:
    """The new state and statistics (keys of `plan`'s outputs) that the next step, the same plan,
    reads as keys of their own: a task reading them on another device, or one left unfused.  Named
    by a getitem at the end of their step, off the next step's path, rather than kept in their run
    and named by one at the start of the next (a task the scheduler must hear has ended before it
    sends its readers).  Found on the plan's own tasks, whose runs are those the executor fuses
    (`given_elsewhere`), once per plan (`Plan.derived`): the executor asks at every step."""
    from taskrt.planning.plan import BUFFER, STATE, output_keys

    if "state_read_as_keys" in plan.derived:
        return plan.derived["state_read_as_keys"]
    skeleton, device = _skeleton(plan)
    fused, _, _ = fuse(skeleton, device, set(output_keys(plan.outputs)), _run_name, held_outputs(plan.outputs))
    inside = {k for fn, *_ in fused.values() if isinstance(fn, FusedRun) for k, _, _ in fn.steps}
    out = set()
    for task in plan.tasks:
        for dep in task.deps:
            if dep.kind in (STATE, BUFFER) and (plan.device_of(dep) != task.device or task.key not in inside):
                key = (plan.outputs.get("state" if dep.kind == STATE else "buffers") or {}).get(dep.key)
                if key is not None:
                    out.add(key)
    plan.derived["state_read_as_keys"] = frozenset(out)
    return plan.derived["state_read_as_keys"]


def _skeleton(plan) -> tuple[dict, dict]:
    """The plan's tasks as a graph of their task dependencies (its data and state are not tasks),
    and each task's device."""
    from taskrt.planning.plan import TASK

    return ({t.key: (t.spec, *[d.key for d in t.deps if d.kind == TASK]) for t in plan.tasks},
            {t.key: t.device for t in plan.tasks})


def _run_name(device, stage) -> tuple:
    return (f"dev{device}-fused", stage)


def held_outputs(outputs: dict) -> frozenset:
    """The outputs a client may keep as values of their runs (`fuse`'s `held`): the new state and
    running statistics, which the next step reads, and the losses, which the client reads on the
    workers (taskrt.transport.worker_reads)."""
    from taskrt.planning.plan import keys_of

    return frozenset(k for name in HELD for k in keys_of(outputs.get(name) or ()))
