"""`taskrt search` on a simulated machine: the strategy table with its sync methods, the memory per
device, the comparison with the baselines, and the strategy file with its JSON-ready meta."""

from __future__ import annotations

import json

import pytest

from taskrt.cli import main
from taskrt.graph.strategy import Strategy


def test_search_prints_memory_per_device_and_saves_it(tmp_path, capsys):
    out = tmp_path / "lenet.json"
    assert main(["search", "--model", "lenet5", "--machine", "simulated:1x4", "--batch-per-device", "8",
                 "--image-size", "16", "--compare", "--cache", str(tmp_path / "c.json"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memory per device of one step" in text and "parameters" in text and "of capacity" in text
    assert "t_s ms  sync" in text and "(layer-wise is" in text
    assert "ms simulated (its plan list-scheduled" in text and "equation 1 adds the layers' costs up" in text
    saved = Strategy.load(out)
    memory = json.loads(out.read_text())["meta"]["memory_per_device"]
    assert sorted(memory) == ["0", "1", "2", "3"][: len(memory)] and memory["0"]["total"] > 0
    assert saved.meta["memory_per_device"] == memory


def test_search_rejects_a_bad_machine_spec(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--model", "lenet5", "--machine", "simulated:four"])
    assert "expected simulated:<nodes>x<devices per node>" in capsys.readouterr().err


def test_search_measures_only_on_a_local_machine():
    with pytest.raises(SystemExit, match="--measure times the candidates on a running cluster.*simulated:1x4"):
        main(["search", "--model", "lenet5", "--machine", "simulated:1x4", "--measure"])


@pytest.mark.slow  # a cost model calibrated on a local machine, then candidates trained (over a minute)
def test_search_measures_the_candidates_on_a_local_machine(tmp_path, capsys):
    assert main(["search", "--model", "lenet5", "--machine", "local:2", "--batch-per-device", "4",
                 "--image-size", "16", "--measure", "--cache", str(tmp_path / "c.json")]) == 0
    text = capsys.readouterr().out
    assert "measured on the machine (median step of 3 rounds): " in text and "; chosen: " in text
    assert "ms simulated (its plan list-scheduled" in text and " ms measured" in text
    # a local machine's workers have a memory limit: the budget is held against the schedule's peak
    assert "peak under the runtime's schedule (what a trainer checks against the budget)" in text
