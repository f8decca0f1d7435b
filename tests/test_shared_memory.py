"""Arrays through shared memory (taskrt.transport.shared_memory), sender and receiver in one process: the
array arrives equal; its segment is reused only after the receiver's array and all its views are
collected; a full pool sends over TCP instead; segments of dead processes are swept."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from taskrt.transport import shared_memory as shm


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


@pytest.fixture
def blocks(tmp_path):
    from taskrt.ops import reuse

    made = shm.Blocks(pool_bytes=64 * shm.GRAIN, directory=str(tmp_path))
    previous = reuse.set_source(made)
    yield made
    reuse.set_source(previous)
    made.close()


def test_a_result_made_in_shared_blocks_is_lent_without_a_copy_and_read_only(blocks):
    from taskrt.ops import reuse

    receiver = shm.Receiver()
    value = reuse.empty((reuse.MIN_BYTES // 4,), np.float32)
    value[:] = 1.0
    slot = shm.Slot.from_message(blocks.lend(value, "tcp://127.0.0.1:1").as_message())
    got = receiver.read(slot)
    np.testing.assert_array_equal(got, value)
    value[0] = 5.0  # the same memory, not a copy (the sender never writes a sent value in a step)
    assert got[0] == 5.0
    with pytest.raises(ValueError):
        got[1] = 2.0
    part = value[1000:3000]  # a view inside the block is lent where it lies
    got_part = receiver.read(blocks.lend(part, "tcp://127.0.0.1:1"))
    np.testing.assert_array_equal(got_part, part)
    assert blocks.lend(np.ones(reuse.MIN_BYTES // 4, np.float32), "tcp://127.0.0.1:1") is None  # not in a block
    assert blocks.lend(value[::2], "tcp://127.0.0.1:1") is None  # not contiguous


def test_a_lent_block_is_handed_out_again_only_once_every_receiver_is_done(blocks):
    from taskrt.ops import reuse

    receiver = shm.Receiver()
    shape = (reuse.MIN_BYTES // 4,)
    value = reuse.empty(shape, np.float32)
    address = value.ctypes.data
    value[:] = 3.0
    held = [receiver.read(blocks.lend(value, f"tcp://127.0.0.1:{port}")) for port in (1, 2, 2)]
    del value
    gc.collect()
    for _ in range(len(held)):
        fresh = reuse.empty(shape, np.float32)  # the sender's own array is gone, its receivers' not
        assert fresh.ctypes.data != address
        fresh[:] = 0.0
        assert all((h == 3.0).all() for h in held)
        del fresh, held[0]
        gc.collect()
    again = [reuse.empty(shape, np.float32) for _ in range(3)]
    assert address in [a.ctypes.data for a in again]  # every receiver done: used again


def test_what_a_lost_worker_was_lent_is_handed_out_again(blocks):
    from taskrt.ops import reuse

    shape = (reuse.MIN_BYTES // 4,)
    value = reuse.empty(shape, np.float32)
    address = value.ctypes.data
    held = shm.Receiver().read(blocks.lend(value, "tcp://127.0.0.1:1"))  # never collected: its worker died
    del value
    gc.collect()
    assert reuse.empty(shape, np.float32).ctypes.data != address
    blocks.forget("tcp://127.0.0.1:1")
    blocks.forget("tcp://127.0.0.1:9")  # never lent anything: nothing to do
    again = [reuse.empty(shape, np.float32) for _ in range(2)]  # held: each a block of its own
    assert address in [a.ctypes.data for a in again]
    slot = blocks.lend(again[0], "tcp://127.0.0.1:2")
    assert slot.done != 2 * 1 + 1  # the lost worker's pair is not given to another
    assert held.shape == shape


def test_blocks_beyond_the_pool_or_dev_shm_come_from_the_heap(blocks, monkeypatch):
    from taskrt.ops import reuse

    blocks.pool_bytes = 0
    assert blocks.new(reuse.MIN_BYTES) is None
    assert reuse.empty((reuse.MIN_BYTES,), np.uint8).nbytes == reuse.MIN_BYTES
    blocks.pool_bytes = shm.POOL_BYTES

    def no_room(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    assert blocks.new(reuse.MIN_BYTES) is None
    sender = shm.Sender(directory=blocks.directory)
    assert sender.write(np.zeros(shm.MIN_BYTES)) is None  # the copy's segment too: over TCP instead
    assert os.listdir(blocks.directory) == []
