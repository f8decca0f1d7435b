"""The dashboard's taskrt page: served by the scheduler's dashboard, showing the strategy, the
bytes per device pair (planned and measured) and the step times."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from taskrt.observing.dashboard import PATH, page_url
from taskrt.training.trainer import Trainer
from tests.graphs import mixed_lenet_strategy, small_lenet


def mixed(graph):
    return mixed_lenet_strategy(graph, fc_devices=(1, 3), name="mixed-for-the-page")


def sources(doc) -> dict:
    """The page's data sources by their first column."""
    from bokeh.models import ColumnDataSource

    return {next(iter(s.data), None): s.data for s in doc.select({"type": ColumnDataSource})}


def test_page_is_served_and_shows_the_running_strategy(machine4):
    from bokeh.client import pull_session
    from bokeh.models import Div

    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine4)
    rng = np.random.default_rng(0)
    for _ in range(3):
        trainer.step(rng.standard_normal(graph.inputs[0].shape).astype(np.float32), rng.integers(0, 10, 4))
    trainer.publish(predicted_step_s=0.123)
    url = page_url(machine4.client)
    assert url.startswith("http://127.0.0.1:") and url.endswith(PATH)

    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        html = response.read().decode()
    assert "taskrt: strategy" in html  # the page's title: a Bokeh document of the scheduler

    with pull_session(url=url) as session:  # the document the browser draws, over the websocket
        doc = session.document
        [header] = doc.select({"type": Div})
        assert "lenet5" in header.text and "mixed-for-the-page" in header.text
        assert "3 steps" in header.text and "measured bytes (step 3) equal the plan" in header.text
        assert "predicted 123.0 ms" in header.text
        memory = trainer.memory()
        assert f"device 1: {memory[1].predicted.total / 2**20:,.1f} / {memory[1].measured / 2**20:,.1f}" in header.text
        data = sources(doc)
        grid, pairs, steps = data["layer"], data["pair"], data["step"]
        cells = set(zip(grid["layer"], grid["device"], grid["split"]))
        devices = [f"{d.id} ({d.kind})" for d in machine4.devices]
        assert ("conv2", devices[2], "h=2") in cells and ("conv2", devices[0], "h=2") in cells
        assert ("fc1", devices[3], "c=2") in cells and ("conv1", devices[1], "n=2") in cells
        assert len(grid["layer"]) == sum(len(trainer.strategy[name].devices) for name in graph.layers)
        planned = {f"{s}->{d}": b for (s, d), b in trainer.plan.bytes_by_pair().items()}
        assert dict(zip(pairs["pair"], pairs["planned"])) == planned
        assert dict(zip(pairs["pair"], pairs["measured"])) == planned  # the transfer logs agree
        assert list(steps["step"]) == [1, 2, 3] and all(ms > 0 for ms in steps["ms"])


def test_page_says_so_when_nothing_was_published():
    from taskrt.observing.dashboard import _header, bytes_columns, grid_columns

    data = {"graph": "g", "strategy": "s", "machine": "m", "steps_done": 0, "layers": [], "devices": [],
            "planned_bytes": {"0->1": 10}, "measured_bytes": {"0->1": 12}, "measured_step": 1,
            "step_times": [], "predicted_step_s": None, "recoveries": [],
            "memory": [[0, 3 * 2**20, 2**20, 4 * 2**20], [2, 2**21, None, None]]}
    assert "<b>differ from the plan</b>" in _header(data)
    assert "device 0: 3.0 / 1.0 of 4.0; device 2: 2.0 / ?</p>" in _header(data)
    assert bytes_columns(data) == {"pair": ["0->1"], "planned": [10], "measured": [12]}
    assert grid_columns(data) == {"layer": [], "device": [], "color": [], "label": [], "split": []}


@pytest.mark.parametrize("degrees, name", [({"n": 2, "c": 1, "h": 1, "w": 1}, "n=2"),
                                           ({"n": 1, "c": 1, "h": 1, "w": 1}, "one part"),
                                           ({"n": 2, "c": 2, "h": 1, "w": 1}, "n=2 c=2")])
def test_split_names(degrees, name):
    from taskrt.observing.dashboard import _split_name

    assert _split_name(degrees) == name


def test_bytes_measured_before_a_recovery_are_not_shown_under_the_new_numbering(monkeypatch):
    """A recovery numbers the devices anew: the pairs measured before it would name other devices."""
    from types import SimpleNamespace

    from taskrt.observing import dashboard

    shown = []
    monkeypatch.setattr(dashboard, "page_data", lambda trainer, measured, *rest: shown.append(measured) or {})
    client = SimpleNamespace(set_metadata=lambda *args: None)
    trainer = SimpleNamespace(strategy=SimpleNamespace(meta={}), stats=SimpleNamespace(measured_bytes={(2, 0): 5}),
                              devices_in_use=[0, 1, 2], machine=SimpleNamespace(client=client))
    publisher = dashboard.Publisher(trainer)
    publisher.publish(measure=True)
    trainer.devices_in_use = [0, 2]
    publisher.publish(measure=False)
    assert shown == [{(2, 0): 5}, None]
