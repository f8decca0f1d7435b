"""Optimizers: the update rules of `torch.optim`'s SGD (momentum, Nesterov), Adam and AdamW, on
flat parameter arrays, with their per-parameter state ("slots") beside each shard.

    tr.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    tr.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tr.optim.AdamW(lr=1e-3, weight_decay=0.05, no_decay=("bias", "norm"))

An optimizer is a value: what the update does.  The trainer turns it into each step's
hyper-parameters (`hyper`: the learning rate of the step, Adam's step count for its bias
correction, the parameters left out of weight decay), which every update task reads; the state a
shard's chunk carries is `(weights, *slots)`, in the order of `slots` (PyTorch's state names).

`update` applies a rule to one chunk: numpy arrays through one numba loop per rule that reads
each array once and writes the new ones into reused memory (`ops.reuse`), cupy arrays through one
elementwise kernel per rule (per run of parameters with the same weight decay).  Pure: returns
new arrays, so a value other tasks may still read is never changed.  `scale` multiplies the
gradient first (gradient clipping's coefficient, the mean over accumulated micro-batches).

Equations, as `torch.optim` (for-loop implementations) computes them, g the gradient:
- SGD: g += wd * w; b = momentum * b + g; d = g + momentum * b if nesterov else b; w -= lr * d
  (without momentum, d = g; the slot then holds g).
- Adam: g += wd * w; m += (1 - b1) * (g - m); v = b2 * v + (1 - b2) * g * g;
  w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
- AdamW: w *= 1 - lr * wd, then Adam without the g += wd * w.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, asdict, dataclass
from typing import ClassVar

import numba
import numpy
import numpy as np

from taskrt.ops import reuse
from taskrt.ops.base import array_module

NO_DECAY_TOKENS = {"bias": "every parameter named 'bias'",
                   "norm": "every parameter of a normalization layer (batch_norm, layer_norm)"}
NORM_KINDS = ("batch_norm", "layer_norm")


class OptimizerError(ValueError):
    """An optimizer setting that is not valid, named with what would be."""


def _number(owner, what, value, low=0.0, low_open=False, high=None, high_open=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptimizerError(f"{owner}: {what} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and (value > high or (
            high_open and value == high))):
        interval = f"{'(' if low_open else '['}{low:g}, {'inf' if high is None else f'{high:g}'}" + (
            ")" if high is None or high_open else "]")
        raise OptimizerError(f"{owner}: {what} must lie in {interval}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Optimizer:
    """What every update rule shares: a learning rate (the one positional argument, as in
    `torch.optim`; the rest by keyword), weight decay and the parameters left out of it
    (`no_decay`: tokens of NO_DECAY_TOKENS, or a function (layer, parameter name) -> True for a
    parameter to leave out, `layer` being the graph's Layer).  None: the rule's default."""

    lr: float | None = None
    _: KW_ONLY
    weight_decay: float | None = None
    no_decay: tuple | object = ()

    kind: ClassVar[str] = "optimizer"
    slots: ClassVar[tuple[str, ...]] = ()
    default_lr: ClassVar[float] = 0.01
    default_weight_decay: ClassVar[float] = 0.0
    counts_steps: ClassVar[bool] = False  # does the rule read the update's number (Adam's bias correction)?

    def __post_init__(self):
        name = type(self).__name__
        lr = self.default_lr if self.lr is None else self.lr
        decay = self.default_weight_decay if self.weight_decay is None else self.weight_decay
        object.__setattr__(self, "lr", _number(name, "lr", lr, low_open=True))
        object.__setattr__(self, "weight_decay", _number(name, "weight_decay", decay))
        if not callable(self.no_decay):
            tokens = (self.no_decay,) if isinstance(self.no_decay, str) else tuple(self.no_decay)
            unknown = [t for t in tokens if t not in NO_DECAY_TOKENS]
            if unknown:
                raise OptimizerError(f"{name}: no_decay {unknown!r} unknown; give any of "
                                     + ", ".join(f"{k!r} ({v})" for k, v in NO_DECAY_TOKENS.items())
                                     + ", or a function (layer, parameter name) -> True to leave one out")
            object.__setattr__(self, "no_decay", tokens)

    # ---- per step ---------------------------------------------------------------------------
    def hyper(self, lr: float | None = None, step: int = 1, no_decay=frozenset()) -> dict:
        """The hyper-parameters update tasks read: this optimizer's at learning rate `lr` (None:
        its own), for update number `step` (from 1), `no_decay` (layer, name) pairs left out."""
        rule = {k: v for k, v in asdict(self).items() if k not in ("no_decay", "_")}
        # only a rule that reads the step count gets it: values that change every step make a GPU
        # worker capture its CUDA graph again (`taskrt.gpu.cuda_graphs`)
        counted = {"step": int(step)} if self.counts_steps else {}
        return {**rule, "rule": self.kind, "lr": float(self.lr if lr is None else lr), **counted,
                "no_decay": frozenset(no_decay)}

    def left_out(self, graph) -> frozenset:
        """(layer, parameter name) of every parameter of `graph` left out of weight decay."""
        out = set()
        for layer in graph:
            for name in layer.param_shapes or {}:
                if callable(self.no_decay):
                    if self.no_decay(layer, name):
                        out.add((layer.name, name))
                elif ("bias" in self.no_decay and name == "bias") or (
                        "norm" in self.no_decay and layer.kind in NORM_KINDS):
                    out.add((layer.name, name))
        return frozenset(out)

    # ---- description ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready (checkpoints); a function given as no_decay is kept as the pairs it chose."""
        out = {"kind": self.kind, **{k: v for k, v in asdict(self).items() if k != "_"}}
        out["no_decay"] = None if callable(self.no_decay) else list(self.no_decay)
        if "betas" in out:
            out["betas"] = list(out["betas"])
        return out

    @staticmethod
    def from_dict(data: dict, no_decay=None) -> Optimizer:
        data = dict(data)
        kind = data.pop("kind")
        if data.get("no_decay") is None:
            data["no_decay"] = no_decay if no_decay is not None else ()
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        return OPTIMIZERS[kind](**data)

    def update(self, hyper: dict, w, slots: tuple, g, segments=None, scale: float = 1.0) -> tuple:
        """(new weights, *new slots) of one chunk; `segments`: ((start, weight decay), ...) runs of
        elements with their own weight decay (None: `hyper["weight_decay"]` for all)."""
        return RULES[hyper["rule"]](hyper, w, slots, g, segments, scale)


@dataclass(frozen=True, kw_only=True)
class SGD(Optimizer):
    """`torch.optim.SGD` (dampening 0)."""

    momentum: float = 0.0
    nesterov: bool = False

    kind: ClassVar[str] = "sgd"
    slots: ClassVar[tuple[str, ...]] = ("momentum_buffer",)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "momentum", _number("SGD", "momentum", self.momentum))
        if not isinstance(self.nesterov, bool):
            raise OptimizerError(f"SGD: nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0:
            raise OptimizerError("SGD: nesterov=True needs a momentum above 0 (as torch.optim.SGD)")


@dataclass(frozen=True, kw_only=True)
class Adam(Optimizer):
    """`torch.optim.Adam` (bias-corrected moments; weight decay added to the gradient)."""

    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    kind: ClassVar[str] = "adam"
    slots: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    default_lr: ClassVar[float] = 1e-3
    counts_steps: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise OptimizerError(f"{name}: betas must be a pair like (0.9, 0.999), got {self.betas!r}")
        betas = tuple(_number(name, f"betas[{i}]", b, high=1.0) for i, b in enumerate(self.betas))
        object.__setattr__(self, "betas", betas)
        object.__setattr__(self, "eps", _number(name, "eps", self.eps, low_open=True))


@dataclass(frozen=True, kw_only=True)
class AdamW(Adam):
    """`torch.optim.AdamW`: weight decay applied to the weights, apart from the moments."""

    kind: ClassVar[str] = "adamw"
    default_weight_decay: ClassVar[float] = 1e-2


OPTIMIZERS = {cls.kind: cls for cls in (SGD, Adam, AdamW)}


def optimizer_of(optimizer=None, lr=None, momentum=None, weight_decay=None) -> Optimizer:
    """The optimizer a trainer was given: `optimizer`, or SGD from the `lr`, `momentum` and
    `weight_decay` shorthand (defaults 0.01, 0, 0); both at once is an error."""
    shorthand = {k: v for k, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay))
                 if v is not None}
    if optimizer is None:
        return SGD(**{"lr": 0.01, **shorthand})
    if not isinstance(optimizer, Optimizer):
        raise OptimizerError(f"optimizer must be one of taskrt.optim.SGD, Adam or AdamW, got {optimizer!r}")
    if shorthand:
        raise OptimizerError(f"give either optimizer= or the SGD shorthand {sorted(shorthand)}, not both: "
                             f"{type(optimizer).__name__} has its own lr and weight_decay")
    return optimizer


def check_clip(max_norm):
    """`clip_grad_norm`: None, or a positive finite number."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
        raise OptimizerError(f"clip_grad_norm must be None or a positive number (the gradients' largest global norm), "
                         f"got {max_norm!r}")
    return float(max_norm)


# ---- the rules --------------------------------------------------------------------------------
def _segments(hyper, segments, dtype):
    """(starts, weight decays in `dtype`) as arrays: one run over everything when `segments` is None."""
    if segments is None:
        return numpy.zeros(1, dtype=numpy.int64), numpy.array([hyper["weight_decay"]], dtype=dtype)
    starts = numpy.array([s for s, _ in segments], dtype=numpy.int64)
    return starts, numpy.array([wd for _, wd in segments], dtype=dtype)


# The loops are branch-free inside and run over views from 0 (a branch per element, or an index
# numba cannot prove non-negative, which it then checks for wrapping around, keeps LLVM from
# vectorizing them: 4x slower for SGD, 5x for Adam, measured on 34M float32 parameters), and numba's
# "numpy" error model drops the zero-division check Python's model puts in every division.  A term
# that is zero adds an exact zero (g * 1 + 0 * w == g for finite w), so results are those of the
# formulas with the zero terms left out, as torch computes them.
@numba.njit(cache=True, nogil=True, error_model="numpy")
def _sgd_run(w, b, g, scale, lr, momentum, nesterov, wd, w_new, b_new):
    if momentum == 0:
        for i in range(w.size):
            step = g[i] * scale + wd * w[i]
            b_new[i] = step
            w_new[i] = w[i] - lr * step
    elif nesterov:
        for i in range(w.size):
            step = g[i] * scale + wd * w[i]
            buf = momentum * b[i] + step
            b_new[i] = buf
            w_new[i] = w[i] - lr * (step + momentum * buf)
    else:
        for i in range(w.size):
            step = g[i] * scale + wd * w[i]
            buf = momentum * b[i] + step
            b_new[i] = buf
            w_new[i] = w[i] - lr * buf


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _sgd(w, b, g, scale, lr, momentum, nesterov, starts, decays, w_new, b_new):
    runs = starts.size
    for r in range(runs):
        lo, hi = starts[r], starts[r + 1] if r + 1 < runs else w.size
        _sgd_run(w[lo:hi], b[lo:hi], g[lo:hi], scale, lr, momentum, nesterov, decays[r], w_new[lo:hi], b_new[lo:hi])


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _adam_run(w, m, v, g, scale, factor, coupled, beta1, beta2, eps, step_size, bc2_sqrt, w_new, m_new, v_new):
    one = w.dtype.type(1)
    for i in range(w.size):
        grad = g[i] * scale + coupled * w[i]
        weight = w[i] * factor
        avg = m[i] + (one - beta1) * (grad - m[i])
        avg_sq = v[i] * beta2 + (one - beta2) * grad * grad
        m_new[i] = avg
        v_new[i] = avg_sq
        w_new[i] = weight - step_size * (avg / (np.sqrt(avg_sq) / bc2_sqrt + eps))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _adam(w, m, v, g, scale, lr, beta1, beta2, eps, step_size, bc2_sqrt, decoupled, starts, decays,
          w_new, m_new, v_new):
    runs = starts.size
    one = w.dtype.type(1)
    for r in range(runs):
        lo, hi = starts[r], starts[r + 1] if r + 1 < runs else w.size
        wd = decays[r]
        # AdamW decays the weights apart from the moments; Adam adds the decay to the gradient
        factor, coupled = (one - lr * wd, wd * 0) if decoupled else (one, wd)
        _adam_run(w[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], scale, factor, coupled, beta1, beta2, eps, step_size,
                  bc2_sqrt, w_new[lo:hi], m_new[lo:hi], v_new[lo:hi])


def _sgd_update(hyper, w, slots, g, segments, scale):
    (b,) = slots
    xp = array_module(w)
    if xp is numpy:
        starts, decays = _segments(hyper, segments, w.dtype)
        w_new, b_new = reuse.empty(w.shape, w.dtype), reuse.empty(w.shape, w.dtype)
        t = w.dtype.type  # the loop computes in w's precision, as torch does
        _sgd(w.ravel(), b.ravel(), numpy.asarray(g, dtype=w.dtype).ravel(), t(scale), t(hyper["lr"]),
             t(hyper["momentum"]), bool(hyper["nesterov"]), starts, decays, w_new.reshape(-1), b_new.reshape(-1))
        return w_new, b_new
    return _on_device("sgd", hyper, w, (b,), g, segments, scale)


def _adam_update(hyper, w, slots, g, segments, scale):
    m, v = slots
    beta1, beta2 = hyper["betas"]
    t = hyper["step"]
    step_size = hyper["lr"] / (1 - beta1 ** t)
    bc2_sqrt = math.sqrt(1 - beta2 ** t)
    xp = array_module(w)
    if xp is numpy:
        starts, decays = _segments(hyper, segments, w.dtype)
        w_new, m_new, v_new = (reuse.empty(w.shape, w.dtype) for _ in range(3))
        d = w.dtype.type
        _adam(w.ravel(), m.ravel(), v.ravel(), numpy.asarray(g, dtype=w.dtype).ravel(), d(scale), d(hyper["lr"]),
              d(beta1), d(beta2), d(hyper["eps"]), d(step_size), d(bc2_sqrt), hyper["rule"] == "adamw", starts,
              decays, w_new.reshape(-1), m_new.reshape(-1), v_new.reshape(-1))
        return w_new, m_new, v_new
    return _on_device("adam", hyper, w, (m, v), g, segments, scale, step_size=step_size, bc2_sqrt=bc2_sqrt)


RULES = {"sgd": _sgd_update, "adam": _adam_update, "adamw": _adam_update}


# ---- GPU workers: one fused elementwise kernel per run of equal weight decay ---------------------
_KERNELS = {}

_KERNEL_SOURCE = {
    "sgd": ("T w, T b, T g, T scale, T lr, T momentum, bool nesterov, T wd", "T w_new, T b_new",
            """T step = scale != 1 ? g * scale : g;
               if (wd != 0) step = step + wd * w;
               if (momentum != 0) {
                   T buf = momentum * b + step;
                   b_new = buf;
                   step = nesterov ? step + momentum * buf : buf;
               } else {
                   b_new = step;
               }
               w_new = w - lr * step;"""),
    "adam": ("T w, T m, T v, T g, T scale, T lr, T beta1, T beta2, T eps, T step_size, T bc2_sqrt, "
             "bool decoupled, T wd", "T w_new, T m_new, T v_new",
             """T grad = scale != 1 ? g * scale : g;
                T weight = w;
                if (wd != 0) {
                    if (decoupled) weight = weight * (1 - lr * wd);
                    else grad = grad + wd * weight;
                }
                T avg = m + (1 - beta1) * (grad - m);
                T avg_sq = v * beta2 + (1 - beta2) * grad * grad;
                m_new = avg;
                v_new = avg_sq;
                w_new = weight - step_size * (avg / (sqrt(avg_sq) / bc2_sqrt + eps));"""),
}


def _kernel(rule):
    if rule not in _KERNELS:
        import cupy

        params, outs, body = _KERNEL_SOURCE[rule]
        _KERNELS[rule] = cupy.ElementwiseKernel(params, outs, body, f"taskrt_{rule}_update")
    return _KERNELS[rule]


def _on_device(rule, hyper, w, slots, g, segments, scale, **extra):
    """The update as cupy kernels: the outputs allocated once, each run of equal weight decay one launch."""
    xp = array_module(w)
    d = w.dtype.type
    g = g.astype(w.dtype, copy=False)
    outs = [xp.empty_like(w) for _ in range(1 + len(slots))]
    bounds = [(0, w.size, hyper["weight_decay"])] if segments is None else [
        (start, segments[i + 1][0] if i + 1 < len(segments) else w.size, wd) for i, (start, wd) in enumerate(segments)]
    for lo, hi, wd in bounds:
        cut = slice(lo, hi)
        if rule == "sgd":
            args = (d(scale), d(hyper["lr"]), d(hyper["momentum"]), bool(hyper["nesterov"]), d(wd))
        else:
            beta1, beta2 = hyper["betas"]
            args = (d(scale), d(hyper["lr"]), d(beta1), d(beta2), d(hyper["eps"]), d(extra["step_size"]),
                    d(extra["bc2_sqrt"]), hyper["rule"] == "adamw", d(wd))
        _kernel(rule)(w[cut], *(s[cut] for s in slots), g[cut], *args, *(o[cut] for o in outs))
    return tuple(outs)


def as_hyper(hyper: dict) -> dict:
    """Hyper-parameters as update tasks read them; a plain {"lr", "momentum", "weight_decay"} (a
    plan run by hand) is SGD's."""
    if "rule" in hyper:
        return hyper
    return {"rule": "sgd", "lr": hyper["lr"], "momentum": hyper.get("momentum", 0.0), "nesterov": False,
            "weight_decay": hyper.get("weight_decay", 0.0), "no_decay": frozenset(), **hyper}


def update(hyper: dict, w, slots: tuple, g, segments=None, scale: float = 1.0) -> tuple:
    """Apply the rule `hyper` names to one chunk (see `Optimizer.update`)."""
    return RULES[hyper["rule"]](hyper, w, slots, g, segments, scale)
