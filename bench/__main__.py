"""python -m taskrt.bench <name>|all [--quick] [--out DIR] [--budget S] (also: taskrt bench ...):
benchmarks writing results/<name>.json, .md and .png.

`all` runs these, in this order:
  kernels      conv forward+backward GFLOP/s next to GEMM (one thread)
  overhead     Dask scheduling overhead per training step
  search       search time, node/edge elimination vs depth-first search (the paper's Table 3)
  strategies   data, model, OWT and layer-wise trained side by side on 2 local devices
  accuracy     predicted vs measured step time on 1 and 2 local devices (the paper's Table 4)
  scaling      throughput and bytes moved on 1-16 simulated P100s (the paper's Figures 7 and 8), the
               runtime free and taskrt's (both executors, costs measured on this host)
  convergence  loss curves of data parallel and layer-wise against one device
  seeds        SplitBrain (000) and the integrated grid (001): their tables and figures, plan vs model,
               the search next to their families (also writes gholami.*: Figs. 6 and 7 of 001)
  data         datasets read by the workers against batches sent from the client: bytes from the client
               per step (Dask's counters) and step time on 2 local devices

These run by name only (long, or needing a GPU, torch or 8 cores):
  hypergraph   seed 003: VGG-16 partitions (layer-wise, naive, Mt-KaHyPar) at N = 2..128 beside the
               thesis's Tables 5.1-5.15 and Appendix A
  elastic      the cost of snapshots for elastic recovery, and of recovering from a killed worker
  gholami      Figs. 6 and 7 of seed 001 from its analytic model alone
  gpu          GPU workers against PyTorch on the same GPU (needs a CUDA GPU, cupy and torch)
  ist          seed 004 (IST): traffic and FLOPs per step of DP and IST, formulas vs plans vs transfer logs;
               Table 1's time to accuracy (local(2) measured, 2/4/8 devices simulated), the batch-norm ablation
  peer         PyTorch on the CPU stepping the same networks, against in-process, local(1) and local(2)
  programs     one program per device and step against a Dask task per fused run: Dask tasks per step,
               a value's hop between two devices' programs, a 64 MB tile's rate, step times on local(2)
  scaling_measured
               strategies on local(1/2/4/8) CPU workers measured beside the simulation (needs 8+ cores)
  optim        what AdamW, clipping and Nesterov cost a step against SGD with momentum on 2 local devices
  zoo          torchvision's networks imported with from_torch: equality with PyTorch, speed, search time
  memory       memory per device: predicted against measured peaks, the fastest strategy under shrinking
               budgets (memory.png), VGG-16-32 where data parallelism does not fit, recomputation's cost

With --budget S, each benchmark runs in its own process and the run stops once S seconds are
spent: a benchmark still running then is stopped, the rest are skipped, and both are listed.
A benchmark that fails still fails the run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time

from taskrt.bench.report import QUICK_VARIABLE

BENCHMARKS = ["kernels", "overhead", "search", "strategies", "accuracy", "scaling", "convergence", "seeds", "data"]
# not in `all`: gholami is part of seeds; gpu needs a GPU; scaling_measured needs 8 cores; hypergraph, ist,
# even with --quick (peer also needs the optional torch; ist takes hours without --quick)
ON_REQUEST = ["gholami", "gpu", "hypergraph", "ist", "elastic", "peer", "programs", "scaling_measured", "optim", "zoo",
              "memory"]


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _folder(text):
    from pathlib import Path

    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder for results")
    return text


class Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line naming the argument and what is valid."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv=None, prog="python -m taskrt.bench"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=BENCHMARKS + ON_REQUEST + ["all"], metavar="name",
                        help=f"one benchmark, or all: {', '.join(BENCHMARKS)} (the others run by name only: "
                             f"{', '.join(ON_REQUEST)})")
    parser.add_argument("--quick", action="store_true", help="a short version (CI)")
    parser.add_argument("--out", default="results", type=_folder, help="folder for results (default: results/)")
    parser.add_argument("--budget", type=_seconds, default=None, metavar="S",
                        help="stop after S seconds in all; what did not run is listed (default: no limit)")
    args = parser.parse_args(argv)
    names = BENCHMARKS if args.name == "all" else [args.name]
    os.environ[QUICK_VARIABLE] = "1" if args.quick else ""  # the pages say so (bench.report.quick_run)
    if args.budget is None:
        for name in names:
            start = time.perf_counter()
            print(f"== bench {name}{' (quick)' if args.quick else ''}", flush=True)
            importlib.import_module(f"taskrt.bench.{name}").run(args.out, args.quick)
            print(f"== bench {name}: {time.perf_counter() - start:.0f} s\n", flush=True)
        return 0
    return _within_budget(names, args)


def _within_budget(names, args) -> int:
    """Each benchmark in a child process, so one that runs past the budget can be stopped cleanly."""
    deadline = time.perf_counter() + args.budget
    stopped, skipped = None, []
    for name in names:
        left = deadline - time.perf_counter()
        if left <= 0 or stopped:
            skipped.append(name)
            continue
        start = time.perf_counter()
        print(f"== bench {name}{' (quick)' if args.quick else ''} ({left:.0f} s of the budget left)", flush=True)
        command = [sys.executable, "-m", "taskrt.bench", name, "--out", args.out] + (["--quick"] if args.quick else [])
        child = subprocess.Popen(command, start_new_session=True)  # its own group: its workers stop with it
        try:
            code = child.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            stopped = name
            print(f"== bench {name}: stopped at the budget of {args.budget:.0f} s", flush=True)
            continue
        if code != 0:
            print(f"== bench {name}: FAILED (exit code {code})", flush=True)
            return code
        print(f"== bench {name}: {time.perf_counter() - start:.0f} s\n", flush=True)
    if stopped or skipped:
        print(f"budget of {args.budget:.0f} s spent: stopped {stopped or 'none'}; not run: "
              f"{', '.join(skipped) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":  # worker processes re-import this module: do not run there
    sys.exit(main())
