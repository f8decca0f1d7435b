"""Landing buffers for copies to a GPU (taskrt.gpu.staging.Landing), with a fake backend: a buffer is
reused only after its array is given back, and then behind the event marking its last readers."""

from __future__ import annotations

import itertools

from taskrt.gpu.staging import Landing


def fake_landing(limit=64):
    buffers, events = itertools.count(), itertools.count()
    return Landing(alloc=lambda nbytes: ("buffer", nbytes, next(buffers)), mark=lambda: ("event", next(events)),
                   limit=limit)


def test_a_buffer_in_use_is_never_handed_out_again():
    landing = fake_landing()
    a, wait_a = landing.take(64)
    b, wait_b = landing.take(64)
    assert a != b and wait_a is None and wait_b is None


def test_a_buffer_given_back_is_reused_behind_the_event_of_its_last_readers():
    landing = fake_landing()
    a, _ = landing.take(64)
    landing.give_back(64, a)
    again, wait = landing.take(64)
    assert again == a and wait == ("event", 0)
    other, wait = landing.take(128)  # another size: a new buffer, nothing to wait for
    assert other != a and wait is None
    assert landing.allocated == 2


def test_buffers_come_back_in_the_order_given_and_beyond_the_limit_are_dropped():
    landing = fake_landing(limit=2)
    held = [landing.take(8)[0] for _ in range(3)]
    for buffer in held:
        landing.give_back(8, buffer)
    assert [landing.take(8) for _ in range(2)] == [(held[0], ("event", 0)), (held[1], ("event", 1))]
    assert landing.take(8)[1] is None  # the third was dropped: a new one
