"""Replaying fused runs as CUDA graphs (`taskrt.gpu.cuda_graphs`): the bookkeeping around a capture,
checked with a stand-in device whose "graph" re-runs the captured function into the same output
arrays (as a CUDA graph rewrites its static outputs).  The real capture runs in the gpu tests."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from taskrt.gpu import cuda_graphs
from taskrt.planning.fusion import FusedRun


class StandInDevice:
    """numpy arrays as device arrays, at their real addresses.  A capture records the body and the
    copies around it; each replay copies the inputs in (at the addresses the table names now), writes
    the body's results into the arrays the capture returned (as a CUDA graph rewrites its static
    outputs), and copies those out: a value handed out uncopied would change under its holder, and a
    table filled wrongly would copy the wrong bytes."""

    def __init__(self, fail=None):
        self.captures = 0
        self.replays = 0
        self.fail = fail

    def is_array(self, x):
        return type(x) is np.ndarray  # OnHost: an array in host memory, not this device's

    def copy(self, x):
        return x.copy()

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def address(self, x):
        return x.__array_interface__["data"][0]

    def device_table(self, n):
        return np.zeros(n, dtype=np.uint64)

    def upload(self, table, host):
        np.copyto(table, np.asarray(host, dtype=np.uint64))

    def copy_segments(self, table, m, blocks):
        src, dst, nbytes, first = (table[i * m:(i + 1) * m].tolist() for i in range(4))
        assert (first, blocks) == cuda_graphs.copy_layout(nbytes)
        for s, d, n in zip(src, dst, nbytes):
            ctypes.memmove(d, s, n)

    def empty_bytes(self, n):
        return np.full(max(n, 1), 0xAB, dtype=np.uint8)  # not zeros: bytes not copied show

    def view(self, buffer, offset, shape, dtype):
        return np.ndarray(shape, dtype, buffer=buffer, offset=offset)

    def ordinary_call(self, body):
        return body()

    def capture(self, body, copy_in, copy_out):
        if self.fail:
            raise RuntimeError(self.fail)
        self.captures += 1
        outputs = body()
        leaves, _ = cuda_graphs.flatten(outputs, self.is_array)

        def replay():
            self.replays += 1
            copy_in()
            fresh, _ = cuda_graphs.flatten(body(), self.is_array)
            for target, value in zip(leaves, fresh):
                np.copyto(target, value)
            copy_out()

        return replay, outputs


class OnHost(np.ndarray):
    """An array the stand-in device does not hold (as a numpy batch is not a GPU's)."""


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
    on_host = rng.standard_normal(4).view(OnHost)
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        got = cuda_graphs.call(run, [on_host, (a, None, b)], device)
        np.testing.assert_array_equal(got[1], run.run([on_host, (a, None, b)])[1])
    assert device.captures == 0 and not cuda_graphs.stats()["failed"]
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        cuda_graphs.call(run, inputs_of(rng), device)
    assert device.captures == 1


def test_values_that_are_not_arrays_are_constants_of_the_capture():
    """A program gives its runs the hyper-parameters as an input (a dict): captured as constants, as
    literals are, so a changed value captures again and an unchanged one replays."""
    device, rng = StandInDevice(), np.random.default_rng(8)
    steps = (("a", scale_and_shift, (("in", 0), ("in", 1))),)
    run = FusedRun(steps, ("a",), program="hyper")
    for lr, calls, captures in ((2.0, cuda_graphs.WARMUP_CALLS + 2, 1), (0.5, cuda_graphs.WARMUP_CALLS + 1, 2),
                                (2.0, 1, 2)):
        for _ in range(calls):
            x = rng.standard_normal(4)
            [got] = cuda_graphs.call(run, [x, {"lr": lr}], device)
            np.testing.assert_array_equal(got, x * lr)
        assert device.captures == captures
    assert device.replays == 2 + 1 + 1  # each capture's own replay, then one per later call


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


# ---- programs on workers -----------------------------------------------------------------------------
def _install_stand_in():
    cuda_graphs.clear()
    cuda_graphs._backend = StandInDevice()


def _stand_in_counts():
    device = cuda_graphs._backend
    return {**cuda_graphs.stats(), "captures": device.captures, "replays": device.replays}


def _remove_stand_in():
    cuda_graphs.clear()
    cuda_graphs._backend = None


def test_every_run_of_every_program_is_replayed_and_computes_what_ordinary_calls_compute(machine4, monkeypatch):
    """Programs on workers taken for GPU devices, with the stand-in device: each device's runs are all
    captured after their ordinary calls (a run's hyper-parameters, a dict, are constants of its capture;
    a device with more runs per step than fit in the workers' keep would capture none), and six
    steps give bit for bit the losses and parameters of the same steps called kernel by kernel."""
    from taskrt import models, search
    from taskrt.execution.executor import Executor
    from tests.graphs import alternating_strategy, with_and_without_graphs

    monkeypatch.setattr(Executor, "gpu_devices", property(lambda self: frozenset(range(self.machine.num_devices))))
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal(graph.inputs[0].shape).astype(np.float32),
                rng.integers(0, 10, graph.inputs[0].shape[0])) for _ in range(6)]
    def every_run_captured(graphs):
        counts = [c for c in machine4.client.run(_stand_in_counts).values() if c["programs"]]
        if graphs:
            assert counts and all(c["captures"] == c["programs"] and not c["failed"] for c in counts), counts
            assert all(c["replays"] >= c["captures"] * (len(batches) - cuda_graphs.WARMUP_CALLS)
                       for c in counts), counts
        else:
            assert not counts, counts  # no program names: ordinary calls

    try:
        strategies = {"data": search.data_parallel(graph, machine4), "alternating": alternating_strategy(graph)}
        for label, strategy in strategies.items():
            results = with_and_without_graphs(machine4, graph, strategy, batches,
                                              lambda: machine4.client.run(_install_stand_in), every_run_captured)
            assert results[True][0] == results[False][0], label
            for layer, params in results[False][1].items():
                for key, value in params.items():
                    np.testing.assert_array_equal(results[True][1][layer][key], value, err_msg=f"{label}: {layer}")
    finally:
        machine4.client.run(_remove_stand_in)


def test_several_steps_to_a_program_replay_their_runs_and_compute_what_one_step_at_a_time_computes(
        machine4, monkeypatch):
    """`fit` with three steps to each program on workers taken for GPU devices (the stand-in device):
    the runs of every step in a program replay as graphs, each step's tiles read on its device as
    it starts, and the losses and parameters are bit for bit those of one step at a time launched
    kernel by kernel."""
    from taskrt import models
    from taskrt.data.datasets import Synthetic
    from taskrt.execution.executor import Executor
    from taskrt.training.trainer import Trainer
    from tests.graphs import alternating_strategy

    monkeypatch.setattr(Executor, "gpu_devices", property(lambda self: frozenset(range(self.machine.num_devices))))
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    dataset = Synthetic(8 * 9, shape=graph.inputs[0].shape[1:], classes=10, seed=4)
    results = {}
    try:
        for per_program, graphs in ((3, True), (1, False)):
            machine4.client.run(_install_stand_in)
            trainer = Trainer(graph, alternating_strategy(graph), machine4, lr=0.05, momentum=0.9, cuda_graphs=graphs)
            history = trainer.fit(dataset, seed=1, progress=False, steps_per_program=per_program)
            results[per_program] = history.losses, trainer.parameters()
            counts = [c for c in machine4.client.run(_stand_in_counts).values() if c["programs"]]
            if graphs:  # 9 steps, the first WARMUP_CALLS of each run called as usual
                assert counts and all(c["captures"] == c["programs"] and not c["failed"] for c in counts), counts
                assert all(c["replays"] >= c["captures"] * (9 - cuda_graphs.WARMUP_CALLS) for c in counts), counts
    finally:
        machine4.client.run(_remove_stand_in)
    assert results[3][0] == results[1][0]
    for layer, params in results[1][1].items():
        for key, value in params.items():
            np.testing.assert_array_equal(results[3][1][layer][key], value, err_msg=layer)


# ---- the copies ----------------------------------------------------------------------------------------
def test_strided_inputs_and_outputs_are_copied_by_their_values():
    """The copies move bytes: a strided input (a transposed tile) is made contiguous for the copy in,
    a strided output (a transposed result) before the copy out; both compare equal to ordinary calls."""
    device, rng = StandInDevice(), np.random.default_rng(9)
    steps = (("t", np.transpose, (("in", 0),)), ("s", np.add, (("own", "t"), ("in", 1))))
    run = FusedRun(steps, ("t", "s"), program="strided")
    for i in range(cuda_graphs.WARMUP_CALLS + 4):
        x = rng.standard_normal((3, 5))
        inputs = [x.T.copy().T if i % 2 else x, rng.standard_normal((5, 3)).astype(np.float32)]
        got, expected = cuda_graphs.call(run, inputs, device), run.run(inputs)
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
    assert device.captures == 1 and got[0].flags.c_contiguous  # replayed: copied out of a contiguous output


def test_outputs_lie_aligned_in_one_fresh_buffer_per_call():
    device, rng = StandInDevice(), np.random.default_rng(10)
    steps = (("a", np.negative, (("in", 0),)), ("b", np.sqrt, (("in", 1),)), ("c", np.add, (("own", "a"), ("lit", 1))))
    run = FusedRun(steps, ("a", "b", "c"), program="aligned")
    calls = []
    for _ in range(cuda_graphs.WARMUP_CALLS + 3):
        inputs = [rng.standard_normal(7), rng.random(3).astype(np.float32)]
        calls.append((cuda_graphs.call(run, inputs, device), run.run(inputs)))
    for got, expected in calls:  # later calls wrote elsewhere
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
    replayed = calls[-1][0]
    addresses = [device.address(a) for a in replayed]
    assert all((p - addresses[0]) % cuda_graphs.ALIGN == 0 for p in addresses)
    assert addresses != [device.address(a) for a in calls[-2][0]]


def _copy_kernel_on_the_cpu(tmp_path):
    """The copy kernel's source compiled for the host (blocks and threads run one after another: each
    thread moves bytes no other moves), called through ctypes."""
    import shutil
    import subprocess

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed")
    source = tmp_path / "copy.cpp"
    source.write_text(
        "struct uint4 { unsigned int x, y, z, w; };\nstruct dim3 { unsigned int x; };\n"
        "static dim3 blockIdx, threadIdx, blockDim;\n#define __global__\n"
        + cuda_graphs.copy_kernel_source()
        + '\nextern "C" void run(const unsigned long long* table, int m, unsigned long long blocks, int threads) {\n'
          "    blockDim.x = threads;\n"
          "    for (unsigned long long b = 0; b < blocks; ++b)\n"
          "        for (int t = 0; t < threads; ++t) { blockIdx.x = b; threadIdx.x = t; copy_segments(table, m); }\n"
          "}\n")
    library = tmp_path / "copy.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", str(source), "-o", str(library)],
                   check=True)
    return ctypes.CDLL(str(library)).run


def test_the_copy_kernel_copies_every_segment_whatever_its_size_and_alignment(tmp_path):
    run = _copy_kernel_on_the_cpu(tmp_path)
    rng = np.random.default_rng(11)
    block = cuda_graphs.COPY_BLOCK_BYTES
    source = rng.integers(0, 256, 6 * block, dtype=np.uint8)
    target = np.zeros_like(source)
    expected = np.zeros_like(source)
    sizes = [0, 1, 15, 16, 17, 1000, block - 1, block, block + 1, 2 * block + 48]
    pieces, at = [], 0
    for n in sizes:  # each piece somewhere in the source, to its own place in the target, any alignment
        shift = int(rng.integers(0, 16))
        pieces.append((int(rng.integers(0, len(source) - n)), at + shift, n))
        at += shift + n
    assert at <= len(target)
    for s, t, n in pieces:
        expected[t:t + n] = source[s:s + n]
    first, blocks = cuda_graphs.copy_layout([n for _, _, n in pieces])
    base_s, base_t = source.ctypes.data, target.ctypes.data
    table = np.array([base_s + s for s, _, _ in pieces] + [base_t + t for _, t, _ in pieces]
                     + [n for _, _, n in pieces] + first, dtype=np.uint64)
    run(table.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(len(pieces)), ctypes.c_ulonglong(blocks),
        ctypes.c_int(cuda_graphs.COPY_THREADS))
    np.testing.assert_array_equal(target, expected)
