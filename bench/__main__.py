"""python -m bench <name>|all [--quick] [--out DIR]: benchmarks writing results/<name>.json, .md and .png.

  kernels      conv forward+backward GFLOP/s next to GEMM (one thread)
  overhead     Dask scheduling overhead per training step
  search       search time, node/edge elimination vs depth-first search (the paper's Table 3)
  strategies   data, model, OWT and layer-wise trained side by side on 2 local devices
  accuracy     predicted vs measured step time on 1 and 2 local devices (the paper's Table 4)
  scaling      throughput and bytes moved on 1-16 simulated P100s (the paper's Figures 7 and 8)
  convergence  loss curves of data parallel and layer-wise against one device
  seeds        SplitBrain (000) and the integrated grid (001): their tables and figures, plan vs model,
               the search next to their families (also writes gholami.*: Figs. 6 and 7 of 001)
  hypergraph   seed 003: VGG-16 partitions (layer-wise, naive, Mt-KaHyPar) at N = 2..128 beside the
               thesis's Tables 5.1-5.15 and Appendix A
  elastic      the cost of snapshots for elastic recovery, and of recovering from a killed worker
  gholami      Figs. 6 and 7 of seed 001 from its analytic model alone
  gpu          GPU workers against PyTorch on the same GPU (needs a CUDA GPU, cupy and torch)
  ist          seed 004 (IST): traffic and FLOPs per step of DP and IST, formulas vs plans vs transfer logs
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

BENCHMARKS = ["kernels", "overhead", "search", "strategies", "accuracy", "scaling", "convergence", "seeds"]
# not in `all`: gholami is part of seeds; gpu needs a GPU; hypergraph, ist and elastic take minutes even with --quick
ON_REQUEST = ["gholami", "gpu", "hypergraph", "ist", "elastic"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=BENCHMARKS + ON_REQUEST + ["all"], help="which benchmark, or all of them")
    parser.add_argument("--quick", action="store_true", help="a short version (CI)")
    parser.add_argument("--out", default="results", help="folder for results (default: results/)")
    args = parser.parse_args(argv)
    for name in BENCHMARKS if args.name == "all" else [args.name]:
        start = time.perf_counter()
        print(f"== bench {name}{' (quick)' if args.quick else ''}", flush=True)
        importlib.import_module(f"bench.{name}").run(args.out, args.quick)
        print(f"== bench {name}: {time.perf_counter() - start:.0f} s\n", flush=True)
    return 0


if __name__ == "__main__":  # worker processes re-import this module: do not run there
    sys.exit(main())
