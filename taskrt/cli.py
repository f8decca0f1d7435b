"""Command line: `taskrt run` (the main job), and the subcommands of later stages."""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np


def cosine_lr(base: float, step: int, total: int) -> float:
    """Cosine decay from `base` to 0: keeps the last epochs from bouncing around the minimum."""
    return 0.5 * base * (1 + math.cos(math.pi * step / max(1, total)))


def train_digits(trainer, epochs: int, batch: int, lr: float, seed: int, out=sys.stdout):
    """Train on the digits, printing loss per epoch with a progress bar; returns (test accuracy, seconds)."""
    from tqdm import tqdm

    from taskrt.data import epoch_batches, load_digits

    size = trainer.graph.inputs[0].shape[-1]
    x_train, y_train, x_test, y_test = load_digits(image_size=size, seed=seed)
    print(f"digits: {len(x_train)} training and {len(x_test)} test images, {size}x{size}, "
          f"scikit-learn's bundled copy", file=out)
    rng = np.random.default_rng(seed)
    steps_per_epoch = len(x_train) // batch
    total, step = epochs * steps_per_epoch, 0
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        bar = tqdm(epoch_batches(x_train, y_train, batch, rng), total=steps_per_epoch, leave=False,
                   desc=f"epoch {epoch}/{epochs}", file=out, dynamic_ncols=True,
                   disable=None)  # a bar on a terminal, none in a log
        pending = None
        for x, y in bar:
            trainer.lr = cosine_lr(lr, step, total)
            # submit the next step before waiting for this one: its data is on its way meanwhile
            future = trainer.submit(x, y)
            if pending is not None:
                losses.append(pending.result())
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            pending = future
            step += 1
        losses.append(pending.result())
        accuracy = float((trainer.predict(x_test).argmax(axis=1) == y_test).mean())
        print(f"epoch {epoch:2d}  loss {np.mean(losses):.4f}  test accuracy {accuracy:.2%}  "
              f"({time.perf_counter() - start:.1f} s)", file=out, flush=True)
    return accuracy, time.perf_counter() - start


def lenet_mixed_strategy(graph):
    """A hand-written layer-wise strategy for LeNet-5 on two devices: sample-parallel first
    convolution, the second convolution and its pooling split over height (halo rows move),
    the fully-connected layers split over channels (model parallel), the loss on one device."""
    from taskrt.config import ParallelConfig as P
    from taskrt.strategy import Strategy

    configs = {}
    for layer in graph:
        if layer.is_input:
            continue
        if layer.name in ("conv2", "pool2"):
            configs[layer.name] = P(h=2)
        elif layer.kind == "linear":
            configs[layer.name] = P(c=2, devices=(1, 0) if layer.name.startswith("fc2") else (0, 1))
        elif layer.kind == "softmax_cross_entropy":
            configs[layer.name] = P(devices=(0,))
        else:
            configs[layer.name] = P(n=2)
    return Strategy(configs, name="lenet5-mixed")


def cmd_run(args):
    from taskrt import models
    from taskrt.machine import Machine
    from taskrt.trainer import Trainer

    graph = models.lenet5(batch=args.batch)
    with Machine.local(args.devices) as machine:
        strategy = lenet_mixed_strategy(graph) if args.devices == 2 else _data_parallel(graph, args.devices)
        trainer = Trainer(graph, strategy, machine, lr=args.lr, momentum=0.9, weight_decay=5e-4, seed=args.seed)
        print(f"\nLeNet-5, batch {args.batch}, on {args.devices} devices, strategy {strategy.name!r}:")
        print(trainer.strategy.table(graph))
        plan = trainer.plan
        print(f"\none step: {len(plan.tasks)} tasks ({_phases(plan)}), "
              f"{plan.bytes_moved:,} bytes moved between devices\n")
        accuracy, seconds = train_digits(trainer, args.epochs, args.batch, args.lr, args.seed)
        stats = trainer.stats
        measured = stats.measured_bytes
        print(f"\nlast step: {stats.summary()}")
        agree = "equal to" if measured == stats.planned_bytes else "DIFFERENT FROM"
        print(f"bytes per device pair from the workers' transfer logs: "
              f"{', '.join(f'{s}->{d}: {b:,}' for (s, d), b in sorted(measured.items()))} ({agree} the plan)")
    verdict = "reached" if accuracy >= 0.95 else "did NOT reach"
    print(f"final test accuracy {accuracy:.2%} after {seconds:.1f} s: {verdict} the 95% goal")
    return 0 if accuracy >= 0.95 else 1


def _phases(plan) -> str:
    return ", ".join(f"{count} {phase}" for phase, count in sorted(plan.phase_counts().items()))


def _data_parallel(graph, devices):
    from taskrt.config import ParallelConfig as P
    from taskrt.strategy import Strategy

    return Strategy({l.name: P(n=devices) for l in graph if not l.is_input}, name=f"data-parallel-{devices}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="taskrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train LeNet-5 on the bundled digits and report what happened")
    run.add_argument("--epochs", type=int, default=10)
    run.add_argument("--batch", type=int, default=64)
    run.add_argument("--lr", type=float, default=0.02)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--devices", type=int, default=2, help="local devices (worker processes)")
    run.set_defaults(func=cmd_run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
