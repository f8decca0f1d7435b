"""Networks as their authors write them in PyTorch (torchvision's definitions), imported with
`tr.from_torch` and their code unchanged: layers and parameters; one SGD step on one device in
float64 against PyTorch's (loss, every parameter's update, the running statistics; dropout and
stochastic depth given taskrt's masks on both sides); a training step on `Machine.local(1)`
against PyTorch on one thread; the searched strategy on `Machine.local(2)` against `local(1)`;
and the search's time on 16 simulated GPUs.

Steps are timed in interleaved rounds (`bench.measure.interleaved`), medians reported.  The
goals (issue 52) are in `bench.goals`: equality within 1e-9, ResNet-50 at 0.8x PyTorch's
one-thread step and MobileNet-v2 / EfficientNet-B0 at 0.5x, the searched ResNet-50 on local(2)
at 1.3x local(1), every search on 16 simulated GPUs under 2 s.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

import taskrt as tr
from taskrt import search
from taskrt.bench.goals import ZOO_EQUAL, ZOO_SEARCH_S, ZOO_SPEED, ZOO_TWO_DEVICES
from taskrt.bench.measure import interleaved
from taskrt.bench.report import write_result
from taskrt.ops.dropout import dropout_keep
from taskrt.ops.rect import Rect

# family -> (torchvision constructor name, keyword arguments, image size of the equality check)
FAMILIES = {
    "resnet18": ("resnet18", {}, 64), "resnet50": ("resnet50", {}, 64), "vgg11_bn": ("vgg11_bn", {}, 64),
    "densenet121": ("densenet121", {}, 64), "googlenet": ("googlenet", {"aux_logits": False,
                                                                        "init_weights": True}, 64),
    # 139x139: the last blocks' batch norms see 3x3 maps; on 1x1 maps of two samples a channel's variance
    # can be nearly nothing, and the normalization amplifies rounding in any sum order past 1e-9
    "inception_v3": ("inception_v3", {"aux_logits": False, "init_weights": True}, 139),
    "squeezenet1_0": ("squeezenet1_0", {}, 64), "mobilenet_v2": ("mobilenet_v2", {}, 64),
    "mnasnet0_5": ("mnasnet0_5", {}, 64), "shufflenet_v2_x0_5": ("shufflenet_v2_x0_5", {}, 64),
    "efficientnet_b0": ("efficientnet_b0", {}, 64), "regnet_y_400mf": ("regnet_y_400mf", {}, 64),
    "convnext_tiny": ("convnext_tiny", {}, 64),
}
QUICK = ("resnet18", "mobilenet_v2")
CLASSES = 10
SPEED_BATCH, SPEED_SIZE = 32, 64


def build(family: str):
    import torch
    import torchvision.models as models

    constructor, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(models, constructor)(num_classes=CLASSES, **kwargs)


def with_taskrt_masks(module, graph, seed: int, step: int):
    """Give `module`'s dropout and stochastic-depth modules taskrt's masks for (seed, step): forward
    hooks replace their random output by input * mask / (1 - p), so one step of each computes the
    same function.  Returns the hooks' handles."""
    import torch
    from torchvision.ops import StochasticDepth

    handles = []
    layers = {layer.name: layer for layer in graph}
    for path, sub in module.named_modules():
        if not isinstance(sub, (torch.nn.Dropout, StochasticDepth)) or path not in layers:
            continue
        op = layers[path].op

        def before(m, inputs, op=op):
            m._taskrt_input = inputs[0].clone()  # an in-place dropout would change it

        def after(m, inputs, output, op=op):
            x = m._taskrt_input
            if op.kind == "drop_path":
                keep = dropout_keep(np, seed, step, op.layer, (x.shape[0],), Rect((0,), (x.shape[0],)), op.p)
                keep = keep.reshape((-1,) + (1,) * (x.dim() - 1))
            else:
                keep = dropout_keep(np, seed, step, op.layer, tuple(x.shape), Rect.full(tuple(x.shape)), op.p)
            return x * torch.from_numpy(keep.astype(np.float64)).to(x.dtype) / (1 - op.p)

        handles += [sub.register_forward_pre_hook(before), sub.register_forward_hook(after)]
    return handles


def relative(a, b, floor: float = 1e-3) -> float:
    """Largest difference over the largest value of `b`, at least `floor`: a bias that stays near
    zero because its gradient is rounding noise (a convolution's or a norm's followed by a batch
    norm, which removes any shift: gradients of 1e-13 from sums of thousands of terms) has nothing
    to be relative to, and is compared to `floor` instead."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)) if b.size else 0.0


def equality_row(family: str) -> dict:
    """One SGD step on one device in float64, taskrt against PyTorch."""
    import torch

    module = build(family).double()
    size = FAMILIES[family][2]
    started = time.perf_counter()
    graph = tr.from_torch(module, (2, 3, size, size))
    import_s = time.perf_counter() - started
    seed = 7
    trainer = tr.SingleDeviceTrainer(graph, lr=0.05, momentum=0.9, weight_decay=1e-4, dtype="float64", seed=seed)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3, size, size)), rng.integers(0, CLASSES, 2)
    loss = trainer.step(x, y)
    handles = with_taskrt_masks(module, graph, seed, 1)
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    torch_loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    torch_loss.backward()
    opt.step()
    torch_loss = float(torch_loss.detach())
    for handle in handles:
        handle.remove()
    expected = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    got = trainer.state_dict()
    params = [relative(got[k], v) for k, v in expected.items() if "running" not in k and "num_batches" not in k]
    running = [relative(got[k], v) for k, v in expected.items() if "running" in k]
    tracked = all(int(got[k]) == int(v) for k, v in expected.items() if "num_batches" in k)
    worst = max([abs(loss - torch_loss) / abs(torch_loss), *params, *running])
    return {"family": family, "layers": len(graph.layers), "parameters": sum(v.size for v in
                                                                           expected.values() if v.dtype.kind == "f"),
            "import_s": import_s, "loss_rel": abs(loss - torch_loss) / abs(torch_loss),
            "param_rel": max(params), "running_rel": max(running, default=0.0), "keys_equal": set(got) == set(expected),
            "batches_tracked": tracked, "equal": worst <= ZOO_EQUAL and set(got) == set(expected) and tracked}


def search_seconds(family: str) -> float:
    """The search on 16 simulated P100s (4 nodes x 4) of the network at batch 64, 224x224 (75x75 and
    up for Inception-v3: 299), from a fresh cost model."""
    size = 299 if family == "inception_v3" else 224
    graph = tr.from_torch(build(family), (64, 3, size, size))
    machine = tr.Machine.simulated(4, 4)
    started = time.perf_counter()
    search.optimize(graph, machine, search.CostModel(machine, cache=None, progress=False))
    return time.perf_counter() - started


def torch_step(module, threads=1):
    import torch

    opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    module.train()

    def step(x, y):
        torch.set_num_threads(threads)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        return float(loss)

    return step


def speed_rows(families, rounds: int) -> list[dict]:
    from threadpoolctl import threadpool_limits

    rows = []
    shape = (SPEED_BATCH, 3, SPEED_SIZE, SPEED_SIZE)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(shape).astype(np.float32), rng.integers(0, CLASSES, SPEED_BATCH)
    with tr.Machine.local(1, probe=False) as one, tr.Machine.local(2) as two, threadpool_limits(1), \
            tempfile.TemporaryDirectory() as tmp:
        cost_model = search.CostModel(two, cache=f"{tmp}/costs.json")
        for family in families:
            module = build(family)
            graph = tr.from_torch(module, shape)
            single = tr.Strategy({l.name: tr.ParallelConfig() for l in graph if not l.is_input})
            searched = search.optimize(graph, two, cost_model)
            runners = {"pytorch": torch_step(module),
                       "local(1)": tr.Trainer(graph, single, one, lr=1e-3, momentum=0.9).step,
                       "local(2) searched": tr.Trainer(graph, searched, two, lr=1e-3, momentum=0.9).step}
            med = interleaved(runners, x, y, rounds, f"zoo {family}")
            rows.append({"family": family, "pytorch_ms": med["pytorch"] * 1e3, "local1_ms": med["local(1)"] * 1e3,
                         "local2_ms": med["local(2) searched"] * 1e3,
                         "local1_vs_pytorch": med["pytorch"] / med["local(1)"],
                         "local2_vs_local1": med["local(1)"] / med["local(2) searched"],
                         "searched_devices": searched.meta.get("device_count", 2),
                         "speed_goal": ZOO_SPEED.get(family), "two_device_goal": ZOO_TWO_DEVICES.get(family)})
    return rows


COLUMNS = [("family", "family"), ("layers", "layers"), ("parameters", "parameters"), ("import_s", "import s"),
           ("loss_rel", "loss rel. err."), ("param_rel", "worst parameter rel. err."),
           ("running_rel", "running stats rel. err."), ("equal", "equal (1e-9)"), ("search_s", "search s (16 GPUs)"),
           ("local1_vs_pytorch", "local(1) / PyTorch 1 thread"), ("local2_vs_local1", "local(2) / local(1)")]


def run(out_dir="results", quick=False):
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print("bench zoo: skipped, torchvision is not installed (bash ../shared/tools/torchvision_cpu.sh .venv)")
        return []
    families = QUICK if quick else tuple(FAMILIES)
    rows = []
    for family in families:
        print(f"zoo: {family}", flush=True)
        row = equality_row(family)
        row["search_s"] = search_seconds(family)
        rows.append(row)
    speed = {r["family"]: r for r in speed_rows([f for f in families if f in ZOO_SPEED or f in ZOO_TWO_DEVICES]
                                                or families[:1], 2 if quick else 5)}
    for row in rows:
        row.update(speed.get(row["family"], {}))
    slowest = max(rows, key=lambda r: r["search_s"])
    summary = [f"equal to PyTorch within {ZOO_EQUAL:g} (float64, one SGD step, one device): "
               f"{sum(r['equal'] for r in rows)} of {len(rows)}",
               f"the search on 16 simulated GPUs under {ZOO_SEARCH_S:g} s: "
               f"{sum(r['search_s'] < ZOO_SEARCH_S for r in rows)} of {len(rows)} (slowest {slowest['family']}, "
               f"{slowest['search_s']:.2f} s)"]
    for r in speed.values():
        if r["speed_goal"]:
            summary.append(f"{r['family']}: local(1) {r['local1_ms']:.0f} ms against PyTorch on one thread "
                           f"{r['pytorch_ms']:.0f} ms = {r['local1_vs_pytorch']:.2f}x (goal >= {r['speed_goal']}x)")
        if r["two_device_goal"]:
            summary.append(f"{r['family']}: the searched strategy on local(2) ({r['searched_devices']} device(s)) "
                           f"{r['local2_ms']:.0f} ms = {r['local2_vs_local1']:.2f}x local(1) (goal >= "
                           f"{r['two_device_goal']}x)")
    write_result(out_dir, "zoo", rows, COLUMNS, {"speed_batch": SPEED_BATCH, "speed_size": SPEED_SIZE}, summary)
    for line in summary:
        print(line)
    return rows
