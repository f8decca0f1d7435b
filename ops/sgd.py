"""SGD with momentum and weight decay (PyTorch's formulation), on flat parameter arrays.

    g <- g + weight_decay * w;   v <- momentum * v + g;   w <- w - lr * v

Pure: returns new arrays, so a value other tasks may still read is never changed.  It allocates
just the two results and works in place on them: fresh memory costs page faults, which for a
large layer cost more than the arithmetic.
"""

from __future__ import annotations

from ops.base import array_module


def sgd_update(w, v, g, lr: float, momentum: float, weight_decay: float):
    xp = array_module(w)
    v_new = xp.multiply(v, momentum) if momentum else xp.zeros_like(g)
    v_new += g
    if weight_decay:
        v_new += weight_decay * w
    w_new = xp.multiply(v_new, -lr)
    w_new += w
    return w_new, v_new
