"""The timing sessions the accuracy benchmark takes its predictions from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import taskrt.search.runtime_costs
from taskrt import search
from taskrt.bench.measure import median_timings, refitted, retiming_rounds, spread
from taskrt.machines.machine import Machine
from taskrt.search.cost_cache import CostCache


def session(tmp_path, name, parts: dict):
    cache = CostCache(tmp_path / name)
    cache.data["parts"] = parts
    return SimpleNamespace(cache=cache)


def test_each_timing_becomes_the_median_of_the_sessions_that_all_timed_it(tmp_path):
    machine = Machine.simulated(1, 2)
    first = search.CostModel(machine, cache=tmp_path / "first.json", progress=False)
    first.cache.data["parts"] = {"cpu:x": {"a": [1.0, 10.0], "b": [2.0, 20.0]}}
    later = [session(tmp_path, "s1.json", {"cpu:x": {"a": [3.0, 30.0], "b": [9.0, 90.0]}}),
             session(tmp_path, "s2.json", {"cpu:x": {"a": [2.0, 40.0]}})]  # "b" not timed again here
    merged = median_timings(first, later, tmp_path)
    assert merged.cache.get("cpu:x", "a") == pytest.approx([2.0, 30.0])
    assert merged.cache.get("cpu:x", "b") == [2.0, 20.0]  # kept as it was: one session lacks it
    assert first.cache.get("cpu:x", "a") == [1.0, 10.0]  # the search's own timings are left alone


def test_what_was_fitted_to_steps_becomes_the_median_of_the_fits(tmp_path, machine4):
    key = f"{machine4.devices[0].kind}|{machine4.num_devices} devices"
    cache = CostCache(tmp_path / "first.json")
    cache.data["overhead"][key] = {"format": taskrt.search.runtime_costs.CALIBRATION_FORMAT, "per_hop_s": 1e-3,
                                   "memory_bandwidth": 1e10, "cpu_per_task_s": 4e-3, "noop_cpu_per_task_s": 1e-3,
                                   "step_dispatch_s": 1e-3, "step_start_extra_s": -2e-3}
    cache.save()
    first = search.CostModel(machine4, cache=tmp_path / "first.json", progress=False)
    assert refitted(first.calibration) == {"cpu_per_task_s": 4e-3, "step_dispatch_s": 1e-3,
                                           "step_start_extra_s": -2e-3}
    later = [SimpleNamespace(cache=CostCache(tmp_path / f"s{i}.json")) for i in range(3)]
    fits = [{"cpu_per_task_s": 3e-3, "step_dispatch_s": 5e-3, "step_start_extra_s": 1e-3},
            {"cpu_per_task_s": 2e-3, "step_dispatch_s": 4e-3, "step_start_extra_s": 0.0}]
    merged = median_timings(first, later, tmp_path, fits)  # two of three sessions fitted again
    assert merged.calibration["cpu_per_task_s"] == pytest.approx(3e-3)
    assert merged.calibration["step_dispatch_s"] == pytest.approx(4e-3)
    assert merged.calibration["step_start_extra_s"] == pytest.approx(0.0)
    assert merged.calibration["per_hop_s"] == 1e-3  # measured on no-op tasks: not fitted again
    assert first.calibration["cpu_per_task_s"] == 4e-3  # the search's own calibration is left alone


def test_the_processor_time_per_task_of_no_op_tasks_is_not_a_fit():
    """Where devices do not share cores it is the no-op tasks' (`Machine.calibrate`), not refitted."""
    assert refitted({"cpu_per_task_s": 4e-3, "step_answer_s": 2e-3, "per_hop_s": 1e-3}) == {"step_answer_s": 2e-3}


def test_retimings_spread_over_the_rounds_and_refits_over_the_retimings():
    assert spread(10, 10) == set(range(10))
    assert spread(10, 2) == {4, 9}
    assert spread(10, 0) == set()
    assert retiming_rounds(10, 10, 2) == (set(range(10)), {4, 9})
    assert retiming_rounds(10, 2, 5) == ({4, 9}, {4, 9})  # no more refits than retimings
    assert retiming_rounds(10, 0, 2) == (set(), set())


def test_nothing_is_fitted_to_steps_without_cpu_workers_to_run_them(tmp_path):
    """Simulated devices (and GPUs) take their runtime costs from no-op tasks: no training steps."""
    model = search.CostModel(Machine.simulated(1, 2), cache=tmp_path / "c.json", progress=False)
    assert model.fit_to_steps(model.calibration) == {}
