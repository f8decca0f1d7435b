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
from taskrt.planning.params import init_buffers
from taskrt.training.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from taskrt.training.elastic import Snapshot, snapshot_interval


class Snapshots:
    """The Trainer's part that keeps snapshots and checkpoints."""

    def _plan_snapshot(self, run: StepRun):
        """Mark step `run.step`'s state for a snapshot (taken when the step finishes) when one is
        due, or a periodic checkpoint."""
        checkpoint = self.checkpoints is not None and self.checkpoints.due(run.step)
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
        params, velocity = self._host_state(state, plan)
        running = self._running(buffers, plan)
        seconds = time.perf_counter() - started
        self.snapshot = Snapshot(step, params, velocity, seconds, running)
        self._log = [entry for entry in self._log if entry.step > step]
        self.snapshots_taken += 1
        self._snapshot_interval()
        if checkpoint:
            self.checkpoints.write(step, self._meta(step), params, velocity, running)

    def _meta(self, steps_done: int) -> dict:
        return {
            "graph": self.graph.to_dict(), "strategy": self._given_strategy.validated(
                self.graph, self.cluster_machine).to_dict(),
            "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "dtype": self.dtype.name, "seed": self.seed, "steps_done": steps_done, "precision": self.precision,
        }

    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, fsync, rename): graph, strategy,
        hyper-parameters, step count, parameters and momentum, and a digest of every array."""
        self.wait()
        params, velocity = self._host_state()
        write_checkpoint(path, self._meta(self.steps_done), params, velocity, self._running())

    @classmethod
    def load(cls, path, machine, strategy: Strategy | None = None, graph: Graph | None = None, **options) -> Self:
        """Resume from a checkpoint on `machine`, with its saved strategy or another one.  With
        `graph`, the checkpoint must be for that graph (CheckpointError names the difference).
        `options`: the Trainer's snapshot_every, checkpoints and replan (a saved strategy has no
        `replan`: without one, it is re-mapped after a lost worker)."""
        meta, params, velocity = read_checkpoint(path, graph)
        graph = Graph.from_dict(meta["graph"])
        strategy = strategy or Strategy.from_dict(meta["strategy"], source=str(path))
        trainer = cls(graph, strategy, machine, lr=meta["lr"], momentum=meta["momentum"],
                      weight_decay=meta["weight_decay"], dtype=meta["dtype"], seed=meta["seed"],
                      precision=meta.get("precision", "fp32"), **options)
        for layer, shapes in ((l.name, l.param_shapes) for l in graph if l.param_shapes):
            for name, shape in shapes.items():
                found = params.get(layer, {}).get(name)
                if found is None or found.shape != tuple(shape):
                    raise CheckpointError(f"{path}: parameter {layer}.{name} has shape "
                                          f"{None if found is None else found.shape}, the graph needs {tuple(shape)}")
        trainer._place(params, velocity)
        running = {**init_buffers(graph, trainer.dtype), **meta["running"]}
        trainer._place_buffers(running)
        trainer.steps_done = meta["steps_done"]
        trainer.snapshot = Snapshot(trainer.steps_done, params, velocity, running=running)
        return trainer
