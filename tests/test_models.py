"""The model zoo: parameter and layer counts against the published networks, shapes, small
versions that run, and argument checking.  Full-size graphs are only built (cheap), never run."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import Graph, models
from taskrt.training.reference import SingleDeviceTrainer

# Published counts with batch norm (torchvision: inception_v3 without aux logits, resnet50):
# every conv bias-free and followed by a batch norm (2 parameters per channel), as here.
WITH_BATCH_NORM = {"inception_v3": 23_834_568, "resnet50": 25_557_032}
LAYERS = {"lenet5": (2, 3), "alexnet": (5, 3), "vgg16": (13, 3), "inception_v3": (94, 1), "resnet50": (53, 1),
          "splitbrain_vgg": (7, 3)}
SMALL_IMAGE = {"lenet5": 32, "alexnet": 32, "vgg16": 32, "inception_v3": 75, "resnet50": 32, "splitbrain_vgg": 32}
# SplitBrain (seed 000) Table 1: parameters of each trainable layer of its VGG variant
SPLITBRAIN_TABLE_1 = {"conv0": 1728, "conv1": 36864, "conv2": 73728, "conv3": 147456, "conv4": 294912,
                      "conv5": 589824, "conv6": 589824, "fc0": 4194304, "fc1": 1048576, "fc2": 10240}


def convs(g: Graph):
    return [layer for layer in g if layer.kind == "conv2d"]


def count(g: Graph, kind: str) -> int:
    return sum(layer.kind == kind for layer in g)


@pytest.fixture(scope="module")
def full():
    """Every model at its default (published) size, built once."""
    return {name: build() for name, build in models.MODELS.items()}


EXACT = [("lenet5", 61_706), ("alexnet", 61_100_840), ("vgg16", 138_357_544), ("splitbrain_vgg", 6_987_456)]


@pytest.mark.parametrize("name, params", EXACT)
def test_exact_param_counts(full, name, params):
    assert full[name].num_params() == params


@pytest.mark.parametrize("name", sorted(WITH_BATCH_NORM))
def test_param_counts_with_batch_norm_match_torchvision(full, name):
    g = full[name]
    assert g.num_params() == WITH_BATCH_NORM[name]
    norms = [layer for layer in g if layer.kind == "batch_norm"]
    assert len(norms) == count(g, "conv2d")
    for norm in norms:  # each follows its bias-free conv
        conv = g[norm.inputs[0]]
        assert conv.kind == "conv2d" and not conv.op.bias and norm.name == f"{conv.name}.bn"


def test_splitbrain_vgg_matches_table_1_layer_by_layer(full):
    g = full["splitbrain_vgg"]
    counts = {layer.name: sum(int(np.prod(s)) for s in layer.param_shapes.values()) for layer in g
              if layer.param_shapes}
    assert counts == SPLITBRAIN_TABLE_1
    conv = sum(v for k, v in counts.items() if k.startswith("conv"))
    # the table prints 24.83% and 75.17%: its rows give 24.82% and 75.18%
    assert round(100 * conv / g.num_params(), 2) == 24.82 and round(100 * (1 - conv / g.num_params()), 2) == 75.18
    assert g["flatten"].shape == (32, 4096)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_counts(full, name):
    assert (count(full[name], "conv2d"), count(full[name], "linear")) == LAYERS[name]


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_graph_ends_in_loss_on_logits(full, name):
    g = full[name]
    (loss,) = g.losses
    logits = g[loss.inputs[0]]
    batch = g["image"].shape[0]
    classes = 10 if name in ("lenet5", "splitbrain_vgg") else 1000
    assert logits.kind == "linear" and logits.shape == (batch, classes)
    assert g[loss.inputs[1]].op.dtype == "int64"
    assert list(g.layers)[-1] == loss.name


@pytest.mark.parametrize("name, shape", [("inception_v3", (32, 2048, 8, 8)), ("resnet50", (32, 2048, 7, 7))])
def test_last_feature_map_before_global_pool(full, name, shape):
    g = full[name]
    pool = g["avgpool"]
    assert g[pool.inputs[0]].shape == shape
    assert pool.shape == (32, 2048, 1, 1)


def test_inception_blocks_concatenate_to_published_widths(full):
    g = full["inception_v3"]
    widths = {block: g[f"mixed_{block}.concat"].shape[1] for block in
              ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c")}
    assert widths == {"5b": 256, "5c": 288, "5d": 288, "6a": 768, "6b": 768, "6c": 768, "6d": 768,
                      "6e": 768, "7a": 1280, "7b": 2048, "7c": 2048}
    assert g["mixed_7b.branch3x3_2a"].op.kernel == (1, 3) and g["mixed_7b.branch3x3_2b"].op.kernel == (3, 1)


def test_resnet_blocks_add_then_relu(full):
    g = full["resnet50"]
    assert count(g, "add") == 16 and sum(name.endswith(".downsample") for name in g.layers) == 4
    block = "layer2.0"
    assert g[f"{block}.conv2"].op.stride == (2, 2)  # v1.5: the stride is on the 3x3 conv
    assert g[f"{block}.conv3"].op.activation is None
    assert g[f"{block}.add"].inputs == (f"{block}.conv3.bn", f"{block}.downsample.bn")
    assert g[f"{block}.relu"].inputs == (f"{block}.add",)
    assert g["layer2.1.add"].inputs == ("layer2.1.conv3.bn", "layer2.0.relu")  # identity shortcut


def test_alexnet_uses_cifar_variant_for_small_images():
    small = models.alexnet(batch=2, image_size=32)
    assert small["conv1"].op.kernel == (3, 3) and small["flatten"].shape == (2, 256 * 4 * 4)
    assert models.alexnet(batch=2, image_size=64)["conv1"].op.kernel == (11, 11)


def test_vgg_at_cifar_size_has_one_pixel_left():
    assert models.vgg16(batch=2, image_size=32, num_classes=10)["flatten"].shape == (2, 512)


def test_width_scales_channels_and_hidden_fc_but_not_classes():
    g = models.vgg16(batch=2, image_size=32, num_classes=10, width=0.25)
    assert g["conv1_1"].shape[1] == 16 and g["conv5_3"].shape[1] == 128
    assert g["fc1"].shape == (2, 1024) and g["fc3"].shape == (2, 10)
    tiny = models.lenet5(width=0.01)  # rounds to zero channels, clamped to one
    assert tiny["conv1"].shape[1] == 1 and tiny["fc1"].shape[1] == 1 and tiny["fc3"].shape[1] == 10


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_small_versions_run_forward(name):
    g = models.get(name, batch=2, image_size=SMALL_IMAGE[name], num_classes=10, width=0.25)
    channels = g["image"].shape[1]
    x = np.random.default_rng(0).random((2, channels, SMALL_IMAGE[name], SMALL_IMAGE[name]), dtype=np.float32)
    logits = SingleDeviceTrainer(g).predict(x)
    assert logits.shape == (2, 10)
    assert np.isfinite(logits).all()
    assert not np.allclose(logits[0], logits[1])  # the signal gets through: not all relus dead


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_minimum_image_size_is_exact(name):
    smallest = models.MIN_IMAGE[name]
    g = models.get(name, batch=1, image_size=smallest)
    assert g["image"].shape[2:] == (smallest, smallest)
    with pytest.raises(ValueError, match=f"image_size must be at least {smallest}"):
        models.get(name, batch=1, image_size=smallest - 1)


def test_inception_rejects_images_below_75():
    with pytest.raises(ValueError, match="inception_v3: image_size must be at least 75, got 74"):
        models.inception_v3(image_size=74)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 0}, "batch must be at least 1"),
    ({"batch": 2.0}, "batch must be an int"),
    ({"image_size": True}, "image_size must be an int"),
    ({"num_classes": 0}, "num_classes must be at least 1"),
    ({"width": 0}, "width must be a positive number"),
    ({"width": -0.5}, "width must be a positive number"),
    ({"width": float("nan")}, "width must be a positive number"),
    ({"width": "1"}, "width must be a positive number"),
])
@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_bad_arguments(name, kwargs, message):
    with pytest.raises(ValueError, match=f"{name}: {message}"):
        models.get(name, **kwargs)


def test_lenet_checks_channels():
    with pytest.raises(ValueError, match="channels must be at least 1"):
        models.lenet5(channels=0)
    assert models.lenet5(channels=3)["image"].shape == (64, 3, 32, 32)


def test_get_unknown_name_lists_known_models():
    with pytest.raises(ValueError, match="unknown model 'resnet18'; known models: lenet5, alexnet"):
        models.get("resnet18")


def test_layer_names_are_unique_and_readable(full):
    g = full["inception_v3"]
    assert "mixed_5b.branch1x1" in g.layers and "mixed_6e.branch7x7dbl_5" in g.layers
    assert "layer4.2.conv3" in full["resnet50"].layers
