"""Array kernels and region rules, one module per op.

Kernels take the array module of their inputs (numpy here, cupy on GPU workers); convolution and
linear layers on cupy arrays run through torch (cuDNN, cuBLAS) when it is importable
(`ops.torch_kernels`).  GPU float32 precision is an explicit choice: `ops.set_precision`.
"""

from ops.base import Op, array_module, dims_of
from ops.batchnorm import BatchNorm
from ops.concat import Concat
from ops.conv import Conv2d
from ops.elementwise import Add, Relu
from ops.errors import ShapeError
from ops.flatten import Flatten
from ops.input import Input
from ops.linear import Linear
from ops.loss import SoftmaxCrossEntropy
from ops.pool import Pool2d
from ops.precision import get_precision, set_precision
from ops.rect import Rect
from ops.sgd import sgd_update

OPS = {op.kind: op for op in (Input, Conv2d, Pool2d, Linear, Relu, Add, Concat, Flatten, SoftmaxCrossEntropy,
                              BatchNorm)}

__all__ = [
    "OPS", "Op", "Rect", "ShapeError", "array_module", "dims_of", "sgd_update", "set_precision", "get_precision",
    "Input", "Conv2d", "Pool2d", "Linear", "Relu", "Add", "Concat", "Flatten", "SoftmaxCrossEntropy",
    "BatchNorm",
]
