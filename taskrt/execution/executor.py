"""The thin Dask layer: a Plan plus the step number -> a task graph on the cluster.

Every task is pinned to its device by the device's resource tag.  Keys are
('<layer>-<phase>-it<step>', part...), which the dashboard groups as '<layer>-<phase>'.
Parameter state enters the graph as the previous step returned it (futures, or values kept in the
runs that computed them: `taskrt.planning.fusion.RunValue`), data as the
futures of tiles scattered straight to their devices, or, where a device's tiles are small,
as tasks in the graph that hold them (`INLINE_DATA_BYTES`), so nothing returns to the client
between steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from operator import getitem

import dask
import numpy as np

from taskrt.data.reading import TileRead, read_tile, tile_on_device
from taskrt.gpu.device import to_device, to_host
from taskrt.machines.devices import MachineError, resource_tag
from taskrt.machines.worker_setup import INLINE
from taskrt.planning.fusion import (
    RunValue,
    export_source,
    fuse,
    held_outputs,
    run_of,
    state_read_as_keys,
    step_done_keys,
)
from taskrt.planning.inprocess import data_tiles
from taskrt.planning.plan import BUFFER, DATA, HYPER, STATE, TASK, Plan, keys_of, map_outputs, output_keys
from taskrt.planning.tasks import Received
from taskrt.transport.worker_reads import TIMED_OUT, ask, reads_of

ANSWER_GRACE_S = 1.0  # how much longer than its own wait a worker may take to answer a read
# A device's data tiles ride in the step's graph when they total at most this many bytes.  A
# scatter costs two round trips (to the worker, then telling the scheduler): on Machine.local(1) a
# graph carrying up to about 2 MiB reached its worker sooner than a scatter followed by its graph,
# and a LeNet-5 step (256 KiB of data) took 24 ms instead of 27.  Above it, tiles go straight to
# their workers, so the scheduler never relays a large batch.
INLINE_DATA_BYTES = 2**20


def data_bytes_by_device(plan: Plan) -> Counter:
    """Bytes of the step's data tiles each device receives."""
    total = Counter()
    for layer, parts in plan.data.items():
        for part in parts:
            total[part.device] += plan.data_nbytes[(layer, part.index)]
    return total


def inline_data_devices(plan: Plan) -> frozenset:
    """The devices whose data tiles the step's graph carries (the rest are scattered)."""
    return frozenset(d for d, nbytes in data_bytes_by_device(plan).items() if nbytes <= INLINE_DATA_BYTES)


def gpu_devices(machine) -> frozenset:
    """The machine's GPU devices: their steps convert data on arrival and bring outputs back to host."""
    return frozenset(d.id for d in machine.devices if d.kind.startswith("gpu:"))


def step_key(key: tuple, step) -> tuple:
    """('conv1-fwd', 0) at step '7-ab12' -> ('conv1-fwd-it7-ab12', 0), shown as 'conv1-fwd'."""
    return (f"{key[0]}-it{step}", *key[1:])


@dataclass
class StepRun:
    """A submitted step: its output futures and what is needed to account for it."""

    step: int | str
    tag: str  # the step's part of every key
    plan: Plan
    outputs: dict  # output name -> list of futures, or dict of futures or values kept in their runs (RunValue)
    keys: set  # every key of the step (task keys and scattered data), to find its transfers
    submitted: float
    finished: float | None = None
    reads: dict | None = None  # what the client waits for on each device (taskrt.transport.worker_reads.reads_of)
    address: dict | None = None  # the devices' worker addresses when the step was sent
    profiled: dict | None = None  # a profiled step's graph and each key's device (`Executor.profiling`)
    window: int = 1  # steps run by the same programs (`ProgramExecutor.submit_window`)
    position: int = 0  # this step's place among them; only the last one's outputs hold the new state
    shared: dict | None = None  # a window's: what the client reads of all its steps at once, once read
    sent: int | None = None  # its programs' place in the order programs were sent (ProgramExecutor)
    # {device: (bytes its values held at most, the GPU allocator's peak or None)}, measured by its
    # program (ProgramExecutor, read with the losses); None where not measured
    memory: dict | None = None

    def futures(self) -> list:
        return futures_of(output_keys(self.outputs))


def futures_of(values) -> list:
    """What holds each value (`taskrt.planning.fusion.run_of`: its future or key, or its run's), once each."""
    return list(dict.fromkeys(map(run_of, values)))


class Executor:
    def __init__(self, machine, fused: bool = True, cuda_graphs: bool = True):
        """`cuda_graphs`: GPU devices replay each fused run as a CUDA graph after warm-up
        (`taskrt.gpu.cuda_graphs`); needs `fused`."""
        if machine.client is None:
            raise MachineError(f"{machine!r} has no cluster to run on (simulated machines only plan and simulate)")
        self.machine = machine
        self.fused = fused
        self.cuda_graphs = cuda_graphs
        self.client = machine.client
        self.profiling = False  # steps submitted time each task on its worker (taskrt.observing.task_timing)

    def scatter(self, plan: Plan, arrays: dict, address: dict | None = None) -> dict:
        """Send each input tile straight to its device; returns {(layer, part): future}, or the
        tile itself where the step's graph carries it (`inline_data_devices`).
        `address`: the devices' worker addresses, if the caller just asked for them."""
        inline = inline_data_devices(plan)
        futures, by_device = {}, {}
        for name, tile in data_tiles(plan, arrays).items():
            device = plan.data[name[0]][name[1]].device
            if device in inline:
                futures[name] = tile
            else:
                by_device.setdefault(device, []).append((name, tile))
        if not by_device:
            return futures
        address = address or self.machine.addresses()
        devices = list(by_device)

        async def to_every_device():  # at once: one round trip for all devices, not one per device
            return await asyncio.gather(*[
                self.client._scatter([tile for _, tile in by_device[d]], workers=[address[d]], hash=False, direct=True)
                for d in devices])

        for device, scattered in zip(devices, self.client.sync(to_every_device)):
            for (name, _), future in zip(by_device[device], scattered):
                futures[name] = future
        return futures

    def submit(self, plan: Plan, step, tag: str, state: dict, data: dict, hyper: dict | None = None,
               buffers: dict | None = None, address: dict | None = None) -> StepRun:
        """Submit `plan` as step `step`; `tag` (unique on the cluster) goes into every key.
        `buffers`: the batch norms' running statistics, {(layer, group): future}.  `address`: the
        devices' worker addresses, if the caller just asked for them (unused here)."""
        dsk, restriction, outputs = step_graph(plan, tag, state, data, hyper, self.gpu_devices, buffers,
                                               self.machine.tag, self.fused, self.cuda_graphs)
        if self.profiling:  # checked once per step: normal steps' graphs are left as they are
            dsk = self._profiled(dsk)
        wanted = futures_of(output_keys(outputs))
        submitted = time.perf_counter()
        # Ready tasks of a device run in graph order (Dask runs the higher priority first), as the
        # simulator assumes: values another device waits for first (taskrt.planning.fusion)
        priority = {key: -i for i, key in enumerate(dsk)}
        # a fused run's exports take microseconds: the worker runs them where they arrive (worker_setup)
        exports = {key for key in dsk if export_source(dsk, key)[1] is not None}
        with dask.annotate(resources=lambda key: restriction[key], priority=lambda key: priority[key],
                           executor=lambda key: INLINE if key in exports else "default"):
            futures = self.client.get(_named_graph(dsk, tag), wanted, sync=False)
        by_key = dict(zip(wanted, futures))

        def held(key):  # the client's future of an output, or of the run that keeps it
            return RunValue(None, by_key[key.run], key.index) if isinstance(key, RunValue) else by_key[key]

        out = map_outputs(outputs, held)
        keys = set(dsk) | {f.key for f in data.values() if not isinstance(f, (np.ndarray, TileRead))}
        device_by_tag = {self.machine.tag(d.id): d.id for d in self.machine.devices}

        def device_of(key):
            return device_by_tag[next(iter(restriction[key]))]

        profiled = {"graph": dsk, "device": {key: device_of(key) for key in dsk}} if self.profiling else None
        return StepRun(step, tag, plan, out, keys, submitted, reads=reads_of(dsk, device_of, outputs),
                       profiled=profiled)

    @staticmethod
    def _profiled(dsk: dict) -> dict:
        """A step's graph whose tasks time themselves where they run (taskrt.observing.task_timing)."""
        from taskrt.observing.task_timing import profiled_graph

        return profiled_graph(dsk)

    def finished(self, run: StepRun) -> None:
        """`run` has ended: what is kept only until then can go (nothing here; see ProgramExecutor)."""

    def read_when_done(self, run: StepRun, timeout: float):
        """The step's loss values (in the order of its "loss" futures) read on its workers as soon as
        its runs end (taskrt.transport.worker_reads); TIMED_OUT if they had not ended within `timeout`; or
        None where the usual wait must tell what happened: a task failed, a worker was lost."""
        values = self._read_when_done(run.reads, run.address, timeout)
        if values is None or values is TIMED_OUT:
            return values
        return [values[i] for i in range(len(run.outputs["loss"]))]

    def _read_when_done(self, reads: dict, address: dict, timeout: float):
        """`read_when_done` of `reads` ({device: [(run, index, key, name)]}): {name: its value} (a
        loss's name is its place among the step's losses), TIMED_OUT or None."""
        if not reads or address is None or any(d not in address for d in reads):
            return None

        async def ask_every_device():
            # At once, the devices' answers coming as their runs end; the first that fails ends the
            # wait (a lost worker: the others would wait out their time for values it never sends)
            asks = [asyncio.ensure_future(ask(self.client, address[d], items, timeout))
                    for d, items in reads.items()]
            pending, deadline = set(asks), time.monotonic() + timeout + ANSWER_GRACE_S
            while pending:
                done, pending = await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done or any(t.exception() is not None or t.result() is None for t in done):
                    for t in pending:  # a failure, or a worker that does not answer at all
                        t.cancel()
                    return None
            return [t.result() for t in asks]

        try:
            answers = self.client.sync(ask_every_device)
        except Exception:  # noqa: BLE001  (the usual wait finds out and reports it)
            return None
        if answers is None:
            return None
        if TIMED_OUT in answers:
            return TIMED_OUT
        values = {}
        for items, answer in zip(reads.values(), answers):
            values.update(zip([loss for *_, loss in items if loss is not None], answer))
        return values

    @property
    def gpu_devices(self) -> frozenset:
        return gpu_devices(self.machine)

    def abort(self, runs, reason: str) -> None:
        """Give up the steps `runs` (their tasks are cancelled by the caller: nothing else to do here)."""

    def cut_lineage(self, values: dict, tag: str) -> dict:
        """The same values under fresh keys that have no dependencies: {name: future}.

        A worker keeps the task state of every released dependency of a value it holds, so
        state that depends on last step's update, which depends on the step before, ... would
        keep the whole training history alive.  Re-registering each value under a new key,
        the way `scatter` registers data, cuts that chain; nothing moves.  `values`: {name:
        future, or RunValue of a value kept in its run (taken out of the run where it lies)}.
        """
        from distributed import Future

        by_worker: dict[str, list] = {}
        fresh = {}
        who_has = self.client.who_has(futures_of(values.values()))
        for name, value in values.items():
            layer, *index = name
            new_key = (f"{layer}-state-it{tag}", *index)
            future, item = (value.run, value.index) if isinstance(value, RunValue) else (value, None)
            [address] = who_has[future.key][:1]
            by_worker.setdefault(address, []).append((future.key, item, new_key))
            fresh[name] = new_key
        # Futures first, then registration, then marking them finished: the order `scatter`
        # uses, so the scheduler's "in memory" report cannot arrive before the futures exist.
        futures_out = {name: Future(key, self.client) for name, key in fresh.items()}
        nbytes = {}
        for sizes in self.client.run(_rekey, by_worker, workers=list(by_worker)).values():  # one round trip
            nbytes.update(sizes)
        self.client.sync(self.client.scheduler.update_data,
                         who_has={new: [address] for address, renames in by_worker.items() for _, _, new in renames},
                         nbytes=nbytes, client=self.client.id)
        for key in fresh.values():
            self.client.futures[key].finish(type=tuple)
        return futures_out

    def host_futures(self, values: list, devices: list) -> list:
        """Futures of state values as numpy arrays, for the client to gather.  `values`: futures,
        or RunValues of values kept in their runs; `devices`: where each lies.  A value kept in a
        run is taken out of it, and one on a GPU brought to host memory, by a task on its device."""
        out = []
        for value, device in zip(values, devices):
            where = {self.machine.tag(device): 1}
            if isinstance(value, RunValue):
                value = self.client.submit(_take, value.run, value.index, resources=where, pure=False)
            elif device in self.gpu_devices:
                value = self.client.submit(to_host, value, resources=where, pure=False)
            out.append(value)
        return out

    def measured_bytes(self, keys: set) -> dict[tuple[int, int], int]:
        """Bytes the workers' transfer logs record for `keys`, per (source, destination) device."""
        device_of = {address: device for device, address in self.machine.addresses().items()}
        logs = self.client.run(_incoming_transfers, sorted(map(str, keys)))
        counts = Counter()
        for receiver, entries in logs.items():
            for sender, nbytes in entries:
                counts[(device_of[sender], device_of[receiver])] += nbytes
        return dict(counts)


def _named_graph(dsk: dict, tag: str):
    """The graph as Dask's low-level graph expression, named by the step's tag: without a name Dask
    derives one by hashing every task's callable and arguments, a third of a second per step on a
    slow machine for nothing, since every key already carries the step's unique tag."""
    try:
        from dask._expr import LLGExpr  # dask >= 2025.1; older versions take the dict as it is
    except ImportError:
        return dsk
    return LLGExpr(dsk, _determ_token=f"taskrt-step-{tag}")


def step_graph(plan: Plan, tag: str, state: dict, data: dict, hyper: dict | None, gpu_devices=frozenset(),
               buffers: dict | None = None, device_tag=resource_tag, fused: bool = True, cuda_graphs: bool = False):
    """The Dask graph of one step (plain data): (graph, resource restriction per key, output keys).

    On GPU devices two adapters join the plan's tasks: each data tile is converted to a device
    array once, by a task beside it ('<layer>-todevice'), and every output the client reads (a loss
    part's sum, logits, gradient sums) is brought back to host memory there ('<layer>-host'),
    so nothing but the step's data crosses between host and device inside a step.

    `data`: {(input layer, part): the future of its scattered tile, the tile itself, which a
    task on its device then gives ('<layer>-data'), or a `TileRead`, which a task on its device
    reads from a dataset ('<layer>-read'; on a GPU device `tile_on_device`)}.  Like the
    '-data' tasks, reads are not fused into the device's runs: the next step's run as soon as
    it is submitted.
    `state`, `buffers`: {name: the future of a value, or a `RunValue` of a value kept in the run
    that computed it}.  A task on the run's device reads a kept value out of the run, fused, or
    out of a getitem there ('<layer>-state', '<layer>-running'); a task elsewhere reads the getitem.
    Fused, the step's new state, statistics and losses stay in their runs where nothing else in
    the step reads those runs (`taskrt.planning.fusion.held_outputs`): the outputs name them as RunValues;
    the state the next step reads as keys (`taskrt.planning.fusion.state_read_as_keys`) is named instead.
    `device_tag(device)`: the resource tag that pins a task to its device (Machine.tag).
    `fused`: each run of tasks a device can do without waiting for another becomes one Dask task
    (taskrt.planning.fusion); the keys the client and other devices read stay as they are.
    `cuda_graphs`: each fused run of a GPU device is named the same at every step of `plan`, so that
    its worker replays it as a CUDA graph (`taskrt.gpu.cuda_graphs`)."""
    dsk, device_of, given = {}, {}, set()  # given: tasks standing for the plan's data and state
    reads = set()  # given tasks that read a dataset: never fused

    def add(key, value, device):
        dsk[key] = value
        device_of[key] = device
        return key

    def state_value(value, dep, kind, device):
        if not isinstance(value, RunValue):
            return value
        layer, *index = dep.key
        export, home = step_key((f"{layer}-{kind}", *index), tag), plan.device_of(dep)
        if fused and device == home:
            return RunValue(export, value.run, value.index)
        if export not in dsk:
            given.add(add(export, (getitem, value.run, value.index), home))
        return export

    def resolve(dep, device):
        if dep.kind == TASK:
            return step_key(dep.key, tag)
        if dep.kind == STATE:
            return state_value(state[dep.key], dep, "state", device)
        if dep.kind == BUFFER:
            return state_value(buffers[dep.key], dep, "running", device)
        if dep.kind == DATA:
            home, tile = plan.device_of(dep), data[dep.key]
            layer, part = dep.key
            if isinstance(tile, TileRead):  # read on its device from a dataset (taskrt.data.reading)
                key = step_key((f"{layer}-read", part), tag)
                if key not in dsk:
                    given.add(add(key, (tile_on_device if home in gpu_devices else read_tile, *tile.args), home))
                    reads.add(key)
                return key
            if isinstance(tile, np.ndarray):  # carried by the graph: a task on its device gives it
                key = step_key((f"{layer}-data", part), tag)
            elif home not in gpu_devices:
                return tile
            else:
                key = step_key((f"{layer}-todevice", part), tag)
            if key not in dsk:
                given.add(add(key, (to_device, tile), home))
            return key
        if dep.kind == HYPER:
            return dict(hyper)
        raise AssertionError(dep)

    for task in plan.tasks:
        spec = Received(task.spec) if any(_through_messages(plan, d, task.device) for d in task.deps) else task.spec
        add(step_key(task.key, tag), (spec, *[resolve(d, task.device) for d in task.deps]), task.device)
    outputs = {}
    for name, value in plan.outputs.items():
        adapted = []
        for key in keys_of(value):
            device = plan.by_key[key].device
            if device in gpu_devices and name not in ("state", "buffers"):  # state stays on its device
                to_client = loss_sum if name == "loss" else to_host
                layer = key[0].rsplit("-", 1)[0]
                adapted.append(add(step_key((f"{layer}-host", *key[1:]), tag),
                                   (to_client, step_key(key, tag)), device))
            else:
                adapted.append(step_key(key, tag))
        outputs[name] = dict(zip(value, adapted)) if isinstance(value, dict) else adapted
    if fused:
        wanted = set(output_keys(outputs))
        named = {step_key(key, tag) for key in state_read_as_keys(plan)}
        program = None
        if cuda_graphs and gpu_devices:
            uid = plan.derived.setdefault("uid", uuid.uuid4().hex[:12])

            def program(device, index):
                return f"{plan.mode}-{uid}/dev{device}/{index}" if device in gpu_devices else None

        dsk, device_of, kept = fuse(dsk, device_of, wanted, lambda device, stage: (f"dev{device}-fused-it{tag}", stage),
                                    held_outputs(outputs) - named, frozenset(given), frozenset(reads), program)

        outputs = map_outputs(outputs, lambda key: RunValue(None, *kept[key]) if key in kept else key)
    outputs["done"] = step_done_keys(outputs, lambda key: export_source(dsk, key)[0])
    restriction = {key: {device_tag(device): 1} for key, device in device_of.items()}
    return dsk, restriction, outputs


@dataclass(frozen=True)
class StandIn:
    """In place of a future, where a step's graph is built only to time it (`graph_seconds`)."""

    key: tuple


@dataclass(frozen=True)
class GraphTimes:
    """Seconds to build a step's graph, to serialize it and to read it back (`graph_seconds`)."""

    build_s: float
    dumps_s: float
    loads_s: float
    devices: int  # devices with tasks in the graph

    @property
    def client_s(self) -> float:
        """This process's work on a step before its graph leaves: building and serializing it."""
        return self.build_s + self.dumps_s

    @property
    def transit_s(self) -> float:
        """On the graph's way to its first task: the scheduler reads it, then writes each task for
        its worker, which reads it (a device's share of the graph)."""
        return self.loads_s + (self.dumps_s + self.loads_s) / max(self.devices, 1)


def graph_seconds(plan: Plan, gpu_devices=frozenset(), device_tag=resource_tag, fused: bool = True,
                  repeats: int = 2) -> GraphTimes:
    """A step of `plan`'s graph built (`step_graph`), serialized as the client does and read back,
    timed: the state and scattered data stand-ins for their futures, the carried data tiles of
    their real size (each the fastest of `repeats` after one untimed round)."""
    from distributed.protocol import pickle

    inline = inline_data_devices(plan)
    data = {}
    for layer, parts in plan.data.items():
        for part in parts:
            key = (layer, part.index)
            data[key] = (np.zeros(plan.data_nbytes[key], dtype=np.uint8) if part.device in inline
                         else StandIn(("data", *key)))
    state = {d.key: StandIn(("state", *d.key)) for t in plan.tasks for d in t.deps if d.kind == STATE}
    buffers = {d.key: StandIn(("running", *d.key)) for t in plan.tasks for d in t.deps if d.kind == BUFFER}
    hyper = {"lr": 0.0, "momentum": 0.0, "weight_decay": 0.0}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dsk, restriction, _ = step_graph(plan, "timing", state, data, hyper, gpu_devices, buffers, device_tag, fused)
        built = time.perf_counter()
        blob = pickle.dumps(dsk)
        dumped = time.perf_counter()
        pickle.loads(blob)
        times.append((built - start, dumped - built, time.perf_counter() - dumped))
    build, dumps, loads = (min(t[i] for t in times[1:]) for i in range(3))
    devices = len({next(iter(r)) for r in restriction.values()})
    return GraphTimes(build, dumps, loads, devices)


def _through_messages(plan: Plan, dep, device: int) -> bool:
    """Whether a task on `device` gets `dep`'s value out of a Dask message (not from its own
    device's earlier task)."""
    if dep.kind == TASK:
        return plan.by_key[dep.key].device != device
    return dep.kind in (DATA, STATE, BUFFER)


def loss_sum(value):
    """The summed per-sample losses of a loss part (its value is (d logits, None, losses)), left where
    it is: reading it to the host would wait for the GPU inside the step (the client reads it with
    `taskrt.gpu.device.to_host_async`)."""
    return value[-1].sum()


def _rekey(by_worker, dask_worker=None):
    data = {new: dask_worker.data[old] if item is None else dask_worker.data[old][item]
            for old, item, new in by_worker[dask_worker.address]}
    return dask_worker.update_data(data=data)["nbytes"]


def _take(run: tuple, index: int):
    """Value `index` of a fused run's result, in host memory."""
    return to_host(run[index])


def _incoming_transfers(keys, dask_worker=None):
    wanted = set(keys)
    out = []
    for entry in dask_worker.transfer_incoming_log:
        for key, nbytes in entry["keys"].items():
            if str(key) in wanted:
                out.append((entry["who"], nbytes))
    return out
