"""Seed 004's Sec. 3.3: IST with and without batch norm, the whole network evaluated.

The seed argues that a subnet sees a neuron's input summed over 1/n of the previous layer, the
deployed network over all of it, and that IST "will simply not work" without normalization.
Here IST trains the speech-shaped network for `steps` steps at each site count, with batch norm
(hidden layers bias-free) and without (hidden layers with a bias, as PyTorch's default linear
layer), each at the best learning rate of the same search (best final test accuracy), and the
whole network is evaluated: with batch norm, with the running statistics the subnets collected
and with statistics recomputed with the whole network.
"""

from __future__ import annotations

import math

from bench.ist_time import Run, graph_for

VARIANTS = {"batch_norm": {"norm": True, "bias": False}, "no_norm": {"norm": False, "bias": True}}


def ablation(setting, task, sites_list, steps: int, grid, evaluations=8, log=print, known=()) -> list[dict]:
    """A row per site count and variant.  Learning rates: `grid`, then one rung of
    `setting.ladder` further out while the best is at an edge (as Table 1's search).  `known`:
    rows of an earlier run with the same arguments, whose curves are taken instead of run again."""
    every = max(setting.local_steps, steps // evaluations // setting.local_steps * setting.local_steps)
    earlier = {(r["sites"], r["variant"], float(lr)): c for r in known for lr, c in r["curves"].items()}
    rows = []
    for sites in sites_list:
        for variant, shape in VARIANTS.items():
            curves, order = {}, list(grid)
            while order:
                lr = order.pop(0)
                curves[lr] = earlier.get((sites, variant, lr)) or _train(setting, task, sites, lr, shape, steps, every)
                log(f"  IST {variant} on {sites} sites, lr {lr:g}: accuracy {curves[lr][-1]['accuracy']:.3f} "
                    f"after {curves[lr][-1]['steps']} steps")
                if not order:  # the best at an edge of what was tried: one rung further out
                    best, tried = max(curves, key=lambda v: _final(curves[v])), sorted(curves)
                    rung = setting.ladder.index(best)
                    if best == tried[-1] and rung + 1 < len(setting.ladder):
                        order.append(setting.ladder[rung + 1])
                    elif best == tried[0] and rung > 0 and len(tried) > 1:
                        order.append(setting.ladder[rung - 1])
            best = max(curves, key=lambda v: _final(curves[v]))
            rows.append({"sites": sites, "variant": variant, "lr": best, "steps": steps, "first": list(grid),
                         "final": curves[best][-1], "curves": {str(lr): c for lr, c in sorted(curves.items())}})
    return rows


def _train(setting, task, sites, lr, shape, steps, every) -> list[dict]:
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
    return points


def _final(points) -> float:
    accuracy = points[-1]["accuracy"]
    return -1.0 if math.isnan(accuracy) else accuracy  # a diverged run loses
