"""Kernels through torch: cuDNN and cuBLAS convolutions and products, and torch's own batch-norm,
pooling, relu and loss kernels, on GPU tiles.

Same tiles, same results as the array kernels in `ops` (the reference they are tested against): a
conv or pool tile arrives with the halo it reads already cut, and the padding a border tile needs
comes from `ops.windows.tile_padding`.  On a GPU the array kernels of batch norm and pooling are
slow: cupy reduces a (64, 192, 35, 35) tile over (n, h, w) in 360 us where torch takes 85 us, and
a max pool's backward takes kh*kw whole-tile passes; each cupy call also costs 10-36 us of Python.

Arrays keep their array module: cupy arrays enter torch through DLPack and come back the same
way (no copy, same memory), numpy arrays through `torch.from_numpy` / `.numpy()`.  torch and cupy
are imported only when a kernel first needs them, so importing `ops` stays light.

Which kernels run (`set_backend`):
- "auto" (default): cupy arrays use torch when torch with CUDA is importable, otherwise cupy's
  im2col kernels; numpy arrays use the numpy reference.
- "torch": every array uses torch (numpy arrays on torch's CPU kernels; used by tests).
- "reference": the array kernels, always (numpy or cupy im2col).

Loading torch here also applies this process's precision (`ops.precision`) and turns on cuDNN's
autotuner (`torch.backends.cudnn.benchmark`): tile shapes repeat every step, so the first step
times cuDNN's algorithms for each shape and later steps use the fastest.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from contextlib import contextmanager

import numpy

from taskrt.ops import precision

BACKENDS = ("auto", "torch", "reference")

_backend = "auto"
_torch = None  # the torch module, once loaded
_torch_cuda: bool | None = None  # is torch with CUDA importable?  (checked once)


def set_backend(backend: str) -> str:
    """Choose which kernels run conv and linear layers (see the module's doc); returns the previous choice."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    if backend == "torch" and importlib.util.find_spec("torch") is None:
        raise ValueError("backend 'torch' needs torch, which is not installed")
    previous, _backend = _backend, backend
    return previous


def get_backend() -> str:
    return _backend


@contextmanager
def backend(name: str):
    """`set_backend(name)` for the duration of a with-block."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


_deterministic = False


def set_deterministic(on: bool = True) -> bool:
    """cuDNN's deterministic algorithms, and not its autotuner (which may pick another algorithm in
    each process): the same inputs then give the same bits run after run, for checks that compare
    two runs (bench gpu's precision check).  For this process (`client.run` it on workers); returns
    the previous choice."""
    global _deterministic
    previous, _deterministic = _deterministic, bool(on)
    if _torch is not None:
        _apply_algorithms(_torch)
    return previous


def _apply_algorithms(torch) -> None:
    torch.backends.cudnn.benchmark = not _deterministic
    torch.backends.cudnn.deterministic = _deterministic


def load_torch():
    """Import torch once and bring it in line with this process's precision and algorithm choices."""
    global _torch
    if _torch is None:
        import torch

        precision.apply_to_torch(torch)
        _apply_algorithms(torch)
        _torch = torch
    return _torch


def torch_cuda_available() -> bool:
    global _torch_cuda
    if _torch_cuda is None:
        _torch_cuda = importlib.util.find_spec("torch") is not None and load_torch().cuda.is_available()
    return _torch_cuda


def use_torch(x) -> bool:
    """Do the torch kernels compute a layer whose input tile is `x`?"""
    if _backend != "auto":
        return _backend == "torch"
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray) and torch_cuda_available()


# ---- array <-> tensor ------------------------------------------------------------------------------
def to_tensor(a):
    """A torch tensor sharing `a`'s memory (numpy: CPU tensor; cupy: CUDA tensor through DLPack)."""
    torch = load_torch()
    if isinstance(a, numpy.ndarray):
        if a.flags.writeable:
            return torch.from_numpy(a)
        with warnings.catch_warnings():  # arrays from other Dask workers may be read-only; kernels only read them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    if not torch.cuda.is_available():
        raise RuntimeError("the torch kernels got a cupy array, but this torch has no CUDA")
    return torch.from_dlpack(a)


def from_tensor(t, like):
    """`t` as an array of the same module as `like`, sharing its memory."""
    if isinstance(like, numpy.ndarray):
        return t.numpy()
    import cupy

    return cupy.from_dlpack(t)


def _compute(*tensors):
    """The tensors in the compute dtype of this process's precision: bfloat16 copies under "bf16" (for
    float32 tensors), else themselves."""
    if precision.get_precision() != "bf16":
        return tensors
    torch = load_torch()
    return tuple(t.to(torch.bfloat16) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def _stored(t, like):
    """A result in the dtype of the tile it belongs to (float32 after bfloat16 compute)."""
    return t if t.dtype == like.dtype else t.to(like.dtype)


# ---- convolution -----------------------------------------------------------------------------------
def split_padding(before: int, after: int, size: int, kernel: int, stride: int) -> tuple[int, tuple[int, int]]:
    """For one spatial axis of a tile: (symmetric padding the convolution adds, (before, after) zeros to add
    explicitly), equivalent to padding the tile by (before, after).

    cuDNN pads both sides alike.  A border tile needs unequal padding; padding the larger side on both
    is still exact when the extra zeros at the end fit no further window (so the output size does not
    change), which saves a copy of the tile.  Otherwise the difference is padded explicitly.
    """
    if size == 0:  # a tile reading only padding: torch convolves no empty input, so all zeros are explicit
        return 0, (before, after)
    out = (size + before + after - kernel) // stride + 1
    if after <= before and (size + 2 * before - kernel) // stride + 1 == out:
        return before, (0, 0)
    common = min(before, after)
    return common, (before - common, after - common)


def _conv_geometry(x_shape, weight_shape, pads, stride, dilation=(1, 1)):
    (pt, pb), (pl, pr) = pads
    kh, kw = weight_shape[2:]  # split_padding needs the window's extent: a dilated kernel's taps span more
    ph, (eh0, eh1) = split_padding(pt, pb, x_shape[2], dilation[0] * (kh - 1) + 1, stride[0])
    pw, (ew0, ew1) = split_padding(pl, pr, x_shape[3], dilation[1] * (kw - 1) + 1, stride[1])
    return (ph, pw), (ew0, ew1, eh0, eh1)  # torch's pad order: last axis first


def conv2d_forward(x, params, stride, pads, activation=None, dilation=(1, 1), groups=1):
    """Output tile of a convolution; `pads` = ((top, bottom), (left, right)) as `ops.windows.tile_padding`;
    `groups` as torch's: the tile's whole groups (`ops.conv.Conv2d` extends a part to them)."""
    torch = load_torch()
    padding, explicit = _conv_geometry(x.shape, params["weight"].shape, pads, stride, dilation)
    xt = to_tensor(x)
    if any(explicit):
        xt = torch.nn.functional.pad(xt, explicit)
    bias = to_tensor(params["bias"]) if "bias" in params else None
    xc, wc, bc = _compute(xt, to_tensor(params["weight"]), bias)
    y = torch.nn.functional.conv2d(xc, wc, bc, tuple(stride), padding, tuple(dilation), groups)
    if activation == "relu":
        y = torch.relu_(y)
    return from_tensor(_stored(y, xt).contiguous(), x)


def conv2d_backward(dy, x, y, params, stride, pads, activation, need_dx, dilation=(1, 1), groups=1):
    """([input-tile gradient or None], {"weight": ..., "bias": ...}) of a convolution tile."""
    torch = load_torch()
    w = params["weight"]
    padding, explicit = _conv_geometry(x.shape, w.shape, pads, stride, dilation)
    dyt = to_tensor(dy)
    if activation == "relu":
        dyt = torch.ops.aten.threshold_backward(dyt, to_tensor(y), 0)
    xt = to_tensor(x)
    if any(explicit):
        xt = torch.nn.functional.pad(xt, explicit)
    has_bias = "bias" in params
    gc, xc, wc = _compute(dyt, xt, to_tensor(w))
    # One call computes every gradient asked for, as autograd does (cuDNN's data and filter kernels).
    dxt, dwt, dbt = torch.ops.aten.convolution_backward(
        gc, xc, wc, [w.shape[0]] if has_bias else None, list(stride), list(padding), list(dilation),
        False, [0, 0], groups, [bool(need_dx), True, has_bias],
    )
    grads = {"weight": from_tensor(_stored(dwt, xt).contiguous(), x)}
    if has_bias:
        grads["bias"] = from_tensor(_stored(dbt, xt).contiguous(), x)
    if not need_dx:
        return [None], grads
    ew0, ew1, eh0, eh1 = explicit
    if any(explicit):
        dxt = dxt[:, :, eh0 : dxt.shape[2] - eh1, ew0 : dxt.shape[3] - ew1]
    return [from_tensor(_stored(dxt, xt).contiguous(), x)], grads


# ---- fully connected -------------------------------------------------------------------------------
def linear_forward(x, params, activation=None):
    torch = load_torch()
    xt = to_tensor(x)
    bias = to_tensor(params["bias"]) if "bias" in params else None
    xc, wc, bc = _compute(xt, to_tensor(params["weight"]), bias)
    y = torch.nn.functional.linear(xc, wc, bc)
    if activation == "relu":
        y = torch.relu_(y)
    return from_tensor(_stored(y, xt).contiguous(), x)


def linear_backward(dy, x, y, params, activation, need_dx):
    torch = load_torch()
    xt, dyt = to_tensor(x), to_tensor(dy)
    if activation == "relu":
        dyt = torch.ops.aten.threshold_backward(dyt, to_tensor(y), 0)
    gc, xc, wc = _compute(dyt, xt, to_tensor(params["weight"]))
    grads = {"weight": from_tensor(_stored(gc.T @ xc, xt).contiguous(), x)}
    if "bias" in params:
        grads["bias"] = from_tensor(dyt.sum(dim=0), x)
    dx = from_tensor(_stored(gc @ wc, xt).contiguous(), x) if need_dx else None
    return [dx], grads


# ---- batch norm (the pieces of `ops.batchnorm`) ------------------------------------------------------
# On CUDA tensors the statistics' fused kernels of torch's SyncBatchNorm do each piece in one pass;
# elsewhere (torch on CPU, in tests) the same formulas in plain torch operations.
def _reduce_dims(t) -> tuple:
    return (0,) if t.dim() == 2 else (0, 2, 3)


def _per_channel(v, ndim):
    return v.view(1, -1) if ndim == 2 else v.view(1, -1, 1, 1)


def _mean_invstd(stats, eps):
    s = to_tensor(stats)
    return s[1], load_torch().rsqrt(s[2] / s[0] + eps)


def bn_partial_stats(x):
    """(count, mean, M2) per channel of one tile, a (3, C) array (`ops.batchnorm.partial_stats`)."""
    torch = load_torch()
    t = to_tensor(x)
    var, mean = torch.var_mean(t, dim=_reduce_dims(t), correction=0)
    count = t.numel() // t.shape[1]
    return from_tensor(torch.stack([torch.full_like(mean, count), mean, var * count]), x)


def bn_normalize(x, stats, weight, bias, eps):
    torch = load_torch()
    t, w, b = to_tensor(x), to_tensor(weight), to_tensor(bias)
    mean, invstd = _mean_invstd(stats, eps)
    if t.is_cuda:
        return from_tensor(torch.batch_norm_elemt(t.contiguous(), w, b, mean, invstd, eps), x)
    nd = t.dim()
    return from_tensor(torch.addcmul(_per_channel(b, nd), t - _per_channel(mean, nd), _per_channel(w * invstd, nd)), x)


def bn_grad_sums(dy, x, stats, eps) -> dict:
    """{"bias": sum dy, "weight": sum dy * xhat} per channel of one tile."""
    torch = load_torch()
    t, g = to_tensor(x), to_tensor(dy)
    mean, invstd = _mean_invstd(stats, eps)
    if t.is_cuda:
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(g.contiguous(), t.contiguous(), mean, invstd,
                                                                    None, True, False, False)
    else:
        dims = _reduce_dims(t)
        sum_dy, sum_dy_xmu = g.sum(dim=dims), (g * (t - _per_channel(mean, t.dim()))).sum(dim=dims)
    return {"bias": from_tensor(sum_dy, x), "weight": from_tensor(sum_dy_xmu * invstd, x)}


def bn_input_grad(dy, x, stats, sums, weight, eps):
    """dx = weight * invstd / N * (N dy - sum dy - xhat sum(dy xhat)), the sums over the whole group."""
    torch = load_torch()
    t, g, w = to_tensor(x), to_tensor(dy), to_tensor(weight)
    mean, invstd = _mean_invstd(stats, eps)
    sum_dy, sum_dy_xhat = to_tensor(sums["bias"]), to_tensor(sums["weight"])
    count = to_tensor(stats)[0]
    if t.is_cuda:  # the group's count as the kernel takes it: one int32 per contributor
        return from_tensor(torch.batch_norm_backward_elemt(g.contiguous(), t.contiguous(), mean, invstd, w, sum_dy,
                                                           sum_dy_xhat / invstd, count[:1].to(torch.int32)), x)
    nd = t.dim()
    xhat = (t - _per_channel(mean, nd)) * _per_channel(invstd, nd)
    scale = _per_channel(w * invstd / count, nd)
    return from_tensor(scale * (g * _per_channel(count, nd) - _per_channel(sum_dy, nd)
                                - xhat * _per_channel(sum_dy_xhat, nd)), x)


# ---- relu ------------------------------------------------------------------------------------------
def relu_forward(x):
    return from_tensor(load_torch().relu(to_tensor(x)), x)


def relu_backward(dy, x):
    return from_tensor(load_torch().ops.aten.threshold_backward(to_tensor(dy), to_tensor(x), 0), x)


# ---- pooling (`ops.pool`: max, or average counting padding) -------------------------------------------
def _pool_input(x, kernel, pads, mode):
    """(tensor, symmetric padding torch adds, explicit (top, left) padding to crop from its gradient)."""
    (pt, pb), (pl, pr) = pads
    t = to_tensor(x)
    if pt == pb and pl == pr and 2 * pt <= kernel[0] and 2 * pl <= kernel[1]:
        return t, (pt, pl), None
    fill = -float("inf") if mode == "max" else 0.0
    return load_torch().nn.functional.pad(t, (pl, pr, pt, pb), value=fill), (0, 0), (pt, pl)


def pool_forward(x, kernel, stride, pads, mode):
    F = load_torch().nn.functional
    t, padding, _ = _pool_input(x, kernel, pads, mode)
    if mode == "max":
        y = F.max_pool2d(t, kernel, stride, padding)
    else:
        y = F.avg_pool2d(t, kernel, stride, padding, count_include_pad=True)
    return from_tensor(y.contiguous(), x)


def pool_backward(dy, x, kernel, stride, pads, mode):
    """Input-tile gradient; a max pool's goes to the first maximum of each window in window order,
    as the array kernels (torch keeps the first maximum it meets)."""
    aten = load_torch().ops.aten
    t, padding, explicit = _pool_input(x, kernel, pads, mode)
    g = to_tensor(dy)
    if mode == "max":
        _, indices = aten.max_pool2d_with_indices(t, list(kernel), list(stride), list(padding))
        dx = aten.max_pool2d_with_indices_backward(g, t, list(kernel), list(stride), list(padding), [1, 1], False,
                                                   indices)
    else:
        dx = aten.avg_pool2d_backward(g, t, list(kernel), list(stride), list(padding), False, True, None)
    if explicit is not None:
        top, left = explicit
        dx = dx[:, :, top : top + x.shape[2], left : left + x.shape[3]]
    return from_tensor(dx.contiguous(), x)


# ---- softmax cross-entropy ---------------------------------------------------------------------------
def cross_entropy_forward(logits, labels):
    """Per-sample losses."""
    torch = load_torch()
    logp = torch.log_softmax(to_tensor(logits), dim=1)
    return from_tensor(-logp.gather(1, to_tensor(labels).view(-1, 1)).view(-1), logits)


def cross_entropy_backward(dy, logits, labels):
    """d logits = (softmax - one-hot) * dy per sample."""
    torch = load_torch()
    z, y = to_tensor(logits), to_tensor(labels).view(-1, 1)
    grad = torch.softmax(z, dim=1)
    grad.scatter_add_(1, y, torch.full(y.shape, -1.0, dtype=grad.dtype, device=grad.device))
    grad *= to_tensor(dy).view(-1, 1)
    return from_tensor(grad, logits)
