"""ops.reuse: large arrays on reused memory, never handed out while anything still reads it."""

from __future__ import annotations

import gc

import numpy as np

from taskrt.ops import optim, reuse


def test_memory_is_reused_only_after_every_view_is_gone():
    shape = (reuse.MIN_BYTES // 4,)
    a = reuse.empty(shape, np.float32)
    a[:] = 1.0
    view = a.reshape(-1)[::2]  # a view outlives its array
    address = a.ctypes.data
    del a
    gc.collect()
    b = reuse.empty(shape, np.float32)
    assert b.ctypes.data != address  # still read by `view`: not handed out again
    b[:] = 2.0
    assert (view == 1.0).all()
    del view, b
    gc.collect()
    c = reuse.empty(shape, np.float32)
    d = reuse.empty(shape, np.float32)
    assert address in (c.ctypes.data, d.ctypes.data)  # free again: used again


def test_small_arrays_and_shapes_are_plain():
    small = reuse.empty((3, 4), np.float64)
    assert small.shape == (3, 4) and small.dtype == np.float64 and small.flags.writeable
    large = reuse.empty((2, reuse.MIN_BYTES // 8), np.float32)
    assert large.shape == (2, reuse.MIN_BYTES // 8) and large.flags.c_contiguous and large.flags.writeable


def test_updates_on_reused_memory_leave_earlier_results_intact():
    n = reuse.MIN_BYTES // 4
    rng = np.random.default_rng(0)
    w, v = rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32)
    history = []
    for _ in range(4):  # each step's results are kept, as a snapshot would keep them
        g = rng.standard_normal(n).astype(np.float32)
        expected_v = 0.9 * v + g
        expected_w = w - 0.1 * expected_v
        sgd = optim.SGD(0.1, momentum=0.9)
        w, v = sgd.update(sgd.hyper(), w, (v,), g)
        np.testing.assert_allclose(w, expected_w, rtol=1e-6)
        history.append((w, w.copy()))
    for kept, value in history:
        np.testing.assert_array_equal(kept, value)


def test_clear_lets_go_of_every_kept_block():
    from taskrt.ops import reuse

    previous = reuse.MAX_FREE_BYTES
    reuse.keep_at_most(1 << 30)
    try:
        a = reuse.empty((1 << 20,), "float64")
        del a
        assert reuse.kept_bytes() >= 8 << 20
        reuse.clear()
        assert reuse.kept_bytes() == 0
    finally:
        reuse.keep_at_most(previous)
