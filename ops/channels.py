"""Ops along the channel axis: a contiguous channel range, ShuffleNet's channel shuffle, and a learned
per-channel scale (ConvNeXt's layer scale).  Each reads its part's samples and positions (h, w)
only; they differ in which channels.

- channel_slice(start, stop) is `x[:, start:stop]` (`torch.chunk` and `torch.split` along dim 1):
  a part reads its own channels shifted by `start`.
- channel_shuffle(groups) is view(n, g, c/g, h, w) -> transpose(1, 2) -> view(n, c, h, w): output
  channel o comes from input channel (o % g) * (c/g) + o // g.  A part reads the smallest channel
  range holding the sources of its channels: correct, but more than it needs when its channels'
  sources are far apart (output channels 0 and 1 come from 0 and c/g; those between travel too).
- scale(weight) multiplies channel k by weight[k] (weight of shape (c,) or (c, 1, 1), as the
  PyTorch module stores it); a part reads its own Rect and its channels of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect


def _image_or_features(what, in_shapes):
    if len(in_shapes) != 1:
        raise ShapeError(f"{what} takes one input, got {len(in_shapes)}")
    if len(in_shapes[0]) not in (2, 4):
        raise ShapeError(f"{what} needs a rank-4 (n, c, h, w) or rank-2 (n, c) input, got shape "
                         f"{tuple(in_shapes[0])}")


def _is_int(value) -> bool:
    return isinstance(value, (int, numpy.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ChannelSlice(Op):
    start: int
    stop: int

    kind = "channel_slice"

    def __post_init__(self):
        _image_or_features("channel_slice", self.in_shapes)
        channels = self.in_shapes[0][1]
        if not (_is_int(self.start) and _is_int(self.stop) and 0 <= self.start < self.stop <= channels):
            raise ShapeError(f"channel_slice needs ints 0 <= start < stop <= {channels} (the input's channels), "
                             f"got start={self.start!r}, stop={self.stop!r}")

    @property
    def out_shape(self):
        shape = self.in_shapes[0]
        return (shape[0], self.stop - self.start, *shape[2:])

    def input_rects(self, out):
        return [out.replace(1, out.lo[1] + self.start, out.hi[1] + self.start)]

    def flops(self, out):
        return 0

    def backward_flops(self, out):
        return 0

    def _channels(self, x, out):
        """Where the tile's channels lie in `x`: all of it when `x` is the Rect the tile reads, else
        `x` is the whole input (whole-tensor runs, such as the single-device reference, pass it)."""
        if x.shape[1] == out.shape[1]:
            return slice(None)
        return slice(self.start + out.lo[1], self.start + out.hi[1])

    def forward(self, xs, params, out):
        # the tile read is exactly the output tile (as identity, nothing writes into an op's output)
        return array_module(xs[0]).ascontiguousarray(xs[0][:, self._channels(xs[0], out)])

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        if x.shape[1] == out.shape[1]:
            return [dy], {}
        dx = array_module(dy).zeros(x.shape, dtype=dy.dtype)
        dx[:, self._channels(x, out)] = dy
        return [dx], {}

    def attrs(self):
        return {"start": int(self.start), "stop": int(self.stop)}


@dataclass(frozen=True)
class ChannelShuffle(Op):
    groups: int

    kind = "channel_shuffle"

    def __post_init__(self):
        _image_or_features("channel_shuffle", self.in_shapes)
        channels = self.in_shapes[0][1]
        if not _is_int(self.groups) or self.groups < 1 or channels % self.groups:
            raise ShapeError(f"channel_shuffle groups must be an int >= 1 dividing the input's {channels} channels, "
                             f"got {self.groups!r}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    def sources(self, c0: int, c1: int) -> numpy.ndarray:
        """The input channel each output channel c0..c1-1 comes from."""
        o = numpy.arange(c0, c1)
        return (o % self.groups) * (self.in_shapes[0][1] // self.groups) + o // self.groups

    def input_rects(self, out):
        src = self.sources(out.lo[1], out.hi[1])
        if not len(src):
            return [out.replace(1, 0, 0)]
        return [out.replace(1, int(src.min()), int(src.max()) + 1)]

    def flops(self, out):
        return 0

    def backward_flops(self, out):
        return 0

    def _index(self, out, xp):
        """Each output channel's source, relative to the channel range the tile read."""
        return xp.asarray(self.sources(out.lo[1], out.hi[1]) - self.input_rects(out)[0].lo[1])

    def forward(self, xs, params, out):
        xp = array_module(xs[0])
        return xp.take(xs[0], self._index(out, xp), axis=1)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        xp = array_module(dy)
        dx = xp.zeros(xs[0].shape, dtype=dy.dtype)  # channels of the range no output comes from get 0
        dx[:, self._index(out, xp)] = dy
        return [dx], {}

    def attrs(self):
        return {"groups": int(self.groups)}


@dataclass(frozen=True)
class Scale(Op):
    """y = x * weight per channel; weight (c,) or, for (n, c, h, w) inputs, (c, 1, 1)."""

    weight_shape: tuple[int, ...]

    kind = "scale"

    def __post_init__(self):
        _image_or_features("scale", self.in_shapes)
        channels, rank = self.in_shapes[0][1], len(self.in_shapes[0])
        valid = [(channels,), (channels, 1, 1)] if rank == 4 else [(channels,)]
        if not isinstance(self.weight_shape, (tuple, list)) or tuple(self.weight_shape) not in valid:
            raise ShapeError(f"scale weight shape must be {' or '.join(map(str, valid))} for an input of shape "
                             f"{tuple(self.in_shapes[0])}, got {self.weight_shape!r}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    def param_shapes(self):
        return {"weight": tuple(self.weight_shape)}

    def param_rects(self, out):
        rest = tuple(self.weight_shape[1:])
        return {"weight": Rect((out.lo[1], *(0,) * len(rest)), (out.hi[1], *rest))}

    def flops(self, out):
        return out.volume

    def backward_flops(self, out):
        return 3 * out.volume  # dx = dy * w, and the weight's products summed

    def _per_channel(self, w, ndim):
        return w.reshape((1, -1) + (1,) * (ndim - 2))

    def forward(self, xs, params, out):
        x = xs[0]
        return x * self._per_channel(params["weight"], x.ndim)

    def backward(self, dy, xs, y, params, out, need_dx):
        x, w = xs[0], params["weight"]
        axes = (0,) + tuple(range(2, x.ndim))
        dw = (dy * x).sum(axis=axes).reshape(w.shape)
        dx = dy * self._per_channel(w, x.ndim) if need_dx[0] else None
        return [dx], {"weight": dw}

    def attrs(self):
        return {"weight_shape": [int(s) for s in self.weight_shape]}
