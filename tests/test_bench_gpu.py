"""The GPU benchmark's parts that need no GPU: refusing to run without one, choosing layers, rows,
summaries and the report, on made-up timings."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from taskrt import models
from taskrt.bench import gpu, gpu_kernels, gpu_steps
from taskrt.ops.rect import Rect


@pytest.fixture
def keep_cupy_variable(monkeypatch):
    """run_part resets the precision, which writes CUPY_TF32: put it back afterwards."""
    monkeypatch.delenv("CUPY_TF32", raising=False)


def test_run_without_a_gpu_exits_naming_what_is_missing(tmp_path):
    if not gpu.missing_gpu_requirements():
        pytest.skip("this machine has what the benchmark needs")
    with pytest.raises(SystemExit, match="missing here: .*(cupy|CUDA|torch)"):
        gpu.run(out_dir=tmp_path, quick=True)
    assert not (tmp_path / "gpu.json").exists()


def test_a_cupy_without_a_device_is_named(monkeypatch):
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    missing = gpu.missing_gpu_requirements()
    assert any("a CUDA device" in m and "cudaErrorNoDevice" in m for m in missing)


def test_large_conv_layers_are_distinct_and_large():
    vgg = gpu.NETWORKS["vgg16"]()
    layers = gpu_kernels.large_conv_layers(vgg)
    assert [layer.name for layer, _ in layers] == ["conv1_2", "conv2_1", "conv2_2", "conv3_1", "conv3_2", "conv4_1",
                                                   "conv4_2", "conv5_1"]
    assert sum(count for _, count in layers) == 12  # all but conv1_1, which has 3 input channels
    alexnet = gpu_kernels.large_conv_layers(gpu.NETWORKS["alexnet"]())
    assert [layer.name for layer, _ in alexnet] == ["conv2", "conv3", "conv4", "conv5"]
    inception = gpu_kernels.large_conv_layers(gpu.NETWORKS["inception_v3"]())
    shapes = {(l.op.in_shapes, l.op.out_channels, l.op.kernel, l.op.stride) for l, _ in inception}
    assert len(shapes) == len(inception) > 10


def fake_layer():
    graph = models.vgg16(batch=2, image_size=32, num_classes=10, width=0.25)
    return graph["conv2_1"]


def test_kernel_rows_and_summary():
    layer = fake_layer()
    rows = [
        gpu_kernels.kernel_row("vgg16", layer, 1, "fp32", {"taskrt": (0.002, 0.004), "cudnn": (0.001, 0.002),
                                                    "cupy_im2col": (0.01, 0.02)}),
        gpu_kernels.kernel_row("vgg16", layer, 1, "tf32", {"taskrt": (0.001, 0.002), "cudnn": (0.0006, 0.0012)},
                       {"cupy_im2col": "OutOfMemoryError: out of memory"}),
    ]
    gflop = 3 * layer.op.flops(Rect.full(layer.shape)) / 1e9
    assert rows[0]["gflop"] == pytest.approx(gflop)
    assert rows[0]["taskrt_tflops"] == pytest.approx(gflop / 0.006 / 1e3)
    assert rows[0]["taskrt_of_cudnn"] == pytest.approx(0.5)
    assert rows[0]["cupy_im2col_of_cudnn"] == pytest.approx(0.1)
    assert rows[1]["taskrt_of_cudnn"] == pytest.approx(0.6)
    assert "cupy_im2col_tflops" not in rows[1] and "out of memory" in rows[1]["cupy_im2col_error"]
    lines = gpu_kernels.kernel_summary(rows)
    assert any("fp32" in line and "median 50%" in line and "met by all" in line for line in lines)
    assert any("im2col path reaches median 10%" in line for line in lines)
    assert any("failed" in line and "cupy_im2col" in line for line in lines)
    missed = gpu_kernels.kernel_row("vgg16", layer, 1, "fp32", {"taskrt": (0.003, 0.006), "cudnn": (0.001, 0.002)})
    assert any("met by 1 of 2" in line for line in gpu_kernels.kernel_summary([rows[0], missed]))


def measured(step_s, loss, memory=2**30, graphs=None, queued_s=None) -> dict:
    out = {"step_s": step_s, "first_loss": loss, "memory": {"allocated": memory, "reserved": memory}}
    if queued_s is not None:
        out["queued_step_s"] = queued_s
    if graphs is not None:
        out["graphs"] = graphs
    return out


def test_cuda_calls_are_sorted_by_what_they_cost_the_host():
    assert gpu_steps.call_kind("cudaStreamSynchronize") == gpu_steps.call_kind("cudaMemcpy") == "synchronization"
    assert gpu_steps.call_kind("cudaMalloc") == gpu_steps.call_kind("cudaFree") == "allocation"
    assert gpu_steps.call_kind("cudaGraphLaunch") == gpu_steps.call_kind("cudaMemcpyAsync") == "launches"
    assert gpu_steps.call_kind("aten::add") is None


def test_step_rows_and_summary():
    graphs = {"a/dev0/0": {"replay_ms": 13.0, "host_ms": 2.0}}
    row = gpu_steps.step_row("training", "alexnet", 128, "fp32", measured(0.030, 6.9078, 2**31, graphs),
                             measured(0.016, 6.9077, 2**30, queued_s=0.015), eager=measured(0.050, 6.9078))
    assert row["runtime_images_per_s"] == pytest.approx(128 / 0.030)
    assert row["of_torch"] == pytest.approx(0.5) and row["goal"] == "missed (above 0.5x)"  # the faster PyTorch
    assert row["rest_ms"] == pytest.approx(30 - 13) and row["launches_ms"] == pytest.approx(20)
    assert row["memory_of_torch"] == pytest.approx(2.0)
    assert gpu_steps.step_row("b", "a", 1, "tf32", measured(0.1, 1), measured(0.09, 1, queued_s=0.2))["goal"] == "met"
    assert "below" in gpu_steps.step_row("b", "a", 1, "tf32", measured(0.1, 1), measured(0.04, 1, queued_s=0.2))["goal"]
    assert row["first_loss_rel_diff"] == pytest.approx(1e-4 / 6.9077)
    lines = gpu_steps.step_summary([row])
    assert "0.50x" in lines[0] and "graph replay (copies included) 13.0 ms, the rest (Dask, data, waiting) 17.0 ms" \
        in lines[0] and "= 2.00x (goal 1.3x: missed)" in lines[0]
    assert "1.4e-05" in lines[1]
    parts = {"allocated": 3 * 2**30, "static_inputs": 2**30, "static_outputs": 2**29, "graph_pools": 2**31,
             "held_by_dask": 2**30, "graphs": 2, "most_per_run": 1}
    timeline = {"trace": "t.json", "gpu_kernels_ms": 11.0, "synchronization": {"ms": 2.5, "calls": 3.0},
                "allocation": {"ms": 0.5, "calls": 1.0}, "launches": {"ms": 1.0, "calls": 12.0}}
    runtime = {**measured(0.030, 6.9, 2**31, graphs), "memory_parts": parts, "timeline": timeline}
    with_parts = gpu_steps.step_row("training", "alexnet", 128, "fp32", runtime, measured(0.016, 6.9, queued_s=0.015))
    assert ("after the steps: arrays 3.0 GiB, of them graphs' static inputs 1.0 and outputs 0.5, held by Dask 1.0; "
            "graphs' pools 2.0 GiB reserved; 2 graphs, at most 1 per run") in gpu_steps.step_summary([with_parts])[0]
    assert ("per step under torch's profiler: synchronization 2.5 ms of host time in 3 calls, allocation 0.5 ms of "
            "host time in 1 calls, launches 1.0 ms of host time in 12 calls, GPU kernels 11.0 ms"
            ) in gpu_steps.step_summary([with_parts])[0]
    windowed = gpu_steps.step_row("training", "alexnet", 128, "fp32",
                                  {**measured(0.030, 6.9, 2**31, graphs), "steps_per_program": 12, "one_step_s": 0.04},
                                  measured(0.016, 6.9, queued_s=0.015))
    assert windowed["steps_per_program"] == 12 and windowed["one_step_ms"] == pytest.approx(40.0)
    assert "12 steps to a program, against 40.0 ms with one step to a program" in gpu_steps.step_summary([windowed])[0]


def test_the_precision_checks_judge_bf16_by_another_fp32_runs_distance():
    from taskrt.bench import gpu_precision

    fp32 = [2.0 - 0.01 * k for k in range(40)]
    assert gpu_precision.curve_distance(fp32, fp32, 10) == 0.0
    shifted = [v + 0.02 for v in fp32]  # 0.02 from curves whose moving means average 1.655
    assert gpu_precision.curve_distance(shifted, fp32, 10) == pytest.approx(0.02 / np.mean(
        gpu_precision.moving_mean(fp32, 10)))
    row = {"part": "bf16", "model": "lenet5 on digits", "steps": 200, "window": 20, "accuracy_fp32": 0.97,
           "accuracy_bf16": 0.966, "accuracy_points": 0.4, "accuracy_met": True, "curve_bf16": 0.03,
           "curve_reordered": 0.02, "curve_met": True, "fp32_repeat_max_diff": 0.0}
    [line] = gpu_precision.precision_summary([row])
    assert "held-out accuracy 96.60% against 97.00% (0.40 points; goal 0.5: met)" in line
    assert "3.00% from fp32's, the same data in another order 2.00% (goal at most 2x: met)" in line
    assert gpu_precision.met(row) and not gpu_precision.met({**row, "curve_met": False})
    assert gpu_precision.precision_summary([{"part": "bf16", "runtime_ms": 1.0}]) == []


def test_strategy_rows_and_summary():
    planned = {(0, 1): 1000, (1, 0): 500}
    good = gpu.strategy_row("vgg16_32", 2, "data", [2.3, 2.2, 2.1], [2.3, 2.2, 2.1 * (1 + 5e-5)], planned,
                            dict(planned), 0.05, 64)
    assert good["matches_one_device"] and good["bytes_match"]
    assert good["planned_by_pair"] == {"0->1": 1000, "1->0": 500} and good["planned_bytes"] == 1500
    assert good["images_per_s"] == pytest.approx(64 / 0.05)
    bad = gpu.strategy_row("vgg16_32", 2, "model", [2.3, 2.5, 2.1], [2.3, 2.2, 2.1], planned, {(0, 1): 1000},
                           0.08, 64)
    assert not bad["matches_one_device"] and not bad["bytes_match"]
    failed = {"part": "strategies", "model": "vgg16_32", "workers": 4, "strategy": "owt", "error": "KeyError: 3"}
    lines = gpu.strategy_summary([good, bad, failed])
    assert any("NOT model on 2" in line for line in lines)
    assert any("DIFFER for model on 2" in line for line in lines)
    assert any("data 50 ms" in line and line.index("data") < line.index("model") for line in lines)
    assert any("owt on 4: KeyError: 3" in line for line in lines)
    assert lines[-1] == "caveat: " + gpu.CAVEAT
    assert gpu.strategy_summary([]) == []


def test_run_part_reports_a_failure_and_goes_on(keep_cupy_variable, capsys):
    errors, rows = {}, []

    def broken(rows):
        rows.append({"done": 1})
        raise RuntimeError("out of memory")

    gpu.run_part("kernels", errors, broken, rows)
    gpu.run_part("training", errors, lambda rows: rows.append({"done": 2}), rows)
    assert errors == {"kernels": "RuntimeError: out of memory"}
    assert rows == [{"done": 1}, {"done": 2}]  # the failing part keeps what it had
    assert "part kernels FAILED" in capsys.readouterr().out


def test_report_files(tmp_path):
    layer = fake_layer()
    kernel_rows = [gpu_kernels.kernel_row("vgg16", layer, 2, p, {"taskrt": (0.002, 0.004), "cudnn": (0.001, 0.002),
                                                                 "cupy_im2col": (0.01, 0.02)}) for p in gpu.PRECISIONS]
    training_rows = [gpu_steps.step_row("training", "alexnet", 128, p, measured(0.03, 6.9),
                                        measured(0.015, 6.9, queued_s=0.014)) for p in gpu.PRECISIONS]
    bf16_rows = [gpu_steps.step_row("bf16", "alexnet", 128, "bf16", measured(0.02, 6.9),
                                    measured(0.01, 6.9, queued_s=0.01))]
    planned = {(0, 1): 10, (1, 0): 20}
    strategy_rows = [gpu.strategy_row("lenet5", 2, s, [2.3], [2.3], planned, planned, 0.01, 64)
                     for s in ("data", "model")]
    strategy_rows.append({"part": "strategies", "model": "lenet5", "workers": 2, "strategy": "owt", "error": "x"})
    meta = {"gpu": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cupy": "14.2", "driver": "570.1"}}
    rows = {"kernels": kernel_rows, "training": training_rows, "bf16": bf16_rows, "strategies": strategy_rows}
    md = gpu.write_report(tmp_path, rows, meta, {"strategies": "MachineError: no GPU worker"})
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["gpu"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert len(record["rows"]) == 2 and len(record["kernels"]) == 2 and len(record["strategies"]) == 3
    assert len(record["bf16"]) == 1
    assert record["errors"] == {"strategies": "MachineError: no GPU worker"}
    text = md.read_text()
    for heading in ("What it measures", "Rerun:", "## a.", "## b.", "## c.", "## d.", "Caveat:",
                    "part strategies FAILED", "NVIDIA H100"):
        assert heading in text
    assert (tmp_path / "gpu.png").stat().st_size > 0
    # a later run of some parts keeps the others' rows, and says when each was measured
    kept, when = gpu.earlier_rows(tmp_path)
    assert kept == {"kernels": record["kernels"], "training": record["rows"], "bf16": record["bf16"],
                    "strategies": record["strategies"]}
    assert when == {part: f"{record['date']} (NVIDIA H100 80GB HBM3)" for part in gpu.PARTS}
    assert gpu.earlier_rows(tmp_path / "nothing") == ({}, {})


def test_unknown_parts_are_refused_before_anything_runs(tmp_path):
    parts = "kernels, training, bf16, strategies"
    with pytest.raises(SystemExit, match=rf"unknown part\(s\) kernel; the parts are {parts}"):
        gpu.run(out_dir=tmp_path, parts=("kernel",))


def test_gpu_description_says_why_a_field_is_missing():
    info = gpu.gpu_description()
    assert set(info) >= {"gpu", "driver", "cupy", "torch", "cudnn", "cuda_driver_api", "cuda_runtime"}
    if gpu.missing_gpu_requirements():
        assert str(info["gpu"]).startswith("unavailable (")


def test_random_batch_fits_the_graph():
    graph = models.lenet5(batch=4)
    x, y = gpu.random_batch(graph)
    assert x.shape == graph.inputs[0].shape and x.dtype == np.float32
    assert y.shape == (4,) and y.min() >= 0 and y.max() < 10


@pytest.mark.slow
def test_the_step_part_runs_end_to_end_on_cpu_workers(tmp_path):
    """The training part's orchestration (fit on a synthetic dataset, the profiled trace, the PyTorch
    peer, the row) on CPU workers and PyTorch's CPU kernels: what the GPU run does, less the GPU."""
    pytest.importorskip("torch")
    rows = []
    networks = {"lenet5": lambda: models.lenet5(batch=8, image_size=16, width=0.5)}
    gpu_steps.steps_part(rows, "training", networks, ("fp32",), 2, 3, 1e-3, 0.9, ("fp32",), tmp_path / "traces",
                         device="cpu")
    [row] = rows
    assert row["runtime_ms"] > 0 and row["torch_ms"] > 0 and row["eager_ms"] > 0
    assert row["first_loss_rel_diff"] < 1e-5  # the same network, parameters and batch
    assert row["memory_of_torch"] is None  # no GPU memory to compare
    assert row["graph_loss_rel_diff"] == 0.0  # the same steps from the same start (no graphs on a CPU worker)
    trace = json.loads((tmp_path / "traces" / "lenet5_fp32.json").read_text())
    assert trace["traceEvents"] and row["profiled_kernels_ms"] > 0
    timeline = json.loads((tmp_path / "traces" / "lenet5_fp32_timeline.json").read_text())  # torch's profiler
    assert timeline["traceEvents"] and row["timeline"] == "lenet5_fp32_timeline.json"
    assert row["timeline_synchronization_calls"] == row["timeline_allocation_calls"] == 0  # no CUDA here
    assert "goal" in gpu_steps.step_summary(rows)[0]


@pytest.mark.slow
def test_the_precision_check_runs_on_a_cpu_worker():
    from taskrt.bench import gpu_precision

    row = gpu_precision.precision_row(steps=12, window=4, device="cpu")
    assert all(len(row[f"losses_{run}"]) == 12 for run in gpu_precision.RUNS)
    # CPU kernels ignore the precision and repeat: bf16 is fp32 there, the reordered run is not
    assert row["curve_bf16"] == row["fp32_repeat_max_diff"] == row["accuracy_points"] == 0.0
    assert row["curve_reordered"] > 0 and gpu_precision.met(row)
    assert 0.1 < row["accuracy_fp32"] <= 1.0
    assert "goal 0.5: met" in gpu_precision.precision_summary([row])[0]


def test_transfer_part_on_cpu_workers():
    """The transfer part's ping-pong on CPU workers (numpy arrays, through shared memory): rows and
    summary say the array arrived equal and did not go through CUDA IPC."""
    from taskrt.bench.gpu_transfer import transfer_part, transfer_summary

    rows = []
    transfer_part(rows, rounds=2, device="cpu", nbytes=2**20)
    assert [r["path"] for r in rows] == ["CUDA IPC", "host memory"]
    assert all(r["arrived_equal"] and not r["through_ipc"] and r["gb_s"] > 0 for r in rows)
    assert "(NOT through IPC: host memory)" in transfer_summary(rows)[0]
