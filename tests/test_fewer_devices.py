"""The search on fewer devices (`search.optimize(fewer_devices=True)`): it keeps the device count
whose strategy simulates fastest, and a strategy that leaves devices unused trains on the whole
machine as it does on a machine of its own devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from taskrt import models, search
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.planning.memory import plan_memory
from taskrt.planning.simulate import Runtime
from taskrt.search.optimize import SIMULATION_MARGIN, SearchAgain, device_counts
from taskrt.training.trainer import Trainer, WorkerLostWarning
from tests.graphs import small_lenet
from tests.test_equivalence import TOLERANCE, assert_close, batch_for


class FetchCosts(search.CostModel):
    """A simulated machine's cost model whose runtime charges `fetch_s` for every value a device
    gets from another (a program's message, or a Dask worker asking another for it), and nothing else."""

    def __init__(self, machine, fetch_s: float):
        super().__init__(machine, cache=False, progress=False)
        self.fetch_s = fetch_s

    def runtime(self, plan, fused: bool = True, executor: str = "programs"):
        if executor == "programs":  # each value from another device costs its message
            return Runtime(programs=True, message_s=self.fetch_s)
        return Runtime(fetch_s=self.fetch_s, fused=fused)


def compute_heavy():
    return models.alexnet(batch=64, image_size=32, num_classes=10)


def devices_of(strategy) -> set:
    return {d for config in strategy.configs.values() for d in config.devices}


def test_by_default_on_a_cluster_only():
    """Simulated hardware's runtime costs nothing: by default its search keeps the whole machine."""
    graph, machine = compute_heavy(), Machine.simulated(1, 2)
    strategy = search.optimize(graph, machine, FetchCosts(machine, fetch_s=0.01))
    assert devices_of(strategy) == {0, 1} and "device_counts" not in strategy.meta
    assert strategy.replan == SearchAgain() and SearchAgain().fewer_devices is None


def test_device_counts():
    assert [device_counts(n) for n in (1, 2, 3, 4, 5, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 5],
                                                              [1, 2, 4, 8]]


@pytest.mark.parametrize("check", [False, True])
def test_where_the_runtime_costs_most_one_device_is_kept(check):
    graph, machine = compute_heavy(), Machine.simulated(1, 2)
    strategy = search.optimize(graph, machine, FetchCosts(machine, fetch_s=0.01), check_by_simulation=check,
                               fewer_devices=True)
    assert strategy.meta["device_count"] == 1 and devices_of(strategy) == {0}
    counts = strategy.meta["device_counts"]
    assert set(counts) == {"1", "2"}
    assert counts["1"]["simulated_step_s"] < counts["2"]["simulated_step_s"]
    if not check:  # equation 1 alone, blind to the runtime's fetches, prefers both devices
        assert counts["2"]["predicted_step_s"] < counts["1"]["predicted_step_s"]
    assert strategy.validated(graph, machine).configs == strategy.configs
    expected = plan_memory(lower(graph, strategy.validated(graph)))
    assert strategy.meta["memory_per_device"] == {str(d): m.to_dict() for d, m in expected.items()}
    if check:  # the simulation check's report, for one device too
        assert strategy.meta["refined_step_s"] == counts["1"]["simulated_step_s"]
        assert strategy.meta["chosen_by_simulation"] == "layer-wise optimum"
    # without: the whole machine, as before
    whole = search.optimize(graph, machine, FetchCosts(machine, fetch_s=0.01), check_by_simulation=check,
                            fewer_devices=False)
    assert devices_of(whole) == {0, 1} and whole.meta["device_count"] == 2 and "device_counts" not in whole.meta
    assert whole.replan == SearchAgain(check, fewer_devices=False)


@pytest.mark.parametrize("check", [False, True])
def test_where_compute_dominates_every_device_is_used(check):
    graph, machine = compute_heavy(), Machine.simulated(1, 4)
    strategy = search.optimize(graph, machine, FetchCosts(machine, fetch_s=0.0), check_by_simulation=check,
                               fewer_devices=True)
    assert strategy.meta["device_count"] == 4 and devices_of(strategy) == {0, 1, 2, 3}
    simulated = {int(k): v["simulated_step_s"] for k, v in strategy.meta["device_counts"].items()}
    assert sorted(simulated) == [1, 2, 4] and min(simulated, key=simulated.get) == 4
    assert strategy.replan == SearchAgain(check, fewer_devices=True)


def test_on_a_real_cluster_more_devices_must_win_by_the_margin():
    """Where the simulation predicts rather than measures, a larger count must be faster by more
    than SIMULATION_MARGIN than the fewer devices kept so far."""
    from taskrt.search.optimize import _fewest_fast

    class Given(FetchCosts):  # simulated steps given per device count
        def simulate(self, plan, fused=True, runtime=None):
            return SimpleNamespace(step_s=times[len({t.device for t in plan.tasks})])

    graph, machine = small_lenet(), Machine.simulated(1, 2)
    one = on_one_device(graph).validated(graph)
    two = Strategy({n: P(n=2, devices=(0, 1)) for n in graph.layers if not graph[n].is_input}).validated(graph)
    for strategy in (one, two):
        strategy.meta["predicted_step_s"] = 1.0
    model, cluster = Given(machine, 0.0), SimpleNamespace(is_simulated=False)
    for faster, expected in ((SIMULATION_MARGIN / 2, 1), (SIMULATION_MARGIN * 2, 2)):
        times = {1: 1.0, 2: 1.0 - faster}
        assert _fewest_fast(graph, cluster, model, {1: one, 2: two}) == expected
        assert _fewest_fast(graph, machine, model, {1: one, 2: two}) == 2  # simulated hardware: any win counts
    assert two.meta["device_counts"] == {"1": {"simulated_step_s": 1.0, "predicted_step_s": 1.0},
                                         "2": {"simulated_step_s": times[2], "predicted_step_s": 1.0}}


# ---- a strategy on one device of a two-device machine trains as on a machine of one --------------


@pytest.fixture(scope="module")
def machines():
    with Machine.local(1, probe=False) as one, Machine.local(2, probe=False) as two:
        yield one, two


def on_one_device(graph, device=0):
    return Strategy({n: P(devices=(device,)) for n in graph.layers if not graph[n].is_input})


def assert_same_parameters(actual, expected, tol):
    assert set(actual) == set(expected)
    for layer in expected:
        for name in expected[layer]:
            assert_close(actual[layer][name], expected[layer][name], tol, f"parameter {layer}.{name}")


@pytest.mark.parametrize("executor", ["programs", "tasks"])
def test_one_device_of_two_trains_as_one_device(machines, executor, tmp_path):
    one, two = machines
    graph, tol = small_lenet(), TOLERANCE["float32"]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "seed": 3}
    reference = Trainer(graph, on_one_device(graph), one, executor=executor, **hyper)
    trainer = Trainer(graph, on_one_device(graph), two, executor=executor, **hyper)
    assert {t.device for t in trainer.plan.tasks} == {0}
    for step in range(3):
        x, y = batch_for(graph, seed=10 + step)
        assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=tol)
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes
    assert_same_parameters(trainer.parameters(), reference.parameters(), tol)
    # a checkpoint of it resumes on the one-device machine, and goes on training alike
    trainer.save(tmp_path / "c.npz")
    resumed = Trainer.load(tmp_path / "c.npz", one, graph=graph, executor=executor)
    x, y = batch_for(graph, seed=20)
    assert resumed.step(x, y) == pytest.approx(reference.step(x, y), rel=tol)
    assert_same_parameters(resumed.parameters(), reference.parameters(), tol)


def test_the_unused_device_alone_trains_alike(machines):
    one, two = machines
    graph, tol = small_lenet(), TOLERANCE["float32"]
    reference = Trainer(graph, on_one_device(graph), one, lr=0.05, seed=1)
    trainer = Trainer(graph, on_one_device(graph, device=1), two, lr=0.05, seed=1)
    for step in range(2):
        x, y = batch_for(graph, seed=step)
        trainer.step(x, y), reference.step(x, y)
    assert_same_parameters(trainer.parameters(), reference.parameters(), tol)


def test_a_searched_strategy_on_fewer_devices_replans_on_the_devices_left():
    """After a lost worker the search runs again on the devices left, fewer devices included."""
    graph, machine = compute_heavy(), Machine.simulated(1, 4)
    strategy = search.optimize(graph, machine, FetchCosts(machine, fetch_s=0.01), fewer_devices=True)
    assert devices_of(strategy) == {0}
    smaller = strategy.replan(graph, Machine.simulated(1, 3))
    assert smaller.meta["device_counts"].keys() == {"1", "2", "3"}
    assert smaller.validated(graph, Machine.simulated(1, 3)).configs == smaller.configs


@pytest.mark.timeout(1200)
@pytest.mark.slow  # SIGKILLs a worker and waits for its restart
def test_losing_the_one_device_used_recovers_on_the_other(tmp_path):
    """A snapshot of a strategy on device 0 of two; device 0's worker is killed; the trainer
    re-plans on device 1 (re-mapped, or searched again) and ends with an uninterrupted run's parameters."""
    from tests.test_elastic import HYPER, RTOL, assert_same, batches, kill, wait_for_all, wait_until_noticed

    graph = small_lenet()
    data = batches(graph, 4, seed=1)
    searched = search.optimize(graph, Machine.simulated(1, 2), FetchCosts(Machine.simulated(1, 2), fetch_s=0.01),
                               fewer_devices=True)
    assert devices_of(searched) == {0}
    with Machine.local(2, probe=False) as machine:
        reference = Trainer(graph, searched, machine, **HYPER)
        losses = [reference.step(x, y) for x, y in data]
        for replan in (None, searched.replan):
            wait_for_all(machine)
            trainer = Trainer(graph, on_one_device(graph), machine, snapshot_every=2, replan=replan, **HYPER)
            got = [trainer.step(x, y) for x, y in data[:3]]
            kill(machine, 0)
            wait_until_noticed(trainer)
            # device 0 stays away (its nanny's new worker can be back before the trainer re-plans)
            live = machine.live_devices
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(machine, "live_devices", lambda live=live: {d: a for d, a in live().items() if d != 0})
                with pytest.warns(WorkerLostWarning, match=r"re-planned on device\(s\) \[1\]"):
                    got += [trainer.step(x, y) for x, y in data[3:]]
            assert got == pytest.approx(losses, rel=RTOL)
            assert_same(trainer.parameters(), reference.parameters())
