"""Choosing a strategy by timing it (search.measured) and optimize(check_by_measurement=True)."""

from __future__ import annotations

import pytest

from taskrt import models, search
from taskrt.machines.machine import Machine
from taskrt.search.measured import pick_by_measurement, random_batch


def small():
    return models.lenet5(batch=8, image_size=16, width=0.5)


def test_the_fastest_measured_candidate_is_chosen_and_every_candidate_timed(machine4):
    graph = small()
    pool = {name: make(graph, machine4) for name, make in search.BASELINES.items()}
    picked = pick_by_measurement(graph, machine4, pool, rounds=2, warmup=1)
    measured = picked.meta["chosen_by_measurement"]
    assert set(measured["median_step_s"]) == set(pool) and measured["rounds"] == 2
    assert all(seconds > 0 for seconds in measured["median_step_s"].values())
    best = min(measured["median_step_s"], key=measured["median_step_s"].get)
    assert measured["chosen"] == best and picked.configs == pool[best].configs


def test_optimize_keeps_its_meta_and_names_what_the_measurement_chose(machine4, cost_cache4):
    graph = small()
    model = search.CostModel(machine4, cache=cost_cache4, repeats=1, progress=False)
    strategy = search.optimize(graph, machine4, model, check_by_measurement=True)
    measured = strategy.meta["chosen_by_measurement"]
    assert "layer-wise" in measured["median_step_s"] and measured["chosen"] in measured["median_step_s"]
    assert strategy.meta["memory_per_device"] and strategy.meta["predicted_step_s"] > 0
    if measured["chosen"] != "layer-wise":  # the baseline's configs, priced by the same model
        chosen = search.BASELINES[measured["chosen"]](graph, machine4).validated(graph, machine4)
    else:
        chosen = search.optimize(graph, machine4, model).validated(graph, machine4)
    assert strategy.configs == chosen.configs


def test_a_simulated_machine_or_no_candidate_is_refused_before_anything_runs(machine4):
    graph = small()
    simulated = Machine.simulated(1, 4)
    with pytest.raises(ValueError, match="running cluster .*simulated machine"):
        pick_by_measurement(graph, simulated, {"data": search.data_parallel(graph, simulated)})
    with pytest.raises(ValueError, match="at least one candidate"):
        pick_by_measurement(graph, machine4, {})
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        pick_by_measurement(graph, machine4, {"data": search.data_parallel(graph, machine4)}, rounds=0)


def test_random_batches_fit_the_graph():
    graph = small()
    x, y = random_batch(graph)
    assert x.shape == graph.inputs[0].shape and y.shape == graph.inputs[1].shape
    assert 0 <= y.min() and y.max() < graph[graph.losses[0].inputs[0]].shape[1]
