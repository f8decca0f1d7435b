"""Seed 004's Sec. 3.3: IST with and without batch norm, the whole network evaluated.

The seed argues that a subnet sees a neuron's input summed over 1/n of the previous layer, the
deployed network over all of it, and that IST "will simply not work" without normalization.
Here IST trains the speech-shaped network for `steps` steps at each site count, with batch norm
(hidden layers bias-free) and without (hidden layers with a bias, as PyTorch's default linear
layer), each at the best learning rate of the same grid (best final test accuracy), and the
whole network is evaluated: with batch norm, with the running statistics the subnets collected
and with statistics recomputed with the whole network.
"""

from __future__ import annotations

import math

from bench.ist_time import Run, graph_for

VARIANTS = {"batch_norm": {"norm": True, "bias": False}, "no_norm": {"norm": False, "bias": True}}


def ablation(setting, task, sites_list, steps: int, grid, evaluations=8, log=print) -> list[dict]:
    every = max(setting.local_steps, steps // evaluations // setting.local_steps * setting.local_steps)
    rows = []
    for sites in sites_list:
        for variant, shape in VARIANTS.items():
            curves = {}
            for lr in grid:
                run = Run("ist", setting, task, sites, lr, graph=graph_for("ist", setting, sites, **shape))
                points = []
                while run.steps < steps:
                    run.advance()
                    if run.steps % every == 0 or run.steps >= steps:
                        point = {"steps": run.steps, "accuracy": run.accuracy(calibrated=True)}
                        if shape["norm"]:
                            point["running_statistics"] = run.accuracy(calibrated=False)
                        points.append(point)
                        if math.isnan(point["accuracy"]):
                            break
                curves[lr] = points
                log(f"  IST {variant} on {sites} sites, lr {lr:g}: accuracy {points[-1]['accuracy']:.3f} "
                    f"after {points[-1]['steps']} steps")
            best = max(grid, key=lambda lr: _final(curves[lr]))
            rows.append({"sites": sites, "variant": variant, "lr": best, "steps": steps,
                         "final": curves[best][-1], "curves": {str(lr): c for lr, c in curves.items()}})
    return rows


def _final(points) -> float:
    accuracy = points[-1]["accuracy"]
    return -1.0 if math.isnan(accuracy) else accuracy  # a diverged run loses
