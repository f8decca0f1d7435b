"""The training runs of bench ist (seed 004): a generated task shaped like the seed's speech data,
Table 1's time to fixed test accuracies, and Sec. 3.3's ablation of batch norm.

The task (`speech_like`), shaped like the seed's 2-layer Google Speech network (4096 features, 35
classes, hidden layers of 4096), with what training on it needs: the network, each step's batches
for n sites, and test accuracy of the whole network.  No download: every class is a mixture of
`modes` Gaussian clusters in a `latent`-dimensional space, seen through a fixed random projection
to `features` dimensions, a tanh, and noise in every feature.  A class is not one blob, so no
linear read-out separates the classes; a hidden layer learns it in a few hundred steps.

Table 1 (`table1`): the time data parallelism (DP), local SGD and IST take to reach fixed test
accuracies, measured on Machine.local(2) and by simulation on 2, 4 and 8 devices.

- Every method, at n sites, trains the same network from the same initial parameters on the same
  samples: each step, each site takes its own batch of `site_batch` samples (DP: the n batches
  are one global batch of n x site_batch split over the devices, as PyTorch's data parallelism
  with a per-process batch; local SGD and IST: each site steps on its own batch and the sites
  synchronize every `local_steps` steps).  Plain SGD, as the seed.
- Learning rate: the same search for every method and site count, in this process (the sites
  one after another; DP at n sites is single-device SGD on the global batch): the rungs of
  `ladder` in the order `first`, then one rung further out while the best is at an edge; the
  best is the one that reaches the highest target in the fewest steps.  A run stops at the
  highest target, or once it has taken as many steps as the best so far (it cannot win).
- Test accuracy of the whole network, its batch norms' statistics recomputed on training samples
  (the seed's Sec. 3.3), at every `local_steps` steps up to 20 of them, then every 5% of the
  steps so far.
- Measured: the three methods on Machine.local(2) with the learning rates found for 2 sites,
  interleaved (one round of `local_steps` steps of each in turn, so a busy moment of the shared
  machine hits all three); time is the wall time of their steps (data sent, computed, synchronized)
  without the evaluations, which are reported beside.
- Simulated: the steps to each target at n sites (from the search above) times the simulated time
  of a step: the method's plan (a DP step, a round of local SGD or IST divided by its steps) on
  n devices linked by `link_bandwidth` (the seed's EC2 instances: "up to 10 Gbps"), each task
  taking its kernel time measured in this process with one thread (a device is one core, as a
  Machine.local worker), no runtime overhead.

The ablation (`ablation`): the seed argues that a subnet sees a neuron's input summed over 1/n of
the previous layer, the deployed network over all of it, and that IST "will simply not work"
without normalization.  Here IST trains the speech-shaped network for `steps` steps at each site
count, with batch norm (hidden layers bias-free) and without (hidden layers with a bias, as
PyTorch's default linear layer), each at the best learning rate of the same search (best final
test accuracy), and the whole network is evaluated: with batch norm, with the running statistics
the subnets collected and with statistics recomputed with the whole network.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace

import numpy as np
from threadpoolctl import threadpool_limits

from taskrt import Graph, Machine, Strategy, lower
from taskrt.data.arrays import bind_inputs
from taskrt.machines.machine import Device
from taskrt.planning.inprocess import buffer_tiles, data_tiles, run_plan, shard_states
from taskrt.planning.params import init_buffers, init_parameters
from taskrt.planning.simulate import Runtime, simulate
from taskrt.search.baselines import data_parallel
from taskrt.training.ist import ISTTrainer, LocalSGDTrainer, full_network_logits, plan_round, units_of
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer


# ---- the generated task ----------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    calibrate: np.ndarray  # training samples the batch norms' statistics are recomputed on

    @property
    def features(self) -> int:
        return self.x_train.shape[1]

    @property
    def classes(self) -> int:
        return int(self.y_train.max()) + 1


def speech_like(features=4096, classes=35, train=16384, test=1024, calibrate=256, latent=32, modes=4, noise=1.0,
                seed=0) -> Task:
    """Seeded: the same arguments give the same task.  Features standardized with the training
    set's mean and deviation."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, modes, latent))
    projection = rng.standard_normal((latent, features)) / np.sqrt(latent)
    n = train + test
    y = rng.integers(0, classes, n)
    z = centers[y, rng.integers(0, modes, n)] + rng.standard_normal((n, latent))
    x = (np.tanh(z @ projection) + noise * rng.standard_normal((n, features))).astype(np.float32)
    mean, std = x[:train].mean(axis=0), x[:train].std(axis=0)
    x = (x - mean) / std
    return Task(x[:train], y[:train], x[train:], y[train:], x[:calibrate])


def network(widths, batch: int, norm=True, bias=False, name="speech") -> Graph:
    """widths[0] features -> hidden linear layers (each [batch norm] ReLU) -> widths[-1] classes
    (the output layer bias-free, as IST needs).  `bias`: on the hidden layers (with batch norm
    its shift does that job)."""
    g = Graph(name)
    x = g.input("x", (batch, widths[0]))
    for i, width in enumerate(widths[1:-1], start=1):
        x = g.linear(x, width, bias=bias, name=f"fc{i}")
        if norm:
            x = g.batch_norm(x, name=f"bn{i}")
        x = g.relu(x, name=f"relu{i}")
    g.softmax_cross_entropy(g.linear(x, widths[-1], bias=False, name="out"), name="loss")
    return g


def dp_strategy(graph, machine) -> Strategy:
    """The data-parallel baseline: every layer on every device, gradients summed by ring all-reduce."""
    dp = data_parallel(graph, machine)
    return Strategy({name: replace(config, sync="allreduce") for name, config in dp.configs.items()},
                    name="data parallel, ring all-reduce")


def site_batches(task: Task, sites: int, batch: int, seed: int):
    """Endless steps: each a list of `sites` (x, labels) batches of `batch` samples, cut in turn
    from shuffled epochs of the training set.  Every method sees the same samples at a step."""
    rng = np.random.default_rng(seed)
    order, at = rng.permutation(len(task.x_train)), 0
    while True:
        step = []
        for _ in range(sites):
            if at + batch > len(order):
                order, at = rng.permutation(len(task.x_train)), 0
            idx = order[at : at + batch]
            at += batch
            step.append((task.x_train[idx], task.y_train[idx]))
        yield step


def test_accuracy(graph, task: Task, params: dict, buffers: dict, calibrated=True) -> float:
    """Test accuracy of the whole network; its batch norms normalize with statistics recomputed on
    `task.calibrate` (the seed's Sec. 3.3), or with their running statistics.  NaN where the
    parameters are not finite (a diverged run)."""
    running = {k: np.stack([v["running_mean"], v["running_var"]]) for k, v in buffers.items()}
    calibrate = task.calibrate if calibrated and running else None
    logits = full_network_logits(graph, units_of(graph), params, running, task.x_test, calibrate)
    if not np.isfinite(logits).all():
        return float("nan")
    return float((logits.argmax(axis=1) == task.y_test).mean())


# ---- Table 1: time to accuracy ---------------------------------------------------------------
METHODS = {"dp": "data parallel", "local_sgd": "local SGD", "ist": "IST"}
SEED, DATA_SEED = 0, 1

# The seed's Table 1, Google Speech 2-layer (seconds): method -> target -> (2, 4, 8 nodes)
SEED_TABLE_1 = {"dp": {0.63: (118, 269, 450), 0.75: (759, 1708, 2417)},
                "local_sgd": {0.63: (68, 130, 235), 0.75: (444, 742, 1110)},
                "ist": {0.63: (35, 28, 24), 0.75: (231, 167, 192)}}


@dataclass(frozen=True)
class Setting:
    widths: tuple
    site_batch: int
    local_steps: int  # J: steps between synchronizations of local SGD and IST
    targets: tuple
    ladder: tuple  # learning rates the search may try
    first: tuple  # the ones it tries first, in order
    max_steps: int
    devices: tuple  # site counts simulated
    task: dict = field(default_factory=dict)  # speech_like arguments
    link_bandwidth: float = 10e9 / 8  # bytes/s: the seed's EC2 instances, "up to 10 Gbps"
    link_latency: float = 50e-6  # s, one way within one data center (assumed; the seed gives none)
    measured_limit: float = 1.5  # local(2) runs stop at this many times the steps found in-process


FULL = Setting(widths=(4096, 4096, 4096, 35), site_batch=64, local_steps=10, targets=(0.63, 0.75),
               ladder=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0), first=(0.1, 0.03, 0.3), max_steps=2000, devices=(2, 4, 8))
QUICK = Setting(widths=(256, 256, 256, 35), site_batch=32, local_steps=5, targets=(0.6, 0.7),
                ladder=(0.1, 0.3, 1.0, 3.0), first=(0.3, 1.0), max_steps=150, devices=(2, 4),
                task={"features": 256, "train": 4096, "test": 512, "calibrate": 128, "modes": 2, "noise": 0.5})


def graph_for(method, setting: Setting, sites: int, norm=True, bias=False):
    """DP's graph holds the global batch; local SGD's and IST's one site's batch."""
    batch = setting.site_batch * (sites if method == "dp" else 1)
    return network(setting.widths, batch, norm=norm, bias=bias)


class Run:
    """One method training on `sites` sites, `local_steps` steps at a time: in this process
    (machine None) or one site per device of `machine`."""

    def __init__(self, method, setting: Setting, task, sites: int, lr: float, machine=None, graph=None):
        self.method, self.setting, self.task, self.sites = method, setting, task, sites
        self.graph = graph or graph_for(method, setting, sites)
        if method == "dp":
            if machine is None:
                self.trainer = SingleDeviceTrainer(self.graph, lr=lr, seed=SEED)
            else:
                self.trainer = Trainer(self.graph, dp_strategy(self.graph, machine), machine, lr=lr, seed=SEED,
                                       snapshot_every=None)
        else:
            kind = ISTTrainer if method == "ist" else LocalSGDTrainer
            self.trainer = kind(self.graph, machine, local_steps=setting.local_steps, lr=lr, seed=SEED, sites=sites)
        self.batches = site_batches(task, sites, setting.site_batch, DATA_SEED)
        self.steps = 0

    def advance(self) -> float:
        """`local_steps` more steps; returns their wall seconds (drawing the batches excluded)."""
        steps = [next(self.batches) for _ in range(self.setting.local_steps)]
        start = time.perf_counter()
        if self.method == "dp":
            for step in steps:
                self.trainer.step(np.concatenate([x for x, _ in step]), np.concatenate([y for _, y in step]))
        else:
            self.trainer.round([[step[s] for step in steps] for s in range(self.sites)])
        self.steps += len(steps)
        return time.perf_counter() - start

    def accuracy(self, calibrated=True) -> float:
        return test_accuracy(self.graph, self.task, self.trainer.parameters(), self.trainer.buffers(), calibrated)


def next_evaluation(steps: int, local_steps: int) -> int:
    """Every `local_steps` steps up to 20 of them, then every 5% of the steps so far."""
    return steps + max(local_steps, local_steps * round(0.05 * steps / local_steps))


class Curve:
    """Test accuracy along a run: (steps, accuracy, training seconds so far) at each evaluation,
    and (steps, seconds) when each target was first reached."""

    def __init__(self, targets):
        self.targets = tuple(targets)
        self.points: list[tuple[int, float, float]] = []
        self.reached: dict[float, tuple[int, float]] = {}
        self.eval_s = 0.0
        self.diverged = False

    def add(self, steps, accuracy, seconds):
        self.points.append((steps, accuracy, seconds))
        if math.isnan(accuracy):
            self.diverged = True
        for target in self.targets:
            if target not in self.reached and accuracy >= target:
                self.reached[target] = (steps, seconds)

    @property
    def done(self) -> bool:
        return self.diverged or len(self.reached) == len(self.targets)

    def score(self):
        """Smaller is better: more targets reached, then fewer steps to the highest of them, then
        a higher last accuracy."""
        last = self.points[-1][1] if self.points and not self.diverged else -1.0
        steps = self.reached[max(self.reached)][0] if self.reached else math.inf
        return (-len(self.reached), steps, -last)

    def to_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "reached": {str(t): list(v) for t, v in self.reached.items()},
                "eval_s": self.eval_s, "diverged": self.diverged}


def train(runs: dict, limits: dict) -> dict:
    """Advance every run of `runs` ({name: Run}) a round at a time in turn, evaluating each when
    due, until it reaches its highest target, diverges, or takes limits[name] steps."""
    curves = {name: Curve(run.setting.targets) for name, run in runs.items()}
    seconds = dict.fromkeys(runs, 0.0)
    due = {name: run.setting.local_steps for name, run in runs.items()}
    active = [name for name in runs if limits[name] > 0]
    while active:
        for name in list(active):
            run, curve = runs[name], curves[name]
            seconds[name] += run.advance()
            if run.steps >= due[name] or run.steps >= limits[name]:
                start = time.perf_counter()
                curve.add(run.steps, run.accuracy(), seconds[name])
                curve.eval_s += time.perf_counter() - start
                due[name] = next_evaluation(run.steps, run.setting.local_steps)
            if curve.done or run.steps >= limits[name]:
                active.remove(name)
    return curves


def search_lr(method, sites, setting: Setting, task, log=print) -> dict:
    """The learning-rate search (module docstring), in this process: {"lr": best, "runs": {lr: curve}}."""
    curves, order, best = {}, list(setting.first), None
    while order:
        lr = order.pop(0)
        limit = setting.max_steps
        if best is not None and setting.targets[-1] in curves[best].reached:
            limit = curves[best].reached[setting.targets[-1]][0]
        curve = train({lr: Run(method, setting, task, sites, lr)}, {lr: limit})[lr]
        curves[lr] = curve
        log(f"  {METHODS[method]} on {sites} sites, lr {lr:g}: reached {_reached(curve)} "
            f"(last accuracy {curve.points[-1][1]:.3f} at step {curve.points[-1][0]})")
        if best is None or curve.score() < curves[best].score():
            best = lr
        if not order:  # the best at an edge of what was tried: one rung further out
            tried, rung = sorted(curves), setting.ladder.index(best)
            if best == tried[-1] and rung + 1 < len(setting.ladder):
                order.append(setting.ladder[rung + 1])
            elif best == tried[0] and rung > 0 and len(tried) > 1:
                order.append(setting.ladder[rung - 1])
    return {"lr": best, "runs": curves}


def _reached(curve) -> str:
    return ", ".join(f"{t} at step {s}" for t, (s, _) in sorted(curve.reached.items())) or "no target"


# ---- simulation ---------------------------------------------------------------------------------
def cloud(n: int, setting: Setting) -> Machine:
    """n machines of one device each, every pair linked at `link_bandwidth`, each with one network
    interface of that bandwidth (for simulation only)."""
    devices = [Device(i, i, "cpu (one core, measured)", None) for i in range(n)]
    bandwidth = np.full((n, n), setting.link_bandwidth)
    np.fill_diagonal(bandwidth, np.inf)
    latency = np.full((n, n), setting.link_latency)
    np.fill_diagonal(latency, 0.0)
    return Machine(devices, bandwidth, latency, description=f"{n} nodes, {setting.link_bandwidth * 8 / 1e9:g} Gb/s",
                   nic_bandwidth=setting.link_bandwidth)


def group(task) -> tuple:
    """Tasks that run the same kernels on arrays of the same shapes, whichever site or site count
    they belong to: their measurements pool."""
    return (task.phase, "site" if task.phase == "local" else task.layer, task.nbytes, task.flops)


def _plan_runner(method, sites, setting: Setting, task):
    """(the plan to simulate: a DP step or a round of J steps, a function that runs the method's
    plan once in this process and returns [(task, seconds)])."""
    graph = graph_for(method, setting, sites)
    batches = site_batches(task, sites, setting.site_batch, DATA_SEED)
    if method == "dp":
        machine = cloud(sites, setting)
        plan = lower(graph, dp_strategy(graph, machine).validated(graph, machine), "train", 4)
        params = init_parameters(graph, SEED)
        velocity = {name: {k: np.zeros_like(v) for k, v in p.items()} for name, p in params.items()}
        state, buffers = shard_states(plan, params, velocity), buffer_tiles(plan, init_buffers(graph))
        step = next(batches)
        x, y = np.concatenate([x for x, _ in step]), np.concatenate([y for _, y in step])
        data = data_tiles(plan, bind_inputs(graph, (x, y), np.float32))

        def once():
            seconds = {}
            run_plan(plan, state, data, {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}, buffers, seconds)
            return [(t, seconds[t.key]) for t in plan.tasks]

        return plan, once
    # a round of 2 local steps has every kind of task a round of J has
    kind = ISTTrainer if method == "ist" else LocalSGDTrainer
    trainer = kind(graph, None, local_steps=2, lr=0.01, seed=SEED, sites=sites)
    m = trainer.partition(0) if method == "ist" else None
    plan = plan_round(graph, units_of(graph), sites, setting.local_steps, m, 0.01, 4, trainer.mode)

    def once():
        trainer.round([[step[s] for step in (next(batches), next(batches))] for s in range(sites)])
        return [(t, trainer.stats.task_seconds[t.key]) for t in trainer.plan.tasks]

    return plan, once


def kernel_seconds(configs, setting: Setting, task, repeats=3) -> tuple[dict, dict]:
    """({(method, sites): plan}, {group: median seconds}): each configuration's plan run in this
    process with one thread, a warm-up and then `repeats` times, the configurations in turn (a busy
    moment of the shared machine hits them all), every measurement of a group pooled."""
    runners = {config: _plan_runner(*config, setting, task) for config in configs}
    samples: dict[tuple, list] = {}
    with threadpool_limits(1):
        for r in range(repeats + 1):
            for _, once in runners.values():
                timed = once()
                if r:
                    for t, seconds in timed:
                        samples.setdefault(group(t), []).append(seconds)
    return {config: plan for config, (plan, _) in runners.items()}, \
        {k: statistics.median(v) for k, v in samples.items()}


def simulated_step(method, sites, plan, seconds: dict, setting: Setting) -> dict:
    """Simulated seconds per step of `method` on `sites` devices of `cloud` (its `plan`, each task
    taking `seconds[group(task)]`), and what moves."""
    sim = simulate(plan, lambda t: seconds[group(t)], cloud(sites, setting), Runtime())
    steps = 1 if method == "dp" else setting.local_steps
    compute = max(sum(seconds[group(t)] for t in plan.tasks if t.device == d) for d in range(sites))
    return {"method": method, "sites": sites, "step_s": float(sim.step_s) / steps,
            "busiest_device_compute_s": compute / steps, "bytes_per_step": plan.bytes_moved / steps,
            "plan_steps": steps, "plan_tasks": len(plan.tasks)}


# ---- the whole table ----------------------------------------------------------------------------
def table1(setting: Setting, log=print, write=lambda result: None) -> dict:
    """Learning-rate searches, the measured runs on local(2) and the simulation; `write(result)`
    is called after each part with what is there so far."""
    task = speech_like(**setting.task)
    result = {"setting": setting_dict(setting), "task": {"train": len(task.x_train), "test": len(task.x_test),
                                                          "calibrate": len(task.calibrate), **setting.task},
              "search": {}, "measured": None, "simulated": [], "seed_table_1": _seed_dict()}
    for sites in setting.devices:
        for method in METHODS:
            started = time.perf_counter()
            found = search_lr(method, sites, setting, task, log)
            result["search"][f"{method}@{sites}"] = {
                "method": method, "sites": sites, "lr": found["lr"], "seconds": time.perf_counter() - started,
                "runs": {str(lr): c.to_dict() for lr, c in found["runs"].items()}}
            write(result)
        if sites == 2:  # the learning rates for 2 sites are known: measure them first
            log("measuring on local(2)")
            result["measured"] = measure_local(setting, task, result["search"])
            write(result)
    simulate_all(result, setting, task, log)
    write(result)
    return result


def simulate_all(result, setting: Setting, task, log=print) -> None:
    """result["simulated"]: a row per method and site count, from the steps its search found."""
    configs = [(method, sites) for sites in setting.devices for method in METHODS]
    plans, seconds = kernel_seconds(configs, setting, task)
    result["simulated"] = []
    for method, sites in configs:
        row = simulated_step(method, sites, plans[(method, sites)], seconds, setting)
        best = result["search"][f"{method}@{sites}"]
        reached = best["runs"][str(best["lr"])]["reached"]
        row["lr"] = best["lr"]
        row["steps"] = {str(t): reached[str(t)][0] if str(t) in reached else None for t in setting.targets}
        row["seconds"] = {t: (float(s * row["step_s"]) if s is not None else None) for t, s in row["steps"].items()}
        result["simulated"].append(row)
        log(f"  simulated {METHODS[method]} on {sites}: {row['step_s'] * 1e3:.1f} ms/step, {row['seconds']}")


def measure_local(setting: Setting, task, search: dict) -> dict:
    machine = Machine.local(2, probe=False)
    try:
        runs, limits, lrs = {}, {}, {}
        for method in METHODS:
            best = search[f"{method}@2"]
            lrs[method] = best["lr"]
            runs[method] = Run(method, setting, task, 2, best["lr"], machine)
            found = best["runs"][str(best["lr"])]["reached"].get(str(setting.targets[-1]))
            steps = found[0] if found else setting.max_steps
            limits[method] = int(math.ceil(steps * setting.measured_limit / setting.local_steps)) * setting.local_steps
        started = time.perf_counter()
        curves = train(runs, limits)
        return {"machine": "Machine.local(2)", "wall_s": time.perf_counter() - started,
                "runs": {m: {"lr": lrs[m], **c.to_dict()} for m, c in curves.items()}}
    finally:
        machine.close()


def setting_dict(setting: Setting) -> dict:
    from dataclasses import asdict

    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setting).items()}


def _seed_dict() -> dict:
    return {m: {str(t): list(v) for t, v in rows.items()} for m, rows in SEED_TABLE_1.items()}


# ---- Sec. 3.3: the batch-norm ablation -------------------------------------------------------
VARIANTS = {"batch_norm": {"norm": True, "bias": False}, "no_norm": {"norm": False, "bias": True}}


def ablation(setting, task, sites_list, steps: int, grid, evaluations=8, log=print, known=()) -> list[dict]:
    """A row per site count and variant.  Learning rates: `grid`, then one rung of
    `setting.ladder` further out while the best is at an edge (as Table 1's search).  `known`:
    rows of an earlier run with the same arguments, whose curves are taken instead of run again."""
    every = max(setting.local_steps, steps // evaluations // setting.local_steps * setting.local_steps)
    earlier = {(r["sites"], r["variant"], float(lr)): c for r in known for lr, c in r["curves"].items()}
    rows = []
    for sites in sites_list:
        for variant, shape in VARIANTS.items():
            curves, order = {}, list(grid)
            while order:
                lr = order.pop(0)
                curves[lr] = earlier.get((sites, variant, lr)) or _ablation_curve(setting, task, sites, lr, shape,
                                                                                  steps, every)
                log(f"  IST {variant} on {sites} sites, lr {lr:g}: accuracy {curves[lr][-1]['accuracy']:.3f} "
                    f"after {curves[lr][-1]['steps']} steps")
                if not order:  # the best at an edge of what was tried: one rung further out
                    best, tried = max(curves, key=lambda v: _final_accuracy(curves[v])), sorted(curves)
                    rung = setting.ladder.index(best)
                    if best == tried[-1] and rung + 1 < len(setting.ladder):
                        order.append(setting.ladder[rung + 1])
                    elif best == tried[0] and rung > 0 and len(tried) > 1:
                        order.append(setting.ladder[rung - 1])
            best = max(curves, key=lambda v: _final_accuracy(curves[v]))
            rows.append({"sites": sites, "variant": variant, "lr": best, "steps": steps, "first": list(grid),
                         "final": curves[best][-1], "curves": {str(lr): c for lr, c in sorted(curves.items())}})
    return rows


def _ablation_curve(setting, task, sites, lr, shape, steps, every) -> list[dict]:
    run = Run("ist", setting, task, sites, lr, graph=graph_for("ist", setting, sites, **shape))
    points = []
    while run.steps < steps:
        run.advance()
        if run.steps % every == 0 or run.steps >= steps:
            point = {"steps": run.steps, "accuracy": run.accuracy(calibrated=True)}
            if shape["norm"]:
                point["running_statistics"] = run.accuracy(calibrated=False)
            points.append(point)
            if math.isnan(point["accuracy"]):
                break
    return points


def _final_accuracy(points) -> float:
    accuracy = points[-1]["accuracy"]
    return -1.0 if math.isnan(accuracy) else accuracy  # a diverged run loses
