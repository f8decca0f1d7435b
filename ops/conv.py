"""2D convolution (NCHW, weight (Cout, Cin/groups, kh, kw)) with optional fused ReLU, as PyTorch's nn.Conv2d:
dilation spaces the kernel's taps, groups split the channels into independent convolutions (depthwise:
groups == Cin).  Kernels: `ops.grouped_conv` picks im2col + GEMM (`ops.conv_kernels`), per-group GEMMs
or the depthwise loops (`ops.depthwise`).

On GPU tiles the same convolution runs through cuDNN when torch can (`ops.torch_kernels`)."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from taskrt.ops import grouped_conv, torch_kernels
from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect
from taskrt.ops.windows import extent, halo, out_size, tile_padding

NO_DILATION = (1, 1)


def check_window(what, in_shape, kernel, stride, padding, dilation=NO_DILATION):
    """Shared validation of conv/pool hyper-parameters against a rank-4 input."""
    if len(in_shape) != 4:
        raise ShapeError(f"{what} needs a rank-4 (n, c, h, w) input, got shape {tuple(in_shape)}")
    for name, pair in (("kernel", kernel), ("stride", stride), ("dilation", dilation)):
        if any(v < 1 for v in pair):
            raise ShapeError(f"{what} {name} must be >= 1, got {pair}")
    if any(p < 0 for p in padding):
        raise ShapeError(f"{what} padding must be >= 0, got {padding}")
    for axis, size, k, p, d in zip("hw", in_shape[2:], kernel, padding, dilation):
        if extent(k, d) > size + 2 * p:
            spans = "" if d == 1 else f" (dilated {d}: spans {extent(k, d)})"
            raise ShapeError(
                f"{what} kernel {kernel}{spans} is larger than the padded input along {axis}: "
                f"{size} + 2*{p} = {size + 2 * p} < {extent(k, d)}"
            )


def window_input_rect(out: Rect, channels: tuple[int, int], kernel, stride, padding, in_shape,
                      dilation=NO_DILATION) -> Rect:
    """Region rule of a windowed op: sample range kept, given channels, halo in h and w."""
    h0, h1, _, _ = halo(out.lo[2], out.hi[2], kernel[0], stride[0], padding[0], in_shape[2], dilation[0])
    w0, w1, _, _ = halo(out.lo[3], out.hi[3], kernel[1], stride[1], padding[1], in_shape[3], dilation[1])
    return Rect((out.lo[0], channels[0], h0, w0), (out.hi[0], channels[1], h1, w1))


@dataclass(frozen=True)
class Conv2d(Op):
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    activation: str | None = None
    bias: bool = True
    dilation: tuple[int, int] = NO_DILATION
    groups: int = 1

    kind = "conv2d"

    def __post_init__(self):
        check_window("conv2d", self.in_shapes[0], self.kernel, self.stride, self.padding, self.dilation)
        if self.out_channels < 1:
            raise ShapeError(f"conv2d out_channels must be >= 1, got {self.out_channels}")
        if self.activation not in (None, "relu"):
            raise ShapeError(f"conv2d activation must be None or 'relu', got {self.activation!r}")
        cin = self.in_shapes[0][1]
        if isinstance(self.groups, bool) or not isinstance(self.groups, Integral) or self.groups < 1:
            raise ShapeError(f"conv2d groups must be an int >= 1, got {self.groups!r}")
        if cin % self.groups or self.out_channels % self.groups:
            valid = [g for g in range(1, cin + 1) if cin % g == 0 and self.out_channels % g == 0]
            raise ShapeError(f"conv2d groups {self.groups} must divide both the input channels ({cin}) and "
                             f"out_channels ({self.out_channels}): one of {valid}")

    @property
    def saves_output(self):
        return self.activation == "relu"

    @property
    def out_shape(self):
        n, _, h, w = self.in_shapes[0]
        return (
            n,
            self.out_channels,
            out_size(h, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0]),
            out_size(w, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1]),
        )

    def param_shapes(self):
        shapes = {"weight": (self.out_channels, self.in_shapes[0][1] // self.groups, *self.kernel)}
        return {**shapes, "bias": (self.out_channels,)} if self.bias else shapes

    def _groups_of(self, c0, c1):
        """The groups [g0, g1) output channels [c0, c1) belong to (one group: all of them)."""
        if self.groups == 1:
            return 0, 1
        per_group = self.out_channels // self.groups
        return c0 // per_group, -(-c1 // per_group)

    def input_rects(self, out):
        """The halo of the dilated kernel (extent dilation*(k-1)+1) in h and w; in c, only the input
        channels of the groups the part's output channels belong to: output channels [c0, c1) read
        input channels [(c0 // opg) * ipg, ceil(c1 / opg) * ipg), opg = Cout/groups and ipg = Cin/groups
        (with one group, every input channel; a depthwise part, its own channels)."""
        g0, g1 = self._groups_of(out.lo[1], out.hi[1])
        ipg = self.in_shapes[0][1] // self.groups
        return [window_input_rect(out, (g0 * ipg, g1 * ipg), self.kernel, self.stride, self.padding,
                                  self.in_shapes[0], self.dilation)]

    def param_rects(self, out):
        """The part's output-channel rows of the weight and bias."""
        c0, c1 = out.lo[1], out.hi[1]
        kh, kw = self.kernel
        rects = {"weight": Rect((c0, 0, 0, 0), (c1, self.in_shapes[0][1] // self.groups, kh, kw))}
        return {**rects, "bias": Rect((c0,), (c1,))} if self.bias else rects

    def flops(self, out):
        return 2 * out.volume * (self.in_shapes[0][1] // self.groups) * self.kernel[0] * self.kernel[1]

    def _pads(self, out):
        return tile_padding(out, self.kernel, self.stride, self.padding, self.in_shapes[0][2:], self.dilation)

    def _whole_groups(self, out):
        """(groups in the part, zero rows its weight needs before and after its own): a channel split that
        cuts a group computes the group's other channels as zeros (kernels take whole groups), then drops them."""
        g0, g1 = self._groups_of(out.lo[1], out.hi[1])
        if self.groups == 1:
            return 1, 0, 0
        per_group = self.out_channels // self.groups
        return g1 - g0, out.lo[1] - g0 * per_group, g1 * per_group - out.hi[1]

    def forward(self, xs, params, out):
        groups, before, after = self._whole_groups(out)
        params = _extended(params, before, after)
        if torch_kernels.use_torch(xs[0]):
            y = torch_kernels.conv2d_forward(xs[0], params, self.stride, self._pads(out), self.activation,
                                             self.dilation, groups)
        else:
            y = grouped_conv.conv2d(xs[0], params["weight"], params.get("bias"), self.stride, self._pads(out),
                                    self.activation == "relu", self.dilation, groups)
        return array_module(y).ascontiguousarray(y[:, before : y.shape[1] - after]) if before or after else y

    def backward(self, dy, xs, y, params, out, need_dx):
        groups, before, after = self._whole_groups(out)
        x, pads, activation = xs[0], self._pads(out), self.activation
        if activation == "relu" and (before or after or not torch_kernels.use_torch(x)):
            dy, activation = dy * (y > 0), None
        if before or after:
            dy = _extended({"d": dy}, before, after, axis=1)["d"]
        weight = _extended({"weight": params["weight"]}, before, after)["weight"]
        if torch_kernels.use_torch(x):
            [dx], grads = torch_kernels.conv2d_backward(dy, x, y, {**params, "weight": weight}, self.stride, pads,
                                                        activation, need_dx[0], self.dilation, groups)
        else:
            dw, db = grouped_conv.weight_grad(dy, x, self.kernel, self.stride, pads, self.dilation, groups)
            grads = {"weight": dw, "bias": db} if self.bias else {"weight": dw}
            dx = grouped_conv.data_grad(dy, weight, x.shape, self.stride, pads, self.dilation, groups) \
                if need_dx[0] else None
        if before or after:
            grads = {k: g[before : g.shape[0] - after] for k, g in grads.items()}
        return [dx], grads

    def attrs(self):
        attrs = {
            "out_channels": self.out_channels,
            "kernel": list(self.kernel),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "activation": self.activation,
            "bias": self.bias,
        }
        # only when set: graphs without them describe themselves (and load) as before
        if tuple(self.dilation) != NO_DILATION:
            attrs["dilation"] = list(self.dilation)
        if self.groups != 1:
            attrs["groups"] = self.groups
        return attrs


def _extended(arrays, before, after, axis=0):
    """Each array with `before` and `after` zero slices added along `axis` (a part's weight and bias
    extended to whole groups); the arrays themselves when there is nothing to add."""
    if not (before or after):
        return arrays
    out = {}
    for name, a in arrays.items():
        xp = array_module(a)
        shape = list(a.shape)
        shape[axis] += before + after
        wide = xp.zeros(shape, dtype=a.dtype)
        index = [slice(None)] * a.ndim
        index[axis] = slice(before, before + a.shape[axis])
        wide[tuple(index)] = a
        out[name] = wide
    return out
