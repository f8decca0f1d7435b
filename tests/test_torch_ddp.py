"""The DDP baseline trains what one TorchPeer trains on the whole batch: two ranks' steps on half
batches each, their gradients averaged by DDP, give the same parameters in float64."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from taskrt import models  # noqa: E402
from taskrt.bench import torch_ddp  # noqa: E402
from taskrt.bench.torch_peer import TorchPeer  # noqa: E402
from taskrt.planning.params import init_parameters  # noqa: E402
from taskrt.search.measured import random_batch  # noqa: E402

HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}

needs_gloo = pytest.mark.skipif(torch_ddp.unavailable() is not None, reason=str(torch_ddp.unavailable()))


@needs_gloo
def test_two_ranks_step_as_one_peer_on_the_whole_batch():
    graph = models.lenet5(batch=8, image_size=16, width=0.5)
    batches = [random_batch(graph, seed) for seed in (0, 1)]
    peer = TorchPeer(graph, init_parameters(graph, 0, "float64"), **HYPER)
    with torch_ddp.DDPRunner(graph, 2, seed=0, dtype="float64", timeout=120, **HYPER) as ddp:
        for x, y in batches:  # two steps: the second one's momentum holds the first's gradient
            expected_loss = peer.step(x.astype(np.float64), y)
            assert abs(ddp.step(x.astype(np.float64), y) - expected_loss) < 1e-12
        got = ddp.parameters()
        assert len(ddp.rank0_times) == 2 and all(t > 0 for t in ddp.rank0_times)
    expected = peer.parameters()
    assert got.keys() == expected.keys()
    for layer in expected:
        for k, value in expected[layer].items():
            assert got[layer][k].dtype == np.float64
            assert np.max(np.abs(got[layer][k] - value)) < 1e-10, f"{layer}.{k}"


def test_a_batch_the_ranks_cannot_share_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="divisible by 3; graph 'lenet5' has batch 8"):
        torch_ddp.DDPRunner(models.lenet5(batch=8), 3)


def test_the_scaling_summary_gives_the_searched_strategy_against_ddp():
    from taskrt.bench import scaling_measured

    rows = [{"model": "alexnet32", "devices": 2, "strategy": name, "measured_ms": ms, "simulated_ms": ms,
             "simulated_error": 0.0} for name, ms in (("data", 500.0), ("searched", 400.0))]
    ddp = [{"model": "alexnet32", "devices": 1, "skipped": "no gloo backend"},
           {"model": "alexnet32", "devices": 2, "skipped": None, "measured_ms": 800.0, "searched_vs_ddp": 2.0}]
    lines = scaling_measured.summary_lines(scaling_measured.with_speedups(rows), [8], 2, ddp)
    assert "by device count: 1: skipped (no gloo backend); 2: DDP 800 ms, searched 2.00x DDP's throughput" in lines[-2]
    assert lines[-1].startswith("not run: 8 devices")
