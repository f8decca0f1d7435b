"""bench ist's parts that need no long training: the generated task, the batches, the evaluation
schedule, the learning-rate search's rule (on made-up curves) and the simulated step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from taskrt.bench import ist_training
from taskrt.bench.ist_training import (
    QUICK,
    Curve,
    kernel_seconds,
    next_evaluation,
    search_lr,
    simulated_step,
    site_batches,
    speech_like,
)


def test_the_task_is_seeded_standardized_and_has_every_class():
    a, b = speech_like(**QUICK.task), speech_like(**QUICK.task)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(speech_like(**QUICK.task, seed=1).x_train, a.x_train)
    assert a.x_train.shape == (4096, 256) and a.x_test.shape == (512, 256) and a.x_train.dtype == np.float32
    np.testing.assert_allclose(a.x_train.mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(a.x_train.std(axis=0), 1, atol=1e-3)
    assert set(a.y_train.tolist()) == set(range(35)) and a.classes == 35


def test_site_batches_cut_epochs_without_repeats():
    task = speech_like(**QUICK.task)
    steps = site_batches(task, sites=4, batch=32, seed=0)
    seen = []
    for _ in range(4096 // (4 * 32)):  # one epoch
        step = next(steps)
        assert len(step) == 4 and all(x.shape == (32, 256) and y.shape == (32,) for x, y in step)
        seen += [x[:, 0].tolist() for x, _ in step]
    firsts = [v for batch in seen for v in batch]
    assert len(set(firsts)) == len(firsts) == 4096  # every sample once


def test_evaluations_every_round_then_every_five_percent():
    points, steps = [], 0
    while steps < 1000:
        steps = next_evaluation(steps, 10)
        points.append(steps)
    assert points[:20] == list(range(10, 210, 10))
    gaps = np.diff(points)
    assert all(g % 10 == 0 for g in gaps)
    assert all(g <= max(10, 0.05 * p + 5) for g, p in zip(gaps, points))


def _curve(reached_at, last=0.5, targets=(0.6, 0.7)):
    """Evaluated every 10 steps: every target reached at `reached_at`, else `last` at step 100."""
    c = Curve(targets)
    for steps in range(10, (reached_at or 100) + 10, 10):
        c.add(steps, 0.75 if steps == reached_at else last * steps / 100, 0.0)
    return c


def test_curves_rank_by_targets_then_steps_then_accuracy():
    assert _curve(40).score() < _curve(50).score() < _curve(None, 0.65).score() < _curve(None, 0.55).score()
    assert _curve(None, 0.65).reached == {0.6: (100, 0.0)}
    nan = Curve((0.6,))
    nan.add(10, math.nan, 0.0)
    assert nan.done and nan.diverged and _curve(None, 0.1).score() < nan.score()


def test_search_stops_runs_that_cannot_win_and_extends_at_an_edge(monkeypatch):
    """QUICK tries 0.3 then 1.0 first.  Steps to the top target per learning rate: 0.3 is the best
    and the lowest tried, so 0.1 is tried next and loses; 3.0 never.  Every run after the first
    is stopped at the best's steps."""
    steps = {0.1: 80, 0.3: 40, 1.0: None}
    limits = {}

    def fake_train(runs, limit):
        (lr,) = runs
        limits[lr] = limit[lr]
        return {lr: _curve(steps[lr] if steps[lr] and steps[lr] <= limit[lr] else None, 0.65)}

    monkeypatch.setattr(ist_training, "train", fake_train)
    monkeypatch.setattr(ist_training, "Run", lambda method, setting, task, sites, lr: {lr: None})
    found = search_lr("ist", 2, QUICK, None, log=lambda _: None)
    assert found["lr"] == 0.3
    assert limits == {0.3: QUICK.max_steps, 1.0: 40, 0.1: 40}
    assert list(found["runs"]) == [0.3, 1.0, 0.1]


@pytest.mark.parametrize("method", ["dp", "ist"])
def test_simulated_step_moves_the_plans_bytes(method):
    task = speech_like(**QUICK.task)
    plans, seconds = kernel_seconds([(method, 2)], QUICK, task, repeats=1)
    row = simulated_step(method, 2, plans[(method, 2)], seconds, QUICK)
    assert row["step_s"] > 0 and row["busiest_device_compute_s"] > 0
    if method == "ist":  # each round: site 1's blocks out and back, over J steps
        widths = QUICK.widths
        block = widths[0] * widths[1] // 2 + (widths[1] // 2) * (widths[2] // 2) + widths[2] // 2 * widths[3]
        norms = 4 * (widths[1] // 2 + widths[2] // 2)  # scale, shift, running mean and variance
        assert row["bytes_per_step"] == 2 * 4 * (block + norms) / QUICK.local_steps
    else:  # ring all-reduce on 2 devices: 2 (n - 1) P floats, and the batch norms' statistics
        params = sum(a * b for a, b in zip(QUICK.widths[:-1], QUICK.widths[1:])) + 2 * 2 * 256
        assert 2 * params <= row["bytes_per_step"] / 4 <= 1.02 * 2 * params


def test_ablation_reuses_known_curves_and_extends_at_an_edge(monkeypatch):
    """Final accuracy per learning rate rises up to 1.0: the grid's best (0.3) is at its edge, so
    1.0 is tried, then 3.0 (1.0 is still at the edge), which loses.  Known curves are not rerun."""
    accuracy = {0.1: 0.5, 0.3: 0.7, 1.0: 0.8, 3.0: math.nan}
    trained = []

    def fake_train(setting, task, sites, lr, shape, steps, every):
        trained.append((shape["norm"], lr))
        return [{"steps": steps, "accuracy": accuracy[lr]}]

    monkeypatch.setattr(ist_training, "_ablation_curve", fake_train)
    known = [{"sites": 2, "variant": "batch_norm", "curves": {"0.1": [{"steps": 60, "accuracy": 0.5}]}}]
    rows = ist_training.ablation(QUICK, None, (2,), 60, (0.1, 0.3), known=known, log=lambda _: None)
    assert [(r["variant"], r["lr"]) for r in rows] == [("batch_norm", 1.0), ("no_norm", 1.0)]
    assert trained == [(True, 0.3), (True, 1.0), (True, 3.0), (False, 0.1), (False, 0.3), (False, 1.0), (False, 3.0)]
    assert list(rows[0]["curves"]) == ["0.1", "0.3", "1.0", "3.0"]
