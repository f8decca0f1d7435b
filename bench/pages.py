"""What each benchmark's results page says about itself before its numbers: what it measures, on
what, how to rerun it, its goal, and whether the run met it (`Page`, one per benchmark in PAGES).

`bench.report.write_result` puts the header on every page it writes; the benchmarks that write
their own pages (data, gpu, hypergraph, ist, seeds) start them with `header(name, record)`.  A
page's verdict is read off the run's record, the same dict that goes to results/<name>.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from taskrt.bench.verdicts import (
    CONVERGENCE_TOLERANCE,
    ELASTIC_TOLERANCE,
    MEASURED_TOLERANCE,
    accuracy_verdict,
    convergence_verdict,
    data_verdict,
    elastic_verdict,
    gholami_verdict,
    gpu_on,
    gpu_verdict,
    hypergraph_verdict,
    ist_verdict,
    kernels_verdict,
    memory_verdict,
    optim_verdict,
    overhead_verdict,
    peer_verdict,
    programs_verdict,
    scaling_measured_verdict,
    scaling_verdict,
    search_verdict,
    seeds_verdict,
    strategies_verdict,
    zoo_verdict,
)


@dataclass(frozen=True)
class Page:
    title: str  # after the benchmark's name in the page's heading
    measures: str  # what it measures, and on which networks and devices
    rerun: str  # the command, and what --quick leaves out
    goal: str
    verdict: Callable[[dict], str]  # the run's record -> "met ..." or "NOT met ..." in words
    on: Callable[[dict], str] | None = None  # the record -> the machine it ran on; default: the host


def header(name: str, record: dict) -> list[str]:
    """The page's first lines: its heading and the five things every page says first."""
    page = PAGES[name]
    try:
        verdict = page.verdict(record)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as error:  # a record of another shape
        verdict = f"not read from this run's record ({type(error).__name__}: {error}); see the summary below"
    on = (page.on or host)(record)
    quick = " (a `--quick` run)" if record.get("quick") else ""
    return [f"# {name}: {page.title}", "",
            f"- **What it measures:** {page.measures}",
            f"- **On:** {on}{quick}",
            f"- **Rerun:** {page.rerun}",
            f"- **Goal:** {page.goal}",
            f"- **This run:** {verdict}", ""]


def host(record: dict) -> str:
    machine = record.get("machine") or {}
    if not machine:
        return "not recorded in this run's record"
    versions = ", ".join(f"{k} {machine[k]}" for k in ("python", "numpy", "dask") if machine.get(k))
    when = f"; {record['date'][:10]}" if record.get("date") else ""
    return f"{machine.get('cpu') or 'this host'}, {machine.get('cores', '?')} cores ({versions}){when}"



QUICK = "`--quick`:"


PAGES = {
    "memory": Page(
        "memory per device, predicted and measured, and under a budget",
        "A: each device's predicted peak (each device's program replayed, `taskrt.planning.peak`) against the "
        "peak its worker held (`taskrt.execution.held`) after a few steps, for bench accuracy's networks and "
        "strategies on `Machine.local(1)` and `local(2)`; B: the fastest strategy the search finds under "
        "shrinking budgets (on a cluster a budget holds the peak under the schedule with the kernels' scratch; "
        "simulated step) beside data parallelism, OWT and SplitBrain, drawn in memory.png; C: VGG-16-32 at "
        "batch 64 on `local(2)` with each worker's memory limit below data "
        "parallelism's need: refused, the search's strategy trained against one device; D: a budget only "
        "recomputation meets (by the search's own count, `optimize(schedule=False)`), its strategy's loss and time "
        "cost against one device's and the simulator's.",
        f"`python -m taskrt.bench memory` (about 20 minutes; {QUICK} LeNet-5 in A, VGG-16-32 alone in B and D, "
        "4 steps in C).",
        "every predicted peak within 10% of the measured; data parallelism refused where it does not fit and the "
        "search's strategy training to one device's loss under the memory; a recomputing strategy exact and its "
        "time cost simulated within 10% (the budgeted search at most 2x the unconstrained, beside).",
        memory_verdict),
    "zoo": Page(
        "PyTorch's networks imported",
        "torchvision's definitions of ResNet-18 and -50, VGG-11 with batch norm, DenseNet-121, GoogLeNet, "
        "Inception-v3, SqueezeNet, MobileNet-v2, MNASNet, ShuffleNet-v2, EfficientNet-B0, RegNet-Y and ConvNeXt-T "
        "through `tr.from_torch`: layers, parameters, one float64 SGD step on one device against PyTorch's "
        "(dropout and stochastic depth given taskrt's masks on both sides), a step on `Machine.local(1)` against "
        "PyTorch on one thread and the searched strategy on `Machine.local(2)` (64x64, batch 32), the search on 16 "
        "simulated P100s (batch 64, 224x224).",
        f"`python -m taskrt.bench zoo` (needs torchvision; {QUICK} ResNet-18 and MobileNet-v2, 2 rounds).",
        "every family equal to PyTorch within 1e-9; local(1) at least 0.8x PyTorch's one-thread step on "
        "ResNet-50, 0.5x on MobileNet-v2 and EfficientNet-B0; the searched ResNet-50 on local(2) at least 1.3x "
        "local(1); every search on 16 simulated GPUs under 2 s.",
        zoo_verdict),
    "optim": Page(
        "what an optimizer costs a step",
        "AdamW, AdamW with gradient clipping and Nesterov SGD against SGD with momentum, each a Trainer on "
        "`Machine.local(2)` under the strategy the search picks for SGD (costs measured in the same run), "
        "interleaved rounds, median steps, AlexNet-32 and VGG-16-32.",
        f"`python -m taskrt.bench optim` (9 rounds; {QUICK} LeNet-5, 3 rounds).",
        "an AdamW step at most 1.1x an SGD-with-momentum step on AlexNet-32 and VGG-16-32.",
        optim_verdict),
    "kernels": Page(
        "convolution kernels against GEMM",
        "forward + backward GFLOP/s of the AlexNet and VGG-16 convolution layers on one thread, each next to a "
        "float32 GEMM timed in alternating rounds with it, as the measuring thread's CPU time. GFLOP/s counts the "
        "direct convolution's FLOPs, so layers that run Winograd's F(2x2, 3x3) have an effective rate that can "
        "pass GEMM's.",
        f"`python -m taskrt.bench kernels` (batch 8, 2048x2048 GEMM, 5 rounds; {QUICK} batch 1, 1024x1024, 3 rounds).",
        "at least 50% of the GEMM rate on every layer with 64 or more input channels (70% the moonshot).",
        kernels_verdict),
    "overhead": Page(
        "the runtime's cost per training step",
        "one device: the same step in-process against `Trainer` on `Machine.local(1)`, fused and unfused, and "
        "in a training loop; two devices: tasks and scheduling overhead per step (step time less the kernels on "
        "the critical path) of LeNet-5 and a small VGG under data parallelism, against Dask running the same "
        "task graph with tasks that spin for the measured kernel times, beside Dask's cost per task and per hop.",
        f"`python -m taskrt.bench overhead` (LeNet-5, AlexNet-32 and VGG-16-32, 9 rounds; {QUICK} LeNet-5, 3 rounds).",
        "local(1) within 1.15x of in-process on AlexNet-32 and VGG-16-32 and within 2x on LeNet-5; on two "
        "devices the overhead within 1.1x of Dask's own on the same graph.",
        overhead_verdict),
    "search": Page(
        "search time (the paper's Table 3)",
        "`search.optimize` end to end from a fresh `CostModel` (cost tables, node and edge elimination, memory per "
        "device), its parts and CPU time, next to the depth-first search with a time limit, for LeNet-5, AlexNet, "
        "VGG-16, Inception-v3 and ResNet-50 on simulated P100s.",
        f"`python -m taskrt.bench search` (4, 8 and 16 devices; {QUICK} 16 devices, fewer repeats).",
        "end to end within a quarter of the paper's time (2.5 / 5 / 25 / 100 ms for LeNet-5, AlexNet, VGG-16, "
        "Inception-v3 on 16 devices).",
        search_verdict),
    "strategies": Page(
        "strategies trained side by side",
        "data, model, OWT and the searched layer-wise strategy (and the search's pick when it also measures) "
        "trained in interleaved rounds on `Machine.local(2)`: images/s, bytes per step, predicted (equation 1 and "
        "simulated) and measured step time.",
        f"`python -m taskrt.bench strategies` (LeNet-5, AlexNet-32, VGG-16-32, 12 rounds; {QUICK} LeNet-5, 4 rounds).",
        "the searched strategy at least as fast as the best of data, model and OWT parallelism (within the run's "
        "noise) on every network, and every plan's bytes equal to the workers' transfer logs.",
        strategies_verdict),
    "accuracy": Page(
        "predicted against measured step time (the paper's Table 4)",
        "every strategy's step time on `Machine.local(1)` and `Machine.local(2)` as the simulator predicts it (and "
        "equation 1 adds it up) against the measured one, LeNet-5, AlexNet-32 and VGG-16-32, steps run by the "
        "Trainer's default executor (programs) and simulated with its costs; part timings and the runtime's costs "
        "measured in the same run, no per-case factors.",
        f"`python -m taskrt.bench accuracy` (about 15 minutes; {QUICK} LeNet-5 only).",
        "at least 12 of the 15 cases' simulated steps within 10% of the measured ones, the median |error| at most "
        "7%, and on every network on two devices the simulation's fastest strategy measured fastest or within "
        "noise (the larger interquartile range of the two).",
        accuracy_verdict),
    "scaling": Page(
        "throughput and bytes on 1-16 simulated GPUs (the paper's Figures 7 and 8), and taskrt's own runtime",
        "SIMULATED: throughput and bytes moved per step of data, model, OWT and layer-wise parallelism for "
        "AlexNet, VGG-16, Inception-v3 and ResNet-50 on 1 to 16 P100s (NVLink within a node, 100 Gb/s between "
        "nodes), roofline kernel times; each step with the runtime free, as in the paper, and with taskrt's runtime "
        "under both executors (programs, the default; a Dask task per fused run), its costs measured on this host "
        "(Machine.local(2)'s calibration; the summary says which cost comes from where).",
        f"`python -m taskrt.bench scaling` (a few minutes, a minute more where this host's calibration is not cached; "
        f"{QUICK} AlexNet on 1, 4 and 16 devices).",
        "the layer-wise strategy at least as fast as the best of the others (within 0.5%) at every device count "
        "under the free runtime, as in the paper's Figure 7; and at 16 devices, layer-wise under taskrt's runtime "
        "with programs within 1.3x of the free runtime's throughput for every model.",
        scaling_verdict),
    "convergence": Page(
        "the same loss curve on one device and on two",
        "LeNet-5 on the bundled digits, data parallelism and the searched strategy on `Machine.local(2)` against "
        "the single-device trainer, same data order and initialization: loss at every step and test accuracy.",
        f"`python -m taskrt.bench convergence` (4 epochs; {QUICK} 1 epoch).",
        f"every trainer's loss within {CONVERGENCE_TOLERANCE:g} (relative) of the single device's at every step, "
        "and the same test accuracy: every strategy computes the same network.",
        convergence_verdict),
    "elastic": Page(
        "snapshots and recovery from a lost worker",
        "LeNet-5 on `Machine.local(2)` under `make run`'s mixed strategy, with snapshots off and at the default, "
        "in interleaved rounds; then a worker killed with SIGKILL between steps: the recovery, the step that "
        "recovered, and the final parameters against an uninterrupted run.",
        f"`python -m taskrt.bench elastic` (5 rounds of 40 steps; {QUICK} 2 rounds of 10).",
        "snapshots at the default cost at most 5% of the step time, and the run ends with the uninterrupted "
        f"run's parameters up to float32 rounding (every element within {ELASTIC_TOLERANCE:g}, relative: replayed "
        "steps may sum in another order).",
        elastic_verdict),
    "peer": Page(
        "PyTorch on the CPU against the runtime",
        "LeNet-5, AlexNet-32 and VGG-16-32 stepped by PyTorch on the CPU (`bench/torch_peer.py` builds the same "
        "network from the Graph): one thread against the runtime in-process and on `Machine.local(1)`, two "
        "threads against `Machine.local(2)` (data parallel, the searched strategy, and one device of it for the "
        "searched strategy to be no slower than), `Machine.local(1)` and PyTorch DDP on two one-thread processes "
        "(gloo, the same global batch: what a user would run instead), all in the same interleaved rounds. "
        "Skips, saying so, without torch.",
        f"`python -m taskrt.bench peer` (needs `pip install '.[torch]'`; 9 rounds; {QUICK} LeNet-5 alone, 3 rounds).",
        "local(1) at least 0.8x PyTorch's one-thread throughput on AlexNet-32 and VGG-16-32; and the searched "
        "strategy on local(2) never slower than one device of it (the same strategy, or a median step at most "
        "5% above, interleaved); two devices beat one: the searched strategy on local(2) at least 1.3x local(1)'s "
        "throughput and at least 0.8x PyTorch's on two threads (AlexNet-32, VGG-16-32).",
        peer_verdict),
    "programs": Page(
        "a step as one program per device against a Dask task per fused run",
        "on `Machine.local(2)`: the Dask tasks the scheduler sends per training step and device (a scheduler "
        "plugin), for data parallelism, model parallelism and OWT on LeNet-5, AlexNet-32 and VGG-16-32, with "
        "`Trainer(executor=\"programs\")` (the default) and `executor=\"tasks\"`; a small value's one-way time "
        "between two programs (half a ping-pong's round trip through the workers' mailboxes) beside Dask's "
        "dependent hop between the two devices; a 64 MB tile between two programs; the step times of both "
        "executors, medians of interleaved rounds; and a whole `fit` of short steps (LeNet-5 on local(1) and "
        "local(2)) with one step to each device's program against several (`steps_per_program=\"auto\"`).",
        f"`python -m taskrt.bench programs` (7 rounds, fits 5 rounds of 120 steps; {QUICK} LeNet-5 alone, 3 rounds, "
        "fits of 48 steps).",
        "at most 2 Dask tasks per step and device; a value between programs in at most 1 ms on loopback "
        "(moonshot 0.3 ms); a 64 MB tile between two workers on one host at at least 5 GB/s.",
        programs_verdict),
    "scaling_measured": Page(
        "strategies measured on 1 to 8 CPU devices beside the simulation",
        "`Machine.local(n)` single-threaded CPU workers for n = 1, 2, 4, 8 on a host with as many cores: the "
        "searched strategy (costs measured on that host in the same run), data parallelism and OWT on AlexNet-32 "
        "and VGG-16-32, each step's median over interleaved rounds beside the simulator's prediction, and the "
        "throughput against one device.",
        f"`python -m taskrt.bench scaling_measured` on a host with 8 or more cores (7 rounds; {QUICK} "
        "AlexNet-32 alone, 3 rounds).",
        f"every device count 2, 4, 8 measured; the searched strategy within {MEASURED_TOLERANCE:.0%} of the fastest "
        "measured at each.",
        scaling_measured_verdict),
    "data": Page(
        "datasets read on the workers against batches sent from the client",
        "per training step, the bytes the client sends (Dask's own counters: the client's stream to the "
        "scheduler plus tiles scattered straight to workers) and the step time, for LeNet-5 (batch 64), AlexNet "
        "at 64 px (batch 32) and VGG-16 at 64 px (batch 16) under the searched strategy on `Machine.local(2)`, "
        "once with each batch sent as numpy arrays (`Trainer.submit`) and once with only its sample indices sent, "
        "each device reading its part of an ArrayDataset placed on it once (`Trainer.submit_from`); 3 steps in "
        "flight, interleaved rounds of 8 steps, medians. Most of a step's client bytes are its task graph, the "
        "same on both paths.",
        f"`python -m taskrt.bench data` (7 rounds; {QUICK} LeNet-5 alone, 3 rounds).",
        "at most 1 KiB of sample data per step from the client on the dataset path; no slower anywhere; faster "
        "where the batch is large.",
        data_verdict),
    "gpu": Page(
        "GPU workers against PyTorch on the same GPU",
        "taskrt on one NVIDIA GPU against PyTorch eager: training steps of AlexNet, VGG-16, Inception-v3 and "
        "ResNet-50 as `trainer.fit` runs them (data generated on the worker, each device's run replayed as a CUDA "
        "graph), where their time goes, peak GPU memory, bf16 against PyTorch's autocast, conv kernels against "
        "cuDNN, strategies on workers sharing the GPU, and a device array between two of them.",
        "`python -m taskrt.bench gpu` on a machine with a CUDA GPU, cupy and torch (`--parts training,bf16` for some "
        "parts; the others keep their rows).",
        "steps at least 0.8x PyTorch's speed (none below 0.5x), peak memory at most 1.3x PyTorch's, conv kernels "
        "at least 50% of cuDNN's rate, bf16's held-out accuracy within 0.5 points of fp32's and its loss curve at "
        "most 2x as far from fp32's as another fp32 run's, a 64 MB device array between two workers at least "
        "100 GB/s.",
        gpu_verdict, gpu_on),
    "hypergraph": Page(
        "seed 003's hypergraph partitions of VGG-16",
        "seed 003 on VGG-16 at batch 32, N = 2..128: work balance and forward volume of layer-wise, naive and "
        "Mt-KaHyPar partitions (Tables 5.1-5.12) with the exact optimum at N = 2 and 4, final imbalances "
        "(Appendix A), one epoch's traffic against data parallelism (Table 5.14) and a time per epoch by "
        "simulation (Table 5.15), each beside the thesis.",
        f"`python -m taskrt.bench hypergraph` (about a minute; {QUICK} N = 2 and 8).",
        "partitioning at N = 128 in under 1 s (the volumes are set beside the thesis's, whose weights are its "
        "own, not judged).",
        hypergraph_verdict),
    "ist": Page(
        "independent subnet training (seed 004)",
        "seed 004's traffic and FLOPs per gradient step of data parallelism and IST (Sec. 3.4, Fig. 2) from the "
        "formulas and from the runtime's plans, planned bytes against the transfer logs on `Machine.local(2)` "
        "and `local(4)`, Table 1's time to fixed test accuracies (measured on local(2), simulated on 2, 4 and 8 "
        "devices) and the batch-norm ablation of Sec. 3.3, on a generated speech-shaped task.",
        f"`python -m taskrt.bench ist` (about 2 hours; {QUICK} a small network in minutes); "
        "`python -m taskrt.bench.ist` "
        "simulates Table 1 again from results/ist.json, `python -m taskrt.bench.ist --measure` measures it again.",
        "IST's traffic equal to the formula, planned bytes equal to the logs, and IST at least 2x sooner than "
        "data parallelism to the highest target on local(2).",
        ist_verdict),
    "seeds": Page(
        "SplitBrain (000) and the integrated grid (001) on the runtime",
        "seed 001's Figs. 6 and 7 from its analytic model (also results/gholami.md) and the runtime's plan beside "
        "the model's volumes layer by layer; seed 000's Table 1, parameter memory per device at mp = 1..16 and "
        "Table 2 by simulation on a machine described like theirs; the search next to both families by "
        "simulation and on `Machine.local(2)`.",
        f"`python -m taskrt.bench seeds` ({QUICK} fewer device counts and a narrower network on local(2)).",
        "the plan's volumes equal the model's or differ as explained; Table 1 reproduced; the search at least as "
        "fast as the best configuration of either family by simulation.",
        seeds_verdict),
    "gholami": Page(
        "seed 001's Figs. 6 and 7 from its analytic model",
        "ANALYTIC, not measured: communication and total time per iteration of AlexNet (B = 2048) on P = 8..512 "
        "KNL processes for every Pr x Pc grid under the seed's Eqs. 6 and 8, one grid for all layers (Fig. 6) "
        "and the convolutions batch parallel (Fig. 7), beside the paper's figures.",
        f"`python -m taskrt.bench gholami` (seconds; also part of `bench seeds`; {QUICK} P = 8, 64 and 512).",
        "the paper's findings under its own model: at P = 8 the grid brings nothing over pure batch parallelism, "
        "at P = 512 it cuts communication, more with the convolutions batch parallel (Fig. 7) than with one "
        "grid (Fig. 6).",
        gholami_verdict),
}
