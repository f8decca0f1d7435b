"""Replaying fused runs as CUDA graphs (`taskrt.cuda_graphs`): the bookkeeping around a capture,
checked with a stand-in device whose "graph" re-runs the captured function into the same output
arrays (as a CUDA graph rewrites its static outputs).  The real capture runs in the gpu tests."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import cuda_graphs
from taskrt.fusion import FusedRun


class StandInDevice:
    """numpy arrays as device arrays; a capture records `fn` and each replay writes its results into
    the arrays the capture returned, so a value handed out uncopied would change under its holder."""

    def __init__(self, fail=None):
        self.captures = 0
        self.replays = 0
        self.fail = fail

    def is_array(self, x):
        return isinstance(x, np.ndarray)

    def copy(self, x):
        return x.copy()

    def copy_all(self, targets, sources):
        for target, x in zip(targets, sources):
            np.copyto(target, x)

    def copies(self, arrays):
        return [a.copy() for a in arrays]

    def capture(self, fn):
        if self.fail:
            raise RuntimeError(self.fail)
        self.captures += 1
        outputs = fn()
        leaves, _ = cuda_graphs.flatten(outputs, self.is_array)

        def replay():
            self.replays += 1
            fresh, _ = cuda_graphs.flatten(fn(), self.is_array)
            for target, value in zip(leaves, fresh):
                np.copyto(target, value)

        return replay, outputs


def scale_and_shift(x, hyper):
    return x * hyper["lr"]


def a_run(program="p"):
    """in 0: an array; in 1: a tuple (another run's result) read item by item; a literal."""
    steps = (
        ("a", scale_and_shift, (("in", 0), ("lit", {"lr": 2.0}))),
        ("b", np.add, (("own", "a"), ("item", (1, 0)))),
        ("c", np.multiply, (("own", "b"), ("item", (1, 2)))),
    )
    return FusedRun(steps, ("b", "c"), program=program)


@pytest.fixture(autouse=True)
def fresh_programs():
    cuda_graphs.clear()
    yield
    cuda_graphs.clear()


def inputs_of(rng):
    return [rng.standard_normal(4), (rng.standard_normal(4), "unused", rng.standard_normal(4))]


def test_replays_compute_what_ordinary_calls_compute_and_hand_out_fresh_arrays():
    device, rng = StandInDevice(), np.random.default_rng(0)
    run = a_run()
    handed_out = []
    for _ in range(6):
        inputs = inputs_of(rng)
        expected = run.run(inputs)
        got = cuda_graphs.call(run, inputs, device)
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
        handed_out.append((got, expected))
    assert device.captures == 1  # after WARMUP_CALLS ordinary calls
    assert device.replays == 6 - cuda_graphs.WARMUP_CALLS  # the capture's own replay, then one per call
    for got, expected in handed_out:  # earlier results are not overwritten by later replays
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_a_changed_literal_or_shape_captures_again():
    device, rng = StandInDevice(), np.random.default_rng(1)
    run = a_run()
    for _ in range(cuda_graphs.WARMUP_CALLS + 2):
        cuda_graphs.call(run, inputs_of(rng), device)
    assert device.captures == 1
    steps = list(run.steps)
    steps[0] = ("a", scale_and_shift, (("in", 0), ("lit", {"lr": 0.5})))
    other = FusedRun(tuple(steps), run.exports, program=run.program)
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        inputs = inputs_of(rng)
        got = cuda_graphs.call(other, inputs, device)
        np.testing.assert_array_equal(got[1], other.run(inputs)[1])
    assert device.captures == 2
    longer = [rng.standard_normal(5), (rng.standard_normal(5), None, rng.standard_normal(5))]
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        got = cuda_graphs.call(run, longer, device)
    np.testing.assert_array_equal(got[1], run.run(longer)[1])
    assert device.captures == 3


def test_the_same_values_given_another_way_replay_the_same_graph():
    """A step whose state comes as futures of its own (the first, or after a lineage cut) reads the
    values the others read out of the previous run's result: one graph serves both."""
    device, rng = StandInDevice(), np.random.default_rng(5)
    run = a_run("state")
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        cuda_graphs.call(run, inputs_of(rng), device)
    as_futures = FusedRun(tuple((key, fn, tuple(("in", 1 + ref[1] // 2) if kind == "item" else (kind, ref)
                                                for kind, ref in args)) for key, fn, args in run.steps),
                          run.exports, program=run.program)
    x, (a, _, b) = inputs_of(rng)
    got = cuda_graphs.call(as_futures, [x, a, b], device)
    np.testing.assert_array_equal(got[1], as_futures.run([x, a, b])[1])
    assert device.captures == 1 and device.replays == 2


def test_a_run_that_cannot_be_captured_warns_once_and_runs_as_before():
    device, rng = StandInDevice(fail="operation not permitted when stream is capturing"), np.random.default_rng(2)
    run = a_run("failing")
    for _ in range(cuda_graphs.WARMUP_CALLS):
        cuda_graphs.call(run, inputs_of(rng), device)
    with pytest.warns(RuntimeWarning, match="'failing' runs without a CUDA graph: RuntimeError: operation not"):
        inputs = inputs_of(rng)
        got = cuda_graphs.call(run, inputs, device)
    np.testing.assert_array_equal(got[1], run.run(inputs)[1])
    assert cuda_graphs.stats()["failed"] == {"failing": "RuntimeError: operation not permitted when stream is "
                                                        "capturing"}
    inputs = inputs_of(rng)
    np.testing.assert_array_equal(cuda_graphs.call(run, inputs, device)[1], run.run(inputs)[1])  # no warning again


def test_a_call_given_host_values_runs_as_before_and_does_not_stop_later_captures():
    device, rng = StandInDevice(), np.random.default_rng(6)
    run = a_run("host")
    _, (a, _, b) = inputs_of(rng)
    got = cuda_graphs.call(run, [1.5, (a, None, b)], device)  # a number: not an array of this device
    np.testing.assert_array_equal(got[1], run.run([1.5, (a, None, b)])[1])
    assert device.captures == 0 and not cuda_graphs.stats()["failed"]
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        cuda_graphs.call(run, inputs_of(rng), device)
    assert device.captures == 1


def test_only_the_most_recent_programs_are_kept():
    device, rng = StandInDevice(), np.random.default_rng(3)
    for i in range(cuda_graphs.MAX_PROGRAMS + 3):
        cuda_graphs.call(a_run(f"run{i}"), inputs_of(rng), device)
    assert cuda_graphs.stats()["programs"] == cuda_graphs.MAX_PROGRAMS


def test_flatten_and_unflatten_keep_the_structure():
    value = (np.zeros(2), None, [np.ones(3), (np.zeros(1),)])
    leaves, structure = cuda_graphs.flatten(value, lambda x: isinstance(x, np.ndarray))
    assert len(leaves) == 3
    rebuilt = cuda_graphs.unflatten(structure, leaves)
    assert rebuilt[1] is None and isinstance(rebuilt[2], list) and isinstance(rebuilt[2][1], tuple)
    assert rebuilt[0] is leaves[0] and rebuilt[2][1][0] is leaves[2]


def test_without_a_gpu_a_named_run_is_an_ordinary_call():
    run = a_run("cpu")
    inputs = inputs_of(np.random.default_rng(4))
    for a, b in zip(run(*inputs), run.run(inputs)):
        np.testing.assert_array_equal(a, b)
    assert cuda_graphs.stats()["programs"] == 0
