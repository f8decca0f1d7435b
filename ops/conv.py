"""2D convolution (NCHW, weight (Cout, Cin, kh, kw)) with optional fused ReLU: im2col + GEMM (`ops.conv_kernels`).

On GPU tiles the same convolution runs through cuDNN when torch can (`ops.torch_kernels`)."""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.ops import torch_kernels
from taskrt.ops.base import Op
from taskrt.ops.conv_kernels import conv2d, conv2d_data_grad, conv2d_weight_grad
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect
from taskrt.ops.windows import halo, out_size, tile_padding


def check_window(what, in_shape, kernel, stride, padding):
    """Shared validation of conv/pool hyper-parameters against a rank-4 input."""
    if len(in_shape) != 4:
        raise ShapeError(f"{what} needs a rank-4 (n, c, h, w) input, got shape {tuple(in_shape)}")
    for name, pair in (("kernel", kernel), ("stride", stride)):
        if any(v < 1 for v in pair):
            raise ShapeError(f"{what} {name} must be >= 1, got {pair}")
    if any(p < 0 for p in padding):
        raise ShapeError(f"{what} padding must be >= 0, got {padding}")
    for axis, size, k, p in zip("hw", in_shape[2:], kernel, padding):
        if k > size + 2 * p:
            raise ShapeError(
                f"{what} kernel {kernel} is larger than the padded input along {axis}: "
                f"{size} + 2*{p} = {size + 2 * p} < {k}"
            )


def window_input_rect(out: Rect, channels: tuple[int, int], kernel, stride, padding, in_shape) -> Rect:
    """Region rule of a windowed op: sample range kept, given channels, halo in h and w."""
    h0, h1, _, _ = halo(out.lo[2], out.hi[2], kernel[0], stride[0], padding[0], in_shape[2])
    w0, w1, _, _ = halo(out.lo[3], out.hi[3], kernel[1], stride[1], padding[1], in_shape[3])
    return Rect((out.lo[0], channels[0], h0, w0), (out.hi[0], channels[1], h1, w1))


@dataclass(frozen=True)
class Conv2d(Op):
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    activation: str | None = None
    bias: bool = True

    kind = "conv2d"

    def __post_init__(self):
        check_window("conv2d", self.in_shapes[0], self.kernel, self.stride, self.padding)
        if self.out_channels < 1:
            raise ShapeError(f"conv2d out_channels must be >= 1, got {self.out_channels}")
        if self.activation not in (None, "relu"):
            raise ShapeError(f"conv2d activation must be None or 'relu', got {self.activation!r}")

    @property
    def saves_output(self):
        return self.activation == "relu"

    @property
    def out_shape(self):
        n, _, h, w = self.in_shapes[0]
        return (
            n,
            self.out_channels,
            out_size(h, self.kernel[0], self.stride[0], self.padding[0]),
            out_size(w, self.kernel[1], self.stride[1], self.padding[1]),
        )

    def param_shapes(self):
        cin = self.in_shapes[0][1]
        shapes = {"weight": (self.out_channels, cin, *self.kernel)}
        return {**shapes, "bias": (self.out_channels,)} if self.bias else shapes

    def input_rects(self, out):
        cin = self.in_shapes[0][1]
        return [window_input_rect(out, (0, cin), self.kernel, self.stride, self.padding, self.in_shapes[0])]

    def param_rects(self, out):
        c0, c1 = out.lo[1], out.hi[1]
        cin = self.in_shapes[0][1]
        kh, kw = self.kernel
        rects = {"weight": Rect((c0, 0, 0, 0), (c1, cin, kh, kw))}
        return {**rects, "bias": Rect((c0,), (c1,))} if self.bias else rects

    def flops(self, out):
        cin = self.in_shapes[0][1]
        return 2 * out.volume * cin * self.kernel[0] * self.kernel[1]

    def _pads(self, out):
        return tile_padding(out, self.kernel, self.stride, self.padding, self.in_shapes[0][2:])

    def forward(self, xs, params, out):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.conv2d_forward(xs[0], params, self.stride, self._pads(out), self.activation)
        return conv2d(xs[0], params["weight"], params.get("bias"), self.stride, self._pads(out),
                      self.activation == "relu")

    def backward(self, dy, xs, y, params, out, need_dx):
        if torch_kernels.use_torch(xs[0]):
            return torch_kernels.conv2d_backward(dy, xs[0], y, params, self.stride, self._pads(out), self.activation,
                                                 need_dx[0])
        x, pads = xs[0], self._pads(out)
        if self.activation == "relu":
            dy = dy * (y > 0)
        dw, db = conv2d_weight_grad(dy, x, self.kernel, self.stride, pads)
        grads = {"weight": dw, "bias": db} if self.bias else {"weight": dw}
        dx = conv2d_data_grad(dy, params["weight"], x.shape, self.stride, pads) if need_dx[0] else None
        return [dx], grads

    def attrs(self):
        return {
            "out_channels": self.out_channels,
            "kernel": list(self.kernel),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "activation": self.activation,
            "bias": self.bias,
        }
