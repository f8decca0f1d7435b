"""search.step_costs: the runtime's processor time per task fitted to training steps, and the
latencies of a step's start, hops and end read from their task stream."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import search
from taskrt.machines.machine import Machine
from taskrt.planning.fusion import fused_plan
from taskrt.planning.lowering import lower
from taskrt.planning.plan import TASK, output_keys
from taskrt.search.step_costs import calibration_network, step_costs, step_timings, strategies, trimmed_mean


def test_the_calibration_strategies_differ_in_tasks_and_bytes():
    machine = Machine.simulated(1, 2)
    graph = calibration_network()
    chosen = strategies(graph, machine)
    assert set(chosen) == {"data", "model", "owt", "height", "one device"}
    assert chosen["height"]["conv1"].h == 2 and chosen["height"]["fc1"].n == 2
    assert chosen["model"]["conv1"].c == 2 and chosen["data"]["conv1"].n == 2
    assert {c.devices for c in chosen["one device"].configs.values()} == {(0,)}
    assert set(strategies(graph, Machine.simulated(1, 1))) == {"one device"}


def test_the_fit_explains_the_steps_and_more_tasks_cost_more(machine4):
    costs = step_costs(machine4, cpu_per_byte_s=1e-9, cpu_per_message_s=5e-4, steps=2, warmup=1, timed=2)
    rows = {r["strategy"]: r for r in costs["step_cpu_rows"]}
    assert set(rows) == {"data", "model", "owt", "height", "one device"}
    assert rows["one device"]["tasks"] == 1 and rows["one device"]["messages"] == 0
    assert costs["cpu_per_task_s"] >= 0 and costs["cpu_per_message_s"] == 5e-4  # measured apart: kept
    # a step whose work is split over channels runs more tasks and messages than data parallelism:
    # the runtime spends more processor time on it, and the fit charges it more
    assert rows["model"]["tasks"] > rows["data"]["tasks"]
    assert rows["model"]["runtime_cpu_s"] > rows["data"]["runtime_cpu_s"]

    def fitted(r):
        return costs["cpu_per_task_s"] * r["tasks"] + costs["cpu_per_message_s"] * r["messages"] + 1e-9 * r["bytes"]

    assert fitted(rows["model"]) > fitted(rows["data"]) > 0
    # one cost per task and message for the four steps that move data: each within a factor of two
    for r in rows.values():
        if r["messages"]:
            assert 0.5 < fitted(r) / r["runtime_cpu_s"] < 2.0, r
    # the latencies, read from the task stream of two more steps of each strategy
    assert len(costs["step_starts"]) == 5 and all(len(firsts) == 2 for _, firsts in costs["step_starts"])
    assert all(0 < s < 1 for _, firsts in costs["step_starts"] for s in firsts)
    # (an answer may be negative: a state output of a busy device ending after the losses were read)
    assert len(costs["step_answers"]) == 10 and all(-1 < a < 1 for a in costs["step_answers"])
    assert costs["step_gaps"]["same"] and costs["step_gaps"]["cross"]
    same, cross = ([g for g, _ in costs["step_gaps"][kind]] for kind in ("same", "cross"))
    assert all(-1e-3 < g < 1 for g in same) and 0 < trimmed_mean(same) < 0.1
    # a cross gap is less the link's modeled time for what it reads, which may be more than it waited
    assert all(-1 < g < 1 for g in cross)


def test_a_cost_model_on_shared_cores_takes_the_steps_costs(machine4, tmp_path, monkeypatch):
    """The runtime's costs the simulator gets: the processor time fitted to steps, and a step's
    start counting the client's own work: the scheduler's answer to which workers there are
    (measured by Machine.calibrate), building and serializing the step's graph and its way to the
    first task (timed on the plan)."""
    from taskrt.execution import executor as executor_module

    fitted = {"cpu_per_task_s": 0.003, "cpu_per_message_s": 123.0, "step_cpu_rows": [],
              "step_gaps": {"same": [], "cross": []}, "step_answers": [], "step_starts": []}
    monkeypatch.setattr(search.runtime_costs, "step_costs",
                        lambda machine, per_byte, per_message, fit_cpu, executor: fitted)
    model = search.CostModel(machine4, cache=tmp_path / "c.json", progress=False)
    # the processor time per task from the steps; per message, Machine.calibrate's own measurement
    assert model.calibration["cpu_per_task_s"] == 0.003 and 0 <= model.calibration["cpu_per_message_s"] < 0.1
    assert "noop_cpu_per_task_s" in model.calibration
    plan = _plan(machine4)
    runtime = model.runtime(plan, executor="tasks")
    assert runtime.cpu_per_task_s == 0.003 and runtime.cpu_per_message_s == model.calibration["cpu_per_message_s"]
    # programs: the steps run as programs give the processor time per program; per message, the mailbox's
    programs = model.runtime(plan)
    assert programs.programs and model.calibration["program_cpu_per_task_s"] == programs.cpu_per_task_s == 0.003
    assert programs.cpu_per_message_s == model.calibration["program_cpu_per_message_s"]
    assert 0 < model.calibration["check_s"] < 1
    monkeypatch.setattr(executor_module, "graph_seconds", lambda *a, **k: executor_module.GraphTimes(0, 0, 0, 1))
    without = model.runtime(plan, executor="tasks").start_s
    assert without >= model.calibration["check_s"]
    # built in 0.25 s, written in 0.5 and read in 0.125, on two devices: the client's 0.75 s, then the
    # scheduler reads it (0.125) and writes half of it for a worker, which reads that (0.3125)
    times = executor_module.GraphTimes(0.25, 0.5, 0.125, 2)
    monkeypatch.setattr(executor_module, "graph_seconds", lambda *a, **k: times)
    assert model.runtime(plan, executor="tasks").start_s == pytest.approx(without + 0.75 + 0.125 + 0.3125, abs=1e-12)


def test_a_simulated_machine_runs_no_steps(monkeypatch):
    monkeypatch.setattr(search.runtime_costs, "step_costs",
                        lambda *a, **k: pytest.fail("steps run on a simulated machine"))
    search.CostModel(Machine.simulated(1, 2), cache=False)


def _plan(machine):
    from taskrt.planning.lowering import lower

    graph = calibration_network(batch=8)
    return lower(graph, search.data_parallel(graph, machine))


def test_a_cost_model_on_local_workers_takes_the_latencies_of_steps(machine4, tmp_path, monkeypatch):
    """A task's dispatch is its gap less the device's own time per task (an export's for an export),
    a fetch the cross gap beyond that; the answer is the measured one; the start beyond the modeled
    one is fitted as a + b * tasks to each strategy's first task."""
    from taskrt.execution import executor as executor_module

    graph = calibration_network(batch=8)
    plans = {n: lower(graph, s) for n, s in strategies(graph, machine4).items() if n in ("data", "one device")}
    counts = {n: len(fused_plan(p)[0].tasks) for n, p in plans.items()}
    assert counts["one device"] == 1 < counts["data"]
    first = {"data": 0.03, "one device": 0.012}  # the steps' first tasks, after their start

    def measured(machine, per_byte, per_message, fit_cpu, executor):
        if executor == "programs":  # a program's hops never reach the scheduler
            return {"cpu_per_task_s": 0.003, "cpu_per_message_s": 0.0, "step_cpu_rows": [],
                    "step_gaps": {"same": [], "cross": []}, "step_answers": [0.001] * 8 + [0.5, 0.4],
                    "step_starts": [(p, [first[n]] * 3) for n, p in plans.items()]}
        return {"cpu_per_task_s": 0.003, "cpu_per_message_s": 0.0, "step_cpu_rows": [],
                "step_gaps": {"same": [(0.004, "fused")] * 5 + [(0.003, "export")] * 5,
                              "cross": [(0.009, "fused")] * 10},
                "step_answers": [0.002] * 8 + [0.5, 0.4],
                "step_starts": [(p, [first[n]] * 3) for n, p in plans.items()]}

    monkeypatch.setattr(search.runtime_costs, "step_costs", measured)
    times = executor_module.GraphTimes(1e-4, 1e-4, 1e-4, 1)
    monkeypatch.setattr(executor_module, "graph_seconds", lambda *a, **k: times)
    model = search.CostModel(machine4, cache=tmp_path / "c.json", progress=False)
    c = model.calibration
    # all gaps less the time per task of their kind: 4 ms - task, 3 ms - export
    net = sorted([0.004 - c["per_task_s"]] * 5 + [0.003 - c["export_s"]] * 5)
    assert c["step_dispatch_s"] == pytest.approx(max(np.mean(net[1:-1]), 0.0), abs=1e-12)
    assert c["step_fetch_s"] == pytest.approx(max(0.009 - c["per_task_s"] - c["step_dispatch_s"], 0.0), abs=1e-12)
    assert c["step_answer_s"] == pytest.approx(0.002)  # the median: not the slow ones
    assert len(c["step_start_rows"]) == 2
    assert c["program_step_answer_s"] == pytest.approx(0.001) and len(c["program_step_start_rows"]) == 2
    for name, plan in plans.items():
        programs = model.runtime(plan)
        assert programs.programs and programs.answer_s == c["program_step_answer_s"]
        runtime = model.runtime(plan, executor="tasks")
        assert runtime.dispatch_s == c["step_dispatch_s"] and runtime.fetch_s == c["step_fetch_s"]
        assert runtime.answer_s == c["step_answer_s"]
        # two strategies, a line through both: the simulated first task starts when the measured did
        modeled = runtime.start_s + runtime.per_task_submit_s * counts[name] + runtime.dispatch_s + runtime.task_s
        assert modeled == pytest.approx(first[name], abs=1e-9)


def test_step_timings_reads_the_gaps_of_a_schedule():
    """A made-up task stream of a model-parallel step: each task starts 1 ms after its inputs on its
    device, 3 ms plus the link's time after those from another device, when its device is free;
    the gaps read back are those, where the device was not busy."""
    machine = Machine.simulated(1, 2)
    graph = calibration_network(batch=8)
    fused, _ = fused_plan(lower(graph, strategies(graph, machine)["model"]))
    latency, bandwidth = np.full((2, 2), 1e-4), np.full((2, 2), 1e9)
    tag, began = "7-ab12", 1000.0
    spans, free = {}, {0: began + 0.005, 1: began + 0.005}
    for task in fused.tasks:  # plans list tasks in dependency order
        inputs = [d for d in task.deps if d.kind == TASK]
        ready = max((spans[d.key][1] for d in inputs), default=began + 0.005)
        remote = {}
        for d in inputs:
            source = fused.by_key[d.key].device
            if source != task.device:
                remote[source] = remote.get(source, 0) + (fused.nbytes_of(d) or 0)
        wait = 0.003 + max(1e-4 + n / 1e9 for n in remote.values()) if remote else 0.001
        start = max(ready + wait, free[task.device])
        spans[task.key] = (start, start + 0.002)
        free[task.device] = start + 0.002
    records = [{"key": (f"{k[0]}-it{tag}", *k[1:]), "startstops": [{"action": "compute", "start": a, "stop": b}]}
               for k, (a, b) in spans.items()]
    records.append({"key": ("other-it9-ff", 0), "startstops": [{"action": "compute", "start": 0.0, "stop": 1.0}]})
    ended = max(b for _, b in spans.values()) + 0.0015
    out = step_timings(fused, records, tag, began, ended, latency, bandwidth)
    assert out["first_start_s"] == pytest.approx(0.006)
    same, cross = ([g for g, _ in out["gaps"][k]] for k in ("same", "cross"))
    assert same and cross
    assert np.allclose(same, 0.001) and np.allclose(cross, 0.003)
    assert {p for _, p in out["gaps"]["same"] + out["gaps"]["cross"]} <= {t.phase for t in fused.tasks}
    outputs = [k for k in output_keys(fused.outputs) if k in fused.by_key]
    assert out["answer_s"] >= 0.0015 - 1e-12 and outputs
    # a task that started before an input ended did not wait for it (the executor's graph lacked
    # that dependency): no gap of it is read
    late = next(t for t in fused.tasks if t.phase != "export" and any(
        d.kind == TASK and fused.by_key[d.key].device == t.device for d in t.deps))
    ready = max(spans[d.key][1] for d in late.deps if d.kind == TASK)
    moved = [{**r, "startstops": [{"action": "compute", "start": ready - 0.001, "stop": ready}]}
             if r["key"] == (f"{late.key[0]}-it{tag}", *late.key[1:]) else r for r in records]
    again = step_timings(fused, moved, tag, began, ended, latency, bandwidth)
    assert len(again["gaps"]["same"]) + len(again["gaps"]["cross"]) == len(same) + len(cross) - 1
    assert all(g >= 0 for g, _ in again["gaps"]["same"] + again["gaps"]["cross"])
    # a fused run missing from the stream: nothing read
    run = next(t.key for t in fused.tasks if t.phase == "fused")
    assert step_timings(fused, [r for r in records if r["key"][1:] != run[1:] or not r["key"][0].startswith(run[0])],
                        tag, began, ended, latency, bandwidth) is None


def test_a_start_fitted_below_zero_comes_off_the_answer(machine4, tmp_path, monkeypatch):
    """Start and answer are read off the same steps: where the fitted start would be negative, the
    step's start plus answer stays what was measured (the answer shorter, the start zero)."""
    from taskrt.execution import executor as executor_module

    graph = calibration_network(batch=8)
    plan = lower(graph, strategies(graph, machine4)["one device"])

    def measured(machine, per_byte, per_message, fit_cpu, executor):
        return {"cpu_per_task_s": 0.003, "cpu_per_message_s": 0.0, "step_cpu_rows": [],
                "step_gaps": {"same": [], "cross": []}, "step_answers": [0.02] * 5,
                "step_starts": [(plan, [0.001] * 3)]}  # its first task long before the modeled start

    monkeypatch.setattr(search.runtime_costs, "step_costs", measured)
    times = executor_module.GraphTimes(0.01, 0.01, 0.01, 1)
    monkeypatch.setattr(executor_module, "graph_seconds", lambda *a, **k: times)
    model = search.CostModel(machine4, cache=tmp_path / "c.json", progress=False)
    extra = model.calibration["step_start_extra_s"]
    assert extra < 0
    other = lower(graph, strategies(graph, machine4)["data"])  # a plan whose modeled start is no longer
    monkeypatch.setattr(executor_module, "graph_seconds", lambda *a, **k: executor_module.GraphTimes(0.001, 0.001,
                                                                                                     0.001, 1))
    runtime = model.runtime(other, executor="tasks")
    unfitted = search.runtime_costs.runtime(model.machine, {k: v for k, v in model.calibration.items()
                                                            if k != "step_start_extra_s"}, other, corun=model.corun,
                                            executor="tasks")
    assert unfitted.start_s + extra < 0
    assert runtime.start_s == 0.0
    assert runtime.answer_s == pytest.approx(max(0.02 + unfitted.start_s + extra, 0.0), abs=1e-12)
    assert runtime.answer_s < model.calibration["step_answer_s"]


def test_the_start_line_ignores_one_strategy_far_off():
    """One calibration strategy whose first tasks all started late (seen: a one-task strategy 67 ms
    late) must not tilt the start's line: least squares gave +54 ms and -1.2 ms per task there."""
    from taskrt.search.step_costs import robust_line

    tasks = np.array([20.0, 44.0, 42.0, 45.0, 1.0])
    extra = 0.002 + 0.0001 * tasks
    late = extra.copy()
    late[-1] += 0.067
    assert robust_line(tasks, late) == pytest.approx((0.002, 0.0001), abs=1e-12)
    slope, intercept = np.polyfit(tasks, late, 1)
    assert intercept > 0.04 and slope < -0.001  # what least squares made of the same points
    # two points: the line through both; one task count: their median, flat
    assert robust_line([1.0, 21.0], [0.001, 0.003]) == pytest.approx((0.0009, 0.0001), abs=1e-12)
    assert robust_line([5.0, 5.0, 5.0], [0.001, 0.002, 0.009]) == (0.002, 0.0)


def test_program_timings_read_the_first_start_and_the_last_end_of_a_steps_programs():
    from taskrt.search.step_costs import program_timings

    def record(key, start, stop):
        return {"key": key, "startstops": [{"action": "compute", "start": start, "stop": stop}]}

    records = [record("dev0-program-it7-ab", 10.25, 11.0), record("dev1-program-it7-ab", 10.5, 11.5),
               record("dev0-program-it8-cd", 9.0, 20.0), record(("conv1-fwd-it7-ab", 0), 1.0, 30.0)]
    timed = program_timings(records, "7-ab", 10.0, 11.75)
    assert timed == {"gaps": {"same": [], "cross": []}, "first_start_s": 0.25, "answer_s": 0.25}
    assert program_timings(records, "9-xy", 10.0, 11.0) is None


def test_steps_run_as_programs_count_a_dask_task_per_device(machine4):
    costs = step_costs(machine4, steps=1, warmup=1, timed=2, rounds=1, executor="programs")
    rows = {r["strategy"]: r for r in costs["step_cpu_rows"]}
    assert rows["one device"]["tasks"] == 1 and rows["data"]["tasks"] == machine4.num_devices
    assert costs["step_gaps"] == {"same": [], "cross": []}
    assert len(costs["step_answers"]) == 10 and all(-1 < a < 1 for a in costs["step_answers"])
    assert all(0 < s < 1 for _, firsts in costs["step_starts"] for s in firsts)
