"""search.optimize chooses what it chose before its cost tables were rebuilt for speed.

tests/search_golden.json holds, per zoo network (batch 32 per device) on small simulated
machines, a digest of the chosen strategy, how many layers take each config, and the predicted
step time, as written by the earlier implementation (per-layer probing of the region rules,
plan-based memory accounting, no shared tables).  Regenerate it (`python -m tests.test_search_golden`)
only for an intended change of the cost model."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from taskrt import models
from taskrt.machines.machine import Machine
from taskrt.search import CostModel, optimize

GOLDEN = Path(__file__).with_name("search_golden.json")
MODELS = ["lenet5", "alexnet", "vgg16", "inception_v3", "resnet50"]
MACHINES = [(1, 2), (2, 2), (1, 4), (2, 4)]


def record(model, nodes, devices_per_node) -> dict:
    machine = Machine.simulated(nodes, devices_per_node)
    graph = models.get(model, batch=32 * machine.num_devices)
    strategy = optimize(graph, machine, CostModel(machine, cache=False))
    layers = {name: str(config) for name, config in strategy.configs.items()}
    return {"model": model, "nodes": nodes, "devices_per_node": devices_per_node,
            "strategy_sha256": hashlib.sha256(json.dumps(layers, sort_keys=True).encode()).hexdigest(),
            "configs": dict(Counter(layers.values())), "predicted_step_s": strategy.meta["predicted_step_s"]}


def cases():
    return json.loads(GOLDEN.read_text())["cases"] if GOLDEN.exists() else [None]  # None: being written


def case_id(case) -> str:
    return "missing" if case is None else f"{case['model']}-{case['nodes']}x{case['devices_per_node']}"


@pytest.mark.parametrize("expected", cases(), ids=case_id)
def test_optimize_chooses_what_it_chose_before(expected):
    assert expected is not None, f"{GOLDEN} is missing"
    got = record(expected["model"], expected["nodes"], expected["devices_per_node"])
    assert got["configs"] == expected["configs"]
    assert got["strategy_sha256"] == expected["strategy_sha256"]
    assert got["predicted_step_s"] == pytest.approx(expected["predicted_step_s"], rel=1e-12)


if __name__ == "__main__":
    out = [record(m, n, d) for m in MODELS for n, d in MACHINES]
    GOLDEN.write_text(json.dumps({"batch_per_device": 32, "cases": out}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(out)} cases)", file=sys.stderr)
