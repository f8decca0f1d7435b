"""Max-pool backward on numpy NCHW tiles: one numba pass over the windows.

The whole-tile form (`ops.pool`, any array module) makes kh*kw passes over the tile, each with
comparison, mask and scatter temporaries; here each window is read once and its gradient goes to
one element.  Both give the gradient to the first element, in window order, equal to the window's
maximum y, padding included (a padding element is -inf and its gradient is dropped).
"""

from __future__ import annotations

import numba
import numpy


@numba.njit(cache=True, nogil=True)
def max_pool_grad(x, y, dy, dx, kh, kw, sh, sw, pt, pl):
    """dx (N, C, H, W), zeroed, += dy (N, C, Ho, Wo) at the first maximum of each window of x."""
    n_, c_, height, width = x.shape
    _, _, ho, wo = y.shape
    for n in range(n_):
        for c in range(c_):
            xs, ys, ds, dxs = x[n, c], y[n, c], dy[n, c], dx[n, c]
            for oh in range(ho):
                for ow in range(wo):
                    target = ys[oh, ow]
                    found = False
                    for i in range(kh):
                        h = oh * sh + i - pt
                        for j in range(kw):
                            w = ow * sw + j - pl
                            inside = 0 <= h < height and 0 <= w < width
                            value = xs[h, w] if inside else -numpy.inf
                            if value == target:
                                if inside:
                                    dxs[h, w] += ds[oh, ow]
                                found = True
                                break
                        if found:
                            break
