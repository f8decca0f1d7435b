"""Bring a PyTorch model: a `torch.nn.Module` traced with torch.fx into a Graph.

    g = tr.from_torch(torchvision.models.resnet18(num_classes=10), (32, 3, 64, 64))
    trainer = tr.Trainer(g, strategy, machine)          # starts from the module's own weights
    module.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()})

torch.fx's symbolic tracing (rather than torch.export) because it keeps the module's own calls:
`nn.Conv2d` at `layer1.0.conv1` stays one node naming its module, so layers are named by module
path and their parameters map one to one onto the module's `state_dict()`; torch.export lowers to
ATen ops and loses that mapping.  Its limit is data-dependent control flow, which it cannot trace:
the error says so and names the usual fixes (a leaf module, `concrete_args`).

Each node becomes a layer kind taskrt already knows (region rules, kernels, costs).  Patterns are
lowered to channel ops on NCHW rather than new layouts: a permute to NHWC, LayerNorm or Linear
over the last axis and a permute back (ConvNeXt) are a layer norm over channels and a 1x1
convolution; ShuffleNet's view/transpose/view is a channel shuffle; `chunk` along channels is
channel slices.  Whatever cannot be mapped is listed, every occurrence with its module path and
the torch operation, in one GraphError before anything runs.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from taskrt.graph.graph import Graph, GraphError, Tensor
from taskrt.graph.torch_calls import (
    FUNCTIONS,
    METHODS,
    MODULES,
    Grouped,
    NotMapped,
    Tensor4,
    Unmapped,
    flat,
    register,
    torchvision_leaves,
)


@dataclass
class Imported:
    """What an import keeps beside the graph: initial values and the module's own names."""

    params: dict = field(default_factory=dict)  # layer -> {name: array}
    buffers: dict = field(default_factory=dict)  # layer -> (2, C) running mean and variance
    # (layer, parameter) -> (state_dict name, shape there); layer -> state_dict prefix of its buffers
    names: dict = field(default_factory=dict)
    buffer_names: dict = field(default_factory=dict)
    batches_tracked: dict = field(default_factory=dict)  # state_dict name -> num_batches_tracked at import
    other_state: dict = field(default_factory=dict)  # state the graph does not use, kept as it was


def from_torch(module, input_shape, loss: str = "cross_entropy", name: str | None = None,
               leaf_modules=(), concrete_args: dict | None = None) -> Graph:
    """The Graph of `module` (its current parameters and batch-norm buffers the graph's initial
    values) for inputs of `input_shape` (n, c, h, w), ending in `loss` ("cross_entropy": a
    softmax cross-entropy over the module's output logits and an int64 "labels" input).
    `leaf_modules`: module classes to keep as calls (not traced into); `concrete_args`: values
    fixed for tracing (torch.fx.symbolic_trace's)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise GraphError(f"from_torch takes a torch.nn.Module, got {type(module).__name__}")
    if loss != "cross_entropy":
        raise GraphError(f"loss {loss!r} is not supported; give loss='cross_entropy'")
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 4 or min(shape) < 1:
        raise GraphError(f"input_shape must be (n, c, h, w) of positive ints, got {tuple(input_shape)!r}")
    return _Importer(module, shape, name or type(module).__name__.lower(), leaf_modules, concrete_args).run()


@contextmanager
def _custom_functions_kept():
    """While tracing, a custom `torch.autograd.Function` stays one call (torch.fx would trace its
    forward and lose its own backward), which no handler maps: it is reported as unsupported."""
    import torch.fx as fx
    from torch.autograd.function import Function

    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        proxies = [a for a in args if isinstance(a, fx.Proxy)]
        if not proxies:
            return original.__func__(cls, *args, **kwargs)

        def custom(*a, **k):
            return original.__func__(cls, *a, **k)

        custom.__name__ = f"{cls.__qualname__}.apply (a custom torch.autograd.Function)"
        custom.__module__ = cls.__module__
        return proxies[0].tracer.create_proxy("call_function", custom, args, kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original


def _is_attr(value) -> bool:
    return isinstance(value, tuple) and value[:1] == ("attr",)


class _Importer:
    def __init__(self, module, shape, name, leaf_modules, concrete_args):
        register()
        self.module, self.shape = module, shape
        self.leaf_modules, self.concrete_args = tuple(leaf_modules), concrete_args
        self.g = Graph(name)
        self.imported = Imported()
        self.values: dict = {}
        self.unsupported: list[str] = []
        self.used_names: set[str] = set()
        self.parameters_used: set[str] = set()

    # ---- tracing ------------------------------------------------------------------------------
    def trace(self):
        import torch
        import torch.fx as fx

        leaves = self.leaf_modules + torchvision_leaves()

        class Tracer(fx.Tracer):
            def is_leaf_module(self, m, qualified_name):
                return isinstance(m, leaves) or super().is_leaf_module(m, qualified_name)

        try:
            with _custom_functions_kept():
                graph = Tracer().trace(self.module, concrete_args=self.concrete_args)
        except Exception as error:  # noqa: BLE001  (torch.fx raises many kinds; all mean the same to the user)
            raise GraphError(
                f"torch.fx could not trace {type(self.module).__name__}: {type(error).__name__}: {error}. The usual "
                "fixes: control flow that depends on tensor values cannot be traced, so give the module whose "
                "forward has it as a leaf (from_torch(..., leaf_modules=[ThatModule]); it must then be a module "
                "taskrt maps), or fix the argument it depends on with concrete_args={name: value}") from None
        gm = fx.GraphModule(self.module, graph)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.shape_prop import ShapeProp

        was_training = self.module.training
        try:
            self.module.eval()  # shapes only: no running statistics change
            with torch.no_grad():
                dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.float32)
                # fake tensors: shapes without the arithmetic (a ResNet-50 at batch 64, 224x224: 0.6 s)
                fake = FakeTensorMode(allow_non_fake_inputs=True)
                ShapeProp(gm, fake_mode=fake).propagate(torch.zeros(self.shape, dtype=dtype))
        except Exception as error:  # noqa: BLE001
            raise GraphError(f"{type(self.module).__name__} does not run on inputs of shape {self.shape}: "
                             f"{type(error).__name__}: {error}") from None
        finally:
            self.module.train(was_training)
        return gm

    # ---- the walk -----------------------------------------------------------------------------
    def run(self) -> Graph:
        gm = self.trace()
        out = None
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                if self.values:
                    self.unsupported.append(f"{node.name}: a second input (from_torch takes one image input)")
                    self.values[node] = Unmapped()
                else:
                    self.g.input("image", self.shape)
                    self.values[node] = Tensor4("image")
            elif node.op == "output":
                out = node.args[0]
            elif node.op == "get_attr":
                self.values[node] = ("attr", node.target)
            else:
                self.values[node] = self.visit(gm, node)
        if self.unsupported:
            listed = "\n  ".join(self.unsupported)
            raise GraphError(f"{type(self.module).__name__} cannot be imported; {len(self.unsupported)} unsupported "
                             f"operation(s), each with its module path and the torch operation:\n  {listed}")
        logits = self.values.get(out) if not isinstance(out, (tuple, list)) else None
        if not isinstance(logits, Tensor4) or len(self.g[logits.layer].shape) != 2:
            raise GraphError(f"{type(self.module).__name__} must return one (n, classes) tensor of logits, got "
                             f"{out!r}")
        self.g.softmax_cross_entropy(Tensor(self.g, logits.layer), name="loss")
        self.collect_state()
        self.g.imported = self.imported
        return self.g

    def visit(self, gm, node):
        args = [self.value(a) for a in node.args]
        kwargs = {k: self.value(v) for k, v in node.kwargs.items()}
        # a call reading an unmapped value is not mapped either, but said only if it is unsupported itself
        downstream = any(isinstance(v, Unmapped) for v in flat((*args, *kwargs.values())))
        if node.op == "call_module":
            submodule = gm.get_submodule(node.target)
            handler = MODULES.get(type(submodule))
            what = f"{node.target} ({type(submodule).__module__}.{type(submodule).__name__})"
            if handler is None:
                handler = next((h for cls, h in MODULES.items() if isinstance(submodule, cls)), None)
            call = (lambda: handler(self, node, submodule, *args, **kwargs)) if handler else None
        elif node.op == "call_function":
            if not downstream and not any(isinstance(v, (Tensor4, Grouped)) or _is_attr(v)
                                          for v in flat((*args, *kwargs.values()))):
                try:  # arithmetic on sizes (ShuffleNet's channels // groups): done now
                    return node.target(*args, **kwargs)
                except Exception:  # noqa: BLE001  (then it is looked up as any call is)
                    pass
            handler = FUNCTIONS.get(node.target) or FUNCTIONS.get(getattr(node.target, "__name__", None))
            what = f"{self.where(node)} (function {getattr(node.target, '__module__', '')}." \
                   f"{getattr(node.target, '__name__', node.target)})"
            call = (lambda: handler(self, node, *args, **kwargs)) if handler else None
        else:  # call_method
            handler = METHODS.get(node.target)
            what = f"{self.where(node)} (method Tensor.{node.target})"
            call = (lambda: handler(self, node, *args, **kwargs)) if handler else None
        if call is None:
            self.unsupported.append(what)
            return Unmapped()
        if downstream:
            return Unmapped()
        try:
            return call()
        except NotMapped as reason:
            self.unsupported.append(f"{what}: {reason}")
            return Unmapped()
        except GraphError as error:
            self.unsupported.append(f"{what}: {error}")
            return Unmapped()

    def value(self, arg):
        import torch.fx as fx

        if isinstance(arg, fx.Node):
            return self.values[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.value(a) for a in arg)
        return arg

    def where(self, node) -> str:
        """The module path a call happens in (fx records the module stack), else the node's name."""
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        return path or f"(top level, {node.name})"

    def layer_name(self, node, path: str | None = None) -> str:
        """The module path where there is one (a module called twice: path_1, path_2, ...), else fx's name."""
        # a module path with characters a layer name cannot have (RegNet's "block1-0"): those become "_";
        # the module's own names stay in the state_dict mapping
        base = re.sub(r"[^A-Za-z0-9_.]", "_", path or node.name)
        name, k = base, 0
        while name in self.used_names or name in self.g.layers:
            k += 1
            name = f"{base}_{k}"
        self.used_names.add(name)
        return name

    def shape_of(self, node) -> tuple:
        meta = node.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None else ()

    def t(self, value: Tensor4) -> Tensor:
        return Tensor(self.g, value.layer)

    # ---- parameters and buffers ---------------------------------------------------------------
    def keep(self, layer: str, path: str, module, names=("weight", "bias"), shapes=None):
        """The module's parameters as the layer's initial values, under their state_dict names."""
        for pname in names:
            tensor = getattr(module, pname, None)
            if tensor is None:
                continue
            array = tensor.detach().cpu().double().numpy()
            want = (shapes or {}).get(pname, array.shape)
            self.imported.params.setdefault(layer, {})[pname] = array.reshape(want)
            self.imported.names[(layer, pname)] = (f"{path}.{pname}" if path else pname, tuple(array.shape))
            self.parameters_used.add(f"{path}.{pname}" if path else pname)

    def keep_running(self, layer: str, path: str, module):
        mean, var = (getattr(module, k).detach().cpu().double().numpy() for k in ("running_mean", "running_var"))
        self.imported.buffers[layer] = np.stack([mean, var])
        self.imported.buffer_names[layer] = path
        tracked = getattr(module, "num_batches_tracked", None)
        if tracked is not None:
            self.imported.batches_tracked[f"{path}.num_batches_tracked"] = int(tracked)
        for k in ("running_mean", "running_var", "num_batches_tracked"):
            self.parameters_used.add(f"{path}.{k}")

    def collect_state(self):
        """State of the module the graph does not use, kept so that `state_dict()` is complete."""
        for key, value in self.module.state_dict().items():
            if key not in self.parameters_used:
                self.imported.other_state[key] = value.detach().cpu().numpy().copy()




def state_dict(graph, params: dict, running: dict, batches: int, dtype=None) -> dict:
    """{name: numpy array} of a trained graph under the module's own `state_dict()` names (and
    shapes), which `module.load_state_dict({k: torch.from_numpy(v) ...}, strict=True)` takes:
    `params` {layer: {name: array}}, `running` {layer: (2, C) running mean and variance},
    `batches` the training forwards since the import (each batch norm's num_batches_tracked
    counts them).  A graph built with taskrt's own API gets "<layer>.<name>" names."""
    imported = getattr(graph, "imported", None)
    out = {}
    if imported is None:
        for layer, values in params.items():
            out.update({f"{layer}.{k}": np.asarray(v) for k, v in values.items()})
        for layer, stats in running.items():
            out[f"{layer}.running_mean"], out[f"{layer}.running_var"] = np.asarray(stats[0]), np.asarray(stats[1])
        return out
    for key, value in imported.other_state.items():
        out[key] = value
    for (layer, pname), (name, shape) in imported.names.items():
        out[name] = np.asarray(params[layer][pname]).reshape(shape)
    for layer, path in imported.buffer_names.items():
        out[f"{path}.running_mean"], out[f"{path}.running_var"] = (np.asarray(a) for a in running[layer])
    for name, tracked in imported.batches_tracked.items():
        out[name] = np.array(tracked + batches, dtype=np.int64)
    return out
