"""Checkpoint files: atomic writes, digests, clear errors, periodic checkpoints."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest

from taskrt import models
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.training.checkpoint import CheckpointError, Checkpoints, read_checkpoint, write_checkpoint
from taskrt.training.trainer import Trainer


def small_lenet(width=0.5):
    return models.lenet5(batch=4, image_size=16, width=width)


def data_parallel(graph, devices=(0, 1)):
    return Strategy({l.name: P(n=len(devices), devices=devices) for l in graph if not l.is_input})


def batches(graph, count, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    return [(rng.standard_normal(shape), rng.integers(0, 10, shape[0])) for _ in range(count)]


def state():
    """Parameters, and the optimizer's state under its slot names (here SGD's momentum buffer)."""
    params = {"fc": {"weight": np.arange(12.0).reshape(3, 4), "bias": np.ones(3)}}
    velocity = {"momentum_buffer": {"fc": {"weight": np.zeros((3, 4)), "bias": np.zeros(3)}}}
    return params, velocity


def test_round_trip_and_no_temporary_file(tmp_path):
    params, velocity = state()
    write_checkpoint(tmp_path / "c.npz", {"graph": {"name": "g", "layers": []}}, params, velocity)
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]
    meta, p, v = read_checkpoint(tmp_path / "c.npz")
    np.testing.assert_array_equal(p["fc"]["weight"], params["fc"]["weight"])
    np.testing.assert_array_equal(v["momentum_buffer"]["fc"]["bias"], velocity["momentum_buffer"]["fc"]["bias"])
    assert set(meta["digests"]) == {"param/fc/weight", "param/fc/bias", "state/momentum_buffer/fc/weight",
                                    "state/momentum_buffer/fc/bias"}


def test_a_failed_write_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    params, velocity = state()
    path = tmp_path / "c.npz"
    write_checkpoint(path, {"graph": {"name": "g", "layers": []}}, params, velocity)
    before = path.read_bytes()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(path, {"graph": {"name": "g", "layers": []}}, {"fc": {"weight": np.zeros((3, 4)),
                         "bias": np.zeros(3)}}, velocity)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_truncated_file_is_named(tmp_path):
    params, velocity = state()
    path = tmp_path / "c.npz"
    write_checkpoint(path, {"graph": {"name": "g", "layers": []}}, params, velocity)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(path)


def test_flipped_byte_is_caught(tmp_path):
    params, velocity = state()
    path = tmp_path / "c.npz"
    write_checkpoint(path, {"graph": {"name": "g", "layers": []}}, params, velocity)
    raw = bytearray(path.read_bytes())
    at = bytes(raw).index(np.arange(12.0)[5:6].tobytes())  # inside param/fc/weight's data
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted.*param/fc/weight") as raised:
        read_checkpoint(path)
    message = str(raised.value)
    assert message.count("corrupted") == 1 and "cannot read" not in message, message


def test_an_array_changed_behind_the_digest_is_named(tmp_path):
    """A well-formed archive whose array no longer matches the digest in its metadata."""
    params, velocity = state()
    path = tmp_path / "c.npz"
    write_checkpoint(path, {"graph": {"name": "g", "layers": []}}, params, velocity)
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["state/momentum_buffer/fc/bias"] = arrays["state/momentum_buffer/fc/bias"] + 1
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())
    assert zipfile.is_zipfile(path)
    with pytest.raises(CheckpointError, match="'state/momentum_buffer/fc/bias' does not match its digest"):
        read_checkpoint(path)


@pytest.mark.parametrize("content", [b"step,loss\n1,2.30\n", b"", np.arange(3.0).tobytes()])
def test_a_file_that_is_no_archive_is_named_so(tmp_path, content):
    """numpy takes a file that is neither .npy nor .npz for a pickle and speaks of allow_pickle:
    the checkpoint reader says what the file is instead."""
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="x.npz is not a taskrt checkpoint: it is .*not an .npz archive") as e:
        read_checkpoint(path)
    assert "pickle" not in str(e.value)


def test_missing_file_and_foreign_archive(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint(tmp_path / "none.npz")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a taskrt checkpoint"):
        read_checkpoint(tmp_path / "other.npz")
    meta = json.dumps({"format": "taskrt-checkpoint/2"}).encode()
    np.savez(tmp_path / "old.npz", meta=np.frombuffer(meta, dtype=np.uint8))
    with pytest.raises(CheckpointError, match="no digests"):
        read_checkpoint(tmp_path / "old.npz")


def test_checkpoint_of_another_graph_names_the_difference(machine4, tmp_path):
    graph = small_lenet()
    trainer = Trainer(graph, data_parallel(graph), machine4)
    trainer.save(tmp_path / "c.npz")
    wider = small_lenet(width=1.0)
    with pytest.raises(CheckpointError, match=r"another graph: layer 'conv1' has out_channels 3 in the checkpoint, "
                                              r"6 in this graph"):
        Trainer.load(tmp_path / "c.npz", machine4, graph=wider)
    resumed = Trainer.load(tmp_path / "c.npz", machine4, graph=graph)
    assert resumed.steps_done == 0


def test_checkpoints_option_validates():
    with pytest.raises(ValueError, match="every must be a positive int"):
        Checkpoints("d", every=0)
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpoints("d", every=2, keep=0)


def test_periodic_checkpoints_keep_the_last_k_and_resume_exactly(machine4, tmp_path):
    graph = small_lenet()
    data = batches(graph, 7, seed=3)
    policy = Checkpoints(tmp_path / "ckpts", every=2, keep=2)
    trainer = Trainer(graph, data_parallel(graph, (2, 3)), machine4, lr=0.05, momentum=0.9, dtype="float64",
                      checkpoints=policy)
    at_six = None
    futures = [trainer.submit(x, y) for x, y in data[:6]]  # steps in flight: checkpoints still per step
    [f.result() for f in futures]
    at_six = trainer.parameters()
    trainer.step(*data[6])
    assert [p.name for p in policy.saved()] == ["step-00000004.npz", "step-00000006.npz"]
    resumed = Trainer.load(policy.latest(), machine4, graph=graph)
    assert resumed.steps_done == 6
    got = resumed.parameters()
    for layer in at_six:
        for name in at_six[layer]:
            np.testing.assert_array_equal(got[layer][name], at_six[layer][name])
    resumed.step(*data[6])
    final, expected = resumed.parameters(), trainer.parameters()
    for layer in final:
        for name in final[layer]:
            np.testing.assert_allclose(final[layer][name], expected[layer][name], rtol=1e-12)


def batch_norm_net(batch=4):
    import taskrt as tr

    g = tr.Graph("bn")
    x = g.input("image", (batch, 2, 6, 6))
    x = g.conv2d(x, 4, 3, padding=1, name="conv")
    x = g.relu(g.batch_norm(x, name="bn"), name="relu")
    x = g.flatten(x, name="flatten")
    g.softmax_cross_entropy(g.linear(x, 10, name="fc"), name="loss")
    return g


def test_running_statistics_travel_with_checkpoints_and_snapshots(machine4, tmp_path):
    graph = batch_norm_net()
    strategy = Strategy({"conv": P(c=2, devices=(0, 1)), "bn": P(n=2, c=2, devices=(0, 1, 2, 3)),
                         "relu": P(n=2, devices=(2, 3)), "flatten": P(n=2, devices=(2, 3)),
                         "fc": P(devices=(1,)), "loss": P(devices=(1,))})
    policy = Checkpoints(tmp_path, every=2, keep=2)
    trainer = Trainer(graph, strategy, machine4, dtype="float64", checkpoints=policy, snapshot_every=2)
    for x, y in batches(graph, 4):
        trainer.step(x, y)
    running = trainer.buffers()
    assert not np.allclose(running["bn"]["running_mean"], 0)  # they moved
    assert np.array_equal(trainer.snapshot.running["bn"][0], running["bn"]["running_mean"])  # snapshot of step 4
    trainer.save(tmp_path / "c.npz")
    for path in (tmp_path / "c.npz", policy.latest()):
        resumed = Trainer.load(path, machine4, graph=graph)
        for name in ("running_mean", "running_var"):
            assert np.array_equal(resumed.buffers()["bn"][name], running["bn"][name])
        x = batches(graph, 1, seed=5)[0][0]
        assert np.allclose(resumed.predict(x), trainer.predict(x), rtol=1e-12, atol=1e-12)
