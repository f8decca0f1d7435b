"""Arrays through shared memory (taskrt.shared_memory), sender and receiver in one process: the
array arrives equal; its segment is reused only after the receiver's array and all its views are
collected; a full pool sends over TCP instead; segments of dead processes are swept."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from taskrt import shared_memory as shm


@pytest.fixture
def pair(tmp_path):
    sender = shm.Sender(pool_bytes=8 * shm.GRAIN, directory=str(tmp_path))
    yield sender, shm.Receiver()
    sender.close()


def test_an_array_arrives_equal_and_aligned(pair):
    sender, receiver = pair
    value = np.random.default_rng(0).standard_normal((64, 3, 33, 17)).astype(np.float32)
    got = receiver.read(shm.Slot.from_message(sender.write(value).as_message()))
    np.testing.assert_array_equal(got, value)
    assert got.dtype == value.dtype and got.shape == value.shape and got.flags.aligned
    got += 1  # the receiver's to change
    assert not np.array_equal(got, value)


def test_a_segment_is_written_again_only_once_every_view_of_its_array_is_gone(pair):
    sender, receiver = pair
    first = np.full(300_000, 1.0)
    slot = sender.write(first)
    got = receiver.read(slot)
    view = got[10:].reshape(-1, 10)
    del got
    gc.collect()
    second = sender.write(np.full(300_000, 2.0))
    assert second.path != slot.path  # the first segment is still read through `view`
    assert (view == 1.0).all()
    del view
    gc.collect()
    third = sender.write(np.full(300_000, 3.0))
    assert third.path == slot.path  # cleared: reused
    assert len(sender.segments) == 2


def test_a_full_pool_gives_none_and_closing_removes_the_files(pair, tmp_path):
    sender, receiver = pair
    held = [receiver.read(sender.write(np.zeros(shm.GRAIN // 8))) for _ in range(4)]  # 2 MiB segments
    assert sender.write(np.zeros(shm.GRAIN // 8)) is None
    assert len(os.listdir(tmp_path)) == 4 and len(held) == 4
    sender.close()
    assert os.listdir(tmp_path) == []


def test_eligible_values_and_hosts():
    assert shm.eligible(np.zeros(shm.MIN_BYTES // 8))
    assert not shm.eligible(np.zeros(16))
    assert not shm.eligible(np.empty(shm.MIN_BYTES, dtype=object))
    assert not shm.eligible((np.zeros(shm.MIN_BYTES),))
    assert shm.same_host("tcp://127.0.0.1:4000", "tcp://127.0.0.1:5000")
    assert not shm.same_host("tcp://10.0.0.1:4000", "tcp://10.0.0.2:4000")


def test_segments_of_dead_processes_are_swept(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / f"{shm.PREFIX}{dead}-ab-1").write_bytes(b"x")
    (tmp_path / f"{shm.PREFIX}{os.getpid()}-ab-1").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert shm.sweep(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([f"{shm.PREFIX}{os.getpid()}-ab-1", "other"])
