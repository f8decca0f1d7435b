"""Snapshots and checkpoints, a part of the Trainer: when a snapshot of the state is due (to recover
from a lost worker) or a periodic checkpoint, taking it once its step has finished, and saving
and loading checkpoint files (`taskrt.training.checkpoint` writes and reads them).
"""

from __future__ import annotations

import statistics
import time
from typing import Self

from taskrt.execution.executor import StepRun
from taskrt.graph.graph import Graph
from taskrt.graph.strategy import Strategy
from taskrt.ops.optim import SGD, Optimizer
from taskrt.planning.params import init_buffers
from taskrt.training.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from taskrt.training.elastic import Snapshot, snapshot_interval


class Snapshots:
    """The Trainer's part that keeps snapshots and checkpoints."""

    def _plan_snapshot(self, run: StepRun):
        """Mark step `run.step`'s state (an update's: never a micro-batch's before the last of an
        accumulation) for a snapshot (taken when the step finishes) when one is due, or a periodic
        checkpoint (one due at a micro-batch is written at its update)."""
        since, self._last_update_step = self._last_update_step, run.step
        checkpoint = self.checkpoints is not None and any(
            self.checkpoints.due(step) for step in range(since + 1, run.step + 1))
        planned = self._pending[-1][0] if self._pending else self.snapshot.step
        if checkpoint or (self.elastic and run.step - planned >= self.snapshot_every):
            self._pending.append((run.step, dict(run.outputs["state"]), run.plan, checkpoint,
                                  dict(run.outputs["buffers"])))

    def _snapshot_interval(self):
        """With automatic snapshots, the interval that keeps their cost at the target share of the
        steps' recent time (`taskrt.training.elastic.snapshot_interval`)."""
        if self._auto_snapshots and self._walls and self.snapshot.seconds:
            logs_arrays = not self._log or self._log[-1].batch is None
            self.snapshot_every = snapshot_interval(self.snapshot.seconds, statistics.median(self._walls),
                                                    logs_arrays=logs_arrays)

    def _take_snapshot(self, step, state, plan, checkpoint, buffers):
        started = time.perf_counter()
        params, slots = self._host_state(state, plan)
        running = self._running(buffers, plan)
        seconds = time.perf_counter() - started
        self.snapshot = Snapshot(step, params, slots, seconds, running)
        self._log = [entry for entry in self._log if entry.step > step]
        self.snapshots_taken += 1
        self._snapshot_interval()
        if checkpoint:
            self.checkpoints.write(step, self._meta(step), params, self._named_slots(slots), running)

    def _named_slots(self, slots: tuple) -> dict:
        return dict(zip(self.optimizer.slots, slots))

    def _meta(self, steps_done: int) -> dict:
        optimizer = self.optimizer.to_dict()
        if optimizer["no_decay"] is None:  # a function chose them: kept as the pairs it chose
            optimizer["no_decay_pairs"] = sorted(map(list, self._left_out))
        return {
            "graph": self.graph.to_dict(), "strategy": self._given_strategy.validated(
                self.graph, self.cluster_machine).to_dict(),
            "optimizer": optimizer, "lr": self.lr, "clip_grad_norm": self.clip_grad_norm,
            "dtype": self.dtype.name, "seed": self.seed, "steps_done": steps_done,
            "updates_done": self._updates_after.get(steps_done, self.updates_done), "precision": self.precision,
        }

    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, fsync, rename): graph, strategy,
        optimizer and hyper-parameters, step count, parameters and the optimizer's state, and a
        digest of every array."""
        self.wait()
        params, slots = self._host_state()
        write_checkpoint(path, self._meta(self.steps_done), params, self._named_slots(slots), self._running())

    @classmethod
    def load(cls, path, machine, strategy: Strategy | None = None, graph: Graph | None = None, **options) -> Self:
        """Resume from a checkpoint on `machine`, with its saved strategy or another one.  With
        `graph`, the checkpoint must be for that graph (CheckpointError names the difference).
        `options`: the Trainer's snapshot_every, checkpoints and replan (a saved strategy has no
        `replan`: without one, it is re-mapped after a lost worker)."""
        meta, params, slots = read_checkpoint(path, graph)
        graph = Graph.from_dict(meta["graph"])
        strategy = strategy or Strategy.from_dict(meta["strategy"], source=str(path))
        optimizer = saved_optimizer(meta)
        trainer = cls(graph, strategy, machine, optimizer=optimizer, clip_grad_norm=meta.get("clip_grad_norm"),
                      dtype=meta["dtype"], seed=meta["seed"], precision=meta.get("precision", "fp32"), **options)
        trainer.lr = float(meta["lr"])  # the learning rate of the last step, as a schedule left it
        for layer, shapes in ((l.name, l.param_shapes) for l in graph if l.param_shapes):
            for name, shape in shapes.items():
                found = params.get(layer, {}).get(name)
                if found is None or found.shape != tuple(shape):
                    raise CheckpointError(f"{path}: parameter {layer}.{name} has shape "
                                          f"{None if found is None else found.shape}, the graph needs {tuple(shape)}")
        missing = [slot for slot in optimizer.slots if slot not in slots]
        if missing:
            raise CheckpointError(f"{path}: the optimizer's state {missing} is missing (saved: {sorted(slots)})")
        ordered = tuple(slots[slot] for slot in optimizer.slots)
        trainer._place(params, ordered)
        running = {**init_buffers(graph, trainer.dtype), **meta["running"]}
        trainer._place_buffers(running)
        trainer.steps_done = trainer._last_update_step = meta["steps_done"]
        trainer.updates_done = meta.get("updates_done", meta["steps_done"])
        trainer.snapshot = Snapshot(trainer.steps_done, params, ordered, running=running)
        return trainer


def saved_optimizer(meta: dict):
    """The optimizer a checkpoint was written with (format 1: SGD from its lr, momentum and weight decay)."""
    if "optimizer" not in meta:
        return SGD(meta["lr"], momentum=meta["momentum"], weight_decay=meta["weight_decay"])
    pairs = meta["optimizer"].get("no_decay_pairs")
    data = {k: v for k, v in meta["optimizer"].items() if k != "no_decay_pairs"}
    if pairs is not None:  # a function chose them when it was saved: the same pairs now
        chosen = {tuple(p) for p in pairs}
        return Optimizer.from_dict(data, no_decay=lambda layer, name: (layer.name, name) in chosen)
    return Optimizer.from_dict(data)
