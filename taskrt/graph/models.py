"""The model zoo: classic CNNs built with the graph API, each ending in a softmax cross-entropy loss.

    g = models.get("resnet50", batch=16, image_size=224)
    g = models.vgg16(batch=2, image_size=32, num_classes=10, width=0.25)   # a small one for tests

Every builder takes `batch`, `image_size` (square images), `num_classes` and `width`, which
multiplies every conv channel count and hidden fc width (not the class count), rounded, at
least 1.  The graph has one float input "image" (batch, channels, size, size) and, from the
loss, one int64 input "labels".

Inception-v3 and ResNet-50 have torchvision's batch norms: each conv has no bias and is followed
by a batch norm (layer "<conv>.bn") and, where the network has one, a ReLU ("<conv>.relu"), so
their parameter counts are torchvision's.  There is no dropout (it changes
nothing in the layer structure) and no adaptive pooling: the first fc layer's input size
follows from the image size, so parameter counts match the published ones at the published
image size only.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from taskrt.graph.graph import Graph, Tensor

# Smallest image each network accepts: below it some window no longer fits its input.
MIN_IMAGE = {"lenet5": 16, "alexnet": 8, "vgg16": 32, "inception_v3": 75, "resnet50": 1, "splitbrain_vgg": 8}
# The ImageNet stem (11x11 stride 4) fits from 63 up; below 64, i.e. CIFAR sizes, use the CIFAR variant.
ALEXNET_IMAGENET_MIN = 64


def _check_int(model, what, value, minimum, why=""):
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{model}: {what} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{model}: {what} must be at least {minimum}, got {value}{why}")


def _check_args(model, batch, image_size, num_classes, width):
    _check_int(model, "batch", batch, 1)
    _check_int(model, "image_size", image_size, MIN_IMAGE[model],
               ": smaller images shrink to nothing inside the network")
    _check_int(model, "num_classes", num_classes, 1)
    if isinstance(width, bool) or not isinstance(width, Real) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"{model}: width must be a positive number, got {width!r}")


class _Net:
    """A Graph with the width multiplier applied, so model code reads like the papers' tables."""

    def __init__(self, model, batch, image_size, channels, width):
        self.g = Graph(model)
        self.width = width
        self.image = self.g.input("image", (batch, channels, image_size, image_size))

    def scaled(self, channels: int) -> int:
        return max(1, round(channels * self.width))

    def conv(self, x, channels, kernel, stride=1, padding=0, relu=True, bias=True, name=None) -> Tensor:
        return self.g.conv2d(x, self.scaled(channels), kernel, stride, padding,
                             activation="relu" if relu else None, bias=bias, name=name)

    def conv_bn(self, x, channels, kernel, stride=1, padding=0, relu=True, name=None) -> Tensor:
        """A bias-free conv, its batch norm ("<name>.bn") and, with `relu`, a ReLU ("<name>.relu")."""
        y = self.g.conv2d(x, self.scaled(channels), kernel, stride, padding, bias=False, name=name)
        y = self.g.batch_norm(y, eps=1e-3 if self.g.name == "inception_v3" else 1e-5, name=f"{name}.bn")
        return self.g.relu(y, name=f"{name}.relu") if relu else y

    def pool(self, x, kernel, stride=None, padding=0, mode="max", name=None) -> Tensor:
        return self.g.pool2d(x, kernel, stride, padding, mode=mode, name=name)

    def classifier(self, x, hidden, num_classes, bias=True, names=None) -> Graph:
        """flatten, then fc with fused relu per hidden width, then the class fc and the loss."""
        names = names or [f"fc{i}" for i in range(1, len(hidden) + 1)] + [f"fc{len(hidden) + 1}" if hidden else "fc"]
        x = self.g.flatten(x, name="flatten")
        for name, features in zip(names, hidden):
            x = self.g.linear(x, self.scaled(features), activation="relu", bias=bias, name=name)
        logits = self.g.linear(x, num_classes, bias=bias, name=names[-1])
        self.g.softmax_cross_entropy(logits, name="loss")
        return self.g

    def global_pool_classifier(self, x, num_classes) -> Graph:
        """Average over whatever spatial extent is left (fixed at build time), then one fc."""
        x = self.pool(x, kernel=x.shape[2:], mode="avg", name="avgpool")
        return self.classifier(x, (), num_classes)


# ---- LeNet-5 ----------------------------------------------------------------------------------
def lenet5(batch=64, image_size=32, num_classes=10, channels=1, width=1.0) -> Graph:
    """LeNet-5 (LeCun et al. 1998): conv 6@5x5, max pool 2, conv 16@5x5, max pool 2,
    fc 120, fc 84, fc classes, all with ReLU.

    61,706 parameters at the defaults (32x32, 10 classes).  C3 is fully connected here, as in
    most modern versions, not the original's sparse table (which gives the often-quoted ~60k);
    max pooling and ReLU also replace the original's subsampling and tanh.  No padding: at 32x32
    the last conv sees 5x5 maps; the smallest image that fits is 16x16.
    """
    _check_args("lenet5", batch, image_size, num_classes, width)
    _check_int("lenet5", "channels", channels, 1)
    net = _Net("lenet5", batch, image_size, channels, width)
    x = net.conv(net.image, 6, 5, name="conv1")
    x = net.pool(x, 2, name="pool1")
    x = net.conv(x, 16, 5, name="conv2")
    x = net.pool(x, 2, name="pool2")
    return net.classifier(x, (120, 84), num_classes)


# ---- AlexNet ----------------------------------------------------------------------------------
def alexnet(batch=32, image_size=224, num_classes=1000, width=1.0) -> Graph:
    """AlexNet, single tower as in torchvision (the "one weird trick" variant):
    conv 64 11x11/4, max pool 3/2, conv 192 5x5, max pool 3/2, conv 384, 256, 256 3x3,
    max pool 3/2, fc 4096, fc 4096, fc classes, all with ReLU.

    61,100,840 parameters at 224x224 and 1000 classes, as torchvision (whose adaptive pool
    is a no-op there: the last pool already gives 6x6).  No dropout.

    For images smaller than 64 (CIFAR-size) the ImageNet stem does not fit, so a CIFAR variant
    is built instead: the same five conv widths, all 3x3 stride 1 padding 1, with 2x2 stride-2
    max pools after conv1, conv2 and conv5, then the same three fc layers (256*4*4 inputs to
    fc1 at 32x32).  It needs images of at least 8x8.
    """
    _check_args("alexnet", batch, image_size, num_classes, width)
    net = _Net("alexnet", batch, image_size, 3, width)
    if image_size >= ALEXNET_IMAGENET_MIN:
        x = net.conv(net.image, 64, 11, stride=4, padding=2, name="conv1")
        x = net.pool(x, 3, 2, name="pool1")
        x = net.conv(x, 192, 5, padding=2, name="conv2")
        pool = (3, 2)
    else:
        x = net.conv(net.image, 64, 3, padding=1, name="conv1")
        x = net.pool(x, 2, 2, name="pool1")
        x = net.conv(x, 192, 3, padding=1, name="conv2")
        pool = (2, 2)
    x = net.pool(x, *pool, name="pool2")
    x = net.conv(x, 384, 3, padding=1, name="conv3")
    x = net.conv(x, 256, 3, padding=1, name="conv4")
    x = net.conv(x, 256, 3, padding=1, name="conv5")
    x = net.pool(x, *pool, name="pool5")
    return net.classifier(x, (4096, 4096), num_classes)


# ---- VGG-16 -----------------------------------------------------------------------------------
VGG16_STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def vgg16(batch=32, image_size=224, num_classes=1000, width=1.0) -> Graph:
    """VGG-16 (Simonyan & Zisserman, configuration D): five stages of 3x3 padding-1 convs with
    ReLU (2, 2, 3, 3, 3 convs), each followed by a 2x2 max pool, then fc 4096, fc 4096,
    fc classes.

    138,357,544 parameters at 224x224 and 1000 classes, as torchvision.  No dropout and no
    adaptive pool: at 32x32 (the smallest that fits) fc1 takes 512*1*1 inputs.
    """
    _check_args("vgg16", batch, image_size, num_classes, width)
    net = _Net("vgg16", batch, image_size, 3, width)
    x = net.image
    for stage, widths in enumerate(VGG16_STAGES, start=1):
        for i, channels in enumerate(widths, start=1):
            x = net.conv(x, channels, 3, padding=1, name=f"conv{stage}_{i}")
        x = net.pool(x, 2, name=f"pool{stage}")
    return net.classifier(x, (4096, 4096), num_classes)


# ---- SplitBrain's VGG variant -----------------------------------------------------------------
SPLITBRAIN_VGG_STAGES = ((64, 64), (128, 128), (256, 256, 256))


def splitbrain_vgg(batch=32, image_size=32, num_classes=10, width=1.0) -> Graph:
    """The VGG variant SplitBrain (seed 000, Table 1) trains on CIFAR-10: seven 3x3 padding-1
    convs (64, 64 | 128, 128 | 256, 256, 256) with ReLU, a 2x2 max pool after each group, then
    fc 1024, fc 1024, fc classes.  Layers are named as in Table 1 (conv0..conv6, fc0..fc2).

    Every layer is bias-free, so the counts are Table 1's exactly at 32x32 and 10 classes:
    1,734,336 conv and 5,253,120 fc parameters, 6,987,456 in all.  (The paper's text says
    "7.5M"; its table's rows sum to 6,987,456, i.e. 24.82% conv and 75.18% fc, which the table
    prints as 24.83% and 75.17%.)
    """
    _check_args("splitbrain_vgg", batch, image_size, num_classes, width)
    net = _Net("splitbrain_vgg", batch, image_size, 3, width)
    x, k = net.image, 0
    for stage, widths in enumerate(SPLITBRAIN_VGG_STAGES):
        for channels in widths:
            x = net.conv(x, channels, 3, padding=1, bias=False, name=f"conv{k}")
            k += 1
        x = net.pool(x, 2, name=f"pool{stage}")
    return net.classifier(x, (1024, 1024), num_classes, bias=False, names=["fc0", "fc1", "fc2"])


# ---- Inception-v3 -----------------------------------------------------------------------------
# Branch and layer names follow torchvision's Inception3, lower-cased.
def _inception_a(net, x, pool_features, name):
    b1 = net.conv_bn(x, 64, 1, name=f"{name}.branch1x1")
    b5 = net.conv_bn(x, 48, 1, name=f"{name}.branch5x5_1")
    b5 = net.conv_bn(b5, 64, 5, padding=2, name=f"{name}.branch5x5_2")
    b3 = net.conv_bn(x, 64, 1, name=f"{name}.branch3x3dbl_1")
    b3 = net.conv_bn(b3, 96, 3, padding=1, name=f"{name}.branch3x3dbl_2")
    b3 = net.conv_bn(b3, 96, 3, padding=1, name=f"{name}.branch3x3dbl_3")
    bp = net.pool(x, 3, 1, padding=1, mode="avg", name=f"{name}.pool")
    bp = net.conv_bn(bp, pool_features, 1, name=f"{name}.branch_pool")
    return net.g.concat([b1, b5, b3, bp], name=f"{name}.concat")


def _inception_b(net, x, name):
    b3 = net.conv_bn(x, 384, 3, stride=2, name=f"{name}.branch3x3")
    bd = net.conv_bn(x, 64, 1, name=f"{name}.branch3x3dbl_1")
    bd = net.conv_bn(bd, 96, 3, padding=1, name=f"{name}.branch3x3dbl_2")
    bd = net.conv_bn(bd, 96, 3, stride=2, name=f"{name}.branch3x3dbl_3")
    bp = net.pool(x, 3, 2, name=f"{name}.pool")
    return net.g.concat([b3, bd, bp], name=f"{name}.concat")


def _inception_c(net, x, c7, name):
    # 7x7 convolutions factorized into 1x7 and 7x1
    b1 = net.conv_bn(x, 192, 1, name=f"{name}.branch1x1")
    b7 = net.conv_bn(x, c7, 1, name=f"{name}.branch7x7_1")
    b7 = net.conv_bn(b7, c7, (1, 7), padding=(0, 3), name=f"{name}.branch7x7_2")
    b7 = net.conv_bn(b7, 192, (7, 1), padding=(3, 0), name=f"{name}.branch7x7_3")
    bd = net.conv_bn(x, c7, 1, name=f"{name}.branch7x7dbl_1")
    bd = net.conv_bn(bd, c7, (7, 1), padding=(3, 0), name=f"{name}.branch7x7dbl_2")
    bd = net.conv_bn(bd, c7, (1, 7), padding=(0, 3), name=f"{name}.branch7x7dbl_3")
    bd = net.conv_bn(bd, c7, (7, 1), padding=(3, 0), name=f"{name}.branch7x7dbl_4")
    bd = net.conv_bn(bd, 192, (1, 7), padding=(0, 3), name=f"{name}.branch7x7dbl_5")
    bp = net.pool(x, 3, 1, padding=1, mode="avg", name=f"{name}.pool")
    bp = net.conv_bn(bp, 192, 1, name=f"{name}.branch_pool")
    return net.g.concat([b1, b7, bd, bp], name=f"{name}.concat")


def _inception_d(net, x, name):
    b3 = net.conv_bn(x, 192, 1, name=f"{name}.branch3x3_1")
    b3 = net.conv_bn(b3, 320, 3, stride=2, name=f"{name}.branch3x3_2")
    b7 = net.conv_bn(x, 192, 1, name=f"{name}.branch7x7x3_1")
    b7 = net.conv_bn(b7, 192, (1, 7), padding=(0, 3), name=f"{name}.branch7x7x3_2")
    b7 = net.conv_bn(b7, 192, (7, 1), padding=(3, 0), name=f"{name}.branch7x7x3_3")
    b7 = net.conv_bn(b7, 192, 3, stride=2, name=f"{name}.branch7x7x3_4")
    bp = net.pool(x, 3, 2, name=f"{name}.pool")
    return net.g.concat([b3, b7, bp], name=f"{name}.concat")


def _split_1x3_3x1(net, x, channels, name):
    """The widening split of InceptionE: parallel 1x3 and 3x1 convs, concatenated."""
    a = net.conv_bn(x, channels, (1, 3), padding=(0, 1), name=f"{name}a")
    b = net.conv_bn(x, channels, (3, 1), padding=(1, 0), name=f"{name}b")
    return net.g.concat([a, b], name=name)


def _inception_e(net, x, name):
    b1 = net.conv_bn(x, 320, 1, name=f"{name}.branch1x1")
    b3 = net.conv_bn(x, 384, 1, name=f"{name}.branch3x3_1")
    b3 = _split_1x3_3x1(net, b3, 384, f"{name}.branch3x3_2")
    bd = net.conv_bn(x, 448, 1, name=f"{name}.branch3x3dbl_1")
    bd = net.conv_bn(bd, 384, 3, padding=1, name=f"{name}.branch3x3dbl_2")
    bd = _split_1x3_3x1(net, bd, 384, f"{name}.branch3x3dbl_3")
    bp = net.pool(x, 3, 1, padding=1, mode="avg", name=f"{name}.pool")
    bp = net.conv_bn(bp, 192, 1, name=f"{name}.branch_pool")
    return net.g.concat([b1, b3, bd, bp], name=f"{name}.concat")


def inception_v3(batch=32, image_size=299, num_classes=1000, width=1.0) -> Graph:
    """Inception-v3 (Szegedy et al. 2016) as torchvision's `inception_v3`, without the auxiliary
    classifier and dropout: every conv is bias-free with a batch norm (eps 1e-3) and a ReLU.

    Stem (five convs, two max pools), Mixed_5b-5d (InceptionA), 6a (B), 6b-6e (C, 1x7/7x1
    factorized, 128/160/160/192 channels in the 7x7 branches), 7a (D), 7b-7c (E), global
    average pool, fc: 94 convs and 1 fc.  At 299x299 the last block gives 8x8x2048.

    23,834,568 parameters at 299 and 1000 classes, torchvision's count without aux logits.
    The smallest image that fits is 75x75 (as in torchvision).
    """
    _check_args("inception_v3", batch, image_size, num_classes, width)
    net = _Net("inception_v3", batch, image_size, 3, width)
    x = net.conv_bn(net.image, 32, 3, stride=2, name="conv2d_1a_3x3")
    x = net.conv_bn(x, 32, 3, name="conv2d_2a_3x3")
    x = net.conv_bn(x, 64, 3, padding=1, name="conv2d_2b_3x3")
    x = net.pool(x, 3, 2, name="maxpool1")
    x = net.conv_bn(x, 80, 1, name="conv2d_3b_1x1")
    x = net.conv_bn(x, 192, 3, name="conv2d_4a_3x3")
    x = net.pool(x, 3, 2, name="maxpool2")
    x = _inception_a(net, x, 32, "mixed_5b")
    x = _inception_a(net, x, 64, "mixed_5c")
    x = _inception_a(net, x, 64, "mixed_5d")
    x = _inception_b(net, x, "mixed_6a")
    for block, c7 in (("6b", 128), ("6c", 160), ("6d", 160), ("6e", 192)):
        x = _inception_c(net, x, c7, f"mixed_{block}")
    x = _inception_d(net, x, "mixed_7a")
    x = _inception_e(net, x, "mixed_7b")
    x = _inception_e(net, x, "mixed_7c")
    return net.global_pool_classifier(x, num_classes)


# ---- ResNet-50 --------------------------------------------------------------------------------
RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # (width, blocks, stride)


def _bottleneck(net, x, channels, stride, project, name):
    """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand x4; relu(branch + shortcut)."""
    out = channels * 4
    y = net.conv_bn(x, channels, 1, name=f"{name}.conv1")
    y = net.conv_bn(y, channels, 3, stride=stride, padding=1, name=f"{name}.conv2")
    y = net.conv_bn(y, out, 1, relu=False, name=f"{name}.conv3")  # the relu comes after the add
    if project:  # first block of a stage: channels (and maybe size) change
        x = net.conv_bn(x, out, 1, stride=stride, relu=False, name=f"{name}.downsample")
    y = net.g.add(y, x, name=f"{name}.add")
    return net.g.relu(y, name=f"{name}.relu")


def resnet50(batch=32, image_size=224, num_classes=1000, width=1.0) -> Graph:
    """ResNet-50 v1.5 as torchvision's `resnet50` (stride on the 3x3 conv of the bottleneck),
    every conv bias-free with a batch norm.

    Stem (conv 64 7x7/2, max pool 3/2), stages of 3, 4, 6, 3 bottlenecks with a 1x1 projection
    shortcut on the first block of each, global average pool, fc: 53 convs and 1 fc.  At
    224x224 the last stage gives 7x7x2048.

    25,557,032 parameters at 224 and 1000 classes, torchvision's count.  Every window is
    padded enough to fit, so any image size works (each stride-2 layer halves it, rounding up).
    """
    _check_args("resnet50", batch, image_size, num_classes, width)
    net = _Net("resnet50", batch, image_size, 3, width)
    x = net.conv_bn(net.image, 64, 7, stride=2, padding=3, name="conv1")
    x = net.pool(x, 3, 2, padding=1, name="maxpool")
    for stage, (channels, blocks, stride) in enumerate(RESNET50_STAGES, start=1):
        for block in range(blocks):
            first = block == 0
            x = _bottleneck(net, x, channels, stride if first else 1, first, f"layer{stage}.{block}")
    return net.global_pool_classifier(x, num_classes)


# ---- lookup -----------------------------------------------------------------------------------
MODELS = {"lenet5": lenet5, "alexnet": alexnet, "vgg16": vgg16, "inception_v3": inception_v3,
          "resnet50": resnet50, "splitbrain_vgg": splitbrain_vgg}


def get(name: str, **kwargs) -> Graph:
    """Build the model called `name` (a key of MODELS) with the builder's keyword arguments."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)
