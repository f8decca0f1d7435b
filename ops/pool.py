"""2D max and average pooling (average counts padding, like count_include_pad=True)."""

from __future__ import annotations

from dataclasses import dataclass

from ops.base import Op, array_module
from ops.conv import check_window, window_input_rect
from ops.errors import ShapeError
from ops.windows import col2im, crop, out_size, pad, tile_padding, windows


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
        win = windows(pad(xs[0], self._pads(out), self._fill()), self.kernel, self.stride)
        if self.mode == "max":
            y = win.max(axis=(4, 5))
        else:
            y = win.sum(axis=(4, 5)) / (self.kernel[0] * self.kernel[1])
        return xp.ascontiguousarray(y, dtype=xs[0].dtype)

    def backward(self, dy, xs, y, params, out, need_dx):
        if not need_dx[0]:
            return [None], {}
        x = xs[0]
        xp = array_module(x)
        pads = self._pads(out)
        xpad = pad(x, pads, self._fill())
        kh, kw = self.kernel
        if self.mode == "max":
            win = windows(xpad, self.kernel, self.stride)
            n, c, ho, wo = dy.shape
            # The first maximum in window order gets the gradient: a tile sees the same
            # window contents as the whole tensor, so it picks the same element.
            arg = win.reshape(n, c, ho, wo, kh * kw).argmax(axis=-1)
            dwin = xp.zeros((n, c, ho, wo, kh * kw), dtype=x.dtype)
            xp.put_along_axis(dwin, arg[..., None], dy[..., None], axis=-1)
            dwin = dwin.reshape(n, c, ho, wo, kh, kw)
        else:
            scaled = dy / (kh * kw)
            dwin = xp.broadcast_to(scaled[..., None, None], (*dy.shape, kh, kw))
        dx = col2im(dwin, xpad.shape, self.stride, x.dtype)
        return [crop(dx, pads)], {}

    def attrs(self):
        return {"kernel": list(self.kernel), "stride": list(self.stride), "padding": list(self.padding),
                "mode": self.mode}
