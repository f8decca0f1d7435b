"""2D max and average pooling (average counts padding, like count_include_pad=True)."""

from __future__ import annotations

from dataclasses import dataclass

from ops.base import Op, array_module
from ops.conv import check_window, window_input_rect
from ops.errors import ShapeError
from ops.windows import crop, out_size, pad, tile_padding, window_offsets


@dataclass(frozen=True)
class Pool2d(Op):
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    mode: str = "max"

    kind = "pool2d"

    def __post_init__(self):
        check_window(f"{self.mode} pool2d", self.in_shapes[0], self.kernel, self.stride, self.padding)
        if self.mode not in ("max", "avg"):
            raise ShapeError(f"pool2d mode must be 'max' or 'avg', got {self.mode!r}")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise ShapeError(f"pool2d padding {self.padding} must be at most half the kernel {self.kernel}")

    @property
    def out_shape(self):
        n, c, h, w = self.in_shapes[0]
        return (
            n,
            c,
            out_size(h, self.kernel[0], self.stride[0], self.padding[0]),
            out_size(w, self.kernel[1], self.stride[1], self.padding[1]),
        )

    def input_rects(self, out):
        channels = (out.lo[1], out.hi[1])
        return [window_input_rect(out, channels, self.kernel, self.stride, self.padding, self.in_shapes[0])]

    def flops(self, out):
        return out.volume * self.kernel[0] * self.kernel[1]

    def _pads(self, out):
        return tile_padding(out, self.kernel, self.stride, self.padding, self.in_shapes[0][2:])

    def _fill(self):
        return -float("inf") if self.mode == "max" else 0.0

    def forward(self, xs, params, out):
        xp = array_module(xs[0])
        xpad = pad(xs[0], self._pads(out), self._fill())
        combine = xp.maximum if self.mode == "max" else xp.add
        y = None
        for index in window_offsets(xpad.shape, self.kernel, self.stride):
            y = xpad[index].copy() if y is None else combine(y, xpad[index], out=y)
        if self.mode == "avg":
            y /= self.kernel[0] * self.kernel[1]
        return xp.ascontiguousarray(y, dtype=xs[0].dtype)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        xp = array_module(x)
        pads = self._pads(out)
        xpad = pad(x, pads, self._fill())
        dx = xp.zeros(xpad.shape, dtype=x.dtype)
        if self.mode == "max":
            if y is None:
                y = self.forward(xs, params, out)
            # The first maximum in window order gets the gradient: a tile sees the same
            # window contents as the whole tensor, so it picks the same element.
            taken = xp.zeros(dy.shape, dtype=bool)
            for index in window_offsets(xpad.shape, self.kernel, self.stride):
                hit = (xpad[index] == y) & ~taken
                dx[index] += xp.where(hit, dy, 0)
                taken |= hit
        else:
            scaled = dy / (self.kernel[0] * self.kernel[1])
            for index in window_offsets(xpad.shape, self.kernel, self.stride):
                dx[index] += scaled
        return [crop(dx, pads)], {}

    def attrs(self):
        return {"kernel": list(self.kernel), "stride": list(self.stride), "padding": list(self.padding),
                "mode": self.mode}
