"""python -m bench <name> [--quick]: benchmarks writing results/<name>.json, .md and .png."""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = {"kernels": "kernels", "overhead": "overhead", "search": "search", "strategies": "strategies",
              "accuracy": "accuracy"}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--quick", action="store_true", help="a short version (CI)")
    parser.add_argument("--out", default="results", help="folder for results (default: results/)")
    args = parser.parse_args(argv)
    import importlib

    importlib.import_module(f"bench.{BENCHMARKS[args.name]}").run(args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
