"""Shared-memory slots for a step's data to workers on this host (taskrt.staging)."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import staging
from taskrt.staging import SLOTS_PER_WORKER, Staging, StagingError, on_this_host, read_staged

WORKER = "tcp://127.0.0.1:4321"


@pytest.fixture
def slots(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHARED_DIR", str(tmp_path))
    area = Staging()
    yield area
    area.close()
    assert not list(tmp_path.iterdir())  # closing removes every slot


def test_a_tile_comes_out_as_it_went_in_and_frees_its_slot(slots):
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5)).astype(np.float32)
    tile = slots.put(WORKER, x)
    assert tile.shape == x.shape and tile.nbytes == x.nbytes
    out = read_staged(tile)
    np.testing.assert_array_equal(out, x)
    assert out.dtype == x.dtype and out.flags.owndata  # a copy: the slot is written again later
    labels = np.arange(7, dtype=np.int64)
    again = slots.put(WORKER, labels)
    assert again.path == tile.path  # the freed slot, its pages already there
    np.testing.assert_array_equal(read_staged(again), labels)


def test_a_tile_overwritten_in_its_slot_is_refused(slots):
    first = slots.put(WORKER, np.zeros(16))
    read_staged(first)
    second = slots.put(WORKER, np.ones(16))
    assert second.path == first.path
    with pytest.raises(StagingError, match="overwritten"):
        read_staged(first)  # a late task of an abandoned step: never the next step's data
    np.testing.assert_array_equal(read_staged(second), np.ones(16))


def test_slots_not_yet_read_are_never_written_and_are_bounded(slots):
    tiles = [slots.put(WORKER, np.full(8, i, dtype=np.float64)) for i in range(SLOTS_PER_WORKER)]
    assert len({t.path for t in tiles}) == SLOTS_PER_WORKER
    assert slots.put(WORKER, np.zeros(8)) is None  # every slot taken: the caller sends a message
    assert slots.put("tcp://127.0.0.1:9999", np.zeros(8)) is not None  # another worker has its own
    for i, t in enumerate(tiles):
        np.testing.assert_array_equal(read_staged(t), np.full(8, i, dtype=np.float64))
    assert slots.put(WORKER, np.zeros(8)) is not None


def test_a_slot_too_small_is_replaced(slots):
    read_staged(small := slots.put(WORKER, np.zeros(4)))
    big = slots.put(WORKER, np.arange(1000.0))
    assert big.path != small.path
    np.testing.assert_array_equal(read_staged(big), np.arange(1000.0))
    with pytest.raises(StagingError, match="abandoned step"):
        read_staged(small)  # its file removed (a worker that had it mapped finds it written over)


def test_only_loopback_workers_count_as_on_this_host():
    assert on_this_host("tcp://127.0.0.1:40000") and on_this_host("tcp://localhost:1")
    assert on_this_host("tcp://[::1]:40000")
    assert not on_this_host("tcp://10.0.0.5:40000") and not on_this_host("tls://gpu-node-3:8786")
