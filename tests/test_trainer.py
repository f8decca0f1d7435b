"""The Trainer on a real local cluster: checkpoints, steps in flight, stats, errors, lost workers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from taskrt.data.arrays import InputError
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy, StrategyError
from taskrt.machines.machine import Machine, MachineError, worker_info
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import CheckpointError, Trainer
from tests.graphs import assert_same_parameters, mixed_lenet_strategy, small_lenet


def mixed(graph):
    """n-split convolutions, h-split second conv, c-split fully-connected layers, on 3 devices."""
    return mixed_lenet_strategy(graph)


def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape), rng.integers(0, 10, shape[0])) for _ in range(count)]


def test_steps_in_flight_equal_sequential_steps(machine4):
    graph = small_lenet()
    data = batches(graph, 6)
    sequential = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64")
    losses = [sequential.step(x, y) for x, y in data]
    pipelined = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64")
    futures = [pipelined.submit(x, y) for x, y in data]  # none waited for before all are submitted
    assert [f.result() for f in futures] == pytest.approx(losses, rel=1e-12)
    a, b = sequential.parameters(), pipelined.parameters()
    for layer in a:
        for name in a[layer]:
            np.testing.assert_allclose(b[layer][name], a[layer][name], rtol=1e-12)


def test_a_full_window_of_steps_in_flight_waits_for_the_oldest_only(machine4, monkeypatch):
    """With MAX_IN_FLIGHT steps in flight, `submit` waits for the oldest one alone: the steps after
    it stay in flight.  (Waiting for every step in flight instead, measured on local(2), data
    parallel, 7 interleaved rounds of 30 steps: LeNet-5 batch 64 14.8 ms a step against 14.4 now,
    AlexNet-32 batch 32 259 against 260: within the noise either way; this is the bound the
    trainer means, and it keeps the workers busy.)"""
    from taskrt.training.steps import MAX_IN_FLIGHT, StepFuture

    graph = small_lenet()
    x, y = batches(graph, 1)[0]
    trainer = Trainer(graph, mixed(graph), machine4, lr=0.01, snapshot_every=None)
    futures = [trainer.submit(x, y) for _ in range(MAX_IN_FLIGHT)]
    waited = []
    result = StepFuture.result

    def recorded(self):
        waited.append(self.run.step)
        return result(self)

    monkeypatch.setattr(StepFuture, "result", recorded)
    trainer.submit(x, y)
    assert waited == [futures[0].run.step]
    monkeypatch.undo()
    trainer.wait()
    assert all(f.finished for f in futures)


def _task_states(machine, token):
    def count(token, dask_worker=None):
        return sum(token in str(key) for key in dask_worker.state.tasks)
    return sum(machine.client.run(count, token).values())


def test_workers_keep_a_bounded_history_of_steps(machine4):
    """The state's lineage is cut every CUT_LINEAGE_EVERY steps, so the task states the workers
    keep stop growing with the number of steps."""
    from taskrt.training.steps import CUT_LINEAGE_EVERY

    graph = small_lenet()
    x, y = batches(graph, 1)[0]
    trainer = Trainer(graph, mixed(graph), machine4, lr=0.01, snapshot_every=None)
    counts = []
    for _ in range(3):
        for _ in range(2 * CUT_LINEAGE_EVERY):
            trainer.step(x, y)
        time.sleep(0.5)  # releases reach the workers
        counts.append(_task_states(machine4, trainer._token))
    per_step = len(trainer.plan.tasks)
    # without cuts every round adds 2 * CUT_LINEAGE_EVERY steps' task states; allow two steps' worth of noise
    assert counts[2] <= counts[1] + 2 * per_step, (counts, per_step)


def test_checkpoint_resume_continues_exactly(machine4, tmp_path):
    graph = small_lenet()
    data = batches(graph, 4, seed=1)
    straight = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, weight_decay=1e-3, dtype="float64")
    for x, y in data:
        straight.step(x, y)
    first = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, weight_decay=1e-3, dtype="float64")
    for x, y in data[:2]:
        first.step(x, y)
    path = tmp_path / "ckpt.npz"
    first.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]  # no temporary file left behind
    # resume under a different strategy: momentum and parameters carry over exactly
    dp = Strategy({l.name: P(n=2, devices=(3, 1)) for l in graph if not l.is_input})
    resumed = Trainer.load(path, machine4, strategy=dp)
    assert resumed.steps_done == 2
    for x, y in data[2:]:
        resumed.step(x, y)
    a, b = straight.parameters(), resumed.parameters()
    for layer in a:
        for name in a[layer]:
            np.testing.assert_allclose(b[layer][name], a[layer][name], rtol=1e-10, atol=1e-14)


def test_allreduce_trains_like_one_device_and_checkpoints_move_between_sync_methods(machine4, tmp_path):
    """Data parallel on 4 devices with reduce-scatter + all-gather: the same steps as one device;
    a checkpoint written with chunked state resumes under a parameter server, and back."""
    graph = small_lenet()
    data = batches(graph, 4, seed=2)
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "dtype": "float64"}
    reference = SingleDeviceTrainer(graph, **hyper)
    ring = Strategy({l.name: P(n=4, devices=(2, 0, 3, 1), sync="allreduce") for l in graph if not l.is_input})
    trainer = Trainer(graph, ring, machine4, **hyper)
    assert "rslice" in trainer.plan.phase_counts()
    x, y = data[0]
    expected, actual = reference.gradients(x, y), trainer.gradients(x, y)
    for layer in expected:
        for name in expected[layer]:
            np.testing.assert_allclose(actual[layer][name], expected[layer][name], rtol=1e-10, atol=1e-14)
    for x, y in data[:2]:
        assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-10)
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes
    trainer.save(tmp_path / "ring.npz")
    ps = Trainer.load(tmp_path / "ring.npz", machine4, strategy=Strategy(
        {l.name: P(n=2, devices=(1, 3)) for l in graph if not l.is_input}))
    x, y = data[2]
    assert ps.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-10)
    ps.save(tmp_path / "ps.npz")
    back = Trainer.load(tmp_path / "ps.npz", machine4, strategy=ring)
    x, y = data[3]
    assert back.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-10)
    a, b = reference.parameters(), back.parameters()
    for layer in a:
        for name in a[layer]:
            np.testing.assert_allclose(b[layer][name], a[layer][name], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(back.optimizer_state()["momentum_buffer"]["fc1"]["weight"],
                               reference.velocity["fc1"]["weight"], rtol=1e-10)


def test_checkpoint_errors(machine4, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="bad.npz is not a taskrt checkpoint: it is a file that starts with"):
        Trainer.load(bad, machine4)
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a taskrt checkpoint"):
        Trainer.load(tmp_path / "other.npz", machine4)


def test_saved_strategy_is_checked_against_the_new_machine(machine4, tmp_path):
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4)
    trainer.save(tmp_path / "ckpt.npz")
    two = Machine.simulated(1, 2)
    two.client = machine4.client  # a 2-device view of the cluster: device 2 is out of range
    with pytest.raises(StrategyError, match="out of range"):
        Trainer.load(tmp_path / "ckpt.npz", two)


def test_stats_report_planned_and_measured_bytes(machine4):
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4)
    x, y = batches(graph, 1)[0]
    trainer.step(x, y)
    stats = trainer.stats
    assert stats.step == 1 and stats.tasks == len(trainer.plan.tasks) and stats.wall_s > 0
    assert stats.planned_bytes == trainer.plan.bytes_by_pair() and stats.bytes_moved > 0
    assert stats.measured_bytes == stats.planned_bytes
    assert "bytes moved" in stats.summary()


def _heap(dask_worker=None):
    """(Dask gives the scheduler as `dask_worker` too, when run there.)"""
    import gc

    from taskrt.machines.worker_setup import FREEZES

    server = dask_worker
    on_worker = hasattr(server, "batched_stream")
    # a message stream (to the scheduler, to a worker) and its record of recent messages
    stream = server.batched_stream if on_worker else next(iter(server.stream_comms.values()))
    return {"frozen": gc.get_freeze_count(), "freezes": FREEZES[0], "recent_messages": stream.recent_message_log.maxlen,
            "transfers": server.transfer_incoming_log.maxlen if on_worker else None}


def test_heaps_are_frozen_after_the_first_step_and_transfer_logs_stay_long(machine4):
    """taskrt.machines.worker_setup: after a trainer's first step the workers and the scheduler hold their
    long-lived objects out of the garbage collector's walks; Dask's debugging logs are short,
    the workers' transfer logs long enough to count bytes many steps later."""
    from taskrt.machines.worker_setup import TRANSFER_LOG_LENGTH

    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4)
    x, y = batches(graph, 1)[0]
    before = machine4.client.run(_heap)
    trainer.step(x, y)
    after = machine4.client.run(_heap)
    for address, heap in after.items():
        # frozen once more after the step, which took its objects in (a count of frozen objects
        # alone can fall: an earlier test's frozen objects die when nothing refers to them)
        assert heap["freezes"] == before[address]["freezes"] + 1 and heap["frozen"] > 0
        assert heap["transfers"] == TRANSFER_LOG_LENGTH and heap["recent_messages"] <= 100
    assert machine4.client.run_on_scheduler(_heap)["recent_messages"] <= 100
    planned = trainer.stats.planned_bytes
    for _ in range(30):  # more tasks than the debugging logs hold
        trainer.step(x, y)
    assert trainer.stats.measured_bytes == planned


def _inline_tasks(dask_worker=None):
    """Whether this worker has the inline executor (taskrt.machines.worker_setup.INLINE), and the keys it
    holds that ran on it."""
    from taskrt.machines.worker_setup import INLINE

    ran = [str(ts.key) for ts in dask_worker.state.tasks.values() if (ts.annotations or {}).get("executor") == INLINE]
    return INLINE in dask_worker.executors, ran


def test_exports_run_on_the_workers_inline_executor(machine4, monkeypatch):
    """A fused run's exports (taskrt.planning.fusion) are annotated for the workers' inline executor, which
    every worker has; nothing else is, and the values are those of the thread pool's path."""
    from taskrt.execution import executor as executor_module
    from taskrt.machines.worker_setup import InlineExecutor

    graph = small_lenet()
    one = Strategy({layer.name: P(devices=(0,)) for layer in graph})  # one run per step
    results = {}
    for executor in ("default", executor_module.INLINE):
        monkeypatch.setattr(executor_module, "INLINE", executor)
        monkeypatch.setattr(executor_module, "held_outputs", lambda outputs: frozenset())  # its state exported
        trainer = Trainer(graph, one, machine4, lr=0.05, momentum=0.9, dtype="float64", executor="tasks")
        futures = [trainer.submit(x, y) for x, y in batches(graph, 2)]
        last = futures[-1].run  # (a finished step's future keeps its loss, not its outputs)
        results[executor] = [f.result() for f in futures], trainer.parameters()
        held = {str(f.key) for f in last.outputs["state"].values()}
    answers = machine4.client.run(_inline_tasks)
    assert all(has for has, _ in answers.values())
    ran = {key for _, keys in answers.values() for key in keys}
    assert held <= ran and not any("fused" in key for key in ran)
    (losses, params), (inline_losses, inline_params) = results.values()
    assert losses == inline_losses
    assert_same_parameters(params, inline_params)
    assert InlineExecutor().submit(sum, [1, 2]).result() == 3
    with pytest.raises(ZeroDivisionError):
        InlineExecutor().submit(lambda: 1 / 0).result()


def test_state_kept_in_the_run_that_computed_it(machine4, monkeypatch):
    """The new state and the losses stay in the run that computed them where nothing else reads
    that run (taskrt.planning.fusion.held_outputs) and the next step reads the state inside its own runs
    (`state_read_as_keys`): on one device a step is a single Dask task, and the next step's run reads
    the state out of it.  The same losses and parameters, bit for bit, as with every value named
    by a task of its own, including with steps in flight, checkpoints (the parameters read back)
    and cut lineage, and the same bytes."""
    from taskrt.execution import executor as executor_module
    from taskrt.execution.executor import step_graph
    from taskrt.planning.fusion import FusedRun, RunValue

    graph = small_lenet()
    data = batches(graph, 10)  # past CUT_LINEAGE_EVERY: the kept values get keys of their own
    one = Strategy({layer.name: P(devices=(0,)) for layer in graph})
    # convolutions on one device, the rest on another: the state of one of them kept
    split = Strategy({layer.name: P(devices=(0,) if layer.name.startswith(("image", "conv", "pool")) else (1,))
                      for layer in graph})
    mixed_ = mixed(graph)  # every run is read by another device's tasks: nothing kept
    for strategy in (one, split, mixed_):
        results = {}
        for keep in (True, False):
            if not keep:
                monkeypatch.setattr(executor_module, "held_outputs", lambda outputs: frozenset())
            trainer = Trainer(graph, strategy, machine4, lr=0.05, momentum=0.9, dtype="float64",
                              executor="tasks")
            futures = [trainer.submit(x, y) for x, y in data[:3]]
            middle = trainer.parameters()  # read out of the runs, steps in flight
            futures += [trainer.submit(x, y) for x, y in data[3:]]
            last = futures[-1].run  # (a finished step's future keeps its loss, not its outputs)
            results[keep] = [f.result() for f in futures], middle, trainer.parameters(), trainer.stats
            kept = [v for v in [*last.outputs["state"].values(), *last.outputs["loss"]] if isinstance(v, RunValue)]
            assert bool(kept) == (keep and strategy is not mixed_)
            if keep and strategy is one:  # one task a step; the next step's run takes this one as an input
                [run] = {v.run for v in kept}
                assert len(kept) == len(last.outputs["state"]) + 1 and last.keys == {run.key}  # data rides inside
                tiles = {k: None for k in trainer.plan.data_nbytes}
                dsk, _, _ = step_graph(trainer.plan, "next", last.outputs["state"], tiles, trainer.hyper())
                [(fn, *inputs)] = dsk.values()
                assert isinstance(fn, FusedRun) and run in inputs
            monkeypatch.undo()
        (losses, middle, params, stats), (plain_losses, plain_middle, plain_params, _) = results[True], results[False]
        assert losses == plain_losses
        for a, b in ((middle, plain_middle), (params, plain_params)):
            for layer in a:
                for name in a[layer]:
                    np.testing.assert_array_equal(a[layer][name], b[layer][name])
        assert stats.measured_bytes == stats.planned_bytes


def test_a_dropped_trainer_is_collected():
    """The client's process is not frozen with a trainer in it: a trainer (in reference cycles
    with its dashboard publisher) and the parameters it holds go once dropped."""
    import gc
    import weakref

    graph = small_lenet()
    with Machine.local(1, probe=False) as machine:
        trainer = Trainer(graph, Strategy({l.name: P(n=1) for l in graph if not l.is_input}), machine)
        x, y = batches(graph, 1)[0]
        trainer.step(x, y)
        trainer.step(x, y)
        gone = weakref.ref(trainer)
        del trainer
        gc.collect()
        assert gone() is None


def test_keys_are_named_by_layer_and_phase(machine4):
    from dask.utils import key_split

    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4, fused=False, executor="tasks")
    x, y = batches(graph, 1)[0]
    future = trainer.submit(x, y)
    future.result()
    names = {key_split(k) for k in future.run.keys if isinstance(k, tuple)}
    assert {"conv1-fwd", "conv1-bwd", "conv2-fwd", "fc1-update", "loss-loss"} <= names


def test_fused_steps_equal_unfused_steps_with_fewer_tasks(machine4):
    from dask.utils import key_split

    graph = small_lenet()
    data = batches(graph, 3)
    runs = {}
    for fused in (True, False):
        trainer = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64", fused=fused,
                          executor="tasks")
        futures = [trainer.submit(x, y) for x, y in data]
        runs[fused] = ([f.result() for f in futures], trainer.parameters(), futures[-1].run.keys, trainer.stats)
    (loss_f, params_f, keys_f, stats_f), (loss_u, params_u, keys_u, _) = runs[True], runs[False]
    assert loss_f == loss_u  # the same kernels in the same order: bit for bit
    assert_same_parameters(params_f, params_u)
    assert len(keys_f) < len(keys_u)
    assert "dev1-fused" in {key_split(k) for k in keys_f if isinstance(k, tuple)}  # device 1 has runs worth fusing
    assert stats_f.measured_bytes == stats_f.planned_bytes


@pytest.mark.parametrize("executor", ["programs", "tasks"])
def test_data_carried_in_the_graph_equals_scattered_data(machine4, monkeypatch, executor):
    """Small batches ride in the step's graph (taskrt.execution.executor.INLINE_DATA_BYTES), larger ones are
    scattered to their devices: the same losses and parameters bit for bit, the same bytes moved."""
    from taskrt.execution import executor as executor_module

    graph = small_lenet()
    data = batches(graph, 3)
    runs = {}
    for limit in (executor_module.INLINE_DATA_BYTES, 0):
        monkeypatch.setattr(executor_module, "INLINE_DATA_BYTES", limit)
        trainer = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64",
                          executor=executor)
        futures = [trainer.submit(x, y) for x, y in data]
        losses = [f.result() for f in futures]
        carried = executor_module.inline_data_devices(trainer.plan)
        scattered = [k for k in futures[-1].run.keys if isinstance(k, str) and k.startswith("ndarray-")]
        runs[limit] = (losses, trainer.parameters(), carried, scattered, trainer.stats)
    (loss_in, params_in, carried, scattered_in, stats_in), (loss_sc, params_sc, none, scattered, _) = runs.values()
    tiles = [p for parts in trainer.plan.data.values() for p in parts]
    assert carried == {p.device for p in tiles} and not scattered_in  # every device's tiles are small here
    assert not none and len(scattered) == len(tiles)
    assert loss_in == loss_sc
    assert_same_parameters(params_in, params_sc)
    assert stats_in.measured_bytes == stats_in.planned_bytes


def test_losses_read_on_the_workers_equal_the_scheduler_path(machine4):
    """Each step's losses come straight from its workers (taskrt.transport.worker_reads) when nothing went
    wrong: the same values, bit for bit, as waiting for the futures and gathering through the scheduler."""
    graph = small_lenet()
    data = batches(graph, 4)
    direct = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64")
    read = direct.executor.read_when_done
    answers = []
    direct.executor.read_when_done = lambda run, timeout: answers.append(read(run, timeout)) or answers[-1]
    usual = Trainer(graph, mixed(graph), machine4, lr=0.05, momentum=0.9, dtype="float64")
    usual.executor.read_when_done = lambda run, timeout: None
    for x, y in data:
        assert direct.step(x, y) == usual.step(x, y)
    # the first step may outlast the wait (kernels compiling on the workers) and take the usual way
    assert len(answers) == len(data) and all(a is not None for a in answers[1:])
    a, b = direct.parameters(), usual.parameters()
    for layer in a:
        for name in a[layer]:
            np.testing.assert_array_equal(a[layer][name], b[layer][name])


def test_worker_reads_give_way_on_a_failed_task_or_a_timeout(machine4):
    """A failed task answers None at once (the trainer then waits the usual way, which reports it), a
    key not computed in time TIMED_OUT (the trainer asks again), and no waiter is left behind."""
    from taskrt.transport.worker_reads import TIMED_OUT, StepWatch, read_when_done

    client = machine4.client
    address = machine4.addresses()[0]
    failing = client.submit(lambda: 1 / 0, key=("boom-it0", 0), workers=[address], pure=False)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    start = time.perf_counter()
    answer = client.run(read_when_done, [(failing.key, None, failing.key, True)], 30.0, workers=[address])
    assert answer[address] is None
    assert time.perf_counter() - start < 10
    never = ("never-it0", 0)
    assert client.run(read_when_done, [(never, 1, never, True)], 0.2, workers=[address])[address] == TIMED_OUT

    def waiters(dask_worker=None):
        return sum(map(len, dask_worker.plugins[StepWatch.name].waiters.values()))

    assert client.run(waiters, workers=[address])[address] == 0


def test_bad_input_is_rejected_before_any_work(machine4):
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4)
    x, y = batches(graph, 1)[0]
    with pytest.raises(InputError, match="expects shape"):
        trainer.step(x[:3], y)
    with pytest.raises(InputError, match=r"must lie in \[0, 10\)"):
        trainer.step(x, y + 10)
    assert trainer.steps_done == 0


def test_predict_matches_single_device_for_any_sample_count(machine4):
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4, dtype="float64", seed=5)
    reference = SingleDeviceTrainer(graph, dtype="float64", seed=5)
    x = np.random.default_rng(2).standard_normal((7, *graph.inputs[0].shape[1:]))
    np.testing.assert_allclose(trainer.predict(x), reference.predict(x), rtol=1e-10)


def test_simulated_machine_cannot_train():
    graph = small_lenet()
    with pytest.raises(MachineError, match="simulated"):
        Trainer(graph, mixed(graph), Machine.simulated(1, 4))


@pytest.mark.slow
def test_pinned_tasks_survive_a_worker_restart():
    """A nanny restart gives the worker a new port; the resource tag still routes its tasks."""
    with Machine.local(2, probe=False) as machine:
        graph = small_lenet()
        strategy = Strategy({l.name: P(n=2) for l in graph if not l.is_input})
        before = machine.addresses()
        machine.client.restart_workers([before[1]])
        after = machine.addresses()
        assert after[1] != before[1]
        trainer = Trainer(graph, strategy, machine, dtype="float64")
        x, y = batches(graph, 1)[0]
        loss = trainer.step(x, y)
        assert loss == pytest.approx(SingleDeviceTrainer(graph, dtype="float64").step(x, y), rel=1e-12)
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


@pytest.mark.slow
def test_lost_device_is_reported_clearly_without_recovery(tmp_path):
    with Machine.local(2, probe=False) as machine:
        graph = small_lenet()
        trainer = Trainer(graph, Strategy({l.name: P(n=2) for l in graph if not l.is_input}), machine,
                          snapshot_every=None)  # no recovery (tests/test_elastic.py has it)
        x, y = batches(graph, 1)[0]
        trainer.step(x, y)
        trainer.save(tmp_path / "ckpt.npz")
        machine.cluster.scale(1)  # device 1's worker goes away with its parameters
        machine.cluster.sync(machine.cluster._correct_state)
        deadline = time.monotonic() + 30
        while len(worker_info(machine.client)) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        # the device without a worker is named, and with it (once the scheduler has marked them) the
        # parameters that were lost; either way the message says how to go on
        with pytest.raises(MachineError, match=r"device\(s\) \[1\] have no worker.*Trainer\.load"):
            trainer.step(x, y)
        assert (tmp_path / "ckpt.npz").exists()  # what was saved is intact


def test_from_client_adopts_a_running_cluster_and_leaves_it_running():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        machine = Machine.from_client(client, probe=True)
        assert machine.num_devices == 2
        assert np.all(machine.bandwidth[~np.eye(2, dtype=bool)] > 0)
        assert sorted(machine.addresses()) == [0, 1]
        amm_running = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.extensions["amm"].running)
        assert not amm_running
        graph = small_lenet()
        trainer = Trainer(graph, Strategy({l.name: P(n=2) for l in graph if not l.is_input}), machine)
        x, y = batches(graph, 1)[0]
        assert np.isfinite(trainer.step(x, y))
        machine.close()
        assert client.status == "running" and len(worker_info(client)) == 2
