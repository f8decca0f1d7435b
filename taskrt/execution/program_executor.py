"""A step as one Dask task per device: each device's program (`taskrt.planning.programs`), run where Dask
places it, exchanging values with the other programs itself (`taskrt.transport.mailbox`).

Dask still places the programs (each pinned by its device's resource tag), keeps their state
from step to step (the new state stays in the program's result, read by the next step's program
on the same device, `taskrt.planning.fusion.RunValue`), notices lost workers and shows the programs in the
dashboard.  Per step the scheduler sees one task per device, plus one per device that reads its
data tiles from a dataset (the reads run ahead, while the step before still computes); the
client sends what changes: the data tiles (or the samples' indices), the hyper-parameters and
where each device's worker is.  A device's program is sent to its worker once per plan, as data
there (a future), so that a worker lost with it fails the step like its lost state does.
A device's program reads what the device's program of the step before left (its state) on their
worker, not as a Dask dependency: the scheduler sends it once the inputs of the one before are
there (they are its Dask inputs too), and the worker starts it as the one before ends, with no word
from the scheduler in between.  Programs come to a device in the order of their steps and its
worker runs one at a time (each holds the device's resource), earlier steps first, so the steps of
several devices are never taken in different orders.  A program about to wait for a value leaves
its worker's thread pool (`distributed.secede`), so that tasks not needing the device run there
meanwhile (it still holds the device's resource).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import replace
from operator import getitem

import dask
import numpy as np

from taskrt.data.reading import TileRead, read_tile, tile_on_device
from taskrt.execution.executor import Executor, StepRun, _named_graph, loss_sum, step_key
from taskrt.execution.held import Held, StepOutOfMemory, allocator_peak, out_of_memory, start_allocator_peak
from taskrt.gpu.device import to_device, to_host
from taskrt.planning.fusion import RunValue
from taskrt.planning.plan import DATA, Plan, map_outputs
from taskrt.planning.programs import Compute, DeviceProgram, Recv, device_programs, value_key
from taskrt.transport.mailbox import PeerLost, ProgramAborted, abort_on, mailbox_of
from taskrt.transport.worker_reads import TIMED_OUT

KEPT_PLANS = 4  # plans whose programs stay on the workers (IST makes a plan per round)
WINDOW_S = 0.25  # `fit`'s automatic steps per program: about this long (`auto_steps_per_program`)
MAX_WINDOW = 16  # steps per program at most, automatic or asked for
SENT = itertools.count()  # steps sent by this client's executors, in order
READ_PRIORITY = 1  # over every program's (0, -1, -2, ...)
HELD = ("state", "buffers", "loss")  # outputs the client keeps as values of their program's result
PER_STEP = ("loss", "logits")  # outputs a window of steps gives for each of its steps
MEMORY = "memory"  # what names a step's measured memory among the values read when it ends


class StepArgs:
    """What a step's program needs besides its Dask inputs, in one object Dask does not look into:
    its key, the step's tag, every device's worker address, `before`, the key of the device's
    program before it (run on the same worker), and `refs`, where each of the program's inputs is:
    ("in", i) the i-th Dask input, ("item", (i, j)) value j of it (a result of another program),
    ("before", j) value j of the result of the program before, read on the worker, not through
    Dask, ("lit", value) given here (the hyper-parameters, small data tiles); in a window of
    steps, ("prev", j) value j of the step before's outputs, ("read", (TileRead, i)) a data tile
    read from the i-th Dask input as the step starts."""

    __slots__ = ("key", "tag", "address", "refs", "profiled", "before")

    def __init__(self, key, tag, address, refs, profiled=False, before=None):
        self.key, self.tag, self.address, self.refs = key, tag, address, refs
        self.profiled, self.before = profiled, before

    def __reduce__(self):
        return (StepArgs, (self.key, self.tag, self.address, self.refs, self.profiled, self.before))


WAITING = ("waiting", "ready", "constrained", "fetch", "flight", "executing", "long-running")  # worker task states


def _before(worker, box, key, tag):
    """The result of the device's program `key` of the step before, which ran on this worker.

    The scheduler sends this program once every input of the one before is there too (it is given
    them as Dask inputs: `ProgramExecutor.submit`), so the one before came to this worker first, and
    ran first: the worker runs one program of the device at a time, by the order the steps were
    sent.  (Not always: where both became ready at once, the scheduler may send this one first and
    the worker start it before it hears of the other; then it is sent again, after.)  Where that
    program failed, this one fails with its error, as Dask fails a task's dependents; where it is
    not on this worker, nor still to come, its worker was lost (Dask may run this program again on
    the worker that took the device's place): PeerLost, which the trainer recovers from."""
    from distributed import Reschedule

    try:
        return worker.data[key]
    except KeyError:
        pass
    error = box.failed.get(key)
    if error is not None:
        raise error
    if tag in box.aborted:
        raise ProgramAborted(f"step {tag}: {box.aborted[tag]}")
    task = worker.state.tasks.get(key)
    if task is not None and task.state == "error":
        raise ProgramAborted(f"step {tag}: the device's program of the step before ({key}) failed")
    if task is not None and task.state in WAITING:  # here but not run yet: come again after it
        raise Reschedule()
    if box.still_coming(key):  # sent here after this one (both ready at once), or not yet placed
        raise Reschedule()
    raise PeerLost(f"step {tag}: the device's program of the step before ({key}) is not on its worker "
                   f"{worker.address}: the worker that ran it was lost")


def run_program(program: DeviceProgram, steps: tuple, *inputs):
    """On a worker: run `program` for each step of `steps` (StepArgs, in order: one step, or a window
    of steps run by one Dask task, each reading the state the one before left, `("prev", j)`);
    returns the values of its outputs after the last step, then, for a window, the losses (or the
    logits) of each step in turn (those of `program.outputs`, in order)."""
    from distributed import Reschedule, get_worker

    worker = get_worker()
    box = mailbox_of(worker)
    per_step = [i for i, o in enumerate(program.outputs) if o.output in PER_STEP]
    previous, each, seceded, memory = None, [], [False], []
    for i, args in enumerate(steps):
        held = Held()
        start_allocator_peak(program.gpu)
        try:
            if i == 0:
                before = _before(worker, box, args.before, args.tag) if args.before is not None else None
            carried, previous = [previous], None  # _run_step lets the step before's outputs go once read
            previous = _run_step(program, args, inputs, before, carried, box, seceded, held)
        except Reschedule:  # the program before has not run yet (`_before`): nothing happened here
            raise
        except BaseException as error:
            if out_of_memory(error):  # said plainly, with what the step held (the trainer names the device)
                error = StepOutOfMemory(program.device, args.tag, held.now, held.peak, repr(error)).caused_by(error)
            tags = [later.tag for later in steps[i:]]
            box.program_failed(args.key, error)
            for tag in tags:
                box.forget(tag)
            if not isinstance(error, ProgramAborted):
                box.tell_peers([args.address[d] for d in program.peers if d in args.address], tags,
                               f"the program of device {program.device} failed: {error!r}")
            raise error
        memory.append((held.peak, allocator_peak(program.gpu)))
        if len(steps) > 1:  # a loss part's sum; logits as they are (brought to the host as they are read)
            each += [loss_sum(previous[j]) if program.outputs[j].output == "loss" else previous[j] for j in per_step]
    return (*(_for_client(o.output, v, program.gpu) for o, v in zip(program.outputs, previous)), *each, *memory)


def _run_step(program: DeviceProgram, args: StepArgs, inputs, before, carried: list, box, seceded,
              held: Held) -> tuple:
    """One step of `program`: the values of its outputs, as they are on the device.  `carried`: [the
    outputs of the step before in the window, or None], emptied here, so that each of those values
    is let go as soon as the step has read it for the last time (one copy of the state fewer).
    `held` counts the step's values as they appear and go (`taskrt.execution.held`)."""
    from distributed import secede

    tag, address = args.tag, args.address
    sent, env, previous = [], {}, carried.pop()
    for name, (kind, ref) in zip(program.inputs, args.refs):
        if kind == "before":
            value = before[ref]
        elif kind == "prev":
            value = previous[ref]
        elif kind == "read":  # a window's tile, read as its step starts: one step's tiles at a time here
            tile, at = ref
            value = (tile_on_device if program.gpu else read_tile)(inputs[at], *tile.args[1:])
        else:
            value = ref if kind == "lit" else inputs[ref] if kind == "in" else inputs[ref[0]][ref[1]]
        env[name] = value = to_device(value) if program.gpu and name.kind == DATA else value
        # what Dask gave the step it holds till the step ends: counted twice, so never let go here
        held.add(value, 1 if kind in ("prev", "read") or (program.gpu and name.kind == DATA) else 2)
    previous = value = None
    for instruction, drops in zip(program.code, program.drops):
        # (no local variable keeps a value: each must go as soon as the program lets it go, so that
        # its memory is reused and counted as let go)
        if isinstance(instruction, Compute):
            run = instruction.run
            if args.profiled:
                from taskrt.observing.task_timing import ProfiledRun

                env.update(zip(instruction.outputs, ProfiledRun(run.steps, run.exports, (), None, args.key).timed(
                    [env[n] for n in instruction.inputs], held)))
            elif run.program is None:
                env.update(zip(instruction.outputs, run.run([env[n] for n in instruction.inputs], held=held)))
            else:  # replayed as a CUDA graph: its values as it gives them
                env.update(zip(instruction.outputs, run(*[env[n] for n in instruction.inputs])))
                for name in instruction.outputs:
                    held.add(env[name])
        elif isinstance(instruction, Recv):
            key = value_key(instruction.name, tag)
            if not seceded[0] and key not in box.values:
                # About to wait: leave the worker's thread pool, so that its other tasks go on meanwhile
                secede()
                seceded[0] = True
            env[instruction.name] = box.take(key, tag, address[instruction.src])
            held.add(env[instruction.name])
        else:
            sent.append(box.send(address[instruction.dst], value_key(instruction.name, tag), tag,
                                 env[instruction.name]))
        for name in drops:
            held.drop(env.pop(name))
    for future in sent:  # a peer that could not be reached fails the step here
        future.result()
    return tuple(env[o.name] for o in program.outputs)


def _for_client(output: str, value, gpu: bool):
    """A loss part's value as the sum of its losses (left where it is: `taskrt.execution.executor.loss_sum`);
    on a GPU, what the client reads brought to host memory; the state as it is."""
    if output == "loss":
        return loss_sum(value)
    if gpu and output not in ("state", "buffers"):
        return to_host(value)
    return value


def read_tiles(reads: tuple, gpu: bool, *sources) -> tuple:
    """A device's data tiles of a step read from a dataset (`taskrt.data.reading`), in order; each read's
    source is given apart (a dataset's copy on the device is a future, which Dask resolves only
    as an argument of its own)."""
    read = tile_on_device if gpu else read_tile
    return tuple(read(source, *r.args[1:]) for r, source in zip(reads, sources))


class ProgramExecutor(Executor):
    """The executor of `Trainer(executor="programs")`: one Dask task per device and step."""

    def __init__(self, machine, cuda_graphs: bool = True):
        super().__init__(machine, fused=True, cuda_graphs=cuda_graphs)
        self._placed: OrderedDict = OrderedDict()  # id(plan) -> (plan, {device: program future})
        # device -> the future of its last program, its worker's address and the program's Dask inputs
        self._last: dict = {}
        # (when sent, a program's future, the future of the one before it, which it reads)
        self._held: list = []

    def _programs(self, plan: Plan, address: dict) -> dict:
        """{device: the future of its program on its worker}, sent once per plan."""
        held = self._placed.get(id(plan))
        if held is not None and held[0] is plan:
            self._placed.move_to_end(id(plan))
            return held[1]
        programs = device_programs(plan, self.gpu_devices, self.cuda_graphs)
        devices = list(programs)
        futures = {}
        for device in devices:  # small objects: one scatter each, once per plan
            [futures[device]] = self.client.scatter([programs[device]], workers=[address[device]], hash=False,
                                                    direct=True)
        self._placed[id(plan)] = (plan, futures)
        while len(self._placed) > KEPT_PLANS:
            self._placed.popitem(last=False)
        return futures

    def submit(self, plan: Plan, step, tag: str, state: dict, data: dict, hyper: dict | None = None,
               buffers: dict | None = None, address: dict | None = None) -> StepRun:
        return self.submit_window(plan, [(step, tag, data, hyper)], state, buffers, address)[0]

    def submit_window(self, plan: Plan, steps: list, state: dict, buffers: dict | None = None,
                      address: dict | None = None) -> list[StepRun]:
        """Submit the steps `steps` ((step, tag, data, hyper) each, in order) as one Dask task per
        device that runs them one after the other (one step: the usual program), each step after the
        first reading the state the one before left where it lies; returns a StepRun per step.  A
        window of several steps needs a plan whose state each device computes itself
        (`windowable`)."""
        address = address or self.machine.addresses()
        placed = self._programs(plan, address)
        programs = device_programs(plan, self.gpu_devices, self.cuda_graphs)
        carried = carried_state(plan, programs) if len(steps) > 1 else {}
        if carried is None:
            raise ValueError(f"plan {plan.mode!r} cannot run several steps per program: a device reads state "
                             "another device computes, or the step has outputs other than its state, losses and "
                             "logits")
        dsk, device_of, kept_of, inputs_of, read_keys = {}, {}, {}, {}, []
        first_tag = steps[0][1]
        window = "" if len(steps) == 1 else f"+{len(steps) - 1}"
        program_key = {d: f"dev{d}-program-it{first_tag}{window}" for d in programs}
        for device, program in programs.items():
            inputs, slots = [], {}

            def slot(value, inputs=inputs, slots=slots):
                name = value if isinstance(value, str) else getattr(value, "key", None) or id(value)
                if name not in slots:
                    slots[name] = len(inputs)
                    inputs.append(value)
                return slots[name]

            # The device's program of the step before ran on the same worker: its results are read
            # there, so that this one need not wait for the scheduler to hear it ended (`_before`).
            before, at, before_inputs = self._last.get(device, (None, None, ()))
            if before is None or before.status in ("error", "cancelled", "lost") or at != address[device]:
                before = None
            reads, all_refs = [], []
            for k, (_, _, data, hyper) in enumerate(steps):
                given = {"state": state or {}, "buffers": buffers or {}, "data": data, "hyper": hyper or {}}
                refs = []
                for name in program.inputs:
                    if k and name in carried.get(device, {}):  # the state the step before left here
                        refs.append(("prev", carried[device][name]))
                        continue
                    value = _given(name, given)
                    if isinstance(value, RunValue) and before is not None and value.run.key == before.key:
                        refs.append(("before", value.index))
                    elif isinstance(value, RunValue):
                        refs.append(("item", (slot(value.run), value.index)))
                    elif isinstance(value, TileRead) and len(steps) > 1:  # read as its step starts
                        refs.append(("read", (replace(value, source=None), slot(value.source))))
                    elif isinstance(value, TileRead):
                        reads.append(value)
                        refs.append(None)
                    elif isinstance(value, (np.ndarray, dict)) or name.kind not in ("state", "data", "buffer"):
                        refs.append(("lit", value))
                    else:
                        refs.append(("in", slot(value)))
                all_refs.append(refs)
            if reads:  # one task reads the device's tiles of the step, ahead of the program
                read_key = f"dev{device}-read-it{first_tag}"
                dsk[read_key] = (read_tiles, tuple(replace(r, source=None) for r in reads),
                                 device in self.gpu_devices, *[r.source for r in reads])
                device_of[read_key] = device
                read_keys.append(read_key)
                at = slot(read_key)
                it = iter(range(len(reads)))
                all_refs = [[("item", (at, next(it))) if r is None else r for r in refs] for refs in all_refs]
            inputs_of[device] = list(inputs)
            if before is not None:  # sent once the inputs of the program before are there: after it
                for value in before_inputs:
                    slot(value)
            key = program_key[device]
            args = tuple(StepArgs(key, tag, address, tuple(refs), self.profiling,
                                  before.key if before is not None else None)
                         for (_, tag, _, _), refs in zip(steps, all_refs))
            if before is not None:
                kept_of[device] = before
            dsk[key] = (run_program, placed[device], args, *inputs)
            device_of[key] = device
        # (a window's values other than its state are read out of its result: no task takes them out)
        outputs, exports = self._outputs(plan, programs, program_key, first_tag, dsk, device_of,
                                         held_only=len(steps) > 1)
        wanted = list(dict.fromkeys([*program_key.values(), *exports, *read_keys]))
        restriction = {key: {self.machine.tag(d): 1} for key, d in device_of.items()}
        # A worker runs the tasks it holds by priority: reads first, then programs in the order their
        # steps were sent (Dask's own order ranks graphs sent within 60 ms of each other by their insides)
        sent = -next(SENT)
        priority = {key: READ_PRIORITY if key in read_keys else sent for key in dsk}
        submitted = time.perf_counter()
        with dask.annotate(resources=lambda key: restriction[key], priority=lambda key: priority[key]):
            futures = self.client.get(_named_graph(dsk, first_tag + window), wanted, sync=False)
        by_key = dict(zip(wanted, futures))
        # The programs before are held here till these have run (a step's run may be dropped before:
        # a recovery's replayed steps that no one waits for), or the worker would let their results go.
        self._held = [(when, after, before) for when, after, before in self._held if after.status == "pending"]
        self._held += [(-sent, by_key[program_key[d]], before) for d, before in kept_of.items()]
        for device, key in program_key.items():  # what the device's next program reads, and waits for
            self._last[device] = (by_key[key], address[device],
                                  [by_key[v] if isinstance(v, str) else v for v in inputs_of[device]])
        out = map_outputs(outputs, lambda v: RunValue(None, by_key[v.run], v.index) if isinstance(v, RunValue)
                          else by_key[v])
        done = [by_key[k] for k in program_key.values()]
        profiled = {"graph": dsk, "device": dict(device_of)} if self.profiling else None
        runs, shared, reads = [], None, {}
        each = next((name for name in PER_STEP if name in plan.outputs), None)
        if len(steps) == 1:  # what the client waits for on each device
            for i, value in enumerate(out.get("loss", [])):
                reads.setdefault(device_of[value.run.key], []).append((value.run.key, value.index, None, i))
        elif each is not None:  # every step's values read at once, as the first is waited for
            places = [window_values(plan, programs, k, each) for k in range(len(steps))]
            shared = {"reads": reads, "count": 0, "name": each}
            for device, index in (place for step_places in places for place in step_places):
                reads.setdefault(device, []).append((program_key[device], index, None, shared["count"]))
                shared["count"] += 1
        for device, key in program_key.items():
            reads.setdefault(device, [(key, None, None, None)])
            # each step's memory, measured by the program (`run_program`), read with the losses
            first = len(programs[device].outputs) + (len(steps) > 1) * len(steps) * sum(
                o.output in PER_STEP for o in programs[device].outputs)
            reads[device] += [(key, first + k, None, (MEMORY, k, device)) for k in range(len(steps))]
        for k, (step, tag, data, _) in enumerate(steps):
            last = k == len(steps) - 1
            if len(steps) == 1:
                outputs_k = {**out, "done": done}
            else:  # each step's losses (logits) come after the last step's outputs in its program's result
                outputs_k = {**(out if last else {name: {} for name in out}), "done": done}
                if each is not None:
                    outputs_k[each] = [RunValue(None, by_key[program_key[d]], i) for d, i in places[k]]
            keys = ({value_key(t.dep, tag) for t in plan.transfers()} | set(dsk) | {
                f.key for f in data.values() if not isinstance(f, (np.ndarray, TileRead))})
            run = StepRun(step, tag, plan, outputs_k, keys, submitted, reads=reads if shared is None else None,
                          profiled=profiled, window=len(steps), position=k, shared=shared, sent=-sent)
            run.address = address
            runs.append(run)
        return runs

    @staticmethod
    def _outputs(plan, programs, program_key, tag, dsk, device_of, held_only=False) -> tuple[dict, list]:
        """The step's outputs: values the client keeps in their program's result (RunValues of its
        key), and the others (gradients, logits) each taken out of it by a task of its own (none
        with `held_only`: those left out)."""
        where = output_places(programs)
        exports = []

        def named(name, key):
            device, index = where[key]
            if name in HELD:
                return RunValue(None, program_key[device], index)
            export = step_key(key, tag)
            dsk[export], device_of[export] = (getitem, program_key[device], index), device
            exports.append(export)
            return export

        outputs = {name: {k: named(name, key) for k, key in value.items()} if isinstance(value, dict)
                   else [named(name, key) for key in value] for name, value in plan.outputs.items()
                   if name in HELD or not held_only}
        return outputs, exports

    def finished(self, run: StepRun) -> None:
        """`run`'s programs have ended on every device, and so have those sent before them (each
        device runs its programs in the order sent, each reading the one before): the programs
        held for them are let go."""
        if run.sent is not None:
            self._held = [held for held in self._held if held[0] > run.sent]

    def read_when_done(self, run: StepRun, timeout: float):
        """As `Executor.read_when_done`; a window's steps are read all at once, as its first is
        waited for (one question to each worker rather than one per step)."""
        if run.shared is None:
            values = self._read_when_done(run.reads, run.address, timeout)
            if values is None or values is TIMED_OUT:
                return values
            run.memory = measured_memory(values, 0)
            return [values[i] for i in range(len(run.outputs["loss"]))]
        if "values" not in run.shared:
            values = self._read_when_done(run.shared["reads"], run.address, timeout)
            if values is None or values is TIMED_OUT:
                return values
            run.shared["values"] = values
        values, count = run.shared["values"], len(run.outputs[run.shared["name"]])
        run.memory = measured_memory(values, run.position)
        return [values[i] for i in range(run.position * count, (run.position + 1) * count)]

    def abort(self, runs, reason: str) -> None:
        """Give up the steps `runs` (StepRuns): their programs still waiting for values fail."""
        tags = [run.tag for run in runs]
        if not tags:
            return
        self._last = {}
        try:
            addresses = list(self.machine.live_devices().values())
        except Exception:  # noqa: BLE001  (no scheduler to ask: no program to abort either)
            return
        self.client.sync(abort_on, self.client, addresses, tags, reason)

def measured_memory(values: dict, k: int) -> dict:
    """{device: (bytes, GPU allocator bytes or None)} of step `k` of a window, from what was read."""
    return {key[2]: tuple(value) for key, value in values.items() if type(key) is tuple and key[:2] == (MEMORY, k)}


def _given(name, given: dict):
    """The value a step is given for program input `name` (a Dep of kind state, buffer, data or hyper)."""
    if name.kind == "state":
        return given["state"][name.key]
    if name.kind == "buffer":
        return given["buffers"][name.key]
    if name.kind == "data":
        return given["data"][name.key]
    return dict(given["hyper"])


def carried_state(plan: Plan, programs: dict) -> dict | None:
    """{device: {state or buffer input of its program: the output of the same program that is its
    next value}}, for a program that runs several steps (`submit_window`): state a step updates
    (training) is carried from step to step, state it only reads (predicting) is the same for all;
    None where a device reads state another device computes, or the step has outputs other than
    state, buffers, losses and logits."""
    cache_key = ("carried", id(programs))  # `programs` is kept in plan.derived too: its id stays its own
    if cache_key not in plan.derived:  # asked before every window (`windowable`)
        plan.derived[cache_key] = _carried_state(plan, programs)
    return plan.derived[cache_key]


def _carried_state(plan: Plan, programs: dict) -> dict | None:
    if set(plan.outputs) - set(HELD) - set(PER_STEP):
        return None
    where = output_places(programs)
    carried = {}
    for device, program in programs.items():
        for name in program.inputs:
            if name.kind not in ("state", "buffer"):
                continue
            updated = plan.outputs.get("state" if name.kind == "state" else "buffers")
            if updated is None:  # read, not updated: every step reads the value given
                continue
            source = updated.get(name.key)
            if source is None or where[source][0] != device:
                return None
            carried.setdefault(device, {})[name] = where[source][1]
    return carried


def output_places(programs: dict) -> dict:
    """{plan task key of a program output: (device, its index in the program's result)}."""
    return {output.key: (device, index) for device, program in programs.items()
            for index, output in enumerate(program.outputs)}


def window_values(plan: Plan, programs: dict, k: int, name: str = "loss") -> list[tuple[int, int]]:
    """Where step `k` of a window's values of output `name` ("loss" or "logits") lie: (device, index in
    its program's result), in the plan's order (`run_program`: each step's after the last step's
    outputs)."""
    at = {}
    for device, program in programs.items():
        mine = [o.key for o in program.outputs if o.output in PER_STEP]
        for j, key in enumerate(mine):
            at[key] = (device, len(program.outputs) + k * len(mine) + j)
    return [at[key] for key in plan.outputs.get(name, [])]


def auto_steps_per_program(step_s: float) -> int:
    """The steps `fit` runs to a program ("auto") where a step takes `step_s` seconds: as many as
    take about WINDOW_S, at most MAX_WINDOW, one for steps longer than that (a program per step
    costs them little: the next is already on its worker as the one before ends)."""
    return max(1, min(int(WINDOW_S / max(step_s, 1e-6)), MAX_WINDOW))


def windowable(plan: Plan, gpu_devices=frozenset(), cuda_graphs: bool = True) -> bool:
    """Whether `plan`'s steps can run several per program (`ProgramExecutor.submit_window`)."""
    return carried_state(plan, device_programs(plan, gpu_devices, cuda_graphs)) is not None


def make_executor(machine, executor: str = "programs", fused: bool = True, cuda_graphs: bool = True) -> Executor:
    """The executor named `executor`: "programs" (one Dask task per device and step,
    `ProgramExecutor`) or "tasks" (a Dask task per plan task, or per fused run: `Executor`)."""
    if executor == "programs":
        if not fused:
            raise ValueError("fused=False needs executor='tasks' (a program runs a device's whole step as one "
                             "Dask task): pass executor='tasks', or leave executor out")
        return ProgramExecutor(machine, cuda_graphs)
    if executor == "tasks":
        return Executor(machine, fused, cuda_graphs)
    raise ValueError(f"executor must be 'programs' or 'tasks', got {executor!r}")

