"""The accuracy benchmark's summary lines, on made-up rows."""

from __future__ import annotations

from taskrt.bench.accuracy import calibration_line, processor_line, ranking


def row(model, devices, strategy, measured, simulated):
    return {"model": model, "devices": devices, "strategy": strategy, "measured_ms": measured,
            "simulated_ms": simulated}


def test_ranking_names_the_networks_whose_simulated_pick_is_not_the_measured_fastest():
    rows = [row("a", 1, "single device", 10, 9),  # one device: nothing to rank
            row("a", 2, "data", 10, 9), row("a", 2, "model", 12, 11),
            row("b", 2, "data", 10, 9), row("b", 2, "layer-wise", 12, 8)]
    line = ranking(rows)
    assert line.startswith("ranking: the simulation's fastest strategy is the measured fastest for 1 of 2 networks")
    assert "b on 2: simulated fastest layer-wise measured 1.20x the step of data" in line
    assert "a on 2" not in line


def test_the_calibration_line_says_which_costs_were_fitted_to_steps():
    one = {"per_hop_s": 0.002, "cpu_per_task_s": 0.001, "cpu_per_byte_s": 1e-9}
    two = {**one, "cpu_per_task_s": 0.003, "noop_cpu_per_task_s": 0.001, "cpu_per_message_s": 0.0}
    line = calibration_line({1: one, 2: two})
    assert line.startswith("runtime costs calibrated in this run: 1 device(s): per hop 2.00 ms, processor time per "
                           "task 1.00 ms, per byte 1.00 ns; 2 device(s):")
    assert "task 3.00 ms (fitted to training steps; 1.00 ms for no-op tasks), per message 0.00 ms" in line


def test_the_processor_line_compares_processor_time_and_names_the_idle_cores_of_short_predictions():
    rows = [{**row("a", 2, "data", 100, 95), "simulated_error": -0.05, "cpu_ms": 180, "simulated_cpu_ms": 171,
             "idle_core_ms": 20, "simulated_idle_core_ms": 19},
            {**row("a", 2, "model", 100, 80), "simulated_error": -0.2, "cpu_ms": 150, "simulated_cpu_ms": 165,
             "idle_core_ms": 50, "simulated_idle_core_ms": -5},
            {**row("a", 1, "single device", 10, 9), "simulated_error": -0.1, "simulated_cpu_ms": None}]
    line = processor_line(rows)
    assert line.startswith("processor time per step (all processes), simulated against measured: -5% to +10%")
    assert "a model on 2 measured 50 ms, simulated -5 ms" in line
    assert "a data on 2 measured" not in line
    assert processor_line([rows[2]]) is None
