"""SGD with momentum and weight decay (PyTorch's formulation), on flat parameter arrays.

    g <- g + weight_decay * w;   v <- momentum * v + g;   w <- w - lr * v

Pure: returns new arrays, so a value other tasks may still read is never changed.
"""

from __future__ import annotations


def sgd_update(w, v, g, lr: float, momentum: float, weight_decay: float):
    if weight_decay:
        g = g + weight_decay * w
    v = momentum * v + g if momentum else g
    return w - lr * v, v
