"""Training that survives lost workers: worker processes killed with SIGKILL (once, twice, during
a step, between steps); the run must end with the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.batching import INTERVAL_S, intervals
from taskrt.machines.machine import Machine, MachineError, worker_info
from taskrt.planning.fusion import run_of
from taskrt.training.checkpoint import Checkpoints, read_checkpoint
from taskrt.training.elastic import remap, snapshot_interval
from taskrt.training.trainer import Trainer, WorkerLostWarning
from tests.graphs import mixed_lenet_strategy, small_lenet

RTOL = 1e-5  # float32: replayed steps run under another strategy, so sums are taken in another order


def mixed(graph):
    """Every device used (see tests/graphs.py)."""
    return mixed_lenet_strategy(graph, name="mixed")


def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, shape[0])) for _ in range(count)]


def kill(machine, device):
    """SIGKILL the worker process of `device` (its nanny starts a new one, a few seconds later)."""
    address = machine.live_devices()[device]
    pid = machine.client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)


def wait_until_noticed(trainer, timeout=60):
    """Until the scheduler has noticed a kill: some of the trainer's parameters are gone."""
    deadline = time.monotonic() + timeout
    while all(run_of(f).status == "finished" for f in trainer._state.values()):
        assert time.monotonic() < deadline, "the scheduler did not notice the lost worker"
        time.sleep(0.05)


def wait_for_all(machine, timeout=300):
    deadline = time.monotonic() + timeout
    while len(machine.live_devices()) < machine.num_devices:
        assert time.monotonic() < deadline, "workers did not come back"
        time.sleep(0.2)


def assert_same(actual, expected, rtol=RTOL):
    for layer in expected:
        for name in expected[layer]:
            np.testing.assert_allclose(actual[layer][name], expected[layer][name], rtol=rtol, atol=1e-6,
                                       err_msg=f"{layer}.{name}")


HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}


@pytest.fixture(scope="module")
def machine3():
    m = Machine.local(3, probe=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def uninterrupted(machine3):
    """Parameters and losses of 6 steps without a loss."""
    graph = small_lenet()
    data = batches(graph, 6, seed=1)
    trainer = Trainer(graph, mixed(graph), machine3, **HYPER)
    losses = [trainer.step(x, y) for x, y in data]
    return data, losses, trainer.parameters()


# ---- pure parts -----------------------------------------------------------------------------
def test_remap_keeps_each_split_where_it_can():
    graph = small_lenet()
    strategy = mixed(graph).validated(graph)
    on_two = remap(strategy, [0, 2])  # device 1 lost; devices 0 and 2 become 0 and 1
    assert on_two["conv2"] == P(h=2, devices=(1, 0))  # both its devices survived: same split, renumbered
    assert on_two["conv1"] == P(n=2, devices=(0, 1))  # its part on lost device 1 moved to a survivor
    assert on_two["fc1"] == P(c=2, devices=(0, 1))
    on_one = remap(strategy, [2])
    for name, cfg in on_one.items():
        assert cfg.total == 1 and cfg.devices == (0,), name
    on_one.validated(graph, Machine.simulated(1, 1))


def test_remap_shrinks_the_largest_degree_and_keeps_devices_distinct():
    four = Strategy({"conv1": P(n=2, h=2, devices=(0, 1, 2, 3), sync="allreduce")})
    three = remap(four, [0, 2, 3])
    cfg = three["conv1"]
    assert cfg.total <= 3 and len(set(cfg.devices)) == cfg.total and cfg.sync == "allreduce"
    assert (cfg.n, cfg.h) in ((1, 2), (2, 1))


def test_snapshot_interval_keeps_the_cost_under_five_percent():
    assert snapshot_interval(0.01, 0.1) == 2  # 10 ms snapshot, 100 ms steps: every 2 steps = 5%
    assert snapshot_interval(0.0001, 0.1) == 1
    assert snapshot_interval(10.0, 0.001) == 100  # bounded: the inputs of the steps since are kept


# ---- killed workers -------------------------------------------------------------------------
# (each starts and kills worker processes: on a loaded 2-core machine one takes minutes)
@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs workers and waits for their restart: minutes on 2 cores
def test_kill_between_steps_replays_and_matches(machine3, uninterrupted):
    data, losses, expected = uninterrupted
    wait_for_all(machine3)
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine3, snapshot_every=2, **HYPER)
    got = [trainer.step(x, y) for x, y in data[:3]]
    kill(machine3, 1)
    wait_until_noticed(trainer)  # between steps: lost before the next step starts
    with pytest.warns(WorkerLostWarning, match=r"restored the snapshot of step 2 and replayed steps 3..3"):
        got += [trainer.step(x, y) for x, y in data[3:]]
    [record] = trainer.recoveries
    assert record["snapshot_step"] == 2 and record["replayed"] == [3]
    assert got == pytest.approx(losses, rel=RTOL)
    assert_same(trainer.parameters(), expected)


@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs workers and waits for their restart: minutes on 2 cores
def test_kill_during_steps_in_flight(machine3, uninterrupted):
    data, losses, expected = uninterrupted
    wait_for_all(machine3)
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine3, snapshot_every=2, **HYPER)
    first = [trainer.step(x, y) for x, y in data[:2]]
    futures = [trainer.submit(x, y) for x, y in data[2:5]]
    assert not futures[-1].done()  # the kill lands while steps run
    kill(machine3, 2)
    with pytest.warns(WorkerLostWarning, match="lost"):
        got = first + [f.result() for f in futures] + [trainer.step(*data[5])]
    assert got == pytest.approx(losses, rel=RTOL)
    assert_same(trainer.parameters(), expected)
    assert all(record["replayed"] for record in trainer.recoveries)


@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs a worker and waits for its restart: minutes on 2 cores
def test_kill_with_adamw_and_clipping_ends_with_the_parameters_and_both_moments(machine3):
    """AdamW's moments live beside each shard, are kept by snapshots and restored with them: a
    worker killed with steps in flight ends with the parameters and both moments of a run without
    a loss (and Adam's step count, which the bias correction reads, replayed as it was)."""
    import taskrt as tr

    wait_for_all(machine3)
    graph = small_lenet()
    data = batches(graph, 6, seed=2)
    options = {"optimizer": tr.optim.AdamW(0.01, weight_decay=0.05, no_decay=("bias",)), "clip_grad_norm": 1.0}
    whole = Trainer(graph, mixed(graph), machine3, **options)
    losses = [whole.step(x, y) for x, y in data]
    trainer = Trainer(graph, mixed(graph), machine3, snapshot_every=2, **options)
    first = [trainer.step(x, y) for x, y in data[:2]]
    futures = [trainer.submit(x, y) for x, y in data[2:5]]
    kill(machine3, 1)
    with pytest.warns(WorkerLostWarning, match="lost"):
        got = first + [f.result() for f in futures] + [trainer.step(*data[5])]
    assert got == pytest.approx(losses, rel=RTOL)
    assert_same(trainer.parameters(), whole.parameters())
    moments, expected = trainer.optimizer_state(), whole.optimizer_state()
    assert set(moments) == {"exp_avg", "exp_avg_sq"}
    for slot in moments:  # relative to each tensor's largest value: the moments are small numbers
        for layer in expected[slot]:
            for name, value in expected[slot][layer].items():
                error = np.max(np.abs(moments[slot][layer][name] - value)) / np.max(np.abs(value))
                assert error < RTOL, (slot, layer, name, error)


@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs workers and waits for their restart: minutes on 2 cores
def test_two_kills_and_the_worker_that_came_back_is_used_again(machine3, uninterrupted):
    data, losses, expected = uninterrupted
    wait_for_all(machine3)
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine3, snapshot_every=3, **HYPER)
    got = [trainer.step(x, y) for x, y in data[:2]]
    killed = machine3.live_devices()[0]
    kill(machine3, 0)
    with pytest.warns(WorkerLostWarning):
        got += [trainer.step(*data[2])]
    first = trainer.recoveries[0]["devices"]
    assert trainer.machine.num_devices == len(first)
    # device 0 is left out, unless its nanny brought a new worker back before the recovery looked
    assert 0 not in first or trainer.machine.live_devices()[first.index(0)] != killed
    kill(machine3, 1)
    with pytest.warns(WorkerLostWarning):
        got += [trainer.step(*data[3])]
    wait_for_all(machine3)  # both nannies restarted their workers
    shortened = intervals(machine3.client)  # the workers that joined batch their messages as the others
    assert set(shortened["workers"].values()) == {INTERVAL_S} and set(shortened["scheduler"]) == {INTERVAL_S}
    kill(machine3, 2)  # the next re-plan takes the devices that came back
    with pytest.warns(WorkerLostWarning):
        got += [trainer.step(x, y) for x, y in data[4:]]
    assert len(trainer.recoveries) == 3
    assert 0 in trainer.recoveries[-1]["devices"] and 1 in trainer.recoveries[-1]["devices"]
    assert got == pytest.approx(losses, rel=RTOL)
    assert_same(trainer.parameters(), expected)


@pytest.mark.slow
def test_searched_strategy_is_searched_again_on_the_survivors(machine3, tmp_path, monkeypatch):
    from taskrt import search

    graph = small_lenet()
    data = batches(graph, 4, seed=2)
    wait_for_all(machine3)
    # every device in use (the search may keep one device for a network this small), so the kill takes state
    strategy = search.optimize(graph, machine3, search.CostModel(machine3, cache=tmp_path / "costs.json",
                                                                 progress=False), fewer_devices=False)
    assert 1 in {d for name in graph.layers for d in strategy[name].devices}
    reference = Trainer(graph, strategy, machine3, **HYPER)
    for x, y in data:
        reference.step(x, y)
    trainer = Trainer(graph, strategy, machine3, snapshot_every=2, **HYPER)
    trainer.step(*data[0])
    # device 1 stays away (its nanny's new worker can be back before the trainer re-plans, and then
    # the given strategy is kept on all three)
    kill(machine3, 1)
    live = machine3.live_devices
    monkeypatch.setattr(machine3, "live_devices", lambda: {d: a for d, a in live().items() if d != 1})
    with pytest.warns(WorkerLostWarning):
        for x, y in data[1:]:
            trainer.step(x, y)
    assert trainer.recoveries[-1]["devices"] == [0, 2]
    assert trainer.strategy.name == "layer-wise" and "search" in trainer.strategy.meta
    assert trainer.strategy.meta["machine"].startswith("devices [")
    assert_same(trainer.parameters(), reference.parameters())


@pytest.mark.slow  # SIGKILLs workers and waits for their restart: minutes on 2 cores
def test_losing_the_last_worker_is_a_clear_error_with_a_checkpoint_on_disk(tmp_path, monkeypatch):
    from taskrt.training import recovery

    monkeypatch.setattr(recovery, "RESTART_GRACE_S", 1.0)
    graph = small_lenet()
    data = batches(graph, 3)
    with Machine.local(1, probe=False) as machine:
        policy = Checkpoints(tmp_path, every=100)
        trainer = Trainer(graph, Strategy({l.name: P() for l in graph if not l.is_input}), machine,
                          snapshot_every=1, checkpoints=policy, **HYPER)
        trainer.step(*data[0])
        trainer.step(*data[1])
        snapshot = trainer.snapshot
        machine.cluster.scale(0)  # the worker goes away for good
        machine.cluster.sync(machine.cluster._correct_state)
        deadline = time.monotonic() + 30
        while worker_info(machine.client) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(MachineError, match=r"no worker is left.*last checkpoint on disk is .*step-00000002"):
            trainer.step(*data[2])
    meta, params, _ = read_checkpoint(policy.latest(), graph)
    assert meta["steps_done"] == snapshot.step == 2
    np.testing.assert_array_equal(params["fc1"]["weight"], snapshot.params["fc1"]["weight"])


@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs a worker and waits for its restart: minutes on 2 cores
@pytest.mark.parametrize("per_program", [1, 3])
def test_kill_during_fit_reads_the_logged_samples_again(machine3, per_program):
    """A step read from a dataset is logged as its sample indices alone; a worker killed while
    `fit` has steps in flight (the dataset's copy on it lost too), one or several to a program,
    ends with the parameters of an uninterrupted run."""
    from taskrt.data.datasets import ArrayDataset

    wait_for_all(machine3)
    graph = small_lenet()
    rng = np.random.default_rng(4)
    dataset = ArrayDataset({"images": rng.standard_normal((24, 1, 16, 16)).astype(np.float32),
                            "labels": rng.integers(0, 10, 24)})
    options = {"epochs": 2, "seed": 1, "progress": False, "prefetch": 3, "steps_per_program": per_program}
    reference = Trainer(graph, mixed(graph), machine3, **HYPER)
    expected = reference.fit(dataset, **options).losses
    trainer = Trainer(graph, mixed(graph), machine3, snapshot_every=4, **HYPER)
    logged = []

    def kill_at_step_ten(step, total):
        if step == 9:  # submitting step 10 (or the program of steps 10 to 12), steps before it in flight
            logged.extend(trainer._log)
            kill(machine3, 1)
        return HYPER["lr"]

    with pytest.warns(WorkerLostWarning, match="lost"):
        history = trainer.fit(dataset, lr_schedule=kill_at_step_ten, **options)
    assert logged and all(entry.arrays is None and entry.nbytes == 4 * 8 for entry in logged)  # indices only
    assert history.losses == pytest.approx(expected, rel=RTOL)
    assert trainer.recoveries[0]["replayed"]  # steps read from the dataset again
    assert_same(trainer.parameters(), reference.parameters())
