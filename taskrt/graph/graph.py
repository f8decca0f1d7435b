"""The graph-building API: layers, their shapes (inferred at build time) and their order.

    g = Graph("lenet")
    x = g.input("image", shape=(64, 1, 28, 28))
    y = g.conv2d(x, 6, kernel=5, padding=2, activation="relu", name="conv1")

Every method returns a Tensor (the layer's output).  Mistakes are caught here, before any
work starts, with the layer's name in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from numbers import Integral, Real

import networkx as nx

from taskrt.ops import (
    OPS,
    AdaptivePool2d,
    Add,
    BatchNorm,
    ChannelShuffle,
    ChannelSlice,
    Concat,
    Conv2d,
    Dropout,
    DropPath,
    Flatten,
    Gelu,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    Input,
    LayerNorm,
    Linear,
    Mean,
    Mul,
    Op,
    Pool2d,
    Relu,
    Relu6,
    Scale,
    ShapeError,
    Sigmoid,
    Silu,
    SoftmaxCrossEntropy,
    Sub,
    Tanh,
)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.]+$")
PREFIX = {"conv2d": "conv", "pool2d": "pool", "linear": "fc", "relu": "relu", "flatten": "flatten",
          "concat": "concat", "add": "add", "batch_norm": "bn", "softmax_cross_entropy": "loss", "input": "input",
          "relu6": "relu6_", "hardtanh": "htanh", "silu": "silu", "sigmoid": "sigmoid", "tanh": "tanh",
          "hardswish": "hswish", "hardsigmoid": "hsigmoid", "gelu": "gelu", "identity": "identity", "mul": "mul",
          "sub": "sub", "adaptive_pool2d": "apool", "mean": "mean", "channel_slice": "chslice",
          "channel_shuffle": "shuffle", "scale": "scale", "layer_norm": "ln", "dropout": "dropout",
          "drop_path": "drop_path"}


class GraphError(ValueError):
    """A graph that cannot be built; the message names the layer."""


@dataclass(frozen=True)
class Tensor:
    """The output of one layer."""

    graph: Graph
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.graph.layers[self.name].shape

    def __repr__(self):
        return f"Tensor({self.name!r}, shape={self.shape})"


@dataclass(frozen=True)
class Layer:
    name: str
    op: Op
    inputs: tuple[str, ...]

    @property
    def kind(self) -> str:
        return self.op.kind

    @property
    def shape(self) -> tuple[int, ...]:
        return self.op.out_shape

    @property
    def dims(self) -> tuple[str, ...]:
        return self.op.dims

    @property
    def is_input(self) -> bool:
        return self.op.kind == "input"

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.op.param_shapes()


def _pair(value, what, layer) -> tuple[int, int]:
    if isinstance(value, (str, bytes)):  # "33" would otherwise unpack to (3, 3)
        raise GraphError(f"layer {layer!r}: {what} must be an int or a pair (h, w), got {value!r}")
    if isinstance(value, int):
        return (value, value)
    try:
        a, b = value
        return (int(a), int(b))
    except (TypeError, ValueError):
        raise GraphError(f"layer {layer!r}: {what} must be an int or a pair (h, w), got {value!r}") from None


def _number(value, what, layer) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise GraphError(f"layer {layer!r}: {what} must be a number, got {value!r}")
    return float(value)


def _flag(value, what, layer) -> bool:
    if not isinstance(value, bool):
        raise GraphError(f"layer {layer!r}: {what} must be True or False, got {value!r}")
    return value


class Graph:
    def __init__(self, name: str = "net"):
        self.name = name
        self.layers: dict[str, Layer] = {}  # insertion order is a topological order

    # ---- building -------------------------------------------------------------------------
    def input(self, name: str, shape, dtype: str = "float") -> Tensor:
        def make(layer):
            if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or not all(
                isinstance(s, Integral) and not isinstance(s, bool) for s in shape
            ):
                raise GraphError(f"layer {layer!r}: shape must be a tuple of ints like (64, 1, 28, 28), "
                                 f"got {shape!r}")
            return Input((), tuple(int(s) for s in shape), dtype)
        return self._add("input", name, [], make)

    def conv2d(self, x, out_channels: int, kernel, stride=1, padding=0, activation=None, bias=True,
               name=None, dilation=1, groups=1) -> Tensor:
        """As torch's nn.Conv2d: `dilation` spaces the kernel's taps, `groups` splits the channels into
        that many independent convolutions (it divides both channel counts; depthwise: the input's)."""
        def make(layer):
            if isinstance(groups, bool) or not isinstance(groups, Integral):
                raise GraphError(f"layer {layer!r}: groups must be an int >= 1 dividing the input and output "
                                 f"channels, got {groups!r}")
            return Conv2d(
                (x.shape,), int(out_channels), _pair(kernel, "kernel", layer), _pair(stride, "stride", layer),
                _pair(padding, "padding", layer), activation, _flag(bias, "bias", layer),
                _pair(dilation, "dilation", layer), int(groups),
            )
        return self._add("conv2d", name, [x], make)

    def pool2d(self, x, kernel, stride=None, padding=0, mode="max", name=None, ceil_mode=False,
               count_include_pad=True) -> Tensor:
        """Max or average pooling as torch's max_pool2d / avg_pool2d, their ceil_mode and (average
        only) count_include_pad included."""
        def make(layer):
            k = _pair(kernel, "kernel", layer)
            s = k if stride is None else _pair(stride, "stride", layer)
            return Pool2d((x.shape,), k, s, _pair(padding, "padding", layer), mode,
                          _flag(ceil_mode, "ceil_mode", layer), _flag(count_include_pad, "count_include_pad", layer))
        return self._add("pool2d", name, [x], make)

    def linear(self, x, out_features: int, activation=None, bias=True, name=None) -> Tensor:
        return self._add("linear", name, [x],
                         lambda layer: Linear((x.shape,), int(out_features), activation, _flag(bias, "bias", layer)))

    def batch_norm(self, x, eps: float = 1e-5, momentum: float = 0.1, name=None) -> Tensor:
        """Batch normalization of each channel of an (n, c) or (n, c, h, w) tensor, with a learned
        scale ("weight") and shift ("bias") and running statistics for inference (PyTorch's)."""
        def make(layer):
            for what, value in (("eps", eps), ("momentum", momentum)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise GraphError(f"layer {layer!r}: {what} must be a number, got {value!r}")
            return BatchNorm((x.shape,), float(eps), float(momentum))
        return self._add("batch_norm", name, [x], make)

    def layer_norm(self, x, eps: float = 1e-5, affine: bool = True, name=None) -> Tensor:
        """Normalization of each sample's channel vector at every (h, w) position of an (n, c) or
        (n, c, h, w) tensor (mean and biased variance over c), then a learned per-channel scale
        ("weight") and shift ("bias") unless `affine=False`: ConvNeXt's LayerNorm2d, `nn.LayerNorm(c)`."""
        def make(layer):
            return LayerNorm((x.shape,), _number(eps, "eps", layer), _flag(affine, "affine", layer))
        return self._add("layer_norm", name, [x], make)

    def dropout(self, x, p: float = 0.5, name=None) -> Tensor:
        """Inverted dropout (torch's): in training each element kept with probability 1 - p and scaled
        by 1 / (1 - p), its mask a hash of (seed, step, layer, element) that every split draws alike;
        in prediction the identity (0 <= p < 1).  The op takes the draw (seed, step) from its caller:
        a trainer that passes none runs it as the identity."""
        def make(layer):
            return Dropout((x.shape,), _number(p, "p", layer), layer)
        return self._add("dropout", name, [x], make)

    def drop_path(self, x, p: float = 0.1, name=None) -> Tensor:
        """Stochastic depth, torchvision's mode "row": in training each sample kept whole with
        probability 1 - p and scaled by 1 / (1 - p), its mask a hash of (seed, step, layer, sample)
        that every split draws alike; in prediction the identity (0 <= p < 1)."""
        def make(layer):
            return DropPath((x.shape,), _number(p, "p", layer), layer)
        return self._add("drop_path", name, [x], make)

    def relu(self, x, name=None) -> Tensor:
        return self._add("relu", name, [x], lambda _: Relu((x.shape,)))

    def relu6(self, x, name=None) -> Tensor:
        """min(max(x, 0), 6), as torch's relu6."""
        return self._add("relu6", name, [x], lambda _: Relu6((x.shape,)))

    def hardtanh(self, x, min_val: float = -1.0, max_val: float = 1.0, name=None) -> Tensor:
        """x clamped to [min_val, max_val], as torch's hardtanh (min_val < max_val)."""
        def make(layer):
            return Hardtanh((x.shape,), _number(min_val, "min_val", layer), _number(max_val, "max_val", layer))
        return self._add("hardtanh", name, [x], make)

    def silu(self, x, name=None) -> Tensor:
        """x * sigmoid(x) (swish)."""
        return self._add("silu", name, [x], lambda _: Silu((x.shape,)))

    def sigmoid(self, x, name=None) -> Tensor:
        return self._add("sigmoid", name, [x], lambda _: Sigmoid((x.shape,)))

    def tanh(self, x, name=None) -> Tensor:
        return self._add("tanh", name, [x], lambda _: Tanh((x.shape,)))

    def hardswish(self, x, name=None) -> Tensor:
        """x * relu6(x + 3) / 6, as torch's hardswish."""
        return self._add("hardswish", name, [x], lambda _: Hardswish((x.shape,)))

    def hardsigmoid(self, x, name=None) -> Tensor:
        """relu6(x + 3) / 6, as torch's hardsigmoid."""
        return self._add("hardsigmoid", name, [x], lambda _: Hardsigmoid((x.shape,)))

    def gelu(self, x, approximate: str = "none", name=None) -> Tensor:
        """x * Phi(x), Phi the normal CDF: exact ("none") or torch's tanh approximation ("tanh")."""
        return self._add("gelu", name, [x], lambda _: Gelu((x.shape,), approximate))

    def identity(self, x, name=None) -> Tensor:
        return self._add("identity", name, [x], lambda _: Identity((x.shape,)))

    def flatten(self, x, name=None) -> Tensor:
        return self._add("flatten", name, [x], lambda _: Flatten((x.shape,)))

    def reshape(self, x, shape, name=None) -> Tensor:
        """`x.reshape(n, -1)` (or (n, c*h*w), (-1, c*h*w)): a flatten layer; no other reshape is supported."""
        def make(layer):
            n, features = x.shape[0], prod(x.shape[1:])
            valid = [(n, -1), (n, features), (-1, features)]
            target = tuple(shape) if isinstance(shape, (tuple, list)) else shape
            if target not in valid:
                raise GraphError(f"layer {layer!r} (flatten): reshape of an input of shape {x.shape} supports "
                                 f"{', '.join(map(str, valid))} only (a flatten), got {shape!r}")
            return Flatten((x.shape,))
        return self._add("flatten", name, [x], make)

    def adaptive_pool2d(self, x, output_size, mode="avg", name=None) -> Tensor:
        """torch's adaptive_avg_pool2d (mode "avg") or adaptive_max_pool2d ("max") to `output_size`:
        an int or a pair (oh, ow), None in the pair keeping the input's size."""
        def make(layer):
            pair = (output_size, output_size) if output_size is None or isinstance(output_size, Integral) \
                else output_size
            try:
                sizes = tuple(x.shape[2 + i] if v is None and len(x.shape) == 4 else v for i, v in enumerate(pair))
            except TypeError:
                sizes = ()
            if isinstance(pair, (str, bytes)) or len(sizes) != 2 or not all(
                    isinstance(v, Integral) and not isinstance(v, bool) and v >= 1 for v in sizes):
                raise GraphError(f"layer {layer!r} (adaptive_pool2d): output_size must be an int >= 1 or a pair "
                                 f"(oh, ow) of them (None keeps the input's size), got {output_size!r}")
            return AdaptivePool2d((x.shape,), tuple(int(v) for v in sizes), mode)
        return self._add("adaptive_pool2d", name, [x], make)

    def mean(self, x, dims=(2, 3), keepdim=False, name=None) -> Tensor:
        """The mean over h and w of an (n, c, h, w) tensor (global average pooling, `x.mean((2, 3))`):
        (n, c), or (n, c, 1, 1) with keepdim."""
        def make(layer):
            try:
                axes = sorted(int(d) % 4 for d in dims if isinstance(d, Integral) and not isinstance(d, bool))
            except TypeError:
                axes = []
            if isinstance(dims, (str, bytes)) or axes != [2, 3] or len(dims) != 2:
                raise GraphError(f"layer {layer!r} (mean): dims must be (2, 3) (or (-2, -1)): the mean over h "
                                 f"and w is the one supported, got {dims!r}")
            return Mean((x.shape,), _flag(keepdim, "keepdim", layer))
        return self._add("mean", name, [x], make)

    def channel_slice(self, x, start: int, stop: int, name=None) -> Tensor:
        """Channels [start, stop) of an (n, c, h, w) or (n, c) tensor: `x[:, start:stop]`, a piece of
        `torch.chunk` or `torch.split` along dim 1."""
        return self._add("channel_slice", name, [x], lambda _: ChannelSlice((x.shape,), start, stop))

    def channel_shuffle(self, x, groups: int, name=None) -> Tensor:
        """ShuffleNet's channel shuffle: view(n, g, c/g, h, w), transpose(1, 2), view(n, c, h, w)."""
        return self._add("channel_shuffle", name, [x], lambda _: ChannelShuffle((x.shape,), groups))

    def scale(self, x, shape, name=None) -> Tensor:
        """x times a learned per-channel "weight" of `shape`, (c,) or (c, 1, 1) as the PyTorch module
        stores it (ConvNeXt's layer scale)."""
        def make(layer):
            weight_shape = tuple(int(s) if isinstance(s, Integral) and not isinstance(s, bool) else s for s in shape) \
                if isinstance(shape, (tuple, list)) else shape
            return Scale((x.shape,), weight_shape)
        return self._add("scale", name, [x], make)

    def concat(self, xs, name=None) -> Tensor:
        xs = list(xs)
        return self._add("concat", name, xs, lambda _: Concat(tuple(x.shape for x in xs)))

    def add(self, a, b, name=None) -> Tensor:
        return self._add("add", name, [a, b], lambda _: Add((a.shape, b.shape)))

    def mul(self, a, b, name=None) -> Tensor:
        """a * b, of one shape, or one (n, c, h, w) and one (n, c, 1, 1) broadcast over h and w (either order)."""
        return self._add("mul", name, [a, b], lambda _: Mul((a.shape, b.shape)))

    def sub(self, a, b, name=None) -> Tensor:
        """a - b, shapes as for `mul`."""
        return self._add("sub", name, [a, b], lambda _: Sub((a.shape, b.shape)))

    def softmax_cross_entropy(self, logits, labels=None, name=None) -> Tensor:
        """Mean cross-entropy over the batch.  Without `labels`, an int64 input named
        "labels" (shape (n,)) is added for them."""
        name = self._new_name("softmax_cross_entropy") if name is None else name
        if labels is None:
            # Check everything before adding the labels input, so a failed call leaves no stray input.
            self._check_name(name)
            self._check_tensor(logits, name)
            try:
                SoftmaxCrossEntropy((logits.shape, (logits.shape[0],)))
            except ShapeError as e:
                raise GraphError(f"layer {name!r} (softmax_cross_entropy): {e}") from None
            label_name = "labels" if "labels" not in self.layers else f"{name}_labels"
            labels = self.input(label_name, shape=(logits.shape[0],), dtype="int64")
        elif isinstance(labels, Tensor) and labels.graph is self and labels.name in self.layers:
            src = self.layers[labels.name]
            if not (src.is_input and src.op.dtype == "int64"):
                what = f"an input of dtype {src.op.dtype!r}" if src.is_input else f"a {src.kind} layer"
                raise GraphError(f"layer {name!r}: labels must be an int64 input layer, got {labels.name!r}, {what}")
        return self._add("softmax_cross_entropy", name, [logits, labels],
                         lambda _: SoftmaxCrossEntropy((logits.shape, labels.shape)))

    def _add(self, kind: str, name, inputs, make) -> Tensor:
        name = self._new_name(kind) if name is None else name
        self._check_name(name)
        for x in inputs:
            self._check_tensor(x, name)
        try:
            op = make(name)
        except ShapeError as e:
            raise GraphError(f"layer {name!r} ({kind}): {e}") from None
        self.layers[name] = Layer(name, op, tuple(x.name for x in inputs))
        return Tensor(self, name)

    def _check_name(self, name):
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise GraphError(
                f"layer name {name!r} is not valid: use letters, digits, '_' and '.' only "
                "(task keys are '<layer>-<phase>', so a '-' would break dashboard grouping)"
            )
        if name in self.layers:
            raise GraphError(f"layer {name!r}: a layer of that name already exists ({self.layers[name].kind})")

    def _check_tensor(self, x, layer):
        if not isinstance(x, Tensor):
            raise GraphError(f"layer {layer!r}: expected a Tensor from this graph, got {type(x).__name__}")
        if x.graph is not self or x.name not in self.layers:
            raise GraphError(f"layer {layer!r}: tensor {x.name!r} belongs to another graph")

    def _new_name(self, kind: str) -> str:
        prefix, k = PREFIX[kind], 1
        while f"{prefix}{k}" in self.layers:
            k += 1
        return f"{prefix}{k}"

    # ---- reading ----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Layer:
        return self.layers[name]

    def __iter__(self):
        return iter(self.layers.values())

    def __len__(self):
        return len(self.layers)

    @property
    def inputs(self) -> list[Layer]:
        return [layer for layer in self if layer.is_input]

    @property
    def losses(self) -> list[Layer]:
        return [layer for layer in self if layer.kind == "softmax_cross_entropy"]

    def consumers(self, name: str) -> list[tuple[str, int]]:
        """(layer, input index) of every use of `name`'s output."""
        return [(layer.name, i) for layer in self for i, src in enumerate(layer.inputs) if src == name]

    def needs_backward(self) -> set[str]:
        """Layers whose backward must run: those with parameters at or upstream of them.

        A layer fed only by inputs and parameter-free layers has no gradient to pass on,
        so neither its backward nor any input gradient it would produce is computed.
        """
        needed: set[str] = set()
        for layer in self:
            if layer.param_shapes or any(src in needed for src in layer.inputs):
                needed.add(layer.name)
        return needed

    def num_params(self) -> int:
        return sum(prod(s) for layer in self for s in layer.param_shapes.values())

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for layer in self:
            g.add_node(layer.name)
            for src in layer.inputs:
                g.add_edge(src, layer.name)
        return g

    # ---- description ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "layers": [
                {"name": l.name, "kind": l.kind, "inputs": list(l.inputs), **l.op.attrs()} for l in self
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Graph:
        """Rebuild a graph from `to_dict` (used by checkpoints)."""
        g = cls(data["name"])
        for spec in data["layers"]:
            spec = dict(spec)
            name, kind, inputs = spec.pop("name"), spec.pop("kind"), spec.pop("inputs")
            if name in g.layers:
                raise GraphError(f"layer {name!r} is defined twice")
            if kind not in OPS:
                raise GraphError(f"layer {name!r}: unknown kind {kind!r}; known: {sorted(OPS)}")
            unknown = [src for src in inputs if src not in g.layers]
            if unknown:
                raise GraphError(f"layer {name!r}: inputs {unknown} are not defined before it")
            in_shapes = tuple(g.layers[src].shape for src in inputs)
            attrs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
            try:
                op = OPS[kind](in_shapes, **attrs)
            except ShapeError as e:
                raise GraphError(f"layer {name!r} ({kind}): {e}") from None
            g.layers[name] = Layer(name, op, tuple(inputs))
        return g

    def summary(self) -> str:
        rows = [f"{'layer':<16} {'kind':<22} {'output shape':<22} params"]
        for layer in self:
            n = sum(prod(s) for s in layer.param_shapes.values())
            rows.append(f"{layer.name:<16} {layer.kind:<22} {str(layer.shape):<22} {n:,}")
        rows.append(f"total parameters: {self.num_params():,}")
        return "\n".join(rows)

    def __repr__(self):
        return f"Graph({self.name!r}, {len(self)} layers)"
