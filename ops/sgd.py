"""SGD with momentum and weight decay (PyTorch's formulation), on flat parameter arrays.

    g <- g + weight_decay * w;   v <- momentum * v + g;   w <- w - lr * v

Pure: returns new arrays, so a value other tasks may still read is never changed.  Numpy arrays
go through one numba loop that reads w, v, g once and writes the two results (the array
operations take four passes) into reused memory (`ops.reuse`: fresh memory costs a page fault per
page); cupy arrays through one elementwise kernel that does the same in one pass.
"""

from __future__ import annotations

import numba
import numpy

from taskrt.ops import reuse
from taskrt.ops.base import array_module


@numba.njit(cache=True, nogil=True)
def _update(w, v, g, lr, momentum, weight_decay, w_new, v_new):
    for i in range(w.size):  # a zero term is left out, as the array operations leave it out
        step = g[i] + weight_decay * w[i] if weight_decay != 0 else g[i]
        velocity = momentum * v[i] + step if momentum != 0 else step
        v_new[i] = velocity
        w_new[i] = w[i] - lr * velocity


_cupy_kernel = None


def _cupy_update():
    """The update as one cupy kernel (compiled on first use): a zero term is left out, as above."""
    global _cupy_kernel
    if _cupy_kernel is None:
        import cupy

        _cupy_kernel = cupy.ElementwiseKernel(
            "T w, T v, T g, T lr, T momentum, T weight_decay", "T w_new, T v_new",
            """T step = weight_decay != 0 ? g + weight_decay * w : g;
               T velocity = momentum != 0 ? momentum * v + step : step;
               v_new = velocity;
               w_new = w - lr * velocity;""",
            "taskrt_sgd_update")
    return _cupy_kernel


def sgd_update(w, v, g, lr: float, momentum: float, weight_decay: float):
    xp = array_module(w)
    if xp is numpy:
        w_new, v_new = reuse.empty(w.shape, w.dtype), reuse.empty(w.shape, w.dtype)
        scalar = w.dtype.type  # the loop computes in w's precision, as the array operations do
        _update(w.ravel(), v.ravel(), numpy.asarray(g, dtype=w.dtype).ravel(), scalar(lr), scalar(momentum),
                scalar(weight_decay), w_new.reshape(-1), v_new.reshape(-1))
        return w_new, v_new
    if xp.__name__ == "cupy":
        scalar = w.dtype.type
        w_new, v_new = _cupy_update()(w, v, g.astype(w.dtype, copy=False), scalar(lr), scalar(momentum),
                                      scalar(weight_decay))
        return w_new, v_new
    if weight_decay:
        g = g + weight_decay * w
    v_new = xp.multiply(v, momentum) if momentum else xp.zeros_like(g)
    v_new += g
    w_new = xp.multiply(v_new, -lr)
    w_new += w
    return w_new, v_new
