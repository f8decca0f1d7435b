"""A plan run in this process computes what the single-device network computes."""

from __future__ import annotations

import numpy as np

from taskrt import Machine, lower
from taskrt.bench.ist_training import dp_strategy, network
from taskrt.data.arrays import bind_inputs
from taskrt.planning.inprocess import buffer_tiles, data_tiles, run_plan, shard_states
from taskrt.planning.params import init_buffers, init_parameters, unpack
from taskrt.training.reference import SingleDeviceTrainer


def test_a_data_parallel_step_in_process_is_the_single_device_step():
    g = network((6, 5, 7, 3), batch=8, norm=True)  # batch norms: their statistics travel too
    machine = Machine.simulated(1, 4)
    plan = lower(g, dp_strategy(g, machine).validated(g, machine), "train", 8)
    params = init_parameters(g, 3, "float64")
    velocity = {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
    seconds = {}
    values = run_plan(plan, shard_states(plan, params, velocity), data_tiles(plan, bind_inputs(g, (x, y), np.float64)),
                      {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}, buffer_tiles(plan, init_buffers(g, "float64")),
                      seconds)
    assert set(seconds) == {t.key for t in plan.tasks} and all(s >= 0 for s in seconds.values())
    reference = SingleDeviceTrainer(g, lr=0.1, seed=3, dtype="float64")
    reference.step(x, y)
    expected = reference.parameters()
    for layer, shards in plan.shards.items():
        for shard in shards:
            flat = np.concatenate([values[plan.outputs["state"][(layer, shard.index, k)]][0]
                                   for k in range(len(shard.chunks))])
            for name, value in unpack(flat, shard.layout).items():
                np.testing.assert_allclose(value, expected[layer][name], rtol=1e-12, atol=1e-14)
    for (layer, index), key in plan.outputs["buffers"].items():
        lo, hi = plan.buffers[layer][index].channels
        np.testing.assert_allclose(values[key], reference.running[layer][:, lo:hi], rtol=1e-12, atol=1e-14)
