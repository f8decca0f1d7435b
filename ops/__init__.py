"""Array kernels and region rules, one module per op.

Kernels take the array module of their inputs (numpy here, cupy on GPU workers); convolution and
linear layers on cupy arrays run through torch (cuDNN, cuBLAS) when it is importable
(`ops.torch_kernels`).  GPU float32 precision is an explicit choice: `ops.set_precision`.
"""

from taskrt.ops import optim
from taskrt.ops.activations import Gelu, Hardsigmoid, Hardswish, Hardtanh, Identity, Relu6, Sigmoid, Silu, Tanh
from taskrt.ops.adaptive_pool import AdaptivePool2d, Mean
from taskrt.ops.base import Op, array_module, dims_of
from taskrt.ops.batchnorm import BatchNorm
from taskrt.ops.channels import ChannelShuffle, ChannelSlice, Scale
from taskrt.ops.concat import Concat
from taskrt.ops.conv import Conv2d
from taskrt.ops.dropout import Dropout, DropPath
from taskrt.ops.elementwise import Add, Mul, Relu, Sub
from taskrt.ops.errors import ShapeError
from taskrt.ops.flatten import Flatten
from taskrt.ops.input import Input
from taskrt.ops.layernorm import LayerNorm
from taskrt.ops.linear import Linear
from taskrt.ops.loss import SoftmaxCrossEntropy
from taskrt.ops.pool import Pool2d
from taskrt.ops.precision import get_precision, set_precision
from taskrt.ops.rect import Rect

OPS = {op.kind: op for op in (Input, Conv2d, Pool2d, Linear, Relu, Add, Concat, Flatten, SoftmaxCrossEntropy,
                              BatchNorm, Relu6, Hardtanh, Silu, Sigmoid, Tanh, Hardswish, Hardsigmoid, Gelu, Identity,
                              Mul, Sub, LayerNorm, Dropout, DropPath, AdaptivePool2d, Mean, ChannelSlice,
                              ChannelShuffle, Scale)}

__all__ = [
    "OPS", "Op", "Rect", "ShapeError", "array_module", "dims_of", "optim", "set_precision", "get_precision",
    "Input", "Conv2d", "Pool2d", "Linear", "Relu", "Add", "Concat", "Flatten", "SoftmaxCrossEntropy",
    "BatchNorm",
]
