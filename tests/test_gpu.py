"""GPU workers for real (marker `gpu`; skipped without cupy and a CUDA device): random strategies
against the numpy reference, residency of every array of a step on the GPU, checkpoints between
GPU and CPU machines, and the search end to end.  Two workers share one GPU when there is only one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device)
        return 0


if _gpu_count() < 1:
    pytest.skip("needs cupy and a CUDA device", allow_module_level=True)

from taskrt import models, search  # noqa: E402
from taskrt.graph.config import ParallelConfig as P  # noqa: E402
from taskrt.graph.strategy import Strategy  # noqa: E402
from taskrt.machines.machine import Machine  # noqa: E402
from taskrt.training.reference import SingleDeviceTrainer  # noqa: E402
from taskrt.training.trainer import Trainer  # noqa: E402
from tests.graphs import alternating_strategy, with_and_without_graphs  # noqa: E402
from tests.strategies import random_strategies  # noqa: E402
from tests.test_equivalence import GRAPHS, batch_for, check_equivalence  # noqa: E402


@pytest.fixture(scope="module")
def gpu2():
    m = Machine.local(2, gpu=True, probe=False)
    yield m
    m.close()


def test_gpu_workers_are_recognized(gpu2):
    assert all(d.kind.startswith("gpu:") for d in gpu2.devices)
    assert all(d.memory and d.memory < 200e9 for d in gpu2.devices)  # the GPU's memory, not the host's


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_on_gpu_workers_match_the_numpy_reference(gpu2, name, data):
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=gpu2.num_devices))
    check_equivalence(graph, strategy, gpu2, "float32")


def test_every_array_of_a_step_lives_on_the_gpu(gpu2):
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    strategy = Strategy({l.name: P(n=2, sync="allreduce") for l in graph if not l.is_input})
    trainer = Trainer(graph, strategy, gpu2, lr=0.05, momentum=0.9)
    x, y = batch_for(graph, seed=0)
    for _ in range(2):
        trainer.step(x, y)
    param_bytes = 4 * graph.num_params()
    pools = gpu2.client.run(_pool_bytes)
    assert sum(pools.values()) >= param_bytes  # weights, velocity and gathered copies on the GPUs

    kinds = gpu2.client.run(_array_kinds, trainer._token)
    for worker, found in kinds.items():
        assert found["numpy"] == [], f"{worker}: numpy arrays of the step in worker memory: {found['numpy']}"
        assert found["cupy"], worker


def test_checkpoints_move_between_gpu_and_cpu_machines(gpu2, tmp_path):
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    strategy = Strategy({l.name: P(n=2) for l in graph if not l.is_input})
    hyper = {"lr": 0.05, "momentum": 0.9, "seed": 2}
    reference = SingleDeviceTrainer(graph, **hyper)
    batches = [batch_for(graph, seed=s) for s in range(3)]
    on_gpu = Trainer(graph, strategy, gpu2, **hyper)
    for x, y in batches[:1]:
        assert on_gpu.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-4)
    on_gpu.save(tmp_path / "gpu.npz")
    with Machine.local(2, probe=False) as cpu:
        on_cpu = Trainer.load(tmp_path / "gpu.npz", cpu)
        x, y = batches[1]
        assert on_cpu.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-4)
        on_cpu.save(tmp_path / "cpu.npz")
    back = Trainer.load(tmp_path / "cpu.npz", gpu2)
    x, y = batches[2]
    assert back.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-4)
    for layer, params in reference.parameters().items():
        for name, value in params.items():
            got = back.parameters()[layer][name]
            assert isinstance(got, np.ndarray)
            np.testing.assert_allclose(got, value, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["lenet5", "inception"])
def test_cuda_graph_replays_compute_what_ordinary_steps_compute(gpu2, name):
    """Eight steps with each run replayed as a CUDA graph from the third on (taskrt.gpu.cuda_graphs) against
    the same steps launched kernel by kernel, data parallel and a layer-wise split over two workers."""
    graph = {"lenet5": lambda: models.lenet5(batch=8, image_size=16, width=0.5),
             "inception": lambda: models.inception_v3(batch=4, image_size=75, num_classes=10, width=1 / 8)}[name]()
    batches = [batch_for(graph, seed=s) for s in range(8)]
    strategies = {"data": search.data_parallel(graph, gpu2), "mixed": alternating_strategy(graph)}
    def captured(graphs):
        if graphs:
            stats = gpu2.client.run(_graph_stats)
            assert all(not s["failed"] for s in stats.values()), stats
            assert sum(s["graphs"] for s in stats.values()) > 0, stats

    for label, strategy in strategies.items():
        results = with_and_without_graphs(gpu2, graph, strategy, batches, lambda: gpu2.client.run(_clear_graphs),
                                          captured)
        np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-5, err_msg=label)
        for layer, params in results[False][1].items():
            for k, value in params.items():
                np.testing.assert_allclose(results[True][1][layer][k], value, rtol=1e-4, atol=1e-6,
                                           err_msg=f"{label}: {layer}.{k}")


@pytest.mark.parametrize("source", ["synthetic", "arrays"])
def test_datasets_read_on_gpu_workers_compute_what_the_numpy_path_computes(gpu2, source):
    """Synthetic generates each device's window on the GPU; an ArrayDataset's tiles go through pinned
    memory on a stream of their own (taskrt.gpu.staging.to_device_async), several steps in flight: the
    same losses and parameters as the same batches sent as numpy arrays (with and without graphs)."""
    from taskrt.data.datasets import ArrayDataset, Synthetic

    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    synthetic = Synthetic(40, shape=graph.inputs[0].shape[1:], classes=10, seed=3)
    every = np.arange(40)
    dataset = synthetic if source == "synthetic" else ArrayDataset(
        {"images": synthetic.read("images", every, (slice(None),) * 3), "labels": synthetic.read("labels", every, ())})
    steps = [np.random.default_rng(k).choice(40, 8) for k in range(6)]
    strategy = alternating_strategy(graph)
    for graphs in (True, False):
        trainer = Trainer(graph, strategy, gpu2, lr=0.05, momentum=0.9, cuda_graphs=graphs)
        reference = Trainer(graph, strategy, gpu2, lr=0.05, momentum=0.9, cuda_graphs=graphs)
        losses = [f.result() for f in [trainer.submit_from(dataset, i) for i in steps]]
        expected = [reference.step(synthetic.read("images", i, (slice(None),) * 3), synthetic.read("labels", i, ()))
                    for i in steps]
        np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=f"graphs={graphs}")
        for layer, params in reference.parameters().items():
            for k, value in params.items():
                np.testing.assert_allclose(trainer.parameters()[layer][k], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("source", ["synthetic", "arrays"])
def test_several_steps_to_a_program_on_gpu_workers_compute_what_one_step_at_a_time_computes(gpu2, source):
    """`fit` with four steps to each program (each step's tiles read on the GPU as it starts, its runs
    replayed as graphs, the state left on the GPU from step to step) against the same steps one to
    a program, a layer-wise split over two workers on the GPU; then `evaluate` three batches to a
    program."""
    from taskrt.data.datasets import ArrayDataset, Synthetic

    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    synthetic = Synthetic(8 * 9, shape=graph.inputs[0].shape[1:], classes=10, seed=5)
    every = np.arange(len(synthetic))
    dataset = synthetic if source == "synthetic" else ArrayDataset(
        {"images": synthetic.read("images", every, (slice(None),) * 3), "labels": synthetic.read("labels", every, ())})
    results = {}
    for per_program in (4, 1):
        gpu2.client.run(_clear_graphs)
        trainer = Trainer(graph, alternating_strategy(graph), gpu2, lr=0.05, momentum=0.9)
        history = trainer.fit(dataset, seed=2, progress=False, steps_per_program=per_program)
        results[per_program] = history.losses, trainer.parameters(), trainer.evaluate(dataset, steps_per_program=3)
        stats = gpu2.client.run(_graph_stats)
        assert all(not s["failed"] for s in stats.values()) and sum(s["graphs"] for s in stats.values()), stats
    np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-5)
    assert results[4][2].accuracy == results[1][2].accuracy  # batches predicted three to a program
    assert results[4][2].loss == pytest.approx(results[1][2].loss, rel=1e-4)
    for layer, params in results[1][1].items():
        for k, value in params.items():
            np.testing.assert_allclose(results[4][1][layer][k], value, rtol=1e-4, atol=1e-6, err_msg=f"{layer}.{k}")


def test_a_profiled_step_on_gpu_workers_times_kernels_with_cuda_events(gpu2, tmp_path):
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    trainer = Trainer(graph, alternating_strategy(graph), gpu2, lr=0.05, momentum=0.9)
    x, y = batch_for(graph, seed=1)
    profile = trainer.profile(x, y, steps=2, path=tmp_path / "trace.json", cost_model=False, reference=False)
    assert profile.check() == []
    rows = [r for r in profile.rows() if r["source"] == "measured"]
    assert all(r["kernels_s"] > 0 for r in rows) and (tmp_path / "trace.json").stat().st_size > 0


def test_cuda_graph_copy_kernel_and_a_replay_on_the_gpu():
    """The graphs' copy kernel against cupy's copies (the check each worker runs), and a captured run
    of strided inputs: each replay's outputs are fresh arrays equal to an ordinary call's."""
    import cupy

    from taskrt.gpu import cuda_graphs
    from taskrt.gpu.device import share_torch_allocator
    from taskrt.planning.fusion import FusedRun

    assert share_torch_allocator()
    cuda_graphs.clear()
    backend = cuda_graphs.TorchBackend()
    backend.check_copies()
    steps = (("t", cupy.transpose, (("in", 0),)), ("s", cupy.add, (("own", "t"), ("in", 1))))
    run = FusedRun(steps, ("t", "s"), program="gpu-copies")
    rng = np.random.default_rng(0)
    calls = []
    for i in range(cuda_graphs.WARMUP_CALLS + 4):
        x = cupy.asarray(rng.standard_normal((300, 70)))
        inputs = [x.T.copy().T if i % 2 else x, cupy.asarray(rng.standard_normal((70, 300)))]
        calls.append((cuda_graphs.call(run, inputs, backend), run.run(inputs)))
    for got, expected in calls:
        for a, b in zip(got, expected):
            cupy.testing.assert_array_equal(a, b)
    assert cuda_graphs.stats()["graphs"] == 1
    cuda_graphs.clear()


def test_a_large_device_array_between_workers_on_one_gpu_goes_through_ipc(gpu2):
    """Two workers sharing the GPU: a 4 MB cupy array from one program's mailbox to the other's
    through CUDA IPC (taskrt.transport.gpu_ipc), arriving equal, and through host memory when told to."""
    from taskrt.bench.gpu_transfer import round_trips

    for ipc in (True, False):
        _, seen = round_trips(gpu2, 4 * 2**20, 3, ipc)
        assert seen == {"equal": True, "ipc": ipc}, seen


def _clear_graphs():
    from taskrt.gpu import cuda_graphs

    cuda_graphs.clear()


def _graph_stats():
    from taskrt.gpu import cuda_graphs

    return cuda_graphs.stats()


def test_search_on_gpu_workers_end_to_end(gpu2, tmp_path):
    graph = models.lenet5(batch=16, image_size=16, width=0.5)
    cost_model = search.CostModel(gpu2, cache=tmp_path / "costs.json", repeats=2, progress=False)
    strategy = search.optimize(graph, gpu2, cost_model)
    assert cost_model.measurements > 0 and all(k.startswith("gpu:") for k in cost_model.kinds)
    trainer = Trainer(graph, strategy, gpu2, lr=0.01)
    x, y = batch_for(graph, seed=5)
    assert np.isfinite(trainer.step(x, y))
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


def _pool_bytes():
    from taskrt.gpu.device import pool_bytes

    return pool_bytes()


def _array_kinds(token, dask_worker=None):
    """Keys of this trainer's steps in worker memory whose values are numpy or cupy arrays."""
    import cupy

    found = {"numpy": [], "cupy": []}

    def arrays(value):
        if isinstance(value, tuple):
            for v in value:
                yield from arrays(v)
        elif value is not None:
            yield value

    for key, value in dask_worker.data.items():
        name = key[0] if isinstance(key, tuple) else str(key)
        if token not in name or "-host" in name:  # outputs brought to the host on purpose
            continue
        for array in arrays(value):
            if isinstance(array, np.ndarray):
                found["numpy"].append(str(key))
            elif isinstance(array, cupy.ndarray):
                found["cupy"].append(str(key))
    return found


def test_a_copy_to_the_device_overlaps_the_kernels_queued_before_it_and_never_writes_under_them():
    """taskrt.gpu.staging.to_device_async in this process: the copy ends while a long kernel queued
    before it still runs, and a landing buffer given back while kernels read it is not written
    until they end (their values stay those of the first tile)."""
    import cupy

    from taskrt.gpu.staging import to_device_async

    a = cupy.random.random((4096, 4096), dtype=cupy.float32)
    cupy.cuda.Stream.null.synchronize()
    tile = np.arange(1 << 20, dtype=np.float32)
    for _ in range(3):  # warm: buffers, pinned memory and the matmul's plan
        to_device_async(tile)
    started = cupy.cuda.Stream.null.record()
    for _ in range(20):
        a = a @ a / 4096
    long_kernels = cupy.cuda.Stream.null.record()
    from taskrt.gpu import staging

    landed = to_device_async(tile)
    copied = staging._staging[-1][1]
    copied.synchronize()
    assert not long_kernels.done, "the copy waited for the kernels queued before it"
    cupy.cuda.Stream.null.synchronize()
    assert cupy.cuda.get_elapsed_time(started, long_kernels) > 5
    np.testing.assert_array_equal(landed.get(), tile)

    first = to_device_async(np.full(1 << 20, 1.0, np.float32))
    total = cupy.zeros((), cupy.float32)
    for _ in range(20):  # kernels reading `first`, queued behind a long product
        a = a @ a / 4096
        total += first.sum()
    del first  # its buffer goes back while those kernels are still queued
    second = to_device_async(np.full(1 << 20, 2.0, np.float32))  # may land in the same buffer
    assert float(total) == 20 * (1 << 20)
    assert float(second.sum()) == 2 * (1 << 20)
