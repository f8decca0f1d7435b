"""The PyTorch peer computes what the single-device runtime computes: logits, loss, every parameter
gradient and two SGD steps, in float64 on CPU, for small versions of the model zoo."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from taskrt import SingleDeviceTrainer, models  # noqa: E402
from taskrt.bench.torch_peer import TorchPeer, time_steps  # noqa: E402

TOL = 1e-9
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3

MODELS = {
    "lenet5": lambda: models.lenet5(batch=2, image_size=16, width=0.5),
    "alexnet": lambda: models.alexnet(batch=2, image_size=16, num_classes=5, width=1 / 32),
    "vgg16": lambda: models.vgg16(batch=2, image_size=32, num_classes=5, width=1 / 32),
    # 107: the last blocks keep 2x2 maps, so each batch norm sees 8 values per channel (at 75, 2 values
    # per channel leave the normalization so ill-conditioned that rounding differences grow past 1e-9)
    "inception_v3": lambda: models.inception_v3(batch=2, image_size=107, num_classes=5, width=1 / 16),
    # 64, for the same reason: at 32 the last block's maps are 1x1 and each batch norm sees 2 values
    "resnet50": lambda: models.resnet50(batch=2, image_size=64, num_classes=5, width=1 / 16),
    "splitbrain_vgg": lambda: models.splitbrain_vgg(batch=2, image_size=32, width=1 / 16),
}


def rel_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def random_batch(graph, seed=0):
    rng = np.random.default_rng(seed)
    image, labels = graph.inputs[0], graph.inputs[1]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(image.shape), rng.integers(0, classes, labels.shape)


def assert_same_params(got, expected, what):
    assert got.keys() == expected.keys(), what
    for layer in expected:
        assert got[layer].keys() == expected[layer].keys(), f"{what}: {layer}"
        for k in expected[layer]:
            err = rel_error(got[layer][k], expected[layer][k])
            assert err < TOL, f"{what} of {layer}.{k}: relative error {err:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_peer_matches_single_device(name):
    graph = MODELS[name]()
    x, y = random_batch(graph)
    ref = SingleDeviceTrainer(graph, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, dtype="float64", seed=0)
    peer = TorchPeer(graph, ref.params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    assert peer.dtype.is_floating_point and peer.np_dtype == np.float64

    assert rel_error(peer.predict(x), ref.predict(x)) < TOL
    assert abs(peer.loss(x, y) - ref.loss(x, y)) < TOL * abs(ref.loss(x, y))
    assert_same_params(peer.gradients(x, y), ref.gradients(x, y), "gradient")

    for step in range(2):
        x, y = random_batch(graph, seed=step + 1)
        expected = ref.step(x, y)
        assert abs(peer.step(x, y) - expected) < TOL * abs(expected)
    assert_same_params(peer.parameters(), ref.params, "parameters after two SGD steps")


def test_peer_takes_tensors_and_dicts():
    import torch

    graph = MODELS["lenet5"]()
    x, y = random_batch(graph)
    ref = SingleDeviceTrainer(graph, dtype="float64", seed=0)
    peer = TorchPeer(graph, ref.params)
    expected = ref.loss(x, y)
    assert abs(peer.loss(torch.from_numpy(x), torch.from_numpy(y)) - expected) < TOL * expected
    assert abs(peer.loss({"image": x, "labels": y}) - expected) < TOL * expected


def test_peer_needs_every_parameter():
    graph = MODELS["lenet5"]()
    ref = SingleDeviceTrainer(graph, dtype="float64", seed=0)
    params = dict(ref.params)
    del params["conv2"]
    with pytest.raises(ValueError, match="conv2"):
        TorchPeer(graph, params)


def test_float32_peer_keeps_float32():
    graph = MODELS["lenet5"]()
    ref = SingleDeviceTrainer(graph, dtype="float32", seed=0)
    peer = TorchPeer(graph, ref.params)
    x, y = random_batch(graph)
    grads = peer.gradients(x, y)
    assert all(g.dtype == np.float32 for p in grads.values() for g in p.values())


def test_time_steps_takes_the_median_after_warmup():
    calls = []
    median, times = time_steps(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and len(times) == 5
    assert median == sorted(times)[2]
