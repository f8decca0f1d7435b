"""Roofline estimates of parts on devices that are not here (Machine.simulated): the larger of
FLOPs over the device kind's peak and bytes over its memory bandwidth, from its data sheet."""

from __future__ import annotations

import numba
import numpy as np

from taskrt.ops.rect import Rect
from taskrt.search.layer_space import channel_params


def roofline_parts(op, shapes, peak, bandwidth, itemsize, per_channel=None,
                   device=None) -> tuple[np.ndarray, np.ndarray]:
    """Roofline estimates (forward, backward) for many parts of one op at once:
    max(FLOPs / peak, bytes / memory bandwidth) from the device kind's data sheet.

    `shapes`: the parts' output tile shapes, then each input's tile shapes (rows); `peak` and
    `bandwidth`: of each part's device kind, or of each device when `device` gives each part's;
    `per_channel`: `channel_params(op)`, if known.  FLOPs and parameter volumes of every op grow
    linearly with the output tile (parameters with its channel extent), so one unit tile gives
    the rates."""
    out = np.asarray(shapes[0], dtype=np.int64)
    unit = Rect((0,) * out.shape[1], (1,) * out.shape[1])
    inputs = tuple(np.asarray(s, dtype=np.int64) for s in shapes[1:]) or (np.zeros((len(out), 1), dtype=np.int64),)
    if device is None:  # a peak and bandwidth per part
        device = np.arange(len(out))
        peak, bandwidth = np.broadcast_to(peak, len(out)), np.broadcast_to(bandwidth, len(out))
    return _roofline(out, inputs, channel_params(op) if per_channel is None else per_channel, itemsize,
                     float(op.flops(unit)), float(op.backward_flops(unit)), np.asarray(peak, dtype=np.float64),
                     np.asarray(bandwidth, dtype=np.float64), np.asarray(device, dtype=np.int64))


@numba.njit(cache=True, nogil=True)
def _roofline(out, inputs, per_channel, itemsize, flops, backward_flops, peak, bandwidth, device):
    """Per part: the volume of its output tile and of its input tiles (elements), the parameters
    of its channels, and the larger of compute and memory time each way (roofline_parts)."""
    parts, rank = out.shape
    forward, backward = np.empty(parts), np.empty(parts)
    read = np.zeros(parts)
    for shape in inputs:
        for p in range(parts):
            v = 1
            for e in range(shape.shape[1]):
                v *= shape[p, e]
            read[p] += v
    for p in range(parts):
        v = 1
        for e in range(rank):
            v *= out[p, e]
        volume = float(v)
        params = per_channel * out[p, 1] if rank > 1 else per_channel
        moved = (read[p] + volume + params) * itemsize
        d = device[p]
        forward[p] = max(flops * volume / peak[d], moved / bandwidth[d])
        backward[p] = max(backward_flops * volume / peak[d], 2 * moved / bandwidth[d])
    return forward, backward
