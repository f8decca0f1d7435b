"""Training on a dataset: epochs of seeded shuffled batches, read by the workers (`Trainer.fit`).

    history = trainer.fit(train, epochs=10, eval_dataset=test)
    history.losses, history.epoch_seconds, history.eval_accuracy
    trainer.evaluate(test)                      # Evaluation(loss, accuracy, samples)

The graph's batch size is fixed, so an epoch whose length it does not divide either drops its
last samples ("drop") or fills the last batch from the start of the next epoch's order ("wrap":
epochs then run into one another, every sample of every epoch is used).  Epoch `e`'s order is
the permutation the seed gives for `e` alone, so the same seed gives the same batches, and any
epoch's batches can be found without the ones before.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

import numpy as np

from taskrt.data.datasets import DatasetError

LAST = ("drop", "wrap")  # what becomes of an epoch's last partial batch
MAX_PREFETCH = 4  # steps in flight at most: Trainer.submit waits beyond its MAX_IN_FLIGHT


@dataclass(frozen=True)
class EpochStats:
    """One epoch of `fit`: its steps' mean loss and wall time, and the evaluation after it.  A
    step is one update (with `accumulate`, of k micro-batches: its loss their mean)."""

    epoch: int  # from 1
    steps: int
    loss: float  # mean of the steps' losses
    seconds: float  # from the first step's submission to the last step's result
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_seconds: float | None = None


@dataclass(frozen=True)
class History:
    """What `fit` did: the loss of every step, in order, and each epoch's summary."""

    losses: tuple
    epochs: tuple  # EpochStats

    @property
    def epoch_seconds(self) -> tuple:
        return tuple(e.seconds for e in self.epochs)

    @property
    def epoch_losses(self) -> tuple:
        return tuple(e.loss for e in self.epochs)

    @property
    def eval_loss(self) -> tuple:
        return tuple(e.eval_loss for e in self.epochs if e.eval_loss is not None)

    @property
    def eval_accuracy(self) -> tuple:
        return tuple(e.eval_accuracy for e in self.epochs if e.eval_accuracy is not None)


@dataclass(frozen=True)
class Evaluation:
    """Mean cross-entropy loss and accuracy over `samples` samples."""

    loss: float
    accuracy: float
    samples: int


def epoch_order(length: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The samples of epoch `epoch` (from 0) in the order they are used."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(length).astype(np.int64)


def steps_per_epoch(length: int, batch: int, epochs: int, last: str) -> list[int]:
    """How many steps each epoch takes.  With "wrap", a step belongs to the epoch of its first sample."""
    if last == "drop":
        return [length // batch] * epochs
    starts = range(0, epochs * length, batch)  # each step's first position in the epochs run end to end
    return [sum(1 for s in starts if s // length == e) for e in range(epochs)]


def batches(length: int, batch: int, epochs: int, seed: int, shuffle: bool, last: str):
    """Yields (epoch, indices) of every step, in order (see `steps_per_epoch`)."""
    if last == "drop":
        for epoch in range(epochs):
            order = epoch_order(length, epoch, seed, shuffle)
            for start in range(0, length - batch + 1, batch):
                yield epoch, order[start:start + batch]
        return
    orders = {}

    def order_of(epoch):  # two at most at a time: the current epoch's and the next one's
        if epoch not in orders:
            if len(orders) > 1:
                del orders[min(orders)]
            orders[epoch] = epoch_order(length, epoch, seed, shuffle)
        return orders[epoch]

    for start in range(0, epochs * length, batch):
        positions = np.arange(start, start + batch)
        epoch_of = positions // length
        indices = np.empty(batch, dtype=np.int64)
        for e in np.unique(epoch_of):
            where = epoch_of == e
            indices[where] = order_of(int(e))[positions[where] - e * length]
        yield start // length, indices


def check_options(epochs, shuffle, seed, last, prefetch, progress):
    for what, value in (("epochs", epochs), ("prefetch", prefetch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if prefetch > MAX_PREFETCH:
        raise ValueError(f"prefetch must be at most {MAX_PREFETCH} (steps in flight), got {prefetch}")
    if last not in LAST:
        raise ValueError(f"last must be one of {', '.join(map(repr, LAST))} (the graph's batch size is fixed: "
                         f"drop the last partial batch, or fill it from the next epoch's order), got {last!r}")
    for what, value in (("shuffle", shuffle), ("progress", progress)):
        if not isinstance(value, bool):
            raise ValueError(f"{what} must be True or False, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def fit(trainer, dataset, epochs: int = 1, shuffle: bool = True, seed: int = 0, last: str = "drop",
        eval_dataset=None, prefetch: int = 3, progress: bool = True, lr_schedule=None, on_epoch=None,
        steps_per_program="auto", accumulate: int = 1) -> History:
    """Train `trainer` on `dataset` for `epochs` epochs; returns the History.

    `prefetch`: steps in flight at most (submitted, result not yet taken).  A step's reads run
    as soon as the device has nothing ready to compute: on a single-threaded worker, in the wait
    between two of its runs (the scheduler learning that one ended and sending the next); with
    3 in flight a step's reads are there during the runs of the step two before, and fill that
    wait (2 often sends them only after it).  `progress`: a progress bar per epoch (on a
    terminal; none in a log).  `lr_schedule(step, total)`: the learning rate of each step (from
    0 of `total`), else the trainer's.  `on_epoch(EpochStats)`: called after each epoch.
    `eval_dataset`: evaluated after each epoch.  `steps_per_program`: steps each device's program
    runs as one Dask task ("auto": as many as take about a quarter of a second, one for long
    steps; `Trainer.steps_per_program`).  `accumulate`: micro-batches (of the graph's batch
    size) per update: their gradients are summed on the devices and the update takes their mean,
    as one step on a k-times larger batch would (batch norm aside: its statistics are each
    micro-batch's, as in PyTorch); each update's k micro-batches run in one program per device
    where programs run several steps.  An epoch's micro-batches beyond a whole number of updates
    are left out.  Everything is checked before the first step."""
    from tqdm import tqdm

    from taskrt.execution.program_executor import MAX_WINDOW

    check_options(epochs, shuffle, seed, last, prefetch, progress)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int (micro-batches per update), got {accumulate!r}")
    _check_steps_per_program(steps_per_program, MAX_WINDOW, trainer, "train")
    if lr_schedule is not None and not callable(lr_schedule):
        raise ValueError(f"lr_schedule must be a function (step, total steps) -> learning rate, got {lr_schedule!r}")
    batch = trainer.batch_size
    trainer.bind(dataset)
    if len(dataset) < batch * accumulate:
        what = f"the batch of {batch}" if accumulate == 1 else f"{accumulate} micro-batches of {batch}"
        raise DatasetError(f"dataset {dataset.name!r} has {len(dataset)} samples, fewer than {what} "
                           f"that graph {trainer.graph.name!r} takes; use a larger dataset or a graph with a "
                           "smaller batch")
    if eval_dataset is not None:
        trainer.bind(eval_dataset)
    micro = steps_per_epoch(len(dataset), batch, epochs, last)
    counts = [m // accumulate for m in micro]  # updates per epoch
    total = sum(counts)
    losses, summaries = [], []
    stream = (indices for _, indices in batches(len(dataset), batch, epochs, seed, shuffle, last))
    for epoch, count in enumerate(counts):
        start = time.perf_counter()
        bar = tqdm(total=count, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True,
                   disable=None if progress else True)  # None: a bar on a terminal, none in a log
        try:
            epoch_losses = _steps(trainer, dataset, stream, count, prefetch, lr_schedule, len(losses), total, bar,
                                  steps_per_program, accumulate)
        finally:
            bar.close()
        for _ in range(micro[epoch] - count * accumulate):  # the epoch's micro-batches short of an update
            next(stream)
        summary = EpochStats(epoch + 1, count, float(np.mean(epoch_losses)) if epoch_losses else float("nan"),
                             time.perf_counter() - start)
        losses += epoch_losses
        if eval_dataset is not None:
            started = time.perf_counter()
            result = evaluate(trainer, eval_dataset, prefetch, steps_per_program)
            summary = EpochStats(summary.epoch, summary.steps, summary.loss, summary.seconds, result.loss,
                                 result.accuracy, time.perf_counter() - started)
        summaries.append(summary)
        if on_epoch is not None:
            on_epoch(summary)
    return History(tuple(losses), tuple(summaries))


def _steps(trainer, dataset, stream, count, prefetch, lr_schedule, step, total, bar, per_program,
           accumulate=1) -> list[float]:
    """`count` updates of `stream` (index arrays, `accumulate` per update), at most `prefetch`
    steps in flight, several to a program where `trainer.steps_per_program` says so (then two
    programs in flight at most: the next one already on its workers as the one before ends);
    each update's loss (the mean of its micro-batches')."""
    pending, losses = deque(), []  # lists of StepFutures, one list per program
    micro_losses = []

    def take():
        for future in pending.popleft():
            micro_losses.append(future.result())
            if len(micro_losses) == accumulate:
                losses.append(float(np.mean(micro_losses)))
                micro_losses.clear()
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)

    left = count * accumulate  # micro-batches
    position = 0  # within the current update's micro-batches
    while left:
        k = trainer.steps_per_program(left, per_program)
        if accumulate > 1 and k >= accumulate:  # whole updates to a program where it holds one or more
            k = k // accumulate * accumulate
        rows = list(islice(stream, k))
        updates = [step + (position + i) // accumulate for i in range(k)]
        lrs = [None if lr_schedule is None else float(lr_schedule(u, total)) for u in updates]
        micro = None if accumulate == 1 else [((position + i) % accumulate, accumulate) for i in range(k)]
        while len(pending) >= programs_in_flight(prefetch, k):
            take()
        if k == 1:
            if lrs[0] is not None:
                trainer.lr = lrs[0]
            pending.append([trainer.submit_from(dataset, rows[0], None if micro is None else micro[0])])
        else:
            pending.append(trainer.submit_window(dataset, rows, lrs, micro))
        step += (position + k) // accumulate
        position = (position + k) % accumulate
        left -= k
    while pending:
        take()
    return losses


def evaluate(trainer, dataset, prefetch: int = 2, steps_per_program="auto") -> Evaluation:
    """Mean cross-entropy and accuracy of `trainer`'s network over every sample of `dataset`: the
    workers read the images in batches (the last one filled with sample 0, its rows unused), the
    client reads the labels.  `steps_per_program`: batches each device's program predicts as one
    Dask task ("auto": one until three are timed, then as many as take about a quarter of a second,
    `taskrt.execution.program_executor.auto_steps_per_program`); then two programs in flight at most."""
    from taskrt.data.arrays import data_inputs
    from taskrt.data.datasets import Batch
    from taskrt.execution.program_executor import MAX_WINDOW, auto_steps_per_program

    binding = trainer.bind(dataset)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= MAX_PREFETCH:
        raise ValueError(f"prefetch must be an int in [1, {MAX_PREFETCH}], got {prefetch!r}")
    _check_steps_per_program(steps_per_program, MAX_WINDOW, trainer, "predict")
    (label_layer,) = [l.name for l in data_inputs(trainer.graph) if l.op.dtype == "int64"]
    labels = np.asarray(dataset.read(binding.field_of(label_layer), np.arange(len(dataset)), ()), dtype=np.int64)
    batch, length = trainer.batch_size, len(dataset)
    losses, correct, pending = [], 0, deque()  # lists of (run, used, rows), one list per program
    windows = trainer.runs_windows("predict")
    started, taken = time.perf_counter(), 0

    def take():
        nonlocal taken
        count = 0
        for run, used, rows in pending.popleft():
            logits = trainer.logits(run)[:used].astype(np.float64)
            top = logits.max(axis=1, keepdims=True)
            log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
            losses.append(log_z - logits[np.arange(used), labels[rows]])
            count += int((logits.argmax(axis=1) == labels[rows]).sum())
            taken += 1
        return count

    starts = list(range(0, length, batch))
    while starts:
        k = 1
        if windows and len(starts) > 1:
            k = steps_per_program if steps_per_program != "auto" else (
                auto_steps_per_program((time.perf_counter() - started) / taken) if taken >= 3 else 1)
            k = min(k, len(starts))
        batches = []
        for start in starts[:k]:
            rows = np.arange(start, min(start + batch, length))
            indices = np.zeros(batch, dtype=np.int64)
            indices[:len(rows)] = rows
            batches.append((Batch(binding, indices), len(rows), rows))
        starts = starts[k:]
        while len(pending) >= programs_in_flight(prefetch, k):
            correct += take()
        if k == 1:
            [(data, used, rows)] = batches
            pending.append([(trainer.predict_run(data), used, rows)])
        else:
            runs = trainer.predict_window([data for data, _, _ in batches])
            pending.append([(run, used, rows) for run, (_, used, rows) in zip(runs, batches)])
    while pending:
        correct += take()
    return Evaluation(float(np.concatenate(losses).mean()), correct / length, length)


def programs_in_flight(prefetch: int, steps_per_program: int) -> int:
    """Programs `fit` and `evaluate` keep in flight: `prefetch` of one step each; of several steps,
    two at most (the next one already on its workers as the one before ends)."""
    return prefetch if steps_per_program == 1 else min(prefetch, 2)


def _check_steps_per_program(value, most: int, trainer, mode: str):
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
        raise ValueError(f"steps_per_program must be 'auto' or an int in [1, {most}], got {value!r}")
    if value not in ("auto", 1) and not trainer.runs_windows(mode):
        raise ValueError(f"steps_per_program={value} needs the trainer's executor 'programs' (the default; this one "
                         f"is {trainer.executor_kind!r}, which runs a Dask task per run), and a strategy whose "
                         "devices each compute the state they hold; pass 'auto' or 1")
