"""search.step_costs: the runtime's processor time per task, fitted to training steps."""

from __future__ import annotations

import pytest

import search
from search.step_costs import calibration_network, step_cpu_costs, strategies
from taskrt.machine import Machine


def test_the_calibration_strategies_differ_in_tasks_and_bytes():
    machine = Machine.simulated(1, 2)
    graph = calibration_network()
    chosen = strategies(graph, machine)
    assert set(chosen) == {"data", "model", "owt", "height"}
    assert chosen["height"]["conv1"].h == 2 and chosen["height"]["fc1"].n == 2
    assert chosen["model"]["conv1"].c == 2 and chosen["data"]["conv1"].n == 2


def test_the_fit_explains_the_steps_and_more_tasks_cost_more(machine4):
    costs = step_cpu_costs(machine4, cpu_per_byte_s=1e-9, steps=2, warmup=1)
    rows = {r["strategy"]: r for r in costs["step_cpu_rows"]}
    assert set(rows) == {"data", "model", "owt", "height"}
    assert costs["cpu_per_task_s"] >= 0 and costs["cpu_per_message_s"] >= 0
    # a step whose work is split over channels runs more tasks and messages than data parallelism:
    # the runtime spends more processor time on it, and the fit charges it more
    assert rows["model"]["tasks"] > rows["data"]["tasks"]
    assert rows["model"]["runtime_cpu_s"] > rows["data"]["runtime_cpu_s"]

    def fitted(r):
        return costs["cpu_per_task_s"] * r["tasks"] + costs["cpu_per_message_s"] * r["messages"] + 1e-9 * r["bytes"]

    assert fitted(rows["model"]) > fitted(rows["data"]) > 0
    # one cost per task and message for all four steps: each within a factor of two of what it measured
    for r in rows.values():
        assert 0.5 < fitted(r) / r["runtime_cpu_s"] < 2.0, r


def test_a_cost_model_on_shared_cores_takes_the_steps_costs(machine4, tmp_path, monkeypatch):
    """The runtime's costs the simulator gets: the processor time fitted to steps, and a step's
    start counting the client's own work: the scheduler's answer to which workers there are
    (measured by Machine.calibrate), building and serializing the step's graph and its way to the
    first task (timed on the plan)."""
    import taskrt.executor

    fitted = {"cpu_per_task_s": 0.003, "cpu_per_message_s": 0.001, "step_cpu_rows": []}
    monkeypatch.setattr(search.cost, "step_cpu_costs", lambda machine, per_byte: fitted)
    model = search.CostModel(machine4, cache=tmp_path / "c.json", progress=False)
    assert model.calibration["cpu_per_task_s"] == 0.003 and model.calibration["cpu_per_message_s"] == 0.001
    assert "noop_cpu_per_task_s" in model.calibration
    plan = _plan(machine4)
    runtime = model.runtime(plan)
    assert runtime.cpu_per_task_s == 0.003 and runtime.cpu_per_message_s == 0.001
    assert 0 < model.calibration["check_s"] < 1
    monkeypatch.setattr(taskrt.executor, "graph_seconds", lambda *a, **k: taskrt.executor.GraphTimes(0, 0, 0, 1))
    without = model.runtime(plan).start_s
    assert without >= model.calibration["check_s"]
    # built in 0.25 s, written in 0.5 and read in 0.125, on two devices: the client's 0.75 s, then the
    # scheduler reads it (0.125) and writes half of it for a worker, which reads that (0.3125)
    times = taskrt.executor.GraphTimes(0.25, 0.5, 0.125, 2)
    monkeypatch.setattr(taskrt.executor, "graph_seconds", lambda *a, **k: times)
    assert model.runtime(plan).start_s == pytest.approx(without + 0.75 + 0.125 + 0.3125, abs=1e-12)


def test_a_simulated_machine_runs_no_steps(monkeypatch):
    monkeypatch.setattr(search.cost, "step_cpu_costs", lambda *a: pytest.fail("steps run on a simulated machine"))
    search.CostModel(Machine.simulated(1, 2), cache=False)


def _plan(machine):
    from taskrt.lowering import lower

    graph = calibration_network(batch=8)
    return lower(graph, search.data_parallel(graph, machine))
