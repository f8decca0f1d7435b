"""Memory as the runtime holds it: each device's predicted peak under its program (taskrt.planning.peak),
checked by hand on small graphs; the peak the workers measure (taskrt.execution.held) against it
for data, model and OWT-style strategies of LeNet-5, AlexNet-32 and VGG-16-32; a trainer that
refuses a strategy predicted not to fit before any step; and a step that runs out of memory,
reported with the device and the step while the parameters stay those of the last finished step."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

import taskrt as tr
from taskrt import Graph, models, search
from taskrt.execution.held import Held
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.planning.lowering import lower
from taskrt.planning.peak import PeakMemory, contiguous, peak_memory
from taskrt.training.memory import summary
from taskrt.training.trainer import Trainer

F32 = 4
STRATEGIES = {"data": search.data_parallel, "model": search.model_parallel, "owt": search.owt}


def mlp(batch=8):
    g = Graph("mlp")
    x = g.input("x", shape=(batch, 12))
    y = g.linear(x, 10, activation="relu", bias=False, name="fc1")
    g.softmax_cross_entropy(g.linear(y, 6, bias=False, name="fc2"), name="loss")
    return g


def flat_net():
    g = Graph("flat")
    x = g.input("x", shape=(4, 2, 3, 3))
    g.softmax_cross_entropy(g.linear(g.flatten(x, name="flat"), 5, bias=False, name="fc"), name="loss")
    return g


def batch_of(graph, seed=0):
    rng = np.random.default_rng(seed)
    shape = graph.inputs[0].shape
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0])


# ---- the prediction, by hand --------------------------------------------------------------------
def test_one_device_peak_is_while_the_last_update_makes_the_new_state():
    """One device, one fused run: fc1-fwd, fc2-fwd, loss, fc2-bwd, fc2-update, fc1-bwd, fc1-update."""
    [peak] = peak_memory(lower(mlp(), Strategy({n: P() for n in ("fc1", "fc2", "loss")}))).values()
    x, labels = 8 * 12 * F32, 8 * 8
    w1, w2 = 10 * 12 * F32, 6 * 10 * F32  # each with a velocity as large
    # given for the whole step: x, labels, both states; fc1's output is let go after fc1-bwd, fc2's
    # after the loss, fc2-bwd's gradients after fc1-bwd: left are the loss's (d logits, losses),
    # fc1's weight gradient, fc2's new state, and fc1's new state being made
    assert peak.at == ("fc1-update", 0, 0)
    assert peak.parameters == w1 + w2 + w2 and peak.optimizer == w1 + w2 + w2
    assert peak.activations == x + labels
    assert peak.gradients == (8 * 6 * F32 + 8 * F32) + w1
    assert peak.workspace == 2 * w1 and peak.transfers == 0
    assert peak.total == 4032
    assert dict(peak.layers)["fc1"] == 2 * w1 + 2 * w1 + w1  # old and new state, its weight gradient


def test_a_view_adds_nothing_and_a_strided_one_is_copied():
    g = flat_net()
    [peak] = peak_memory(lower(g, Strategy({n: P() for n in ("flat", "fc", "loss")}))).values()
    x, labels, w = 72 * F32, 4 * 8, 18 * 5 * F32
    assert peak.activations == x + labels  # flatten of the whole tile is a view of it
    assert (peak.parameters, peak.optimizer, peak.workspace) == (w, w, 2 * w)
    assert peak.gradients == (4 * 5 + 4) * F32 + w and peak.total == 2216
    # flatten split over channels: device 0 reshapes its strided half of x (a copy, 144 bytes) and
    # receives device 1's; device 1's peak is x's slice arriving, not yet read (in flight)
    split = peak_memory(lower(g, Strategy({"flat": P(c=2, devices=(0, 1)), "fc": P(), "loss": P()})))
    assert split[0].activations == x + labels + 2 * 36 * F32
    assert split[1] == PeakMemory(transfers=36 * F32, at=split[1].at, layers=(("x", 144),))
    assert split[1].at[0] == "recv"


def test_contiguous_windows_as_numpy_says():
    a = np.zeros((4, 3, 5, 2))
    for window in [(slice(0, 2), slice(0, 3), slice(0, 5), slice(0, 2)), (slice(1, 2), slice(1, 3), slice(0, 5),
                   slice(0, 2)), (slice(0, 4), slice(0, 3), slice(1, 3), slice(0, 2)),
                   (slice(2, 3), slice(1, 2), slice(1, 4), slice(0, 2)), (slice(0, 4), slice(0, 1), slice(0, 5),
                                                                         slice(0, 2))]:
        assert contiguous(a.shape, window) == a[window].flags.c_contiguous


def test_held_counts_a_buffer_once_whatever_views_of_it_appear():
    held = Held()
    a, b = np.zeros(1000, np.float32), np.ones(10)
    values = [a, a[10:20], (a.reshape(10, 100), None, b), {"lr": 0.1}]  # a dict holds nothing counted
    for value in values:
        held.add(value)
    assert held.now == held.peak == 4000 + 80
    for value in values[:2]:
        held.drop(value)
    assert held.now == 4080  # a reshape of `a` is still held
    held.drop(values[2])
    assert held.now == 0 and held.peak == 4080
    held.add(a, 2)  # held twice (what a step is given): one drop leaves it
    held.drop(a)
    assert held.now == 4000


# ---- measured beside predicted ------------------------------------------------------------------
@pytest.fixture(scope="module")
def machine2():
    m = tr.Machine.local(2, probe=False)
    yield m
    m.close()


def measured_ratios(graph, make, machine, steps=3) -> dict:
    trainer = Trainer(graph, make(graph, machine), machine, lr=0.01, momentum=0.9, seed=0)
    x, y = batch_of(graph)
    for _ in range(steps):
        trainer.step(x, y)
    memory = trainer.memory()
    for d, use in memory.items():
        assert use.measured is not None and use.measured_max >= use.measured
        assert use.capacity == machine.devices[d].memory and use.allocated is None  # CPU workers
    return trainer, {d: use.measured / use.predicted.total for d, use in memory.items()}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_lenet5_measured_peak_is_the_predicted_one(machine2, name):
    trainer, ratios = measured_ratios(models.lenet5(batch=64), STRATEGIES[name], machine2)
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
    text = summary(trainer.memory())
    assert "predicted" in text and "measured" in text and "capacity" in text and len(text.splitlines()) == 4
    assert re.search(r"most memory on device \d: [\d.]+ MiB measured, [\d.]+ MiB predicted", trainer.stats.summary())
    assert trainer.stats.memory[0].measured == trainer.memory()[0].measured


def test_recomputed_layers_measured_peak_is_the_predicted_one(machine2):
    """Copies computed again for backward are values of the device's program like any other."""
    graph = models.lenet5(batch=64)
    plain = Strategy({layer.name: P(n=2) for layer in graph if not layer.is_input})
    again = Strategy({layer.name: P(n=2, recompute=layer.kind == "conv2d") for layer in graph if not layer.is_input})
    assert peak_memory(lower(graph, again))[1].total < peak_memory(lower(graph, plain))[1].total
    trainer = Trainer(graph, again, machine2, lr=0.01, momentum=0.9, seed=0)
    x, y = batch_of(graph)
    for _ in range(2):
        trainer.step(x, y)
    assert all(abs(use.measured / use.predicted.total - 1) < 1e-3 for use in trainer.memory().values())


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("net", ["alexnet", "vgg16"])
def test_larger_networks_measured_peak_is_the_predicted_one(machine2, net, name):
    graph = (models.alexnet(batch=32, image_size=32, num_classes=10) if net == "alexnet"
             else models.vgg16(batch=16, image_size=32, num_classes=10))
    _, ratios = measured_ratios(graph, STRATEGIES[name], machine2, steps=2)
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_a_profile_shows_each_steps_measured_peak_beside_the_predicted(machine2, tmp_path):
    graph = models.lenet5(batch=64)
    trainer = Trainer(graph, search.model_parallel(graph, machine2), machine2, lr=0.01, seed=0)
    x, y = batch_of(graph)
    profile = trainer.profile(x, y, steps=2, path=tmp_path / "trace.json", png=False, reference=False)
    predicted = {d: use.predicted.total for d, use in trainer.memory().items()}
    assert {d: m["predicted"] for d, m in profile.memory.items()} == predicted
    assert all(len(m["measured"]) == 2 and all(abs(v / m["predicted"] - 1) < 0.1 for v in m["measured"])
               for m in profile.memory.values())
    assert "memory per device (MiB): predicted peak, measured in each profiled step" in profile.summary()
    trace = json.loads((tmp_path / "trace.json").read_text())
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == 2 * len(predicted) and all({"predicted", "measured"} <= set(e["args"]) for e in counters)
    assert trace["otherData"]["memory_bytes"]["0"]["predicted"] == predicted[0]


# ---- refusing before any step --------------------------------------------------------------------
def small(machine, mib: float):
    """A view of `machine` whose devices report `mib` MiB of memory."""
    view = machine.subset(list(range(machine.num_devices)))
    view.devices = [dataclasses.replace(d, memory=mib * 2**20) for d in view.devices]
    return view


def test_a_strategy_predicted_not_to_fit_is_refused_before_any_step(machine2):
    graph = models.alexnet(batch=32, image_size=32, num_classes=10)
    strategy = search.data_parallel(graph, machine2)
    peaks = peak_memory(lower(graph, strategy), slots=1)
    assert peaks[0].total > 400 * 2**20 > peaks[1].total  # the parameter server's device alone does not fit
    view = small(machine2, 400)
    with pytest.raises(tr.DeviceMemoryError) as error:
        Trainer(graph, strategy, view, lr=0.01, momentum=0.9)
    text = str(error.value)
    assert error.value.devices == (0,) and isinstance(error.value, MemoryError)
    assert text.startswith("alexnet under strategy 'data parallel' does not fit the memory of 1 device(s), "
                           "before any step")
    assert (f"device 0: predicted peak {peaks[0].total / 2**20:.1f} MiB held + {peaks[0].scratch / 2**20:.1f} MiB of "
            f"kernels' scratch") in text and f"= {peaks[0].needed / 2**20:.1f} MiB against its memory 400.0 MiB" in text
    assert "device 1:" not in text
    assert "parameters 200.9, optimizer 200.9, gradients 141.1, workspace 128.0 MiB" in text
    assert "layers holding most: fc1 384.3, fc2 256.1" in text and "while task ('fc1-update', 0, 0) runs" in text
    assert "taskrt.search.optimize(graph, machine, memory=...)" in text and "more devices" in text
    assert "smaller batch" in text and "check_memory=False" in text
    trainer = Trainer(graph, strategy, view, lr=0.01, momentum=0.9, check_memory=False)  # told to: it trains
    assert trainer.memory()[0].capacity == 400 * 2**20 and trainer.memory()[0].measured is None


def test_a_strategy_replanned_on_fewer_devices_is_checked_too(machine2):
    graph = models.lenet5(batch=64)
    whole = small(machine2, 5.0)  # two devices fit (2.5 MiB held + 1.8 of scratch each), one alone does not (5.9)
    trainer = Trainer(graph, search.model_parallel(graph, whole), whole, lr=0.01)
    with pytest.raises(tr.DeviceMemoryError, match=r"re-planned on the devices left after a lost worker, does "
                                                   r"not fit the memory of 1 device\(s\)") as error:
        trainer._use([1])  # what a recovery does after losing device 0's worker
    assert error.value.devices == (1,) and "device 1: predicted peak" in str(error.value)


# ---- running out anyway ------------------------------------------------------------------------
def _fail_conv(dask_worker=None):
    from taskrt.ops import conv

    def forward(self, *args, **kwargs):
        raise MemoryError("Unable to allocate 96.0 GiB for an array with shape (1, 2, 3) and data type float32")

    conv.Conv2d._kept_forward = conv.Conv2d.forward
    conv.Conv2d.forward = forward


def _restore_conv(dask_worker=None):
    from taskrt.ops import conv

    conv.Conv2d.forward = conv.Conv2d._kept_forward


def test_a_step_that_runs_out_of_memory_says_where_and_keeps_the_last_good_parameters(machine2, tmp_path):
    graph = models.lenet5(batch=64)
    checkpoints = tr.Checkpoints(tmp_path, every=1, keep=5)
    trainer = Trainer(graph, search.model_parallel(graph, machine2), machine2, lr=0.01, momentum=0.9, seed=0,
                      checkpoints=checkpoints)
    x, y = batch_of(graph)
    trainer.step(x, y)
    trainer.step(x, y)
    trainer.wait()
    before, state = trainer.parameters(), trainer.state_dict()
    last = trainer.memory()[1]
    on = [machine2.addresses()[1]]
    machine2.client.run(_fail_conv, workers=on)
    try:
        with pytest.raises(tr.DeviceMemoryError) as error:
            trainer.step(x, y)
    finally:
        machine2.client.run(_restore_conv, workers=on)
    text = str(error.value)
    assert error.value.devices == (1,)
    assert text.startswith("device 1 ran out of memory in step 3 (MemoryError('Unable to allocate 96.0 GiB")
    assert f"predicted peak {last.predicted.total / 2**20:.1f} MiB of its {last.capacity / 2**20:.1f} MiB" in text
    assert f"last measured peak {last.measured / 2**20:.1f} MiB" in text
    assert "the parameters are those after step 2, the last finished step" in text
    assert "taskrt.search.optimize(graph, machine, memory=...)" in text
    after = trainer.parameters()
    assert all(np.array_equal(before[layer][k], after[layer][k]) for layer in before for k in before[layer])
    assert all(np.array_equal(state[k], v) for k, v in trainer.state_dict().items())
    assert trainer.steps_done == 2
    assert int(checkpoints.latest().stem.split("-")[-1]) == 2  # written before, and read back whole
    resumed = Trainer.load(checkpoints.latest(), machine2)
    assert all(np.array_equal(before[layer][k], v) for layer, p in resumed.parameters().items() for k, v in p.items())
    reference = Trainer(graph, search.model_parallel(graph, machine2), machine2, lr=0.01, momentum=0.9, seed=0)
    for _ in range(3):
        reference.step(x, y)
    trainer.step(x, y)  # training goes on from there, as if the failed step never happened
    again = trainer.parameters()
    assert all(np.allclose(again[layer][k], v, atol=1e-6) for layer, p in reference.parameters().items()
               for k, v in p.items())


def _hog(dask_worker=None):
    import time

    from taskrt.ops import conv

    def forward(self, *args, **kwargs):
        hog = np.ones(400 * 2**20 // 8)  # 400 MB written, over the worker's limit: its nanny restarts it
        time.sleep(5)
        return hog

    conv.Conv2d.forward = forward


@pytest.mark.slow
def test_a_worker_its_nanny_restarts_over_its_memory_limit_is_reported_as_out_of_memory(tmp_path):
    with tr.Machine.local(2, probe=False, memory_limit="400MB") as machine:
        graph = models.lenet5(batch=64)
        trainer = Trainer(graph, search.model_parallel(graph, machine), machine, lr=0.01, momentum=0.9, seed=0)
        x, y = batch_of(graph)
        trainer.step(x, y)
        trainer.step(x, y)
        before = trainer.parameters()
        machine.client.run(_hog, workers=[machine.addresses()[1]])
        with pytest.raises(tr.DeviceMemoryError) as error:
            trainer.step(x, y)
        text = str(error.value)
        assert error.value.devices == (1,)
        assert re.match(r"device 1 ran out of memory in step 3 \(the Dask nanny restarted its worker at \d+ MiB of "
                        r"process memory, over its memory_limit\); predicted peak", text), text
        assert "the parameters are those after step 2, the last finished step" in text
        # restored from the snapshot and the steps since (replayed, perhaps on the device left)
        after = trainer.parameters()
        assert trainer.steps_done == 2 and len(trainer.recoveries) == 1
        assert all(np.allclose(before[layer][k], after[layer][k], atol=1e-6) for layer in before for k in before[layer])
        trainer.step(x, y)
