"""What an optimizer costs a step: AdamW (two moments per parameter, read and written beside the
weights), AdamW with gradient clipping (one scalar per device reduced before the updates) and
Nesterov SGD, against SGD with momentum, on Machine.local(2) under the strategy the search picks
for SGD (costs measured in the same run), AlexNet-32 and VGG-16-32.

Runners take turns in interleaved rounds (`bench.measure.interleaved`: two steps each, the second
timed), medians reported, each ratio against SGD with momentum from the same rounds.  The goal
(issue 53, goal 4): an AdamW step at most 1.1x an SGD-with-momentum step on both networks.
"""

from __future__ import annotations

import tempfile

import taskrt as tr
from taskrt import search
from taskrt.bench.goals import OPTIM_GOAL
from taskrt.bench.measure import LOCAL_MODELS, QUICK_MODELS, interleaved
from taskrt.bench.report import write_result
from taskrt.machines.machine import Machine
from taskrt.planning.memory import plan_memory
from taskrt.search.measured import random_batch
from taskrt.training.trainer import Trainer

MODELS = {name: LOCAL_MODELS[name] for name in ("alexnet32", "vgg16_32")}
RUNNERS = {
    "sgd-momentum": {"optimizer": tr.optim.SGD(1e-4, momentum=0.9)},
    "sgd-nesterov": {"optimizer": tr.optim.SGD(1e-4, momentum=0.9, nesterov=True, weight_decay=5e-4)},
    "adamw": {"optimizer": tr.optim.AdamW(1e-4, weight_decay=0.05, no_decay=("bias", "norm"))},
    "adamw-clipped": {"optimizer": tr.optim.AdamW(1e-4, weight_decay=0.05, no_decay=("bias", "norm")),
                      "clip_grad_norm": 1.0},
}
COLUMNS = [("model", "model"), ("batch", "batch"), ("strategy", "strategy (searched for SGD)"),
           ("sgd_momentum_ms", "SGD momentum ms"), ("sgd_nesterov_ms", "Nesterov ms"), ("adamw_ms", "AdamW ms"),
           ("adamw_clipped_ms", "AdamW clipped ms"), ("adamw_vs_sgd", "AdamW / SGD"),
           ("clipped_vs_sgd", "clipped / SGD"), ("goal", "goal"), ("meets_goal", "met")]


def rows_for(chosen: dict, rounds: int) -> list[dict]:
    rows = []
    with Machine.local(2) as machine, tempfile.TemporaryDirectory() as tmp:
        cost_model = search.CostModel(machine, cache=f"{tmp}/costs.json")
        for name, make in chosen.items():
            graph = make()
            x, y = random_batch(graph)
            strategy = search.optimize(graph, machine, cost_model)
            trainers = {label: Trainer(graph, strategy, machine, **options) for label, options in RUNNERS.items()}
            med = interleaved({label: t.step for label, t in trainers.items()}, x, y, rounds, f"{name}, optimizers")
            ratio = med["adamw"] / med["sgd-momentum"]
            judged = name in MODELS
            rows.append({
                "model": name, "batch": graph.inputs[0].shape[0],
                "strategy": f"{strategy.meta.get('device_count', 2)} device(s), {strategy.name or 'layer-wise'}",
                **{f"{label.replace('-', '_')}_ms": med[label] * 1e3 for label in RUNNERS},
                "adamw_vs_sgd": ratio, "clipped_vs_sgd": med["adamw-clipped"] / med["sgd-momentum"],
                "nesterov_vs_sgd": med["sgd-nesterov"] / med["sgd-momentum"],
                "optimizer_mib": {label: optimizer_mib(t) for label, t in trainers.items()},
                "goal": OPTIM_GOAL if judged else None, "meets_goal": ratio <= OPTIM_GOAL if judged else None})
    return rows


def optimizer_mib(trainer) -> float:
    """MiB of the optimizer's state over every device (`taskrt.planning.memory.plan_memory`)."""
    memory = plan_memory(trainer.plan, trainer.dtype.itemsize, len(trainer.optimizer.slots))
    return sum(m.optimizer for m in memory.values()) / 2**20


def run(out_dir="results", quick=False):
    chosen = QUICK_MODELS if quick else MODELS
    rounds = 3 if quick else 9
    rows = rows_for(chosen, rounds)
    summary = []
    for row in rows:
        goal = (f"goal <= {row['goal']}x: {'met' if row['meets_goal'] else 'NOT met'}" if row["goal"]
                else "no goal for this network")
        memory = ", ".join(f"{k} {v:.1f}" for k, v in row["optimizer_mib"].items())
        summary.append(f"{row['model']}: AdamW {row['adamw_ms']:.1f} ms a step against SGD with momentum "
                       f"{row['sgd_momentum_ms']:.1f} ms = {row['adamw_vs_sgd']:.3f}x ({goal}); with clipping "
                       f"{row['clipped_vs_sgd']:.3f}x; Nesterov with weight decay {row['nesterov_vs_sgd']:.3f}x; "
                       f"optimizer state MiB: {memory}")
    summary.append("AdamW reads and writes two moments where SGD has one momentum buffer (their memory above); "
                   "clipping adds a sum of squares on each device and one 8-byte value each way before the "
                   "updates can start.")
    write_result(out_dir, "optim", rows, COLUMNS, {"rounds": rounds}, summary)
    for line in summary:
        print(line)
    return rows
