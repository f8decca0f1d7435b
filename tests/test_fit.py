"""Training from datasets on a real local cluster: each device reads only its rows and window, the
dataset path computes exactly what the numpy path computes, `fit` repeats with its seed, and bad
input fails clearly without losing a finished step."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
from dask.utils import key_split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt.data.datasets import ArrayDataset, DataReadError, DatasetError, NpyDataset, Synthetic
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.training.fit import batches
from taskrt.training.trainer import Trainer
from tests.graphs import inception_block, mixed_lenet_strategy, small_lenet
from tests.strategies import random_strategies

HYPER = {"lr": 0.05, "momentum": 0.9, "dtype": "float64"}
READS: list = []  # in each worker process: (dataset name, field, rows, window) of every read there


@dataclass(frozen=True)
class Recorded(Synthetic):
    """Synthetic samples whose every read is recorded where it runs."""

    def read(self, field, indices, window, xp=np, dtype="float32"):
        READS.append((self.name, field, tuple(int(i) for i in indices), tuple((s.start, s.stop) for s in window)))
        return super().read(field, indices, window, xp, dtype)


def _reads_here(name, dask_worker=None):
    return [read[1:] for read in READS if read[0] == name]


def whole(dataset, field, indices):
    """The samples as the numpy path gets them: read on the client, all of each sample."""
    return dataset.read(field, indices, (slice(None),) * len(dataset.fields[field].shape))


def assert_same_parameters(a, b):
    for layer in a:
        for name in a[layer]:
            np.testing.assert_array_equal(a[layer][name], b[layer][name], err_msg=f"{layer}.{name}")


def numpy_path(trainer, dataset, steps):
    return [trainer.step(whole(dataset, "images", i), whole(dataset, "labels", i)) for i in steps]


def test_each_device_reads_only_its_own_rows_and_window(machine4):
    graph = small_lenet()  # batch 4, images (1, 16, 16)
    strategy = mixed_lenet_strategy(graph)
    strategy = Strategy({**dict(strategy.items()), "image": P(n=2, w=2, devices=(3, 1, 0, 2)),
                         "labels": P(n=2, devices=(2, 0))})
    dataset = Recorded(50, shape=(1, 16, 16), classes=10, name=f"recorded-{uuid.uuid4().hex[:6]}")
    steps = [np.array(i) for i in ([7, 3, 3, 41], [0, 49, 12, 8], [5, 6, 7, 8])]
    trainer = Trainer(graph, strategy, machine4, **HYPER)
    futures = [trainer.submit_from(dataset, i) for i in steps]  # all in flight
    losses = [f.result() for f in futures]
    device_of = {address: device for device, address in machine4.addresses().items()}
    read = {device_of[a]: sorted(r) for a, r in machine4.client.run(_reads_here, dataset.name).items()}
    expected = {}
    for indices in steps:
        for layer, parts in trainer.plan.data.items():
            field = "images" if layer == "image" else "labels"
            for part in parts:
                rows = tuple(int(i) for i in indices[part.rect.lo[0]:part.rect.hi[0]])
                window = tuple(zip(part.rect.lo[1:], part.rect.hi[1:]))
                expected.setdefault(part.device, []).append((field, rows, window))
    assert {d: r for d, r in read.items() if r} == {d: sorted(e) for d, e in expected.items()}
    assert len(read) == 4 and all(read.values())  # every device read, once per tile per step
    keys = futures[-1].run.keys
    assert {key_split(k) for k in keys if "-read-" in str(k)} == {f"dev{d}-read" for d in range(4)}  # one per device
    assert not [k for k in keys if str(k).startswith("ndarray-")]  # nothing scattered with the step
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes
    reference = Trainer(graph, strategy, machine4, **HYPER)
    assert numpy_path(reference, dataset, steps) == losses
    assert_same_parameters(trainer.parameters(), reference.parameters())


GRAPHS = {"lenet5": small_lenet, "inception_block": lambda: inception_block(batch=4, channels=4, size=7)}


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_the_dataset_path_computes_what_the_numpy_path_computes(machine4, name, data):
    """Random strategies (any split of every layer, the inputs' included): the same losses and
    parameters, bit for bit, from the same batches read on the devices or sent as arrays."""
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=machine4.num_devices))
    image = graph.inputs[0]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    dataset = Synthetic(30, shape=image.shape[1:], classes=classes, seed=data.draw(st.integers(0, 99)))
    steps = [np.random.default_rng(k).choice(30, image.shape[0]) for k in range(3)]
    trainer, reference = Trainer(graph, strategy, machine4, **HYPER), Trainer(graph, strategy, machine4, **HYPER)
    assert [f.result() for f in [trainer.submit_from(dataset, i) for i in steps]] == numpy_path(
        reference, dataset, steps)
    assert_same_parameters(trainer.parameters(), reference.parameters())
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


def test_fit_repeats_with_its_seed_and_reports_what_it_did(machine4):
    graph = small_lenet()
    strategy = mixed_lenet_strategy(graph)
    rng = np.random.default_rng(0)
    train = ArrayDataset({"images": rng.standard_normal((10, 1, 16, 16)), "labels": rng.integers(0, 10, 10)})
    test = ArrayDataset({"images": rng.standard_normal((7, 1, 16, 16)), "labels": rng.integers(0, 10, 7)})
    trainer = Trainer(graph, strategy, machine4, snapshot_every=100, **HYPER)  # every step in the log
    seen = []
    history = trainer.fit(train, epochs=2, seed=3, last="wrap", eval_dataset=test, progress=False,
                          on_epoch=seen.append)
    # 20 samples in batches of 4, wrapping: steps starting at samples 0, 4, 8 (epoch 1), 12, 16 (epoch 2)
    assert [e.steps for e in history.epochs] == [3, 2] and len(history.losses) == 5
    assert list(history.epochs) == seen and all(s > 0 for s in history.epoch_seconds)
    assert len(history.eval_accuracy) == 2 and all(np.isfinite(history.eval_loss))
    # the same seed, the same batches (tests/test_datasets.py): the losses of those batches sent as arrays
    reference = Trainer(graph, strategy, machine4, **HYPER)
    expected = [reference.step(train.arrays["images"][i], train.arrays["labels"][i])
                for _, i in batches(10, 4, 2, 3, True, "wrap")]
    assert list(history.losses) == expected
    assert_same_parameters(trainer.parameters(), reference.parameters())
    # the evaluation after the last epoch is that of the final parameters
    logits = reference.predict(test.arrays["images"])
    assert history.eval_accuracy[-1] == np.mean(logits.argmax(axis=1) == test.arrays["labels"])
    evaluation = trainer.evaluate(test)
    assert evaluation.samples == 7 and evaluation.accuracy == history.eval_accuracy[-1]
    assert evaluation.loss == pytest.approx(history.eval_loss[-1], rel=1e-12)
    # the arrays were placed once on each device that reads them; the log keeps indices only
    placed = [key for key in trainer._placed if key[0] == id(train)]
    assert len(placed) == len({(layer, p.device) for layer, parts in trainer.plan.data.items() for p in parts})
    assert len(trainer._log) == 5 and all(e.arrays is None and e.nbytes == 4 * 8 for e in trainer._log)


def test_fit_refuses_bad_input_before_any_step(machine4, tmp_path):
    graph = small_lenet()
    trainer = Trainer(graph, mixed_lenet_strategy(graph), machine4, **HYPER)
    x, y = np.zeros((10, 1, 16, 16)), np.zeros(10, dtype=np.int64)
    fits = ArrayDataset({"images": x, "labels": y})
    with pytest.raises(DatasetError, match=r"dataset 'arrays' has 3 samples, fewer than the batch of 4"):
        trainer.fit(ArrayDataset({"images": x[:3], "labels": y[:3]}))
    with pytest.raises(ValueError, match=r"last must be one of 'drop', 'wrap'"):
        trainer.fit(fits, last="pad")
    with pytest.raises(ValueError, match="prefetch must be at most 4"):
        trainer.fit(fits, prefetch=9)
    with pytest.raises(DatasetError, match=r"eval.*samples of shape \(1, 8, 8\); input 'image'.*\(1, 16, 16\)"):
        trainer.fit(fits, eval_dataset=ArrayDataset({"images": x[:, :, :8, :8], "labels": y}, name="eval"))
    np.save(tmp_path / "y.npy", y + 10)
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(DatasetError, match=rf"file {tmp_path / 'y.npy'} .*labels from 10 to 10; input 'labels'"):
        trainer.fit(NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y.npy"}))
    with pytest.raises(DatasetError, match=r"the batch asks for indices from 0 to 10"):
        trainer.submit_from(fits, [0, 1, 2, 10])
    assert trainer.steps_done == 0 and not trainer._log


@pytest.mark.parametrize("per_program, snapshot", [(1, 3), (2, 4)])
def test_a_file_cut_short_while_training_loses_no_finished_step(machine4, tmp_path, per_program, snapshot):
    """The read fails on its device naming the file and the input; the steps in flight never
    happen, the parameters are those of the last finished step, and training goes on from there.
    Two steps to a program: the snapshot due at step 3 is taken at the end of its program."""
    graph = small_lenet()
    strategy = mixed_lenet_strategy(graph)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 1, 16, 16)), rng.integers(0, 10, 16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    dataset = NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y.npy"})
    trainer = Trainer(graph, strategy, machine4, snapshot_every=3, **HYPER)
    size = os.path.getsize(tmp_path / "x.npy")

    def cut_short(epoch):  # after the first epoch's 4 steps
        with open(tmp_path / "x.npy", "r+b") as f:
            f.truncate(size - 8 * 16 * 16)  # the last sample's values are gone: no read trusts the file now

    with pytest.raises(DataReadError, match=rf"input 'image', samples .*file {tmp_path / 'x.npy'} .*is truncated: "
                                            rf"it holds {size - 2048:,} bytes, .* needs {size:,}"):
        trainer.fit(dataset, epochs=2, prefetch=3, progress=False, on_epoch=cut_short, steps_per_program=per_program)
    assert trainer.steps_done == 4 and trainer.snapshot.step == snapshot  # the first epoch's steps finished
    reference = Trainer(graph, strategy, machine4, **HYPER)
    for _, i in batches(16, 4, 1, 0, True, "drop"):
        reference.step(x[i], y[i])
    assert_same_parameters(trainer.parameters(), reference.parameters())
    np.save(tmp_path / "x.npy", x)  # the file is back: training goes on from the last finished step
    trainer.submit_from(dataset, [0, 1, 2, 3]).result()
    reference.step(x[:4], y[:4])
    assert_same_parameters(trainer.parameters(), reference.parameters())
