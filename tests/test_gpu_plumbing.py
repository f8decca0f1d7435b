"""The GPU residency plumbing, run on CPU workers: the executor's adapters (data converted once
on arrival, outputs brought to host memory on their device, state created on the device) with
`to_device` / `to_host` as identities, so the same step must give the same numbers; and clear
errors where no GPU is."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from dask.utils import key_split

from taskrt import models
from taskrt.execution.executor import Executor, step_graph
from taskrt.gpu.device import to_device
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine, MachineError
from taskrt.planning.lowering import lower
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer


def graph():
    return models.lenet5(batch=4, image_size=16, width=0.5)


def mixed(g):
    configs = {l.name: P(n=2, devices=(0, 1)) for l in g if not l.is_input}
    configs.update({"fc1": P(c=2, devices=(1, 2)), "loss": P(n=2, devices=(2, 1))})
    return Strategy(configs)


def test_step_graph_adds_adapters_only_on_gpu_devices():
    g = graph()
    plan = lower(g, mixed(g))
    data = {key: f"data-{key}" for key in plan.data_nbytes}
    state = {key: f"state-{key}" for key in (k for k in plan.outputs["state"])}
    hyper = {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    cpu, _, cpu_out = step_graph(plan, "3-ab", state, data, hyper, fused=False)
    gpu, restriction, gpu_out = step_graph(plan, "3-ab", state, data, hyper, gpu_devices=frozenset({1}), fused=False)
    added = {key_split(k) for k in set(gpu) - set(cpu)}
    assert added == {"image-todevice", "labels-todevice", "loss-host"}
    # one conversion per data tile that lives on a GPU device, pinned beside it
    todevice = [k for k in gpu if key_split(k).endswith("-todevice")]
    assert sorted(restriction[k]["dev1"] for k in todevice) == [1] * len(todevice)
    on_gpu = [key for key in plan.data_nbytes if plan.data[key[0]][key[1]].device == 1]
    assert len(todevice) == len(on_gpu)
    # the loss part on device 1 is read through a host task, the one on device 2 directly; state stays
    assert sorted(key_split(k) for k in gpu_out["loss"]) == ["loss-host", "loss-loss"]
    assert gpu_out["state"] == cpu_out["state"]
    # a tile the graph carries (an array, not a future) is put on its device by the task that gives it
    tiles = {key: np.zeros(1) for key in plan.data_nbytes}
    carried, restriction, _ = step_graph(plan, "4-ab", state, tiles, hyper, gpu_devices=frozenset({1}), fused=False)
    given = [k for k in carried if key_split(k).endswith("-data")]
    assert len(given) == len(tiles) and not [k for k in carried if key_split(k).endswith("-todevice")]
    assert all(carried[k][0] is to_device for k in given)


@pytest.fixture
def pretend_gpus(monkeypatch):
    """Devices 0 and 1 of machine4 treated as GPU devices (their workers stay CPU workers)."""
    monkeypatch.setattr(Executor, "gpu_devices", property(lambda self: frozenset({0, 1})))


def test_adapted_steps_compute_what_one_device_computes(machine4, pretend_gpus, tmp_path):
    g = graph()
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "dtype": "float64", "seed": 1}
    reference = SingleDeviceTrainer(g, **hyper)
    trainer = Trainer(g, mixed(g), machine4, **hyper)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(g.inputs[0].shape), rng.integers(0, 10, 4)
    np.testing.assert_allclose(trainer.predict(x), reference.predict(x), rtol=1e-10)
    for layer, grads in reference.gradients(x, y).items():
        for name, value in grads.items():
            np.testing.assert_allclose(trainer.gradients(x, y)[layer][name], value, rtol=1e-10, atol=1e-14)
    for _ in range(2):
        assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-10)
        assert trainer.stats.measured_bytes == trainer.stats.planned_bytes  # conversions move nothing between devices
    trainer.save(tmp_path / "ckpt.npz")
    resumed = Trainer.load(tmp_path / "ckpt.npz", machine4)
    assert resumed.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-10)


def test_trainer_precision_is_checked_and_set_on_the_workers(machine4):
    g = graph()
    with pytest.raises(ValueError, match="precision must be one of 'fp32', 'tf32', 'bf16', got 'fp16'"):
        Trainer(g, mixed(g), machine4, precision="fp16")
    Trainer(g, mixed(g), machine4, precision="tf32")
    try:
        from taskrt.ops.precision import get_precision

        assert set(machine4.client.run(get_precision).values()) == {"tf32"}
    finally:
        Trainer(g, mixed(g), machine4)  # back to the default on the shared workers


def test_local_gpu_machine_without_a_gpu_says_what_is_missing():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from taskrt.machines.machine import Machine, MachineError\n"
            "try:\n    Machine.local(1, gpu=True)\nexcept MachineError as e:\n    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "ERROR Machine.local(gpu=True) needs cupy" in out and "cupy-cuda13x" in out


def test_worker_device_mode_follows_the_environment(monkeypatch):
    from taskrt.gpu import device

    for value, gpu in (("cpu", False), ("", False)):
        monkeypatch.setenv("TASKRT_DEVICE", value)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        device.is_gpu.cache_clear()
        assert device.is_gpu() is gpu and device.array_module() is np
        assert device.describe()["kind"].startswith("cpu:")
    if "cupy" not in sys.modules:
        monkeypatch.setitem(sys.modules, "cupy", None)  # no cupy importable: gpu mode must say so
        monkeypatch.setenv("TASKRT_DEVICE", "gpu")
        device.is_gpu.cache_clear()
        with pytest.raises(RuntimeError, match="TASKRT_DEVICE=gpu but cupy cannot reach a CUDA device"):
            device.is_gpu()
    monkeypatch.setenv("TASKRT_DEVICE", "cpu")
    device.is_gpu.cache_clear()
    a = np.ones(3)
    assert device.to_device((a, None))[0] is a and device.to_host(a) is a


def test_local_machines_mark_their_workers_cpu(machine4):
    kinds = {d.kind for d in machine4.devices}
    assert all(k.startswith("cpu:") for k in kinds)
    assert set(machine4.client.run(lambda: os.environ.get("TASKRT_DEVICE")).values()) == {"cpu"}
    assert Machine.simulated(1, 2).devices[0].kind == "P100"
    assert issubclass(MachineError, RuntimeError)
