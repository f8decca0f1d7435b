"""Convolution and fully-connected kernels through torch: cuDNN and cuBLAS on GPU tiles.

Same tiles, same results as the array kernels in `ops.conv` and `ops.linear` (the reference they
are tested against): a conv tile arrives with the halo it reads already cut, and the zeros a
border tile needs come from `ops.windows.tile_padding`.

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

from ops import precision

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


def load_torch():
    """Import torch once and bring it in line with this process's precision choice."""
    global _torch
    if _torch is None:
        import torch

        precision.apply_to_torch(torch)
        torch.backends.cudnn.benchmark = True
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


def _conv_geometry(x_shape, weight_shape, pads, stride):
    (pt, pb), (pl, pr) = pads
    kh, kw = weight_shape[2:]
    ph, (eh0, eh1) = split_padding(pt, pb, x_shape[2], kh, stride[0])
    pw, (ew0, ew1) = split_padding(pl, pr, x_shape[3], kw, stride[1])
    return (ph, pw), (ew0, ew1, eh0, eh1)  # torch's pad order: last axis first


def conv2d_forward(x, params, stride, pads, activation=None):
    """Output tile of a convolution; `pads` = ((top, bottom), (left, right)) as `ops.windows.tile_padding`."""
    torch = load_torch()
    padding, explicit = _conv_geometry(x.shape, params["weight"].shape, pads, stride)
    xt = to_tensor(x)
    if any(explicit):
        xt = torch.nn.functional.pad(xt, explicit)
    bias = to_tensor(params["bias"]) if "bias" in params else None
    y = torch.nn.functional.conv2d(xt, to_tensor(params["weight"]), bias, tuple(stride), padding)
    if activation == "relu":
        y = torch.relu_(y)
    return from_tensor(y.contiguous(), x)


def conv2d_backward(dy, x, y, params, stride, pads, activation, need_dx):
    """([input-tile gradient or None], {"weight": ..., "bias": ...}) of a convolution tile."""
    torch = load_torch()
    w = params["weight"]
    padding, explicit = _conv_geometry(x.shape, w.shape, pads, stride)
    dyt = to_tensor(dy)
    if activation == "relu":
        dyt = torch.ops.aten.threshold_backward(dyt, to_tensor(y), 0)
    xt = to_tensor(x)
    if any(explicit):
        xt = torch.nn.functional.pad(xt, explicit)
    has_bias = "bias" in params
    # One call computes every gradient asked for, as autograd does (cuDNN's data and filter kernels).
    dxt, dwt, dbt = torch.ops.aten.convolution_backward(
        dyt, xt, to_tensor(w), [w.shape[0]] if has_bias else None, list(stride), list(padding), [1, 1],
        False, [0, 0], 1, [bool(need_dx), True, has_bias],
    )
    grads = {"weight": from_tensor(dwt.contiguous(), x)}
    if has_bias:
        grads["bias"] = from_tensor(dbt.contiguous(), x)
    if not need_dx:
        return [None], grads
    ew0, ew1, eh0, eh1 = explicit
    if any(explicit):
        dxt = dxt[:, :, eh0 : dxt.shape[2] - eh1, ew0 : dxt.shape[3] - ew1]
    return [from_tensor(dxt.contiguous(), x)], grads


# ---- fully connected -------------------------------------------------------------------------------
def linear_forward(x, params, activation=None):
    torch = load_torch()
    bias = to_tensor(params["bias"]) if "bias" in params else None
    y = torch.nn.functional.linear(to_tensor(x), to_tensor(params["weight"]), bias)
    if activation == "relu":
        y = torch.relu_(y)
    return from_tensor(y.contiguous(), x)


def linear_backward(dy, x, y, params, activation, need_dx):
    torch = load_torch()
    dyt = to_tensor(dy)
    if activation == "relu":
        dyt = torch.ops.aten.threshold_backward(dyt, to_tensor(y), 0)
    grads = {"weight": from_tensor((dyt.T @ to_tensor(x)).contiguous(), x)}
    if "bias" in params:
        grads["bias"] = from_tensor(dyt.sum(dim=0), x)
    dx = from_tensor((dyt @ to_tensor(params["weight"])).contiguous(), x) if need_dx else None
    return [dx], grads
