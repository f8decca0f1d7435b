"""The accuracy benchmark's ranking line, on made-up rows."""

from __future__ import annotations

from bench.accuracy import ranking


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
