"""Element-wise activations: each output element is a function of the same input element.

The region rule is the output's own Rect (`Op.input_rects`), so a tile computes exactly the slice
of the whole-tensor output and its input gradient covers only its own Rect.  Kernels use the array
module of their input (numpy here, cupy on GPU workers).

Definitions and gradients are PyTorch's (`torch.nn.functional`), the kinks included: hardtanh and
relu6 pass no gradient at either bound, hardsigmoid none at -3 or 3, hardswish 0 at -3 and 1 at 3
(tests/test_activations.py checks every op against torch in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError

GELU_APPROXIMATIONS = ("none", "tanh")
_SQRT1_2 = math.sqrt(0.5)
_NORMAL_PDF = 1 / math.sqrt(2 * math.pi)  # torch's kBeta of the erf form: M_2_SQRTPI * M_SQRT1_2 * 0.5
_TANH_BETA = math.sqrt(2 / math.pi)  # torch's kBeta of the tanh form: M_SQRT2 * M_2_SQRTPI * 0.5
_TANH_KAPPA = 0.044715


@dataclass(frozen=True)
class Activation(Op):
    """One input, output of its shape.  Subclasses give `apply` and `gradient`, and their cost:
    (forward, backward) elementary operations per element, a transcendental function counting one."""

    kind = "activation"
    cost = (1, 2)

    def __post_init__(self):
        if len(self.in_shapes) != 1:
            raise ShapeError(f"{self.kind} takes one input, got {len(self.in_shapes)}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    def flops(self, out):
        return self.cost[0] * out.volume

    def backward_flops(self, out):
        return self.cost[1] * out.volume

    def forward(self, xs, params, out):
        return self.apply(array_module(xs[0]), xs[0])

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        if self.saves_output and y is None:  # called without the saved output (not through the lowering)
            y = self.forward(xs, params, out)
        return [self.gradient(array_module(dy), dy, xs[0], y)], {}

    def apply(self, xp, x):
        raise NotImplementedError

    def gradient(self, xp, dy, x, y):
        """dL/dx from dL/dy, the input tile and (for ops that save it) the output tile."""
        raise NotImplementedError


@numba.njit(cache=True, nogil=True)
def _inside(x, dy, low, high, out):
    """dy where low < x < high, else 0 (hardtanh's gradient)."""
    for i in range(x.size):
        out[i] = dy[i] if low < x[i] < high else 0


@dataclass(frozen=True)
class Hardtanh(Activation):
    """clamp(x, min_val, max_val); gradient 1 strictly inside the bounds, 0 at and beyond them."""

    min_val: float = -1.0
    max_val: float = 1.0

    kind = "hardtanh"
    cost = (2, 3)

    def __post_init__(self):
        super().__post_init__()
        for what, value in (("min_val", self.min_val), ("max_val", self.max_val)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ShapeError(f"{self.kind} {what} must be a finite number, got {value!r}")
        if not self.min_val < self.max_val:
            raise ShapeError(f"{self.kind} needs min_val < max_val, got min_val={self.min_val!r} "
                             f"and max_val={self.max_val!r}")

    def apply(self, xp, x):
        return xp.minimum(xp.maximum(x, self.min_val), self.max_val)

    def gradient(self, xp, dy, x, y):
        if xp is np and x.flags.c_contiguous and dy.flags.c_contiguous and x.dtype == dy.dtype:
            out = np.empty_like(dy)  # one pass (the array expression takes four: a relu6 backward in MobileNet)
            _inside(x.reshape(-1), dy.reshape(-1), x.dtype.type(self.min_val), x.dtype.type(self.max_val),
                    out.reshape(-1))
            return out
        return xp.where((x > self.min_val) & (x < self.max_val), dy, 0)

    def attrs(self):
        return {"min_val": self.min_val, "max_val": self.max_val}


@dataclass(frozen=True)
class Relu6(Hardtanh):
    """min(max(x, 0), 6): hardtanh(0, 6) under its own kind, as torch's relu6."""

    min_val: float = 0.0
    max_val: float = 6.0

    kind = "relu6"

    def __post_init__(self):
        super().__post_init__()
        if (self.min_val, self.max_val) != (0, 6):
            raise ShapeError(f"relu6 bounds are 0 and 6, got {self.min_val!r} and {self.max_val!r}; "
                             "use hardtanh for others")

    def attrs(self):
        return {}


def sigmoid(xp, x):
    """1 / (1 + exp(-x)) without overflow: exp of -|x| only."""
    if _loops(xp, x):
        out = np.empty_like(x)
        _sigmoid(x.reshape(-1), out.reshape(-1))
        return out
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1, e) / (1 + e)


def _loops(xp, *arrays) -> bool:
    """Whether the numba loops below take these arrays (numpy, contiguous, one float dtype): one pass
    each, where the array expressions take five to seven (EfficientNet's SiLUs were a quarter of a step)."""
    return xp is np and all(a.flags.c_contiguous and a.dtype == arrays[0].dtype for a in arrays) and \
        arrays[0].dtype in (np.float32, np.float64)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _sigmoid(x, out):
    one = x.dtype.type(1)
    for i in range(x.size):
        v = x[i]
        e = np.exp(-np.abs(v))
        out[i] = (one if v >= 0 else e) / (one + e)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _silu(x, out):
    one = x.dtype.type(1)
    for i in range(x.size):
        v = x[i]
        e = np.exp(-np.abs(v))
        out[i] = v * ((one if v >= 0 else e) / (one + e))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _silu_gradient(dy, x, out):
    one = x.dtype.type(1)
    for i in range(x.size):
        v = x[i]
        e = np.exp(-np.abs(v))
        s = (one if v >= 0 else e) / (one + e)
        out[i] = dy[i] * s * (one + v * (one - s))


@dataclass(frozen=True)
class Sigmoid(Activation):
    kind = "sigmoid"
    cost = (4, 3)
    saves_output = True  # the gradient is y (1 - y)

    def apply(self, xp, x):
        return sigmoid(xp, x)

    def gradient(self, xp, dy, x, y):
        return dy * (1 - y) * y


@dataclass(frozen=True)
class Tanh(Activation):
    kind = "tanh"
    cost = (1, 3)
    saves_output = True  # the gradient is 1 - y^2

    def apply(self, xp, x):
        return xp.tanh(x)

    def gradient(self, xp, dy, x, y):
        return dy * (1 - y * y)


@dataclass(frozen=True)
class Silu(Activation):
    """x * sigmoid(x) (swish)."""

    kind = "silu"
    cost = (5, 8)

    def apply(self, xp, x):
        if _loops(xp, x):
            out = np.empty_like(x)
            _silu(x.reshape(-1), out.reshape(-1))
            return out
        return x * sigmoid(xp, x)

    def gradient(self, xp, dy, x, y):
        if _loops(xp, x, dy):
            out = np.empty_like(x)
            _silu_gradient(dy.reshape(-1), x.reshape(-1), out.reshape(-1))
            return out
        s = sigmoid(xp, x)
        return dy * s * (1 + x * (1 - s))


@dataclass(frozen=True)
class Hardswish(Activation):
    """x * relu6(x + 3) / 6.  Gradient (torch's): 0 for x <= -3, 1 for x >= 3, x / 3 + 1/2 between
    (so 0 at -3 and 1 at 3, the outer pieces' slopes)."""

    kind = "hardswish"
    cost = (5, 5)

    def apply(self, xp, x):
        return x * xp.minimum(xp.maximum(x + 3, 0), 6) / 6

    def gradient(self, xp, dy, x, y):
        return xp.where(x <= -3, 0, xp.where(x >= 3, dy, dy * (x / 3 + 0.5)))


@dataclass(frozen=True)
class Hardsigmoid(Activation):
    """relu6(x + 3) / 6.  Gradient 1/6 strictly between -3 and 3, 0 at and beyond them (torch's)."""

    kind = "hardsigmoid"
    cost = (4, 3)

    def apply(self, xp, x):
        return xp.minimum(xp.maximum(x + 3, 0), 6) / 6

    def gradient(self, xp, dy, x, y):
        return xp.where((x > -3) & (x < 3), dy / 6, 0)


def erf(xp):
    """The error function for arrays of `xp` (scipy's for numpy, cupyx's for cupy), imported when first used."""
    if xp.__name__ == "numpy":
        from scipy.special import erf as numpy_erf

        return numpy_erf
    from cupyx.scipy.special import erf as cupy_erf

    return cupy_erf


@dataclass(frozen=True)
class Gelu(Activation):
    """x * Phi(x) with the normal CDF Phi exact (approximate="none", through erf) or torch's tanh
    approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (approximate="tanh")."""

    approximate: str = "none"

    kind = "gelu"
    cost = (8, 12)

    def __post_init__(self):
        super().__post_init__()
        if self.approximate not in GELU_APPROXIMATIONS:
            raise ShapeError(f"gelu approximate must be one of {', '.join(map(repr, GELU_APPROXIMATIONS))}, "
                             f"got {self.approximate!r}")

    def _tanh_inner(self, xp, x):
        return xp.tanh(_TANH_BETA * (x + _TANH_KAPPA * (x * x * x)))

    def apply(self, xp, x):
        if self.approximate == "tanh":
            return 0.5 * x * (1 + self._tanh_inner(xp, x))
        return x * 0.5 * (1 + erf(xp)(x * _SQRT1_2))

    def gradient(self, xp, dy, x, y):
        if self.approximate == "tanh":
            t = self._tanh_inner(xp, x)
            inner_slope = _TANH_BETA * (1 + 3 * _TANH_KAPPA * (x * x))
            return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * inner_slope)
        cdf = 0.5 * (1 + erf(xp)(x * _SQRT1_2))
        pdf = _NORMAL_PDF * xp.exp(-0.5 * (x * x))
        return dy * (cdf + x * pdf)

    def attrs(self):
        return {"approximate": self.approximate}


@dataclass(frozen=True)
class Identity(Activation):
    kind = "identity"
    cost = (0, 0)

    def apply(self, xp, x):
        # the tile itself when contiguous, as flatten does: nothing reads an op's output to write it
        return xp.ascontiguousarray(x)

    def gradient(self, xp, dy, x, y):
        return dy
