"""The kernels' scratch (taskrt.ops.scratch): a convolution's estimate against the bytes its numpy
kernels really allocate (tracemalloc sees numpy's arrays), on each path they take; the peak's
`scratch` field from a lowered plan; and a check that refuses a plan whose held peak fits its
device but whose held peak with the scratch on top does not."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

import taskrt as tr
from taskrt import Graph
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.ops import grouped_conv, scratch
from taskrt.planning.lowering import lower
from taskrt.planning.peak import PeakMemory, peak_memory
from taskrt.training.memory import MemoryUse, check_fits, summary

MIB = 2**20
SMALL = 64 << 10  # Python's own small objects and the buffers the estimate leaves out (bias, vectors)

# (x shape, weight shape, stride, padding): Winograd, planes, channels-last im2col, gathering backward
PATHS = {"winograd": ((8, 64, 16, 16), (64, 64, 3, 3), (1, 1), 1),
         "planes": ((16, 3, 32, 32), (32, 3, 3, 3), (1, 1), 1),
         "channels-last, strided": ((8, 32, 16, 16), (64, 32, 3, 3), (2, 2), 1),
         "gathering, more in than out": ((16, 64, 8, 8), (16, 64, 5, 5), (1, 1), 2)}


def _peak_of(call, repeats=3):
    """(peak bytes over what was allocated before, result) of `call()`: the least of a few calls, as
    tracemalloc also counts what other threads of the process allocate meanwhile (a Dask client's,
    left by an earlier test), which only adds."""
    peaks = []
    for _ in range(repeats):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            out = call()
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    return min(peaks), out


@pytest.mark.parametrize("path", PATHS)
def test_a_convolutions_scratch_is_what_its_kernels_allocate(path):
    x_shape, w_shape, stride, pad = PATHS[path]
    pads = ((pad, pad), (pad, pad))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    y = grouped_conv.conv2d(x, w, None, stride, pads, True)  # the numba loops loaded: their code is not scratch
    dy = rng.standard_normal(y.shape)

    def backward():
        d = dy * (y > 0)
        dw, db = grouped_conv.weight_grad(d, x, w_shape[2:], stride, pads)
        return d, dw, db, grouped_conv.data_grad(d, w, x_shape, stride, pads)

    backward()
    forward_peak, y = _peak_of(lambda: grouped_conv.conv2d(x, w, None, stride, pads, True))
    backward_peak, (_, dw, db, dx) = _peak_of(backward)
    forward = scratch.conv_forward(x_shape, w_shape, stride, pads, itemsize=8)
    back = scratch.conv_backward(x_shape, w_shape, stride, pads, itemsize=8, relu=True)
    # the peak holds the scratch and at most the results made by then
    assert forward_peak - y.nbytes - SMALL <= forward <= forward_peak
    assert backward_peak - dx.nbytes - dw.nbytes - db.nbytes - SMALL <= back <= backward_peak
    assert forward > 0.5 * MIB


def conv_net(batch=16):
    g = Graph("convs")
    x = g.input("x", shape=(batch, 16, 16, 16))
    y = g.conv2d(x, 64, 3, padding=1, activation="relu", name="c1")
    y = g.conv2d(y, 64, 3, padding=1, activation="relu", name="c2")
    g.softmax_cross_entropy(g.linear(g.flatten(y, name="flat"), 10, name="fc"), name="loss")
    return g


def test_a_peaks_scratch_is_its_largest_convolutions_on_top_of_what_is_held():
    g = conv_net()
    [peak] = peak_memory(lower(g, Strategy({n: P() for n in ("c1", "c2", "flat", "fc", "loss")})), itemsize=4).values()
    assert peak.scratch > 0 and peak.scratch_at is not None and peak.scratch_at[0].startswith(("c1", "c2"))
    assert peak.needed == peak.total + peak.scratch
    # at least the largest convolution's own scratch is more than the held peak's slack
    c2 = scratch.conv_backward((16, 64, 16, 16), (64, 64, 3, 3), (1, 1), ((1, 1), (1, 1)), itemsize=4, relu=True)
    assert peak.scratch <= c2 + peak.total
    assert "scratch" in summary({0: MemoryUse(predicted=peak)})


def test_a_plan_whose_held_peak_fits_but_not_with_its_scratch_is_refused():
    peak = PeakMemory(activations=300 * MIB, scratch=120 * MIB, scratch_at=("c2-bwd", 0, 0))
    machine = SimpleNamespace(devices=[SimpleNamespace(memory=400 * MIB)])
    assert peak.total < 400 * MIB < peak.needed
    with pytest.raises(tr.DeviceMemoryError) as error:
        check_fits({0: peak}, machine, [0], "convs", "data parallel")
    text = str(error.value)
    assert ("device 0: predicted peak 300.0 MiB held + 120.0 MiB of kernels' scratch (while task "
            "('c2-bwd', 0, 0) runs) = 420.0 MiB against its memory 400.0 MiB") in text
    check_fits({0: PeakMemory(activations=300 * MIB, scratch=100 * MIB)}, machine, [0], "convs", "")  # fits: 400
