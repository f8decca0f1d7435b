"""Device arrays between workers through CUDA IPC (`taskrt.transport.gpu_ipc`): the buffers, their flags and
the messages, checked with a stand-in device whose memory is host memory at real addresses.  The
CUDA calls run in the gpu tests (two workers sharing a GPU exchange values through them)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from taskrt.transport import gpu_ipc, shared_memory


class StandInDevice:
    """Buffers are numpy arrays, an IPC handle is the address, copies happen at once."""

    def __init__(self):
        self.buffers, self.events = {}, 0

    def address(self, array):
        return array.ctypes.data

    def malloc(self, nbytes):
        buffer = np.empty(nbytes, np.uint8)
        self.buffers[buffer.ctypes.data] = buffer
        return buffer.ctypes.data

    def memory_handle(self, pointer):
        return pointer.to_bytes(8, "little")

    def ipc_event(self):
        self.events += 1
        return self.events

    def event_handle(self, event):
        return event.to_bytes(8, "little")

    def copy_and_mark(self, target, source, nbytes, event):
        ctypes.memmove(target, source, nbytes)

    def open_memory(self, handle):
        return int.from_bytes(handle, "little")

    def open_event(self, handle):
        return int.from_bytes(handle, "little")

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def copy_after(self, target, source, nbytes, event):
        ctypes.memmove(target, source, nbytes)
        return None

    def wait(self, event):
        pass


@pytest.fixture
def pair(tmp_path):
    device = StandInDevice()
    sender = gpu_ipc.Sender(device, pool_bytes=4 * gpu_ipc.GRAIN, directory=str(tmp_path))
    yield sender, gpu_ipc.Receiver(device)
    sender.close()


def test_an_array_arrives_equal_through_a_buffer_whose_flag_clears_once_copied(pair):
    sender, receiver = pair
    value = np.random.default_rng(0).standard_normal((300, 257)).astype(np.float32)
    slot = sender.write(value)
    assert sender.flags[slot.index] == 1
    got = receiver.read(gpu_ipc.Slot.from_message(slot.as_message()))  # as a message carries it
    np.testing.assert_array_equal(got, value)
    assert got.dtype == value.dtype and got.ctypes.data != sender.buffers[slot.index].pointer
    receiver.copies.join()
    assert sender.flags[slot.index] == 0


def test_a_buffer_in_use_is_not_written_again_and_a_full_pool_says_so(pair):
    sender, receiver = pair
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(gpu_ipc.GRAIN // 8) for _ in range(5)]  # a buffer each
    slots = [sender.write(v) for v in values[:4]]
    assert len({s.index for s in slots}) == 4
    assert sender.write(values[4]) is None  # four buffers in use fill the pool: through host memory
    for slot, value in zip(slots, values):
        np.testing.assert_array_equal(receiver.read(slot), value)
    receiver.copies.join()
    again = sender.write(values[4])  # a buffer free again: reused, not a fifth
    assert again is not None and again.index in {s.index for s in slots} and len(sender.buffers) == 4
    np.testing.assert_array_equal(receiver.read(again), values[4])


def test_the_flags_file_is_named_for_its_process_and_removed_on_close(tmp_path):
    sender = gpu_ipc.Sender(StandInDevice(), directory=str(tmp_path))
    name = os.path.basename(sender.path)
    assert name.startswith(f"{shared_memory.PREFIX}{os.getpid()}-")  # swept once the process is gone
    sender.close()
    assert not os.listdir(tmp_path)


def test_only_large_device_arrays_are_eligible():
    assert not gpu_ipc.eligible(np.zeros(2**20))  # a host array: shared memory's


def test_the_mailbox_sends_a_device_array_through_a_buffer_and_hands_over_its_copy(monkeypatch, tmp_path):
    """The mailbox's side of IPC, with the stand-in device: a large "device array" to a worker on the
    same host that takes IPC goes as a slot (no value in the message), and the receiving mailbox hands
    over an equal copy; to a worker that does not take IPC, the value itself goes."""
    import taskrt.transport.mailbox as mailbox
    from taskrt.ops import reuse
    from tests.test_programs import FakeWorker

    device = StandInDevice()
    monkeypatch.setattr(gpu_ipc, "eligible", lambda value: isinstance(value, np.ndarray) and value.nbytes >= 2**20)
    real_receiver = gpu_ipc.Receiver
    monkeypatch.setattr(gpu_ipc, "Receiver", lambda: real_receiver(device))
    source = reuse.set_source(None)  # the mailboxes install their shared blocks: put back after
    sender, receiver = mailbox.Mailbox(), mailbox.Mailbox()
    sender.setup(FakeWorker())
    receiver.setup(FakeWorker())
    try:
        _exchange(monkeypatch, tmp_path, device, sender, receiver)
    finally:
        for box in (receiver, sender):
            box.teardown(box.worker)
        reuse.set_source(source)


def _exchange(monkeypatch, tmp_path, device, sender, receiver):
    sender.shm_sender = None  # as on a GPU worker's device arrays: not host memory's to lend
    sender.gpu_sender = gpu_ipc.Sender(device, directory=str(tmp_path))
    sent = []

    async def write(address, msg):  # the message as it would be written
        sent.append(dict(msg))

    monkeypatch.setattr(sender, "_write", write)
    sender.links = None
    value = np.random.default_rng(3).standard_normal(2**18)  # 2 MiB
    for takes, peer in ((True, "tcp://here:2"), (False, "tcp://here:3")):
        sender.gpu_peers[peer] = takes
        sender.send(peer, ("x", peer), "1", value).result()
    through_ipc, as_value = sent
    assert "gpu_slot" in through_ipc and "value" not in through_ipc and "gpu_slot" not in as_value
    receiver.put(**{k: v for k, v in through_ipc.items() if k not in ("op", "reply")})
    got = receiver.take(("x", "tcp://here:2"), "1", "tcp://here:1")
    np.testing.assert_array_equal(got, value)
    assert receiver.gpu_receiver.reads == 1
