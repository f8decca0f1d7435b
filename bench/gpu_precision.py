"""bf16 against fp32, judged by what a second fp32 run does: part "bf16" of `bench gpu`.

LeNet-5 trained on the bundled digits (a fixed task that learns) on one GPU worker, four times from
the same initial parameters: fp32 and bf16 on the same batches in the same order, fp32 on them
again (with cuDNN's deterministic algorithms and no autotuner, `ops.torch_kernels.set_deterministic`,
this run repeats the first bit for bit: what is left between the first two is bf16's own), and fp32
on the same data shuffled in another order, a run a user would take as equally good.  The checks:

- held-out accuracy (the digits' test split) after the steps: bf16's within BF16_ACCURACY_POINTS
  points of fp32's;
- the loss curve (each run's losses as a moving mean over `window` steps): bf16's mean distance
  from fp32's at most BF16_CURVE_FACTOR times the reordered fp32 run's distance from it.

A second fp32 run on the same batches is no yardstick once the algorithms are deterministic (it is
zero), and one with the GPU's own nondeterminism measures the atomics' rounding, not what a user
would call the same training; another order of the same data is a change no user would object to.
On a CPU worker (`device="cpu"`) bf16 changes nothing: the part's plumbing can be tried there.
"""

from __future__ import annotations

import numpy as np

from taskrt.bench.goals import BF16_ACCURACY_POINTS, BF16_CURVE_FACTOR

STEPS = 200
WINDOW = 20
RUNS = {"fp32": ("fp32", 0), "bf16": ("bf16", 0), "fp32_again": ("fp32", 0), "fp32_reordered": ("fp32", 1)}


def moving_mean(values, window: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(values)))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def curve_distance(losses, reference, window: int) -> float:
    """The mean distance between two loss curves' moving means, relative to the reference's mean."""
    a, b = moving_mean(losses, window), moving_mean(reference, window)
    return float(np.mean(np.abs(a - b)) / max(np.mean(np.abs(b)), 1e-30))


def precision_row(steps: int = STEPS, window: int = WINDOW, lr=0.05, momentum=0.9, device="cuda") -> dict:
    """The four runs (RUNS: precision and the data order's seed) and the checks' figures."""
    from taskrt import models, search
    from taskrt.data.arrays import epoch_batches, load_digits
    from taskrt.machines.machine import Machine
    from taskrt.ops.torch_kernels import set_deterministic
    from taskrt.training.trainer import Trainer

    graph = models.lenet5(batch=64)
    x_train, y_train, x_test, y_test = load_digits(image_size=32, seed=0)
    losses, accuracy = {}, {}
    with Machine.local(1, gpu=device == "cuda") as machine:
        machine.client.run(set_deterministic, True)
        for run, (precision, order) in RUNS.items():
            trainer = Trainer(graph, search.data_parallel(graph, machine), machine, lr=lr, momentum=momentum,
                              precision=precision, seed=0)
            rng, futures = np.random.default_rng(order), []
            while len(futures) < steps:
                for xb, yb in epoch_batches(x_train, y_train, 64, rng):
                    futures.append(trainer.submit(xb, yb))
                    if len(futures) == steps:
                        break
            losses[run] = [f.result() for f in futures]
            accuracy[run] = float(np.mean(np.argmax(trainer.predict(x_test), axis=1) == y_test))
        machine.client.run(set_deterministic, False)
    bf16 = curve_distance(losses["bf16"], losses["fp32"], window)
    reordered = curve_distance(losses["fp32_reordered"], losses["fp32"], window)
    points = abs(accuracy["bf16"] - accuracy["fp32"]) * 100
    return {"part": "bf16", "model": "lenet5 on digits", "steps": steps, "window": window,
            **{f"accuracy_{run}": value for run, value in accuracy.items()},
            "accuracy_points": points, "accuracy_met": points <= BF16_ACCURACY_POINTS,
            "curve_bf16": bf16, "curve_reordered": reordered,
            "curve_met": bf16 <= BF16_CURVE_FACTOR * reordered,
            "fp32_repeat_max_diff": max(abs(a - b) for a, b in zip(losses["fp32_again"], losses["fp32"])),
            **{f"losses_{run}": values for run, values in losses.items()}}


def met(row: dict) -> bool:
    return row["accuracy_met"] and row["curve_met"]


def precision_summary(rows) -> list[str]:
    lines = []
    for r in rows:
        if "curve_bf16" not in r:
            continue
        lines.append(
            f"bf16 against fp32, {r['model']}, {r['steps']} steps: held-out accuracy {r['accuracy_bf16']:.2%} against "
            f"{r['accuracy_fp32']:.2%} ({r['accuracy_points']:.2f} points; goal {BF16_ACCURACY_POINTS}: "
            f"{'met' if r['accuracy_met'] else 'missed'}); loss curve ({r['window']}-step means) {r['curve_bf16']:.2%} "
            f"from fp32's, the same data in another order {r['curve_reordered']:.2%} (goal at most "
            f"{BF16_CURVE_FACTOR:g}x: {'met' if r['curve_met'] else 'missed'}); fp32 run again on the same batches: "
            f"losses within {r['fp32_repeat_max_diff']:.1e} (deterministic algorithms: 0)")
    return lines
