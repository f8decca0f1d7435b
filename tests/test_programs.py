"""A step as one program per device (taskrt.planning.programs): built from the plan alone, every program
together computes what the plan computes, sending exactly the plan's messages, and no program
waits for a value whose sender waits in turn; on a cluster (taskrt.execution.program_executor) a step is at
most two Dask tasks per device, and a step given up or a peer gone never leaves a program waiting."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.planning.inprocess import buffer_tiles, data_tiles, run_plan, shard_states
from taskrt.planning.lowering import lower
from taskrt.planning.params import init_buffers, init_parameters
from taskrt.planning.plan import BUFFER, DATA, HYPER, STATE, TASK, Dep
from taskrt.planning.programs import Compute, Recv, Send, device_programs, value_key
from taskrt.training.trainer import Trainer
from tests.graphs import assert_same_parameters, mixed_lenet_strategy, small_lenet
from tests.strategies import random_strategies
from tests.test_equivalence import GRAPHS, batch_for

HYPER_VALUES = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}


def given_values(graph, plan, seed=0):
    """A step's state, data and running statistics, keyed as the plan's dependencies name them."""
    params = init_parameters(graph, 0, np.dtype("float64"))
    velocity = {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
    x, y = batch_for(graph, seed)
    arrays = {l.name: (x if l.op.dtype != "int64" else y) for l in graph.inputs}
    buffers = buffer_tiles(plan, init_buffers(graph, np.dtype("float64")))
    return shard_states(plan, params, velocity), data_tiles(plan, arrays), buffers


def run_in_process(plan, programs, state, data, buffers):
    """Every device's program, interleaved in this process: each runs until it waits for a value
    not sent yet; messages go into one mailbox.  Returns (each program's values at its end,
    messages sent as (source, destination, value name, bytes)).  Fails if every program waits (a deadlock)."""
    given = {STATE: state, DATA: data, BUFFER: buffers}
    boxes, sent = {}, []
    envs, at = {}, {}
    for device, program in programs.items():
        env = {}
        for name in program.inputs:
            env[name] = dict(HYPER_VALUES) if name.kind == HYPER else given[name.kind][name.key]
        envs[device], at[device] = env, 0
    running = deque(programs)
    idle = 0
    while running:
        device = running.popleft()
        program, env = programs[device], envs[device]
        progressed = False
        while at[device] < len(program.code):
            instruction = program.code[at[device]]
            if isinstance(instruction, Recv):
                key = (device, instruction.name)
                if key not in boxes:
                    break
                env[instruction.name] = boxes.pop(key)
            elif isinstance(instruction, Send):
                value = env[instruction.name]
                boxes[(instruction.dst, instruction.name)] = value
                sent.append((device, instruction.dst, instruction.name, value.nbytes))
            else:
                out = instruction.run(*[env[n] for n in instruction.inputs])
                env.update(zip(instruction.outputs, out))
            for name in program.drops[at[device]]:
                del env[name]
            at[device] += 1
            progressed = True
        if at[device] < len(program.code):
            running.append(device)
        idle = 0 if progressed else idle + 1
        assert idle <= len(running), f"deadlock: every program waits ({dict(at)})"
    assert not boxes, f"values sent and never taken: {list(boxes)}"
    return envs, sent


def check_programs(graph, strategy):
    plan = lower(graph, strategy.validated(graph), "train", 8)  # float64, as given_values
    programs = device_programs(plan)
    # every task once, on its device
    ran = Counter(key for p in programs.values() for c in p.code if isinstance(c, Compute) for key, _, _ in c.run.steps)
    assert ran == Counter(t.key for t in plan.tasks)
    for device, program in programs.items():
        for c in program.code:
            if isinstance(c, Compute):
                assert {plan.by_key[key].device for key, _, _ in c.run.steps} == {device}
    state, data, buffers = given_values(graph, plan)
    envs, sent = run_in_process(plan, programs, state, data, buffers)
    # exactly the plan's messages, bytes per device pair included
    assert Counter((s, d, n) for s, d, n, _ in sent) == Counter((t.src, t.dst, t.dep) for t in plan.transfers())
    by_pair = Counter()
    for s, d, _, nbytes in sent:
        by_pair[(s, d)] += nbytes
    assert dict(by_pair) == plan.bytes_by_pair()
    # the values the plan computes, and each program ends holding just its outputs
    expected = run_plan(plan, state=state, data=data, hyper=HYPER_VALUES, buffers=buffers)
    for device, program in programs.items():
        assert set(envs[device]) == {o.name for o in program.outputs}
        for output in program.outputs:
            a, b = envs[device][output.name], expected[output.key]
            for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                if u is not None:
                    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_programs_compute_the_plan_with_its_messages_and_never_deadlock(name, data):
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=4))
    check_programs(graph, strategy)


def test_a_device_that_only_holds_data_has_a_program_that_sends_it():
    graph = small_lenet()
    strategy = Strategy({**dict(mixed_lenet_strategy(graph).items()), "image": P(n=2, w=2, devices=(3, 1, 0, 2))})
    check_programs(graph, strategy)
    program = device_programs(lower(graph, strategy.validated(graph), "train", 8))[3]
    assert all(isinstance(c, Send) for c in program.code) and program.peers


def test_sends_go_out_as_soon_as_their_value_is_computed():
    """A value another device reads is sent right after the task computing it, before the device's
    next task; a received value is waited for just before its first reader."""
    graph = small_lenet()
    plan = lower(graph, mixed_lenet_strategy(graph).validated(graph))
    for program in device_programs(plan).values():
        for i, c in enumerate(program.code):
            if isinstance(c, Send) and c.name.kind == TASK:
                before = next(p for p in reversed(program.code[:i]) if isinstance(p, Compute))
                assert before.run.steps[-1][0] == c.name.key
            if isinstance(c, Recv):
                after = next(p for p in program.code[i:] if isinstance(p, Compute))
                assert c.name in plan.by_key[after.run.steps[0][0]].deps


def test_value_keys_are_the_per_task_executor_keys():
    assert value_key(Dep(TASK, ("conv1-fwd", 0)), "7-ab") == ("conv1-fwd-it7-ab", 0)
    assert value_key(Dep(DATA, ("image", 2)), "7-ab") == ("image-data-it7-ab", 2)
    with pytest.raises(ValueError, match="never travels"):
        value_key(Dep(STATE, ("conv1", 0, 0)), "7-ab")


def test_gpu_programs_name_their_runs_the_same_at_every_step():
    """On a GPU device each Compute is a named run (replayed as a CUDA graph: taskrt.gpu.cuda_graphs),
    one name per Compute, kept from step to step; CPU devices' runs are not named."""
    graph = small_lenet()
    plan = lower(graph, mixed_lenet_strategy(graph).validated(graph))
    programs = device_programs(plan, frozenset({1}), program_names=True)
    names = [c.run.program for c in programs[1].code if isinstance(c, Compute)]
    assert all(names) and len(set(names)) == len(names)
    assert all(c.run.program is None for c in programs[0].code if isinstance(c, Compute))
    assert device_programs(plan, frozenset({1}), program_names=True) is programs  # built once per plan
    assert programs[1].gpu and not programs[0].gpu


# ---- on a cluster -------------------------------------------------------------------------------
def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape), rng.integers(0, 10, shape[0])) for _ in range(count)]


def test_a_step_is_one_dask_task_per_device_and_one_more_to_read(machine4):
    """Per step, the scheduler sees each device's program, and where the step reads a dataset
    one task per device reading its tiles; the programs' keys are named by device."""
    from dask.utils import key_split

    from taskrt.data.datasets import ArrayDataset

    graph = small_lenet()
    trainer = Trainer(graph, mixed_lenet_strategy(graph), machine4, lr=0.05)
    x, y = batches(graph, 1)[0]
    future = trainer.submit(x, y)
    programs = future.run.outputs["done"]
    future.result()
    assert sorted(key_split(f.key) for f in programs) == ["dev0-program", "dev1-program", "dev2-program"]
    rng = np.random.default_rng(1)
    dataset = ArrayDataset({"images": rng.standard_normal((8, 1, 16, 16)), "labels": rng.integers(0, 10, 8)})
    run = trainer.submit_from(dataset, np.arange(4))
    run.result()
    graph_keys = {k for k in run.run.keys if isinstance(k, str) and "-it" in k}
    per_device = Counter(key_split(k).split("-")[0] for k in graph_keys)
    assert set(per_device) == {"dev0", "dev1", "dev2"} and max(per_device.values()) <= 2


def _in_memory(keys, dask_scheduler=None) -> int:
    return sum(1 for key in keys if key in dask_scheduler.tasks and dask_scheduler.tasks[key].state == "memory")


def test_finished_steps_futures_kept_do_not_keep_their_parameters_on_the_workers(machine4):
    """A program's result holds its device's new parameters: a finished step's future keeps only
    its loss, so a caller holding many futures holds no more of them than the trainer needs."""
    graph = small_lenet()
    trainer = Trainer(graph, mixed_lenet_strategy(graph), machine4, lr=0.05, snapshot_every=None)
    x, y = batches(graph, 1)[0]
    futures, programs = [], []
    for _ in range(10):  # (submit waits for the oldest step beyond 4 in flight, which finishes it)
        futures.append(trainer.submit(x, y))
        programs += [f.key for f in futures[-1].run.outputs["done"]]
    losses = [f.result() for f in futures]
    held = _settled(machine4, programs)  # the client's releases reach the scheduler in batches
    assert held <= 3 * 3, held  # three devices, a few steps the trainer keeps (not the ten)
    assert all(np.isfinite(losses)) and all(f.run.outputs == {} for f in futures)
    del futures
    assert _settled(machine4, programs) == held


def _settled(machine, keys, wait_s=0.3) -> int:
    """How many of `keys` the scheduler holds in memory once that stops changing for `wait_s`."""
    count = machine.client.run_on_scheduler(_in_memory, keys)
    for _ in range(20):
        time.sleep(wait_s)
        now = machine.client.run_on_scheduler(_in_memory, keys)
        if now == count:
            return count
        count = now
    return count


def test_programs_equal_tasks_bit_for_bit(machine4):
    """The same kernels in the same order on each device: the same losses and parameters as the
    per-task executor, bit for bit, with steps in flight, and the same bytes."""
    graph = small_lenet()
    data = batches(graph, 4)
    results = {}
    for executor in ("programs", "tasks"):
        trainer = Trainer(graph, mixed_lenet_strategy(graph), machine4, lr=0.05, momentum=0.9, dtype="float64",
                          executor=executor)
        futures = [trainer.submit(x, y) for x, y in data]
        results[executor] = [f.result() for f in futures], trainer.parameters(), trainer.stats
    (losses, params, stats), (losses_t, params_t, _) = results["programs"], results["tasks"]
    assert losses == losses_t
    assert_same_parameters(params, params_t)
    assert stats.measured_bytes == stats.planned_bytes


def test_a_failed_program_fails_its_peers_and_training_goes_on(machine4):
    """A step whose data cannot be read on one device: the programs waiting for that device's
    values fail too rather than wait (taskrt.transport.mailbox), the step raises, and the next steps train
    from the last finished one."""
    from taskrt.data.datasets import ArrayDataset, DataReadError

    class Broken(ArrayDataset):
        placed = False  # read through `read`, on the workers

        def read(self, field, rows, window):
            if 13 in list(rows):
                raise DataReadError("sample 13 is unreadable")
            return super().read(field, rows, window)

    graph = small_lenet()
    rng = np.random.default_rng(2)
    dataset = Broken({"images": rng.standard_normal((16, 1, 16, 16)), "labels": rng.integers(0, 10, 16)})
    strategy = Strategy({l.name: P(n=2, devices=(0, 1)) for l in graph if not l.is_input})
    trainer = Trainer(graph, strategy, machine4, lr=0.05, dtype="float64")
    reference = Trainer(graph, strategy, machine4, lr=0.05, dtype="float64")
    trainer.submit_from(dataset, np.arange(4)).result()
    reference.submit_from(dataset, np.arange(4)).result()
    started = time.monotonic()
    with pytest.raises(DataReadError, match="unreadable"):
        trainer.submit_from(dataset, np.array([0, 1, 2, 13])).result()  # device 1's half
    assert time.monotonic() - started < 30
    trainer.submit_from(dataset, np.arange(4, 8)).result()
    reference.submit_from(dataset, np.arange(4, 8)).result()
    a, b = trainer.parameters(), reference.parameters()
    for layer in a:
        for name in a[layer]:
            np.testing.assert_array_equal(a[layer][name], b[layer][name])


# ---- the mailbox alone ------------------------------------------------------------------------
class FakeWorker:
    def __init__(self):
        import asyncio

        self.handlers, self.address, self.scheduler_delay = {}, "tcp://here:1", 0.0
        self.transfer_incoming_log, self.transfer_outgoing_log = deque(), deque()
        self.asyncio_loop = asyncio.new_event_loop()
        self.loop = self
        threading.Thread(target=self.asyncio_loop.run_forever, daemon=True).start()


def test_mailbox_hands_over_values_and_never_waits_for_a_lost_sender(monkeypatch):
    import asyncio

    import taskrt.transport.mailbox as mailbox

    box = mailbox.Mailbox()
    box.setup(FakeWorker())
    value = np.arange(6.0)
    threading.Timer(0.05, box.put, kwargs={"key": ("a-it1", 0), "tag": "1", "value": value,
                                           "sender": "tcp://there:2", "sent": time.time()}).start()
    assert box.take(("a-it1", 0), "1", "tcp://there:2") is value
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), box.loop).result()  # the log is appended on the loop
    [logged] = box.worker.transfer_incoming_log
    assert logged["keys"] == {("a-it1", 0): value.nbytes} and logged["who"] == "tcp://there:2"
    # a step given up: its waiting program fails, and values that come for it later are dropped
    threading.Timer(0.05, box.abort, kwargs={"tags": ["2"]}).start()
    with pytest.raises(mailbox.ProgramAborted):
        box.take(("a-it2", 0), "2", "tcp://there:2")
    box.put(key=("b-it2", 0), tag="2", value=value, sender="tcp://there:2", sent=time.time())
    assert not box.values
    # a sender whose worker is gone
    monkeypatch.setattr(mailbox, "WATCH_S", 0.05)
    monkeypatch.setattr(box, "_alive", lambda address: False)
    with pytest.raises(mailbox.PeerLost, match="tcp://there:2"):
        box.take(("a-it3", 0), "3", "tcp://there:2")


def test_programs_cannot_be_unfused():
    from taskrt.execution.program_executor import make_executor

    with pytest.raises(ValueError, match="executor='tasks'"):
        make_executor(None, "programs", fused=False)
    with pytest.raises(ValueError, match="'programs' or 'tasks'"):
        make_executor(None, "threads")


def test_a_program_reads_the_step_before_on_its_worker_fails_with_its_error_or_as_lost():
    from types import SimpleNamespace

    from distributed import Reschedule

    from taskrt.execution.program_executor import _before
    from taskrt.transport.mailbox import PeerLost, ProgramAborted

    result = (np.ones(2), "loss")
    failed = ValueError("a bad tile")
    worker = SimpleNamespace(address="tcp://w", data={"dev0-program-it1": result},
                             state=SimpleNamespace(tasks={"dev0-program-it2": SimpleNamespace(state="constrained"),
                                                          "dev0-program-it3": SimpleNamespace(state="error")}))
    box = SimpleNamespace(aborted={"9": "given up"}, failed={"dev0-program-it4": failed},
                          still_coming=lambda key: key == "dev0-program-it6")
    assert _before(worker, box, "dev0-program-it1", "2") is result
    with pytest.raises(Reschedule):  # here, not run yet: this one comes again after it
        _before(worker, box, "dev0-program-it2", "3")
    with pytest.raises(ProgramAborted, match="failed"):
        _before(worker, box, "dev0-program-it3", "4")
    with pytest.raises(ValueError, match="a bad tile"):  # its own error, as Dask hands it to dependents
        _before(worker, box, "dev0-program-it4", "5")
    with pytest.raises(ProgramAborted, match="given up"):
        _before(worker, box, "dev0-program-it8", "9")
    with pytest.raises(Reschedule):  # sent here after this one: this one comes again after it
        _before(worker, box, "dev0-program-it6", "7")
    with pytest.raises(PeerLost, match="was lost"):  # never here: its worker was lost, the trainer recovers
        _before(worker, box, "dev0-program-it7", "8")


def test_the_mailbox_asks_the_scheduler_whether_a_program_is_still_to_come():
    import taskrt.transport.mailbox as mailbox

    worker = FakeWorker()
    states = {"sent-here": "processing", "sent-there": "processing", "waiting": "waiting", "done": "memory"}

    async def get_task_status(keys):
        return {k: states.get(k) for k in keys}

    async def processing(workers):
        return {w: ["sent-here"] for w in workers}

    worker.scheduler = SimpleNamespace(get_task_status=get_task_status, processing=processing)
    box = mailbox.Mailbox()
    box.setup(worker)
    assert box.still_coming("sent-here") and box.still_coming("waiting")
    assert not box.still_coming("sent-there") and not box.still_coming("done") and not box.still_coming("forgotten")
