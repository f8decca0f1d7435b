"""How each call of a traced PyTorch module becomes taskrt layers (`taskrt.graph.from_torch`): the
values a walk over the fx graph carries, and one handler per module class, function and method.

A handler takes the importer (its graph, and where the module's parameters go), the fx node and
the node's arguments as values (`Tensor4` for a layer's output, Python values for sizes), and
returns the node's value; `NotMapped` says why a call has no layer here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from taskrt.graph.graph import Tensor


@dataclass(frozen=True)
class Tensor4:
    """A value of the traced module that is a taskrt layer's output, seen in `layout` ("nchw", or
    "nhwc": the same NCHW tensor after a permute to channels last)."""

    layer: str
    layout: str = "nchw"


@dataclass(frozen=True)
class Grouped:
    """ShuffleNet's view (n, groups, c // groups, h, w) of a layer, `transposed` after transpose(1, 2)."""

    layer: str
    groups: int
    transposed: bool = False


class Unmapped:
    """The value of a node that could not be mapped: what reads it is skipped (already reported)."""


class NotMapped(Exception):
    """This call has no taskrt layer (the reason is the message)."""


def plain(value) -> bool:
    return not isinstance(value, (Tensor4, Grouped, Unmapped))


def flat(values):
    for v in values:
        if isinstance(v, (list, tuple)) and not (v[:1] == ("attr",)):
            yield from flat(v)
        else:
            yield v


def torchvision_leaves() -> tuple:
    """torchvision modules whose forward draws random numbers or branches: kept as calls."""
    try:
        from torchvision.ops import StochasticDepth
    except ImportError:
        return ()
    return (StochasticDepth,)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


# ---- modules ------------------------------------------------------------------------------------
def _conv(imp, node, m, x):
    if not isinstance(x, Tensor4) or x.layout != "nchw":
        raise NotMapped("a convolution of a permuted tensor")
    if m.padding_mode != "zeros":
        raise NotMapped(f"padding_mode {m.padding_mode!r} (only 'zeros')")
    padding = m.padding
    if isinstance(padding, str):  # 'valid', or 'same' with an odd effective kernel
        if padding == "valid":
            padding = (0, 0)
        else:
            extent = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation)]
            if any(e % 2 for e in extent):
                raise NotMapped("padding='same' with an even effective kernel (asymmetric padding)")
            padding = tuple(e // 2 for e in extent)
    name = imp.layer_name(node, node.target)
    kwargs = {}
    if tuple(m.dilation) != (1, 1):
        kwargs["dilation"] = tuple(m.dilation)
    if m.groups != 1:
        kwargs["groups"] = m.groups
    y = imp.g.conv2d(imp.t(x), m.out_channels, tuple(m.kernel_size), stride=tuple(m.stride), padding=tuple(padding),
                     bias=m.bias is not None, name=name, **kwargs)
    imp.keep(name, node.target, m)
    return Tensor4(y.name)


def _batch_norm(imp, node, m, x):
    if not isinstance(x, Tensor4) or x.layout != "nchw":
        raise NotMapped("a batch norm of a permuted tensor")
    if m.momentum is None or not m.track_running_stats or not m.affine:
        raise NotMapped("batch norm needs affine=True, track_running_stats=True and a momentum (not None)")
    name = imp.layer_name(node, node.target)
    y = imp.g.batch_norm(imp.t(x), eps=float(m.eps), momentum=float(m.momentum), name=name)
    imp.keep(name, node.target, m)
    imp.keep_running(name, node.target, m)
    return Tensor4(y.name)


def _linear(imp, node, m, x):
    if not isinstance(x, Tensor4):
        raise NotMapped("a linear layer of an unmapped value")
    name = imp.layer_name(node, node.target)
    if x.layout == "nhwc":  # over the channels of every position: a 1x1 convolution on NCHW
        y = imp.g.conv2d(imp.t(x), m.out_features, 1, bias=m.bias is not None, name=name)
        shapes = {"weight": (m.out_features, m.in_features, 1, 1)}
        imp.keep(name, node.target, m, shapes=shapes)
        return Tensor4(y.name, "nhwc")
    if len(imp.g[x.layer].shape) != 2:
        raise NotMapped(f"a linear layer over a tensor of shape {imp.g[x.layer].shape} (needs (n, features) "
                         "or channels last)")
    y = imp.g.linear(imp.t(x), m.out_features, bias=m.bias is not None, name=name)
    imp.keep(name, node.target, m)
    return Tensor4(y.name)


def _layer_norm_module(imp, node, m, x):
    if not m.elementwise_affine and getattr(m, "bias", None) is not None:
        raise NotMapped("layer norm with a bias but no weight")
    return _layer_norm(imp, node, x, tuple(m.normalized_shape), m.eps, node.target, m,
                       affine=m.elementwise_affine)


def _layer_norm(imp, node, x, normalized_shape, eps, path, module, affine=True, weight=None, bias=None):
    if not isinstance(x, Tensor4):
        raise NotMapped("layer norm of an unmapped value")
    channels = imp.g[x.layer].shape[1]
    over_channels = (x.layout == "nhwc" or len(imp.g[x.layer].shape) == 2) and normalized_shape == (channels,)
    if not over_channels:
        raise NotMapped(f"layer norm over {normalized_shape} (only over the channels: NHWC's last axis, or "
                         "(n, c)'s features)")
    name = imp.layer_name(node, path)
    y = imp.g.layer_norm(imp.t(x), eps=float(eps), affine=affine, name=name)
    if module is not None:
        imp.keep(name, path, module)
    return Tensor4(y.name, x.layout)


def _elementwise(method: str, **fixed):
    def handler(imp, node, m_or_x, *rest, **kwargs):
        x = m_or_x if isinstance(m_or_x, Tensor4) else rest[0]
        if not isinstance(x, Tensor4):
            raise NotMapped("an element-wise op of an unmapped value")
        path = node.target if node.op == "call_module" else None
        y = getattr(imp.g, method)(imp.t(x), name=imp.layer_name(node, path), **fixed)
        return Tensor4(y.name, x.layout)
    return handler


def _module_activation(imp, node, m, x):
    import torch

    if isinstance(m, torch.nn.ReLU6):
        return _elementwise("relu6")(imp, node, x)
    if isinstance(m, torch.nn.Hardtanh):
        return _elementwise("hardtanh", min_val=float(m.min_val), max_val=float(m.max_val))(imp, node, x)
    if isinstance(m, torch.nn.GELU):
        return _elementwise("gelu", approximate=m.approximate)(imp, node, x)
    if isinstance(m, torch.nn.Identity):
        return x
    method = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu", torch.nn.Sigmoid: "sigmoid", torch.nn.Tanh: "tanh",
              torch.nn.Hardswish: "hardswish", torch.nn.Hardsigmoid: "hardsigmoid"}[type(m)]
    return _elementwise(method)(imp, node, x)


def _dropout_module(imp, node, m, x):
    return _dropout(imp, node, x, float(m.p), node.target)


def _dropout(imp, node, x, p, path=None):
    if not isinstance(x, Tensor4):
        raise NotMapped("dropout of an unmapped value")
    if p == 0:
        return x
    y = imp.g.dropout(imp.t(x), p=p, name=imp.layer_name(node, path))
    return Tensor4(y.name, x.layout)


def _stochastic_depth_module(imp, node, m, x):
    return _drop_path(imp, node, x, float(m.p), m.mode, node.target)


def _drop_path(imp, node, x, p, mode, path=None):
    if p == 0:
        return x
    if mode != "row":
        raise NotMapped(f"stochastic depth in mode {mode!r} (only 'row')")
    y = imp.g.drop_path(imp.t(x), p=p, name=imp.layer_name(node, path))
    return Tensor4(y.name, x.layout)


def _pool_module(imp, node, m, x):
    import torch

    mode = "max" if isinstance(m, torch.nn.MaxPool2d) else "avg"
    if mode == "max" and _pair(m.dilation) != (1, 1):
        raise NotMapped("max pooling with dilation")
    if mode == "avg" and m.divisor_override is not None:
        raise NotMapped("average pooling with divisor_override")
    return _pool(imp, node, x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                 getattr(m, "count_include_pad", True), mode, node.target)


def _pool(imp, node, x, kernel, stride, padding, ceil_mode, count_include_pad, mode, path=None):
    if not isinstance(x, Tensor4) or x.layout != "nchw":
        raise NotMapped("pooling of a permuted or unmapped tensor")
    stride = kernel if stride is None or stride == [] else stride
    kwargs = {}
    if ceil_mode:
        kwargs["ceil_mode"] = True
    if not count_include_pad:
        kwargs["count_include_pad"] = False
    y = imp.g.pool2d(imp.t(x), _pair(kernel), stride=_pair(stride), padding=_pair(padding), mode=mode,
                     name=imp.layer_name(node, path), **kwargs)
    return Tensor4(y.name)


def _adaptive_module(imp, node, m, x):
    import torch

    mode = "avg" if isinstance(m, torch.nn.AdaptiveAvgPool2d) else "max"
    return _adaptive(imp, node, x, m.output_size, mode, node.target)


def _adaptive(imp, node, x, output_size, mode, path=None):
    if not isinstance(x, Tensor4) or x.layout != "nchw":
        raise NotMapped("adaptive pooling of a permuted or unmapped tensor")
    size = _pair(output_size)
    _, _, h, w = imp.g[x.layer].shape
    size = tuple(s if s is not None else d for s, d in zip(size, (h, w)))
    y = imp.g.adaptive_pool2d(imp.t(x), size, mode=mode, name=imp.layer_name(node, path))
    return Tensor4(y.name)


def _flatten_module(imp, node, m, x):
    return _flatten(imp, node, x, m.start_dim, m.end_dim, node.target)


def _flatten(imp, node, x, start_dim=0, end_dim=-1, path=None):
    if not isinstance(x, Tensor4) or x.layout != "nchw":
        raise NotMapped("flattening a permuted or unmapped tensor")
    rank = len(imp.g[x.layer].shape)
    if start_dim != 1 or end_dim not in (-1, rank - 1):
        raise NotMapped(f"flatten(start_dim={start_dim}, end_dim={end_dim}) (only from dim 1 to the end)")
    if rank == 2:
        return x
    y = imp.g.flatten(imp.t(x), name=imp.layer_name(node, path))
    return Tensor4(y.name)


MODULES: dict = {}  # module class -> handler(importer, node, module, *args)
FUNCTIONS: dict = {}  # function (or its __name__) -> handler(importer, node, *args, **kwargs)
METHODS: dict = {}  # Tensor method name -> handler(importer, node, tensor, *args, **kwargs)


def register():
    """Fill the tables (torch imported now, not when taskrt is)."""
    if MODULES:
        return
    import torch.nn as nn

    MODULES.update({
        nn.Conv2d: _conv, nn.BatchNorm2d: _batch_norm, nn.BatchNorm1d: _batch_norm, nn.Linear: _linear,
        nn.LayerNorm: _layer_norm_module, nn.Dropout: _dropout_module, nn.MaxPool2d: _pool_module,
        nn.AvgPool2d: _pool_module, nn.AdaptiveAvgPool2d: _adaptive_module, nn.AdaptiveMaxPool2d: _adaptive_module,
        nn.Flatten: _flatten_module,
        **{cls: _module_activation for cls in (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
                                               nn.Hardsigmoid, nn.Hardtanh, nn.GELU, nn.Identity)},
    })
    try:
        from torchvision.ops import StochasticDepth

        MODULES[StochasticDepth] = _stochastic_depth_module
    except ImportError:
        pass
    _register_calls()




# ---- functions and methods -------------------------------------------------------------------------
def _tensor(value, what: str) -> Tensor4:
    if not isinstance(value, Tensor4):
        raise NotMapped(f"{what} of {type(value).__name__} values")
    return value


def _add(imp, node, a, b, alpha=1):
    if isinstance(a, Tensor4) and isinstance(b, Tensor4) and alpha == 1 and a.layout == b.layout:
        return Tensor4(imp.g.add(imp.t(a), imp.t(b), name=imp.layer_name(node)).name, a.layout)
    raise NotMapped("an addition other than of two tensors of the same layout")


def _mul(imp, node, a, b):
    if isinstance(a, tuple) and a[:1] == ("attr",):
        a, b = b, a
    if isinstance(b, tuple) and b[:1] == ("attr",):  # a learned per-channel scale (ConvNeXt's layer scale)
        x = _tensor(a, "a product")
        param = imp.module.get_parameter(b[1])
        if x.layout != "nchw" or param.numel() != imp.g[x.layer].shape[1]:
            raise NotMapped(f"a product with parameter {b[1]} of shape {tuple(param.shape)}")
        name = imp.layer_name(node, b[1].rpartition(".")[0] or None)
        y = imp.g.scale(imp.t(x), tuple(param.shape), name=name)
        imp.imported.params.setdefault(name, {})["weight"] = param.detach().cpu().double().numpy()
        imp.imported.names[(name, "weight")] = (b[1], tuple(param.shape))
        imp.parameters_used.add(b[1])
        return Tensor4(y.name)
    if isinstance(a, Tensor4) and isinstance(b, Tensor4) and a.layout == b.layout == "nchw":
        return Tensor4(imp.g.mul(imp.t(a), imp.t(b), name=imp.layer_name(node)).name)
    raise NotMapped("a product other than of two tensors or a tensor and a per-channel parameter")


def _cat(imp, node, tensors, dim=0):
    parts = [_tensor(t, "a concatenation") for t in tensors]
    if len(parts) == 1:  # DenseNet's first layer concatenates its one input
        return parts[0]
    if dim != 1 or any(p.layout != "nchw" for p in parts):
        raise NotMapped(f"concatenation along dim {dim} (only channels, dim 1)")
    return Tensor4(imp.g.concat([imp.t(p) for p in parts], name=imp.layer_name(node)).name)


def _function_flatten(imp, node, x, start_dim=0, end_dim=-1):
    return _flatten(imp, node, _tensor(x, "flatten"), start_dim, end_dim)


def _activation(method, **fixed):
    def handler(imp, node, x, *args, **kwargs):
        options = dict(fixed)
        if method == "gelu":
            options["approximate"] = kwargs.get("approximate", "none")
        if method == "hardtanh":
            low, high = (list(args) + [kwargs.get("min_val", -1.0), kwargs.get("max_val", 1.0)])[:2]
            options.update(min_val=float(low), max_val=float(high))
        return _elementwise(method, **options)(imp, node, _tensor(x, method))
    return handler


def _adaptive_function(mode):
    def handler(imp, node, x, output_size):
        return _adaptive(imp, node, _tensor(x, "adaptive pooling"), output_size, mode)
    return handler


def _pool_function(mode):
    def handler(imp, node, x, kernel_size, stride=None, padding=0, *rest, **kwargs):
        options = dict(zip(("dilation", "ceil_mode", "return_indices") if mode == "max" else
                           ("ceil_mode", "count_include_pad", "divisor_override"), rest))
        options.update(kwargs)
        if options.get("return_indices") or options.get("divisor_override") or \
                _pair(options.get("dilation", 1)) != (1, 1):
            raise NotMapped("pooling with return_indices, divisor_override or dilation")
        return _pool(imp, node, _tensor(x, "pooling"), kernel_size, stride, padding, options.get("ceil_mode", False),
                     options.get("count_include_pad", True), mode)
    return handler


def _dropout_function(imp, node, x, p=0.5, training=True, inplace=False):
    return _dropout(imp, node, _tensor(x, "dropout"), float(p)) if training else x


def _stochastic_depth_function(imp, node, x, p, mode, training=True):
    return _drop_path(imp, node, _tensor(x, "stochastic depth"), float(p), mode) if training else x


def _layer_norm_function(imp, node, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm as ConvNeXt's LayerNorm2d calls it, with its module's weight and bias."""
    path = weight[1].rpartition(".")[0] if isinstance(weight, tuple) and weight[:1] == ("attr",) else None
    module = imp.module.get_submodule(path) if path else None
    if (weight is None) != (bias is None) or (weight is not None and module is None):
        raise NotMapped("layer norm whose weight and bias are not its module's")
    return _layer_norm(imp, node, _tensor(x, "layer norm"), tuple(normalized_shape), eps, path, module,
                       affine=weight is not None)


def _permute(imp, node, x, *dims):
    x = _tensor(x, "permute")
    dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else tuple(dims)
    if len(imp.g[x.layer].shape) == 4 and dims == (0, 2, 3, 1) and x.layout == "nchw":
        return Tensor4(x.layer, "nhwc")
    if len(imp.g[x.layer].shape) == 4 and dims == (0, 3, 1, 2) and x.layout == "nhwc":
        return Tensor4(x.layer, "nchw")
    raise NotMapped(f"permute{dims} of a {x.layout.upper()} tensor (only NCHW <-> NHWC)")


def _mean(imp, node, x, dim=None, keepdim=False, **kwargs):
    x = _tensor(x, "mean")
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    dims = tuple(sorted(d % 4 for d in dims))
    if x.layout != "nchw" or dims != (2, 3) or kwargs.get("dtype") is not None:
        raise NotMapped(f"mean over {dim} (only over h and w, dims (2, 3))")
    return Tensor4(imp.g.mean(imp.t(x), dims=(2, 3), keepdim=bool(keepdim), name=imp.layer_name(node)).name)


def _size(imp, node, x, dim=None):
    shape = imp.shape_of(node.args[0])
    return shape if dim is None else shape[dim]


def _chunk(imp, node, x, chunks, dim=0):
    x = _tensor(x, "chunk")
    channels = imp.g[x.layer].shape[1]
    if dim != 1 or x.layout != "nchw" or channels % chunks:
        raise NotMapped(f"chunk({chunks}, dim={dim}) (only equal chunks of the channels, dim 1)")
    size = channels // chunks
    return tuple(Tensor4(imp.g.channel_slice(imp.t(x), k * size, (k + 1) * size,
                                             name=imp.layer_name(node, f"{node.name}_{k}")).name)
                 for k in range(chunks))


def _getitem(imp, node, value, index):
    if isinstance(value, tuple) and not value[:1] == ("attr",):
        return value[index]
    if isinstance(value, Tensor4):
        raise NotMapped("indexing a tensor")
    return operator.getitem(value, index)


def _view(imp, node, x, *shape):
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else tuple(shape)
    target = imp.shape_of(node)
    if isinstance(x, Grouped):
        if len(target) == 4 and not x.transposed:  # back to where it came from
            return Tensor4(x.layer)
        if len(target) == 4:  # ShuffleNet's channel shuffle
            y = imp.g.channel_shuffle(Tensor(imp.g, x.layer), x.groups, name=imp.layer_name(node))
            return Tensor4(y.name)
        raise NotMapped(f"view{shape} of a grouped view")
    x = _tensor(x, "view")
    source = imp.g[x.layer].shape
    if x.layout == "nchw" and len(target) == 2 and target[0] == source[0]:
        return _flatten(imp, node, x, 1, -1)
    if x.layout == "nchw" and len(source) == 4 and len(target) == 5 and target[0] == source[0] and \
            target[1] * target[2] == source[1] and tuple(target[3:]) == tuple(source[2:]):
        return Grouped(x.layer, target[1])
    if tuple(target) == tuple(source):
        return x
    raise NotMapped(f"view/reshape from {source} to {target} (only to (n, -1) and ShuffleNet's channel groups)")


def _transpose(imp, node, x, dim0, dim1):
    if isinstance(x, Grouped) and {dim0, dim1} == {1, 2}:
        return Grouped(x.layer, x.groups, not x.transposed)
    raise NotMapped(f"transpose({dim0}, {dim1}) (only ShuffleNet's of a channel-grouped view)")


def _same(imp, node, x, *args, **kwargs):  # contiguous(), clone() and the like
    return x


def _register_calls():
    import torch
    import torch.nn.functional as F

    activations = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid,
                   "tanh": torch.tanh, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
                   "hardtanh": F.hardtanh}
    FUNCTIONS.update({
        operator.add: _add, operator.iadd: _add, torch.add: _add, operator.mul: _mul, operator.imul: _mul,
        torch.mul: _mul, torch.cat: _cat, torch.concat: _cat, torch.flatten: _function_flatten,
        F.adaptive_avg_pool2d: _adaptive_function("avg"), F.adaptive_max_pool2d: _adaptive_function("max"),
        F.avg_pool2d: _pool_function("avg"), F.max_pool2d: _pool_function("max"), F.dropout: _dropout_function,
        F.layer_norm: _layer_norm_function, torch.permute: _permute, torch.mean: _mean, torch.chunk: _chunk,
        operator.getitem: _getitem, torch.transpose: _transpose, torch.sigmoid: _activation("sigmoid"),
        "stochastic_depth": _stochastic_depth_function,
        **{fn: _activation(name) for name, fn in activations.items()},
    })
    METHODS.update({
        "add": _add, "add_": _add, "mul": _mul, "flatten": _function_flatten, "permute": _permute, "mean": _mean,
        "size": _size, "chunk": _chunk, "view": _view, "reshape": _view, "transpose": _transpose,
        "contiguous": _same, "clone": _same, "relu": _activation("relu"), "relu_": _activation("relu"),
        "sigmoid": _activation("sigmoid"), "tanh": _activation("tanh"),
    })
