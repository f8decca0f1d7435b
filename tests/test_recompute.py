"""Activation recomputation, a per-layer choice (`ParallelConfig.recompute`): exact like every other.

Random strategies with random recompute flags, run in this process in float64: the loss and every
gradient equal the same strategy's without recomputation bit for bit (the same kernels on the same
tiles), and the single-device network's; the plan keeps no recomputed output for backward, its
copies travel where forward's did, and each device computes a copy just before the backward task
that reads it.  The trainer on four local workers checks the same with transfers measured
(`test_trainer_with_recomputation_matches_single_device`)."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import models, search
from taskrt.data.arrays import bind_inputs
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy, StrategyError
from taskrt.machines.machine import Machine
from taskrt.ops.rect import Rect
from taskrt.planning.inprocess import buffer_tiles, data_tiles, run_plan, shard_states
from taskrt.planning.lowering import lower
from taskrt.planning.memory import plan_memory
from taskrt.planning.params import init_buffers, init_parameters, unpack
from taskrt.planning.plan import TASK
from taskrt.planning.programs import device_order, device_programs
from taskrt.planning.recompute import PHASES
from taskrt.search.memory import step_memory
from taskrt.training.reference import SingleDeviceTrainer
from tests.strategies import random_strategies
from tests.test_dropout_training import net as dropout_net
from tests.test_equivalence import GRAPHS, batch_for, check_equivalence
from tests.test_memory import LARGE, MEMORY_GRAPHS, SMALL

SEED = 3


def residual_net():
    return models.resnet50(batch=2, image_size=16, width=1 / 32, num_classes=4)


RECOMPUTE_GRAPHS = {**GRAPHS, "resnet50": residual_net, "dropout": dropout_net}


def can_recompute(layer) -> bool:
    return not layer.is_input and layer.kind != "softmax_cross_entropy"


@st.composite
def recomputing_strategies(draw, graph, max_devices=4):
    """(devices, a random strategy, the same with random layers recomputed)."""
    devices, strategy = draw(random_strategies(graph, max_devices=max_devices))
    strategy = strategy.validated(graph)
    flags = {name: draw(st.booleans(), label=f"recompute {name}") and can_recompute(graph[name]) for name in strategy}
    again = Strategy({name: dataclasses.replace(cfg, recompute=flags[name]) for name, cfg in strategy.items()})
    return devices, strategy, again


def run(graph, strategy, x, y):
    """{(layer, parameter): gradient} and the per-sample losses of one step of `strategy`'s plan in
    this process (float64)."""
    plan = lower(graph, strategy, "gradients", 8)
    params = init_parameters(graph, SEED, "float64")
    values = run_plan(plan, shard_states(plan, params), data_tiles(plan, bind_inputs(graph, (x, y), np.float64)),
                      {"seed": SEED, "draw": 0}, buffer_tiles(plan, init_buffers(graph, "float64")))
    grads = {}
    for layer, shards in plan.shards.items():
        for shard in shards:
            flat = np.concatenate([values[plan.outputs["grads"][(layer, shard.index, k)]]
                                   for k in range(len(shard.chunks))])
            for name, value in unpack(flat, shard.layout).items():
                grads[(layer, name, shard.index)] = value
                whole = grads.setdefault((layer, name), np.zeros(graph[layer].param_shapes[name]))
                whole[shard.rects[name].relative_to(Rect.full(whole.shape))] = value
    losses = [values[key][2] for key in plan.outputs["loss"]]
    return plan, grads, losses


def reference_gradients(graph, x, y):
    reference = SingleDeviceTrainer(graph, dtype="float64", seed=SEED)
    return reference.gradients(x, y), reference.loss(x, y)


def check_plan(graph, plan, again):
    """What the plan keeps and where its copies run."""
    recomputed = {name for name, cfg in again.items() if cfg.recompute}
    plan.check_single_reader()
    by_key = plan.by_key

    def forward_value_of(dep):  # the layer whose forward output `dep` is (through slices and aliases)
        while dep.kind == TASK:
            task = by_key[dep.key]
            if task.phase == "fwd":
                return task.layer
            if task.phase not in ("slice", "send"):
                return None
            dep = task.deps[0]
        return None

    backward_phases = {"bwd", "bstat", *PHASES}
    for task in plan.tasks:
        if task.phase in backward_phases:
            for dep in task.deps:
                assert forward_value_of(dep) not in recomputed, f"{task.key} reads {dep.key}, which is not kept"
        if task.phase in PHASES:
            assert task.layer in recomputed
            original = by_key[(task.key[0].rsplit("-", 1)[0] + "-" + {"recompute": "fwd", "reslice": "slice",
                                                                       "resend": "send"}[task.phase], *task.key[1:])]
            assert (original.device, original.nbytes, original.flops) == (task.device, task.nbytes, task.flops)
            assert task.spec.spec is original.spec
    # just in time: on its device, the next task that is not itself a copy reads a copy, unless
    # another device reads it (or a copy made from it): it is computed before that device needs it
    readers = {}
    for t in plan.tasks:
        for d in t.deps:
            if d.kind == TASK:
                readers.setdefault(d.key, []).append(t)

    def sent(key):
        return any(r.device != by_key[key].device or (r.phase in PHASES and sent(r.key)) for r in readers[key])

    for device, tasks in device_order(plan).items():
        position = {t.key: i for i, t in enumerate(tasks)}
        for i, task in enumerate(tasks):
            if task.phase in PHASES and not sent(task.key):
                first = min(position[r.key] for r in readers[task.key])
                between = [t.key for t in tasks[i + 1: first] if t.phase not in PHASES]
                assert not between, f"{task.key} on device {device} runs before {between}, then its reader"


def check_recomputation(graph, strategy, again):
    x, y = batch_for(graph, seed=1)
    plan, grads, losses = run(graph, strategy, x, y)
    plan_again, grads_again, losses_again = run(graph, again, x, y)
    assert grads.keys() == grads_again.keys()
    for key in grads:
        np.testing.assert_array_equal(grads_again[key], grads[key], err_msg=f"gradient {key}")
    for a, b in zip(losses_again, losses):
        np.testing.assert_array_equal(a, b)
    expected, loss = reference_gradients(graph, x, y)
    assert abs(sum(float(np.sum(v)) for v in losses_again) / len(y) - loss) <= 1e-12 * max(1.0, abs(loss))
    assert {(layer, name) for layer in expected for name in expected[layer]} <= grads_again.keys()
    for layer in expected:
        for name, value in expected[layer].items():
            np.testing.assert_allclose(grads_again[(layer, name)], value, rtol=1e-9, atol=1e-12,
                                       err_msg=f"gradient {layer}.{name}")
    check_plan(graph, plan_again, again)


@pytest.mark.parametrize("name", list(RECOMPUTE_GRAPHS))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_strategies_recomputing_random_layers_compute_the_same_gradients(name, data):
    graph = RECOMPUTE_GRAPHS[name]()
    _, strategy, again = data.draw(recomputing_strategies(graph))
    check_recomputation(graph, strategy, again)


# ---- memory: what forward keeps and what backward computes again --------------------------------

def with_flags(graph, strategy, data):
    return Strategy({name: dataclasses.replace(cfg, recompute=can_recompute(graph[name])
                                               and data.draw(st.booleans(), label=f"recompute {name}"))
                     for name, cfg in strategy.items()}).validated(graph)


@pytest.mark.parametrize("graph", SMALL)
@settings(deadline=None, derandomize=True, max_examples=25)
@given(data=st.data())
def test_step_memory_is_the_plans_memory_with_recomputed_layers(graph, data):
    g = MEMORY_GRAPHS[graph]()
    _, strategy = data.draw(random_strategies(g, max_devices=4))
    strategy = with_flags(g, strategy.validated(g), data)
    assert step_memory(g, strategy) == plan_memory(lower(g, strategy))


@pytest.mark.parametrize("graph", [*SMALL, *LARGE])
@settings(deadline=None, derandomize=True, max_examples=6,
          suppress_health_check=[HealthCheck.large_base_example, HealthCheck.data_too_large, HealthCheck.too_slow])
@given(data=st.data())
def test_search_space_strategies_with_recomputed_layers_are_counted_without_lowering(graph, data):
    g = MEMORY_GRAPHS[graph]()
    cm = search.CostModel(Machine.simulated(2, 2), cache=False)
    strategy = with_flags(g, Strategy({layer.name: data.draw(st.sampled_from(cm.layer_space(layer).configs),
                                                             label=layer.name) for layer in g}), data)
    expected = plan_memory(lower(g, strategy))
    with mock.patch("taskrt.search.memory._lowered", side_effect=AssertionError("lowered the plan")):
        assert step_memory(g, strategy) == expected
        assert step_memory(g, strategy, regions=cm.regions) == expected


def test_recomputing_vgg16s_convolutions_lowers_the_predicted_peak():
    g = models.vgg16(batch=16, image_size=32, num_classes=10)
    for devices in (1, 2):
        plain = Strategy({layer.name: P(n=devices) for layer in g if not layer.is_input}).validated(g)
        again = Strategy({name: dataclasses.replace(cfg, recompute=g[name].kind == "conv2d")
                          for name, cfg in plain.items()}).validated(g)
        before, after = plan_memory(lower(g, plain)), plan_memory(lower(g, again))
        assert step_memory(g, again) == after
        for d in before:
            assert after[d].activations < before[d].activations / 3  # the pools' outputs and the data stay
            assert after[d].transient > before[d].transient  # two convolutions' copies at a time
            # at 32x32 its 134 M parameters (with their gradients and momentum) outweigh the activations
            assert after[d].total < before[d].total - 4 * 2**20 / devices


# ---- the trainer on local workers: programs, their messages, the bytes they move ------------------

@pytest.mark.parametrize("name", ["lenet5", "inception_block", "batch_norm_net", "dropout"])
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_trainer_with_recomputation_matches_single_device(machine4, name, data):
    """Loss, gradients, parameters after 3 steps and running statistics equal one device's in
    float64, and the bytes the workers' logs report equal the plan's (the copies' slices travel)."""
    graph = RECOMPUTE_GRAPHS[name]()
    _, _, again = data.draw(recomputing_strategies(graph, max_devices=machine4.num_devices))
    check_equivalence(graph, again, machine4, "float64")


def test_a_resnet_recomputing_its_blocks_steps_as_pytorch_does(machine4):
    """ResNet-18 traced from torchvision, float64, every convolution, batch norm, ReLU and sum
    recomputed, split over samples on two devices and the first stage over rows on two others
    (halos travel, and travel again in backward): one SGD step equals PyTorch's."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision.models")
    from taskrt.graph.from_torch import from_torch
    from taskrt.training.trainer import Trainer
    from tests.test_from_torch import relative, torch_step

    torch.manual_seed(0)
    module = torchvision.resnet18(num_classes=10).double()
    g = from_torch(module, (4, 3, 32, 32))
    configs = {}
    for layer in g:
        if layer.is_input:
            continue
        again = layer.kind in ("conv2d", "batch_norm", "relu", "add")
        configs[layer.name] = P(h=2, devices=(2, 3), recompute=again) if layer.name.startswith("layer1.") else \
            P(n=2, recompute=again) if again else P()
    trainer = Trainer(g, Strategy(configs), machine4, lr=0.1, momentum=0.9, weight_decay=1e-4, dtype="float64")
    assert trainer.plan.phase_counts()["recompute"] > 0 and trainer.plan.phase_counts()["reslice"] > 0
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 32, 32)), rng.integers(0, 10, 4)
    loss = trainer.step(x, y)
    expected_loss, expected = torch_step(module, x, y)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    got = trainer.state_dict()
    for key in expected:  # every parameter's update, running statistics, num_batches_tracked
        assert relative(got[key], expected[key]) < 1e-9, key
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


# ---- the flag: JSON, printing, validation ---------------------------------------------------------

def test_the_flag_is_saved_printed_and_validated(tmp_path):
    g = models.lenet5(batch=4, image_size=16, width=0.5)
    cfg = P(n=2, recompute=True)
    assert cfg.to_dict()["recompute"] is True and "recompute" not in P(n=2).to_dict()
    assert P.from_dict(cfg.to_dict()) == cfg and cfg != P(n=2)
    assert str(cfg).endswith("(recompute)")
    strategy = Strategy({layer.name: P(recompute=layer.name == "conv1") for layer in g if not layer.is_input})
    strategy.save(tmp_path / "s.json")
    loaded = Strategy.load(tmp_path / "s.json", g)
    assert loaded["conv1"].recompute and not loaded["pool1"].recompute
    assert json.loads((tmp_path / "s.json").read_text())["layers"]["conv1"]["recompute"] is True
    assert "(recompute)" in loaded.table(g).splitlines()[2]  # header, image, conv1
    with pytest.raises(ValueError, match="recompute='yes' must be true or false"):
        P(recompute="yes")
    with pytest.raises(StrategyError, match="layer 'conv1'.*recompute"):
        Strategy.from_dict({"layers": {"conv1": {"devices": [0], "recompute": 1}}})
    for name, why in (("loss", "the loss"), ("image", "an input")):
        bad = Strategy({**strategy.configs, name: P(recompute=True)})
        with pytest.raises(StrategyError, match=f"layer '{name}' .*cannot be recomputed.*{why}"):
            bad.validated(g)
        with pytest.raises(StrategyError, match=f"layer '{name}'"):
            lower(g, bad)


def test_prediction_is_the_same_plan_with_or_without_recomputation():
    g = models.lenet5(batch=4, image_size=16, width=0.5)
    plain = Strategy({layer.name: P(n=2) for layer in g if not layer.is_input})
    again = Strategy({n: dataclasses.replace(c, recompute=can_recompute(g[n])) for n, c in plain.items()})
    one, other = lower(g, plain, "predict"), lower(g, again, "predict")
    assert [(t.key, t.deps) for t in one.tasks] == [(t.key, t.deps) for t in other.tasks]


def test_a_device_drops_a_recomputed_output_after_its_last_forward_reader():
    """One device, one run: conv1's output is let go once pool1's forward has read it, and its copy
    is made after the whole forward, just before pool1's backward reads it."""
    g = models.lenet5(batch=4, image_size=16, width=0.5)
    plain = Strategy({layer.name: P() for layer in g if not layer.is_input})
    for recompute in (False, True):
        strategy = Strategy({n: dataclasses.replace(c, recompute=recompute and n == "conv1")
                             for n, c in plain.items()})
        (program,) = device_programs(lower(g, strategy)).values()
        (run,) = [c.run for c in program.code if hasattr(c, "run")]
        steps = [key for key, _, _ in run.steps]
        last_use = run._last_use[("conv1-fwd", 0)]
        if not recompute:
            assert steps[last_use] == ("conv1-bwd", 0)  # kept for backward (its relu's mask)
            continue
        assert steps[last_use] == ("pool1-fwd", 0)
        again = steps.index(("conv1-recompute", 0))
        assert again == steps.index(("pool1-bwd", 0)) - 1 and again > steps.index(("loss-loss", 0))
        assert steps[run._last_use[("conv1-recompute", 0)]] == ("conv1-bwd", 0)  # its relu's mask


def test_a_copy_costs_its_forward_in_the_simulation():
    """The simulator prices a copy as its forward part: on one device with an ideal runtime the
    step is longer by the recomputed layers' forward kernels."""
    from taskrt.planning.simulate import simulate

    g = models.vgg16(batch=2, image_size=32, num_classes=5, width=1 / 8)
    machine = Machine.simulated(1, 1)
    cm = search.CostModel(machine, cache=False)
    plain = Strategy({layer.name: P() for layer in g if not layer.is_input}).validated(g)
    again = Strategy({n: dataclasses.replace(c, recompute=g[n].kind == "conv2d") for n, c in plain.items()})
    one, other = lower(g, plain), lower(g, again)
    price_one, price_other = cm.timer(one), cm.timer(other)
    forward = {t.key: price_one(t) for t in one.tasks if t.phase == "fwd"}
    copies = [t for t in other.tasks if t.phase == "recompute"]
    assert copies and all(price_other(t) == forward[(f"{t.layer}-fwd", *t.key[1:])] > 0 for t in copies)
    extra = simulate(other, price_other, machine).step_s - simulate(one, price_one, machine).step_s
    assert extra == pytest.approx(sum(price_other(t) for t in copies), rel=1e-9)


@pytest.mark.parametrize("options", [{"executor": "tasks"}, {"executor": "tasks", "fused": False}])
def test_the_per_task_executor_runs_copies_too(machine4, options):
    g = RECOMPUTE_GRAPHS["batch_norm_net"]()
    configs = {layer.name: P(n=2, devices=(1, 3), recompute=can_recompute(layer)) for layer in g
               if not layer.is_input}
    configs["fc1"] = P(c=2, devices=(0, 2), recompute=True)  # its copy's slices travel to fc1.bn's parts
    from taskrt.training.trainer import Trainer

    trainer = Trainer(g, Strategy(configs), machine4, dtype="float64", seed=SEED, **options)
    reference = SingleDeviceTrainer(g, dtype="float64", seed=SEED)
    x, y = batch_for(g, seed=1)
    expected, actual = reference.gradients(x, y), trainer.gradients(x, y)
    for layer in expected:
        for name in expected[layer]:
            np.testing.assert_allclose(actual[layer][name], expected[layer][name], rtol=1e-9, atol=1e-12)
    assert trainer.step(x, y) == pytest.approx(reference.step(x, y), rel=1e-12)
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes


def test_the_single_device_trainer_takes_a_recomputing_graph_as_it_is():
    g = dropout_net()
    x, y = batch_for(g, seed=1)
    assert np.isfinite(SingleDeviceTrainer(g, dtype="float64").step(x, y))


def test_runs_with_copies_replay_as_cuda_graphs(machine4, monkeypatch):
    """Programs of a strategy recomputing every layer, on workers taken for GPU devices (the
    stand-in device of tests/test_cuda_graphs.py): every run is captured and replayed, and six
    steps give bit for bit the losses and parameters of the same steps launched kernel by kernel."""
    from taskrt.execution.executor import Executor
    from tests.graphs import alternating_strategy, with_and_without_graphs
    from tests.test_cuda_graphs import _install_stand_in, _remove_stand_in, _stand_in_counts

    monkeypatch.setattr(Executor, "gpu_devices", property(lambda self: frozenset(range(self.machine.num_devices))))
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    strategy = alternating_strategy(graph)
    strategy = Strategy({n: dataclasses.replace(c, recompute=can_recompute(graph[n])) for n, c in strategy.items()})
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal(graph.inputs[0].shape).astype(np.float32),
                rng.integers(0, 10, graph.inputs[0].shape[0])) for _ in range(6)]

    def every_run_captured(graphs):
        counts = [c for c in machine4.client.run(_stand_in_counts).values() if c["programs"]]
        assert bool(counts) == graphs, counts
        assert all(c["captures"] == c["programs"] and not c["failed"] for c in counts), counts

    try:
        results = with_and_without_graphs(machine4, graph, strategy, batches,
                                          lambda: machine4.client.run(_install_stand_in), every_run_captured)
    finally:
        machine4.client.run(_remove_stand_in)
    assert results[True][0] == results[False][0]
    for layer, params in results[False][1].items():
        for key, value in params.items():
            np.testing.assert_array_equal(results[True][1][layer][key], value, err_msg=layer)


def test_timelines_show_copies_as_a_phase_of_their_own():
    from taskrt.observing.gantt import PHASE_COLORS, phase_color
    from taskrt.observing.timeline import KERNELS, simulated_step
    from taskrt.planning.simulate import simulate

    g = models.lenet5(batch=4, image_size=16, width=0.5)
    strategy = Strategy({layer.name: P(n=2, recompute=can_recompute(layer)) for layer in g if not layer.is_input})
    plan = lower(g, strategy)
    timeline = simulated_step(plan, simulate(plan, lambda task: 1e-3, Machine.simulated(1, 2)), range(2))
    copies = [span for span in timeline.spans if span.lane == KERNELS and "-recompute " in span.name]
    assert len(copies) == sum(t.phase == "recompute" for t in plan.tasks)
    assert {phase_color(span) for span in copies} == {PHASE_COLORS["recompute"]}
    assert PHASE_COLORS["recompute"] not in {PHASE_COLORS[p] for p in ("fwd", "bwd", "other")}
