"""Datasets without a cluster: synthetic values at any window, the reads of a tile, seeded epoch
orders, the read tasks of a step's graph, and every bad input named clearly before any work."""

from __future__ import annotations

import os

import numpy as np
import pytest
from dask.utils import key_split
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import models
from taskrt.data import synthetic
from taskrt.data.datasets import (
    ArrayDataset,
    DataReadError,
    DatasetError,
    NpyDataset,
    Synthetic,
    batch_indices,
    bind_dataset,
    mapped,
)
from taskrt.data.reading import TileRead, read_tile, tile_on_device
from taskrt.execution.executor import step_graph
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.ops.rect import Rect
from taskrt.planning.lowering import lower
from taskrt.training.fit import batches, check_options, epoch_order, steps_per_epoch


def lenet():
    return models.lenet5(batch=4, image_size=16, width=0.5)


@st.composite
def windows(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    window = []
    for size in shape:
        lo = draw(st.integers(0, size - 1))
        window.append(slice(lo, draw(st.integers(lo + 1, size))))
    indices = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5))
    return shape, tuple(window), indices


# ---- synthetic values -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(case=windows(), seed=st.integers(-(2**40), 2**40))
def test_a_synthetic_window_equals_the_whole_sample_sliced(case, seed):
    shape, window, indices = case
    whole = synthetic.values(np, seed, indices, shape, tuple(slice(None) for _ in shape))
    part = synthetic.values(np, seed, indices, shape, window)
    assert whole.shape == (len(indices), *shape) and part.dtype == np.float32
    np.testing.assert_array_equal(part, whole[(slice(None),) + window])
    # one sample alone is the same as in any batch: a pure function of (seed, index, position)
    np.testing.assert_array_equal(synthetic.values(np, seed, indices[-1:], shape, window), part[-1:])


def test_synthetic_values_are_exact_repeatable_and_spread():
    shape, everything = (3, 16, 16), (slice(None),) * 3
    x32 = synthetic.values(np, 7, np.arange(64), shape, everything)
    x64 = synthetic.values(np, 7, np.arange(64), shape, everything, dtype="float64")
    np.testing.assert_array_equal(x32.astype(np.float64), x64)  # k * 2**-23 - 1: exact in both
    assert -1 <= x32.min() and x32.max() < 1 and abs(x32.mean()) < 0.01 and abs(x32.std() - 3**-0.5) < 0.01
    np.testing.assert_array_equal(x32, synthetic.values(np, 7, np.arange(64), shape, everything))
    other = synthetic.values(np, 8, np.arange(64), shape, everything)
    assert (other != x32).mean() > 0.99
    labels = synthetic.labels(np, 7, np.arange(10_000), 10)
    assert labels.dtype == np.int64 and set(np.unique(labels)) == set(range(10))
    assert np.bincount(labels).min() > 900  # about 1000 of each class
    np.testing.assert_array_equal(labels[[5, 3]], synthetic.labels(np, 7, [5, 3], 10))


# ---- reading a tile -------------------------------------------------------------------------
def _sources(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((12, 3, 5, 6)), rng.integers(0, 10, 12)
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    np.save(tmp_path / "y.npy", y)
    return {"array": ArrayDataset({"images": x, "labels": y}),
            "npy": NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y.npy"}),
            "synthetic": Synthetic(12, shape=(3, 5, 6), classes=10)}


def test_a_read_takes_the_rect_of_the_batch_and_nothing_else(tmp_path):
    indices = np.array([9, 2, 2, 7, 0], dtype=np.int64)
    rect = Rect((1, 1, 2, 0), (4, 3, 5, 6))  # rows 1..3 of the batch, channels 1..2, rows 2..4 of each image
    for name, dataset in _sources(tmp_path).items():
        whole = dataset.read("images", indices, (slice(None),) * 3).astype(np.float32)
        tile = read_tile(dataset, "images", indices, rect, "float32")
        np.testing.assert_array_equal(tile, whole[1:4, 1:3, 2:5, 0:6], err_msg=name)
        assert tile.flags.c_contiguous and tile.dtype == np.float32
        labels = read_tile(dataset, "labels", indices, Rect((3,), (5,)), "int64")
        np.testing.assert_array_equal(labels, dataset.read("labels", indices[3:5], ()), err_msg=name)
    placed = _sources(tmp_path)["array"].array("images", "float64")  # a copy placed on a device
    np.testing.assert_array_equal(read_tile(placed, "images", indices, rect, "float64"),
                                  placed[indices][1:4, 1:3, 2:5])
    assert tile_on_device(placed, "images", indices, rect, "float64").shape == (3, 2, 3, 6)  # a CPU worker: host


def test_read_tasks_stand_for_the_data_on_their_devices_and_are_not_fused():
    g = lenet()
    strategy = Strategy({l.name: P(n=2, devices=(0, 1)) for l in g if not l.is_input} | {"image": P(n=2, h=2)})
    plan = lower(g, strategy)
    dataset = Synthetic(100, shape=g.inputs[0].shape[1:], classes=10)
    indices = np.arange(4, dtype=np.int64)
    reads = {(layer, part.index): TileRead(dataset, "images" if layer == "image" else "labels", indices, part.rect,
                                           "float32" if layer == "image" else "int64", layer)
             for layer, parts in plan.data.items() for part in parts}
    state = {key: f"state-{key}" for key in plan.outputs["state"]}
    hyper = {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    dsk, restriction, _ = step_graph(plan, "5-ab", state, reads, hyper, gpu_devices=frozenset({1}))
    read_keys = [k for k in dsk if key_split(k).endswith("-read")]
    assert sorted(map(key_split, read_keys)) == sorted(f"{layer}-read" for layer, _ in reads)
    for key in read_keys:
        layer, part = key[0].split("-read-it")[0], key[1]
        device = plan.data[layer][part].device
        assert restriction[key] == {f"dev{device}": 1}
        fn, *args = dsk[key]
        assert fn is (tile_on_device if device == 1 else read_tile)
        assert args == list(reads[(layer, part)].args) and args[2] is indices  # one array for every read
    assert any("fused" in str(k) for k in dsk)  # the rest was fused; the reads stayed tasks of their own


# ---- epoch orders ---------------------------------------------------------------------------
def test_seeded_shuffles_repeat_and_differ_between_seeds_and_epochs():
    first = [i.tolist() for _, i in batches(50, 8, 3, seed=4, shuffle=True, last="drop")]
    assert first == [i.tolist() for _, i in batches(50, 8, 3, seed=4, shuffle=True, last="drop")]
    assert first != [i.tolist() for _, i in batches(50, 8, 3, seed=5, shuffle=True, last="drop")]
    assert not np.array_equal(epoch_order(50, 0, 4, True), epoch_order(50, 1, 4, True))
    np.testing.assert_array_equal(epoch_order(50, 2, 4, False), np.arange(50))


@pytest.mark.parametrize("length,batch,epochs", [(50, 8, 3), (16, 8, 2), (10, 4, 1), (7, 7, 4), (9, 4, 3)])
def test_drop_and_wrap_use_every_sample_as_they_say(length, batch, epochs):
    drop = list(batches(length, batch, epochs, 1, True, "drop"))
    assert len(drop) == sum(steps_per_epoch(length, batch, epochs, "drop")) == epochs * (length // batch)
    for e in range(epochs):
        used = np.concatenate([i for epoch, i in drop if epoch == e])
        assert len(set(used)) == len(used) == length // batch * batch  # distinct, the remainder dropped
    wrap = list(batches(length, batch, epochs, 1, True, "wrap"))
    counts = steps_per_epoch(length, batch, epochs, "wrap")
    assert len(wrap) == sum(counts) == -(-epochs * length // batch)
    assert [sum(1 for epoch, _ in wrap if epoch == e) for e in range(epochs)] == counts
    stream = np.concatenate([i for _, i in wrap])
    orders = np.concatenate([epoch_order(length, e, 1, True) for e in range(epochs + 1)])
    np.testing.assert_array_equal(stream, orders[:len(stream)])  # each epoch whole, the last batch filled from the next
    assert all(len(i) == batch and i.dtype == np.int64 for _, i in wrap)


def test_fit_options_are_checked():
    check_options(1, True, 0, "wrap", 2, False)
    for args, match in [((0, True, 0, "drop", 2, True), "epochs must be a positive int"),
                        ((1, True, 0, "pad", 2, True), "last must be one of 'drop', 'wrap'.*got 'pad'"),
                        ((1, True, 0, "drop", 0, True), "prefetch must be a positive int"),
                        ((1, True, 0, "drop", 9, True), "prefetch must be at most 4"),
                        ((1, "yes", 0, "drop", 2, True), "shuffle must be True or False"),
                        ((1, True, 1.5, "drop", 2, True), "seed must be an int")]:
        with pytest.raises(ValueError, match=match):
            check_options(*args)


# ---- bad input ------------------------------------------------------------------------------
def test_npy_files_are_checked_when_the_dataset_is_made(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 1, 16, 16), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.zeros(10, dtype=np.int64))
    np.save(tmp_path / "y9.npy", np.zeros(9, dtype=np.int64))
    with pytest.raises(DatasetError, match=r"field 'labels': .*nothing\.npy: no such file"):
        NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "nothing.npy"})
    with pytest.raises(DatasetError, match=r"same number of samples.*x\.npy: 10.*y9\.npy: 9"):
        NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y9.npy"})
    (tmp_path / "text.npy").write_text("not numbers")
    with pytest.raises(DatasetError, match=r"text\.npy is not a \.npy file"):
        NpyDataset({"images": tmp_path / "text.npy"})
    size = os.path.getsize(tmp_path / "x.npy")
    with open(tmp_path / "x.npy", "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(DatasetError, match=rf"x\.npy is truncated: it holds {size - 100:,} bytes, its header \(shape "
                                           rf"\(10, 1, 16, 16\), dtype float32\) needs {size:,}"):
        NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y.npy"})


def test_a_file_changed_after_it_was_opened_is_read_only_as_it_was_checked(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(40, dtype=np.float32).reshape(10, 4))
    dataset = NpyDataset({"images": path})
    npy = dataset.files["images"]
    np.testing.assert_array_equal(dataset.read("images", [3], (slice(1, 3),)), [[13, 14]])
    np.save(path, -np.arange(40, dtype=np.float32).reshape(10, 4))  # replaced, same header: read anew
    np.testing.assert_array_equal(dataset.read("images", [3], (slice(1, 3),)), [[-13, -14]])
    np.save(path, np.zeros((10, 5), dtype=np.float32))
    with pytest.raises(DataReadError, match=rf"file {path} .*changed while training: its header says shape \(10, 5\)"):
        mapped(npy, dataset.where("images"))
    np.save(path, np.zeros((10, 4), dtype=np.float32))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(DataReadError, match=rf"file {path} .*is truncated: it holds"):
        dataset.read("images", [9], (slice(None),))
    os.remove(path)
    with pytest.raises(DataReadError, match=rf"file {path} .*disappeared: no such file while training"):
        dataset.read("images", [0], (slice(None),))


def test_datasets_that_do_not_fit_the_graph_are_named_with_what_would(tmp_path):
    g = lenet()  # image (4, 1, 16, 16) float, labels (4,) int64, 10 classes
    x, y = np.zeros((6, 1, 16, 16), dtype=np.float32), np.arange(6)
    binding = bind_dataset(g, ArrayDataset({"images": x, "labels": y}), "float32", min_length=4)
    assert binding.fields == (("image", "images", "float32"), ("labels", "labels", "int64"))
    with pytest.raises(DatasetError, match=r"array 'images' of dataset 'arrays' has samples of shape \(1, 8, 8\); "
                                           r"input 'image' of graph 'lenet5' takes samples of shape \(1, 16, 16\)"):
        bind_dataset(g, ArrayDataset({"images": x[:, :, :8, :8], "labels": y}), "float32")
    with pytest.raises(DatasetError, match=r"holds dtype float32; input 'labels' holds class labels and needs int"):
        bind_dataset(g, ArrayDataset({"images": x, "labels": y.astype(np.float32)}), "float32")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y + 5)
    with pytest.raises(DatasetError, match=rf"file {tmp_path / 'y.npy'} \(field 'labels' of dataset .*\) holds labels "
                                           r"from 5 to 10; input 'labels' \(labels of 'loss'\) must lie in \[0, 10\)"):
        bind_dataset(g, NpyDataset({"images": tmp_path / "x.npy", "labels": tmp_path / "y.npy"}), "float32")
    with pytest.raises(DatasetError, match=r"synthetic field 'labels' .* holds labels from 0 to 99; .*\[0, 10\)"):
        bind_dataset(g, Synthetic(10, shape=(1, 16, 16), classes=100), "float32")
    with pytest.raises(DatasetError, match=r"has 3 samples, fewer than the batch of 4 .*input 'image'"):
        bind_dataset(g, ArrayDataset({"images": x[:3], "labels": y[:3]}), "float32", min_length=4)
    with pytest.raises(DatasetError, match=r"no field 'images' for input 'image'.*fields are \['labels', 'pixels'\]"):
        bind_dataset(g, ArrayDataset({"pixels": x, "labels": y}), "float32")
    named = ArrayDataset({"pixels": x, "labels": y}, inputs={"image": "pixels", "labels": "labels"})
    assert bind_dataset(g, named, "float64").fields[0] == ("image", "pixels", "float64")
    with pytest.raises(DatasetError, match=r"inputs name field\(s\) \['photos'\] it does not have"):
        ArrayDataset({"pixels": x, "labels": y}, inputs={"image": "photos"})
    with pytest.raises(DatasetError, match=r"inputs names \['img'\], which graph 'lenet5' does not have"):
        bind_dataset(g, ArrayDataset({"pixels": x, "labels": y}, inputs={"img": "pixels"}), "float32")
    with pytest.raises(DatasetError, match=r"expected a taskrt dataset .* got ndarray"):
        bind_dataset(g, x, "float32")


def test_arrays_and_indices_are_checked():
    with pytest.raises(DatasetError, match=r"same number of samples.*'images': 4, 'labels': 3"):
        ArrayDataset({"images": np.zeros((4, 2)), "labels": np.zeros(3, dtype=int)})
    with pytest.raises(DatasetError, match="field 'images' contains NaN or infinite values"):
        ArrayDataset({"images": np.full((4, 2), np.nan)})
    with pytest.raises(DatasetError, match="length must be a positive int, got 0"):
        Synthetic(0)
    dataset = Synthetic(10, shape=(2,), classes=3)
    np.testing.assert_array_equal(batch_indices(dataset, [1, 2, 9], 3), [1, 2, 9])
    with pytest.raises(DatasetError, match=r"a batch is 3 sample indices .* got shape \(2,\)"):
        batch_indices(dataset, [1, 2], 3)
    with pytest.raises(DatasetError, match=r"samples 0\.\.9; the batch asks for indices from 1 to 10"):
        batch_indices(dataset, [1, 2, 10], 3)
    with pytest.raises(DatasetError, match=r"got shape \(3,\), dtype float64"):
        batch_indices(dataset, [1.0, 2.0, 3.0], 3)
