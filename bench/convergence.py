"""Training quality: LeNet-5 on the digits with the searched strategy and with data parallelism on
Machine.local(2), next to the single-device trainer, same data order and initialization: the
loss curves agree step for step (the paper's "maintains network accuracy": every strategy
computes the same network)."""

from __future__ import annotations

import tempfile

import numpy as np
from tqdm import tqdm

from taskrt import models, search
from taskrt.bench.report import write_result
from taskrt.data.arrays import epoch_batches, load_digits
from taskrt.machines.machine import Machine
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer

HYPER = {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4, "seed": 0}


def run(out_dir="results", quick=False):
    epochs = 1 if quick else 4
    graph = models.lenet5(batch=64)
    x_train, y_train, x_test, y_test = load_digits(image_size=32)
    batches = [b for epoch in range(epochs) for b in epoch_batches(x_train, y_train, 64, np.random.default_rng(epoch))]
    curves, accuracy, strategies = {}, {}, {}
    reference = SingleDeviceTrainer(graph, **HYPER)
    curves["single device"] = [reference.step(x, y) for x, y in tqdm(batches, desc="single device", leave=False,
                                                                        disable=None)]
    accuracy["single device"] = float((reference.predict(x_test).argmax(1) == y_test).mean())
    with Machine.local(2) as machine, tempfile.TemporaryDirectory() as tmp:
        cost_model = search.CostModel(machine, cache=f"{tmp}/costs.json")
        strategies["data parallel"] = search.data_parallel(graph, machine)
        strategies["layer-wise"] = search.optimize(graph, machine, cost_model)
        for name, strategy in strategies.items():
            trainer = Trainer(graph, strategy, machine, **HYPER)
            curves[name] = [trainer.step(x, y) for x, y in tqdm(batches, desc=name, leave=False, disable=None)]
            accuracy[name] = float((trainer.predict(x_test).argmax(1) == y_test).mean())
    base = np.array(curves["single device"])
    rows = []
    for name, losses in curves.items():
        diff = np.abs(np.array(losses) - base) / np.maximum(np.abs(base), 1e-12)
        rows.append({"trainer": name, "steps": len(losses), "final_loss": losses[-1], "test_accuracy": accuracy[name],
                     "max_relative_loss_difference": float(diff.max()), "losses": losses})
    summary = [f"{r['trainer']}: {r['steps']} steps, final loss {r['final_loss']:.4f}, test accuracy "
               f"{r['test_accuracy']:.2%}, largest relative difference from the single-device loss at any step "
               f"{r['max_relative_loss_difference']:.1e}" for r in rows]
    summary.append("float32; differences come only from the order of floating-point sums "
                   "(gradient contributions and replicas are added in another order)")
    columns = [("trainer", "trainer"), ("steps", "steps"), ("final_loss", "final loss"),
               ("test_accuracy", "test accuracy"), ("max_relative_loss_difference", "max rel. loss difference")]
    md = write_result(out_dir, "convergence", rows, columns,
                      {"hyper": HYPER, "layer_wise": strategies["layer-wise"].to_dict()}, summary)
    _plot(curves, out_dir)
    print(md.read_text())
    return rows


def _plot(curves, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles = {"single device": ("k", "-", 3), "data parallel": ("tab:orange", "--", 1.5),
              "layer-wise": ("tab:blue", ":", 1.5)}
    for name, losses in curves.items():
        color, style, width = styles[name]
        ax.plot(range(1, len(losses) + 1), losses, color=color, linestyle=style, linewidth=width, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("training step (batch 64)")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("LeNet-5 on the digits: the same curve on 1 device and on 2 (Dask)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out_dir}/convergence.png", dpi=120)
    plt.close(fig)
