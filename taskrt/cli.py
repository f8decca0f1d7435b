"""taskrt's command line: `taskrt run` trains LeNet-5 on the bundled digits and shows what the
runtime did; `taskrt search` finds a layer-wise strategy for a zoo model on a machine;
`taskrt profile` times training steps device by device; `taskrt bench` runs the benchmarks."""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np


def cosine_lr(base: float, step: int, total: int) -> float:
    """Cosine decay from `base` to 0: keeps the last epochs from bouncing around the minimum."""
    return 0.5 * base * (1 + math.cos(math.pi * step / max(1, total)))


def train_digits(trainer, epochs: int, batch: int, lr: float, seed: int, out=sys.stdout):
    """Train on the digits through the dataset path (`Trainer.fit`: the workers hold the images
    and read their own part of each batch), printing loss and test accuracy per epoch with a
    progress bar; returns (test accuracy, seconds)."""
    from taskrt.data.datasets import digits

    size = trainer.graph.inputs[0].shape[-1]
    train, test = digits(image_size=size, seed=seed)
    print(f"digits: {len(train)} training and {len(test)} test images, {size}x{size}, scikit-learn's bundled "
          f"copy, placed once on the devices that read them; each step sends only its {batch} sample indices",
          file=out)
    start = time.perf_counter()

    def report(epoch):
        print(f"epoch {epoch.epoch:2d}  loss {epoch.loss:.4f}  test accuracy {epoch.eval_accuracy:.2%}  "
              f"({epoch.seconds:.1f} s, {time.perf_counter() - start:.1f} s in all)", file=out, flush=True)

    history = trainer.fit(train, epochs=epochs, seed=seed, eval_dataset=test,
                          lr_schedule=lambda step, total: cosine_lr(lr, step, total), on_epoch=report)
    return history.eval_accuracy[-1], time.perf_counter() - start


def lenet_mixed_strategy(graph):
    """A hand-written layer-wise strategy for LeNet-5 on two devices: sample-parallel first
    convolution, the second convolution and its pooling split over height (halo rows move),
    the fully-connected layers split over channels (model parallel), the loss on one device."""
    from taskrt.graph.config import ParallelConfig as P
    from taskrt.graph.strategy import Strategy

    configs = {}
    for layer in graph:
        if layer.is_input:
            continue
        if layer.name in ("conv2", "pool2"):
            configs[layer.name] = P(h=2)
        elif layer.kind == "linear":
            configs[layer.name] = P(c=2, devices=(1, 0) if layer.name.startswith("fc2") else (0, 1))
        elif layer.kind == "softmax_cross_entropy":
            configs[layer.name] = P(devices=(0,))
        else:
            configs[layer.name] = P(n=2)
    return Strategy(configs, name="lenet5-mixed")


def predicted_step_s(trainer) -> float:
    """The training plan's step time as the simulator predicts it from the cost model's
    measurements on this machine (cached on disk, so later runs measure nothing)."""
    from taskrt.search import CostModel

    cost_model = CostModel(trainer.machine)
    plan = trainer.plan
    return cost_model.simulate(plan, fused=trainer.executor.fused, executor=trainer.executor_kind).step_s


def cmd_run(args):
    from taskrt import models
    from taskrt.machines.machine import Machine
    from taskrt.observing.dashboard import page_url
    from taskrt.training.memory import summary as memory_summary
    from taskrt.training.trainer import Trainer

    graph = models.lenet5(batch=args.batch)
    with Machine.local(args.devices) as machine:
        strategy = lenet_mixed_strategy(graph) if args.devices == 2 else _data_parallel(graph, args.devices)
        trainer = Trainer(graph, strategy, machine, lr=args.lr, momentum=0.9, weight_decay=5e-4, seed=args.seed)
        print(f"\nLeNet-5, batch {args.batch}, on {args.devices} devices, strategy {strategy.name!r}:")
        print(trainer.strategy.table(graph))
        plan = trainer.plan
        print(f"\none step: {len(plan.tasks)} tasks ({_phases(plan)}), "
              f"{plan.bytes_moved:,} bytes moved between devices")
        predicted = predicted_step_s(trainer)
        trainer.publish(predicted)
        print(f"predicted step time {predicted * 1e3:.1f} ms (the plan simulated with measured costs)")
        print(f"strategy, bytes and step times as it trains: {page_url(machine.client)}\n")
        accuracy, seconds = train_digits(trainer, args.epochs, args.batch, args.lr, args.seed)
        trainer.publish()
        stats = trainer.stats
        measured = stats.measured_bytes
        print(f"\nlast step: {stats.summary()}")
        agree = "equal to" if measured == stats.planned_bytes else "DIFFERENT FROM"
        print(f"bytes per device pair from the workers' transfer logs: "
              f"{', '.join(f'{s}->{d}: {b:,}' for (s, d), b in sorted(measured.items()))} ({agree} the plan)")
        print(memory_summary(trainer.memory()))
    verdict = "reached" if accuracy >= 0.95 else "did NOT reach"
    print(f"final test accuracy {accuracy:.2%} after {seconds:.1f} s: {verdict} the 95% goal")
    return 0 if accuracy >= 0.95 else 1


def _phases(plan) -> str:
    return ", ".join(f"{count} {phase}" for phase, count in sorted(plan.phase_counts().items()))


def _data_parallel(graph, devices):
    from taskrt.graph.config import ParallelConfig as P
    from taskrt.graph.strategy import Strategy

    return Strategy({l.name: P(n=devices) for l in graph if not l.is_input}, name=f"data-parallel-{devices}")


def random_batch(graph, seed: int = 0) -> tuple:
    """A seeded batch for every input of `graph`: standard normal images, labels of its classes."""
    from taskrt.data.arrays import data_inputs, logits_layer

    rng = np.random.default_rng(seed)
    classes = graph[logits_layer(graph)].shape[1]
    return tuple(rng.integers(0, classes, layer.shape) if layer.op.dtype == "int64"
                 else rng.standard_normal(layer.shape).astype(np.float32) for layer in data_inputs(graph))


def profile_cost_model(machine, cache=None):
    """What `taskrt profile` simulates the plan with: the search's cost model of `machine` (its
    runtime calibrated and parts timed once, then cached in `cache`)."""
    from taskrt.search import CostModel

    return CostModel(machine, cache=cache)


def profile_strategy(spec: str, graph, machine, cost_model):
    """--strategy: 'data-parallel', 'search' (search.optimize under `cost_model`) or a JSON file."""
    from taskrt.graph.strategy import Strategy

    if spec == "data-parallel":
        return _data_parallel(graph, machine.num_devices)
    if spec == "search":
        from taskrt import search

        return search.optimize(graph, machine, cost_model)
    return Strategy.load(spec, graph, machine)


def cmd_profile(args):

    from taskrt.graph.strategy import StrategyError
    from taskrt.machines.machine import Machine
    from taskrt.observing.dashboard import page_url
    from taskrt.training.trainer import Trainer

    kwargs = {k: v for k, v in (("batch", args.batch), ("image_size", args.image_size),
                                ("num_classes", args.classes)) if v is not None}
    graph = zoo_graph("profile", args.model, kwargs)
    batch = random_batch(graph, args.seed)
    with Machine.local(args.devices) as machine:
        cost_model = profile_cost_model(machine, args.cache)
        try:
            strategy = profile_strategy(args.strategy, graph, machine, cost_model)
        except StrategyError as error:
            raise SystemExit(f"taskrt profile: --strategy {args.strategy}: {error}") from None
        trainer = Trainer(graph, strategy, machine, lr=args.lr, momentum=0.9, seed=args.seed)
        print(f"{graph.name}, batch {graph.inputs[0].shape[0]}, on {machine.description}, strategy "
              f"{strategy.name or args.strategy!r}: {args.warmup} step(s) to warm up, then {args.steps} profiled")
        for _ in range(args.warmup):
            trainer.step(*batch)
        profile = trainer.profile(*batch, steps=args.steps, path=args.trace, png=args.png, cost_model=cost_model)
        print(profile.summary())
        for problem in profile.check():
            print(f"inconsistent: {problem}")
        print(f"the last profiled step on the dashboard: {page_url(machine.client)}")
        if args.serve:
            print(f"serving the dashboard for {args.serve:g} s")
            time.sleep(args.serve)
    return 0


def zoo_graph(command: str, name: str, kwargs: dict):
    """A zoo model, or one line saying why not (a size the network cannot take), before any machine starts."""
    from taskrt import models

    try:
        return models.get(name, **kwargs)
    except ValueError as error:  # models.get's own checks, and shapes the layers cannot take
        raise SystemExit(f"taskrt {command}: {error}") from None


def machine_devices(spec: str) -> int:
    """The device count of a --machine spec (already checked by `_machine`)."""
    kind, _, rest = spec.partition(":")
    if kind == "simulated":
        nodes, per_node = (int(v) for v in rest.partition(":")[0].lower().split("x"))
        return nodes * per_node
    return int(rest or 2)


def parse_machine(spec: str):
    """'simulated:4x4[:P100]' or 'local:2' (checked by `_machine`) -> Machine."""
    from taskrt.machines.machine import Machine

    kind, _, rest = spec.partition(":")
    if kind == "simulated":
        shape, _, device_kind = rest.partition(":")
        nodes, per_node = (int(v) for v in shape.lower().split("x"))
        return Machine.simulated(nodes, per_node, device_kind=device_kind or "P100")
    return Machine.local(machine_devices(spec))


def cmd_search(args):
    from taskrt import search
    from taskrt.planning.lowering import lower

    if args.measure and not args.machine.startswith("local"):
        raise SystemExit(f"taskrt search: --measure times the candidates on a running cluster: use --machine "
                         f"local:<devices>, not {args.machine}")
    devices = machine_devices(args.machine)
    if args.devices is not None and args.devices != devices:
        raise SystemExit(f"taskrt search: --devices {args.devices} does not match --machine {args.machine} "
                         f"({devices} devices)")
    batch = args.batch_per_device * devices
    kwargs = {"batch": batch}
    if args.image_size:
        kwargs["image_size"] = args.image_size
    if args.classes:
        kwargs["num_classes"] = args.classes
    graph = zoo_graph("search", args.model, kwargs)
    machine = parse_machine(args.machine)
    try:
        cost_model = search.CostModel(machine, cache=args.cache, placement=args.placement)
        try:
            strategy = search.optimize(graph, machine, cost_model, check_by_measurement=args.measure,
                                       memory=args.memory)
        except search.MemoryBudgetError as error:
            raise SystemExit(f"taskrt search: {error}") from None
        meta = strategy.meta
        info = meta["search"]
        print(f"{args.model}, batch {batch} ({args.batch_per_device} per device), on {machine.description}")
        print(f"search: {info['configs']} configs, cost tables {info['tables_s']:.3f} s, node/edge elimination "
              f"{info['optimize_s'] * 1e3:.2f} ms, reduced graph {info['reduced_nodes']} nodes ({info['method']})")
        if meta.get("memory_budget") is None:
            print("memory budget: none\n")
        else:
            bound = ("it bound: the fastest strategy that fits, searched in "
                     f"{info['budget_s'] * 1e3:.1f} ms ({info['budget']['method']})" if meta["memory_bound"]
                     else "the fastest strategy fits")
            if meta.get("recomputed"):
                bound += f"; recomputing {len(meta['recomputed'])} layers in backward: {', '.join(meta['recomputed'])}"
            print(f"memory budget: {meta['memory_budget'] / 2**20:.1f} MiB per device; {bound}\n")
        if "device_counts" in meta:
            print(f"devices: kept {meta['device_count']} of {machine.num_devices}; simulated step per device count: "
                  + ", ".join(f"{k}: {v['simulated_step_s'] * 1e3:.1f} ms" for k, v in meta["device_counts"].items())
                  + "\n")
        if args.measure:
            measured = meta["chosen_by_measurement"]
            print("measured on the machine (median step of " + str(measured["rounds"]) + " rounds): " + ", ".join(
                f"{name} {seconds * 1e3:.1f} ms" for name, seconds in sorted(measured["median_step_s"].items(),
                                                                               key=lambda kv: kv[1]))
                  + f"; chosen: {measured['chosen']}\n")
        print(report(graph, strategy))
        simulated = cost_model.simulate(lower(graph, strategy)).step_s
        measured = meta.get("chosen_by_measurement", {}).get("median_step_s", {}).get(
            meta.get("chosen_by_measurement", {}).get("chosen"))
        print(f"\nstep time of this strategy: {simulated * 1e3:.1f} ms simulated (its plan list-scheduled with "
              "the measured costs: the figure to expect)"
              + (f"; {measured * 1e3:.1f} ms measured" if measured else "")
              + "\n  equation 1 adds the layers' costs up with nothing overlapping: "
              f"{meta['predicted_step_s'] * 1e3:.1f} ms, the search's objective for ranking strategies, "
              "not a step time")
        print("\nmemory per device of one step as the search counts it, every value a step ever holds (parameters, "
              "gradients, optimizer state, activations kept for backward, largest backward working set):")
        print(memory_report(strategy.meta["memory_per_device"], machine))
        schedule = meta.get("schedule_peak_per_device")
        if schedule:
            scratch = meta.get("schedule_scratch_per_device") or {}
            print("peak under the runtime's schedule (what a trainer checks against the budget), kernels' scratch "
                  "included: " + ", ".join(f"device {d} {(v + scratch.get(d, 0)) / 2**20:.1f} MiB"
                                           for d, v in schedule.items()))
        if args.compare:
            print("\nequation 1 of the standard strategies under the same cost model:")
            for name, make in search.BASELINES.items():
                total = cost_model.breakdown(graph, make(graph, machine)).total
                ratio = total / meta["predicted_step_s"]
                print(f"  {name:<6} {total * 1e3:10.3f} ms   (layer-wise is {ratio:.2f}x faster)")
        if args.out:
            strategy.save(args.out)
            print(f"\nstrategy written to {args.out}")
    finally:
        machine.close()
    return 0


def memory_report(memory: dict, machine) -> str:
    """The per-device memory table (MiB), with each device's capacity where the machine knows it."""
    from taskrt.planning.memory import KINDS

    rows = [f"{'device':>6} " + " ".join(f"{k:>12}" for k in (*KINDS, "total")) + f" {'of capacity':>12}   (MiB)"]
    for device, m in memory.items():
        capacity = machine.devices[int(device)].memory
        share = f"{m['total'] / capacity:12.1%}" if capacity else f"{'?':>12}"
        rows.append(f"{device:>6} " + " ".join(f"{m[k] / 2**20:12.2f}" for k in (*KINDS, "total")) + f" {share}")
    return "\n".join(rows)


def report(graph, strategy) -> str:
    """The chosen strategy per layer, in the style of the paper's Table 5, with predicted costs."""
    from taskrt.graph.config import DIMS

    meta = strategy.meta
    rows = [f"{'layer':<28} {'kind':<22} {'config':<24} {'devices':<10} {'t_c ms':>9} {'t_x ms':>9} {'t_s ms':>9}"
            "  sync"]
    for name in graph.layers:
        cfg, cost = strategy[name], meta["per_layer_s"][name]
        degrees = "{" + ", ".join(f"{d}={getattr(cfg, d)}" for d in DIMS) + "}"
        span = f"{cfg.devices[0]}-{cfg.devices[-1]}" if len(cfg.devices) > 1 else str(cfg.devices[0])
        sync = cfg.sync if graph[name].param_shapes and (cfg.n, cfg.h, cfg.w) != (1, 1, 1) else ""
        rows.append(f"{name:<28} {graph[name].kind:<22} {degrees:<24} {span:<10} {cost['t_c'] * 1e3:9.3f} "
                    f"{cost['t_x'] * 1e3:9.3f} {cost['t_s'] * 1e3:9.3f}  {sync}")
    rows.append(f"equation 1 (the sum of the columns): {meta['predicted_step_s'] * 1e3:.3f} ms"
                + (" (t_c: roofline estimates for the simulated device kind)" if meta["estimated"] else ""))
    return "\n".join(rows)


class Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line naming the argument and what is valid, no usage dump;
    no abbreviated options (a misspelt one is named rather than taken for another)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _number(kind, least, what):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < least or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = what
    return parse


POSITIVE = _number(int, 1, "a whole number of at least 1")
COUNT = _number(int, 0, "a whole number of at least 0")
RATE = _number(float, 1e-300, "a positive number")
SECONDS = _number(float, 0.0, "a number of seconds of at least 0")


def _model(text):
    from taskrt.graph.models import MODELS

    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; known models: {', '.join(MODELS)}")
    return text


def _machine(text):
    """'simulated:<nodes>x<per node>[:<kind>]' or 'local:<devices>', checked before anything starts."""
    from taskrt.machines.device_kinds import DEVICE_KINDS

    kind, _, rest = text.partition(":")
    if kind == "simulated":
        shape, _, device_kind = rest.partition(":")
        parts = shape.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: expected simulated:<nodes>x<devices per node>[:<kind>], "
                                             "e.g. simulated:4x4:P100")
        if device_kind and device_kind not in DEVICE_KINDS:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown device kind {device_kind!r}; known: "
                                             f"{', '.join(DEVICE_KINDS)}")
        return text
    if kind == "local" and (rest == "" or (rest.isdigit() and int(rest) >= 1)):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected local:<devices> (e.g. local:2) or "
                                     "simulated:<nodes>x<devices per node>[:<kind>] (e.g. simulated:4x4)")


def _memory_budget(text):
    """--memory: bytes per device ('16GiB', '512MiB', '2GB', a number of bytes) or 'off'."""
    from taskrt.search.budget import parse_memory

    if text == "off":
        return False
    try:
        return parse_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a budget per device such as 16GiB, 512MiB, 2GB or a number of "
                                         f"bytes, or off, got {text!r}") from None


def _writable(text):
    """A file to write: its directory must exist."""
    from pathlib import Path

    if not Path(text).expanduser().resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: its directory does not exist")
    return text


def _strategy(text):
    from pathlib import Path

    if text in ("data-parallel", "search") or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected data-parallel, search or a strategy JSON file "
                                     "(taskrt search --out FILE writes one); no such file")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless there is none or the help already names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> Parser:
    parser = Parser(prog="taskrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser,
                                metavar="{run,search,profile,bench}")
    defaults = _Defaults
    run = sub.add_parser("run", help="train LeNet-5 on the bundled digits and report what happened",
                         description="Train LeNet-5 on scikit-learn's digits on local devices under a hand-written "
                                     "layer-wise strategy, printing the strategy, the bytes a step moves, the "
                                     "predicted and measured step times and the test accuracy per epoch.",
                         formatter_class=defaults)
    run.add_argument("--epochs", type=POSITIVE, default=10, help="passes over the training images")
    run.add_argument("--batch", type=POSITIVE, default=64, help="images per step (the graph's batch size)")
    run.add_argument("--lr", type=RATE, default=0.02, help="learning rate at the start (cosine decay to 0)")
    run.add_argument("--seed", type=COUNT, default=0, help="initial weights and the order of the batches")
    run.add_argument("--devices", type=POSITIVE, default=2, help="local devices (worker processes)")
    run.set_defaults(func=cmd_run)
    models = "lenet5, alexnet, vgg16, inception_v3, resnet50 or splitbrain_vgg"
    find = sub.add_parser("search", help="find the best layer-wise strategy for a model on a machine",
                          formatter_class=defaults)
    find.add_argument("--model", required=True, type=_model, help=models)
    find.add_argument("--machine", default="simulated:4x4", type=_machine,
                      help="simulated:<nodes>x<per node>[:P100] or local:<n>")
    find.add_argument("--devices", type=POSITIVE, help="device count (checked against --machine)")
    find.add_argument("--batch-per-device", type=POSITIVE, default=32,
                      help="images per device (the graph's batch is this times the device count)")
    find.add_argument("--image-size", type=POSITIVE, help="default: the network's published size")
    find.add_argument("--classes", type=POSITIVE, help="default: the network's published class count")
    find.add_argument("--placement", choices=["first", "aligned"], default="first",
                      help="first: a layer split P ways runs on devices 0..P-1; aligned: also on every block "
                           "k*P..(k+1)*P-1")
    find.add_argument("--memory", type=_memory_budget, default=None,
                      help="memory budget per device (e.g. 16GiB, 512MiB, 2GB; off: none): the fastest strategy "
                           "whose predicted step fits (default: each device's own memory)")
    find.add_argument("--cache", type=_writable, help="cost cache file (default: ~/.cache/taskrt/costs.json)")
    find.add_argument("--out", type=_writable, help="write the strategy as JSON")
    find.add_argument("--compare", action="store_true", help="also show data, model and OWT parallelism")
    find.add_argument("--measure", action="store_true",
                      help="local machines: time the result and data, model and OWT parallelism a few steps each "
                           "and keep the fastest")
    find.set_defaults(func=cmd_search)
    prof = sub.add_parser("profile", help="profile training steps of a zoo model into a per-device timeline, "
                                          "measured beside simulated (Chrome trace and PNG)", formatter_class=defaults)
    prof.add_argument("model", type=_model, help=models)
    prof.add_argument("--devices", type=POSITIVE, default=2, help="local devices (worker processes)")
    prof.add_argument("--batch", type=POSITIVE, help="default: the model's")
    prof.add_argument("--image-size", type=POSITIVE, help="default: the network's published size")
    prof.add_argument("--classes", type=POSITIVE, help="default: the network's published class count")
    prof.add_argument("--strategy", default="data-parallel", type=_strategy,
                      help="data-parallel, search, or a JSON file")
    prof.add_argument("--steps", type=POSITIVE, default=3, help="steps profiled")
    prof.add_argument("--warmup", type=COUNT, default=3, help="steps before, not profiled")
    prof.add_argument("--trace", default="trace.json", type=_writable,
                      help="the Chrome trace (Perfetto, chrome://tracing)")
    prof.add_argument("--png", default="trace.png", type=_writable, help="the Gantt chart of the last step")
    prof.add_argument("--cache", type=_writable, help="cost cache file (default: ~/.cache/taskrt/costs.json)")
    prof.add_argument("--lr", type=RATE, default=0.001, help="learning rate (SGD)")
    prof.add_argument("--seed", type=COUNT, default=0, help="initial weights and the batches")
    prof.add_argument("--serve", type=SECONDS, default=0.0, help="seconds to keep the dashboard up afterwards")
    prof.set_defaults(func=cmd_profile)
    sub.add_parser("bench", help="the benchmark runner: taskrt bench <name>|all [--quick] (= python -m taskrt.bench)",
                   add_help=False)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from taskrt.bench.__main__ import main as bench_main

        return bench_main(argv[1:], prog="taskrt bench")
    args = build_parser().parse_args(argv)
    from taskrt.data.datasets import DatasetError
    from taskrt.graph.graph import GraphError
    from taskrt.graph.strategy import StrategyError
    from taskrt.machines.devices import MachineError
    from taskrt.ops.errors import ShapeError
    from taskrt.training.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (GraphError, StrategyError, MachineError, DatasetError, CheckpointError, ShapeError) as error:
        raise SystemExit(f"taskrt {args.command}: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
