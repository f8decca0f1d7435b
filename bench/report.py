"""Benchmark results: one JSON (raw numbers, machine, versions, date) and one Markdown page per run,
which starts with what the benchmark measures, on what, how to rerun it, its goal and whether the
run met it (bench.pages)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

from taskrt.bench.pages import header


def machine_description() -> dict:
    import dask
    import distributed
    import numpy

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1) if memory_gib else None,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "platform": platform.platform(),
    }


def quick_run() -> bool:
    """Whether this is a `--quick` run (`python -m taskrt.bench` says so to the benchmarks it runs)."""
    return os.environ.get(QUICK_VARIABLE) == "1"


QUICK_VARIABLE = "TASKRT_BENCH_QUICK"


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(columns: list[tuple[str, str]], rows: list[dict]) -> str:
    """`columns` are (key, header); floats are shown with 3 significant digits unless preformatted."""
    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_result(out_dir, name: str, rows: list[dict], columns, meta: dict, summary: list[str]) -> Path:
    """Write results/<name>.json and results/<name>.md (its header from bench.pages, then the table
    and the summary); returns the Markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "quick": quick_run(),
        **meta,
        "summary": summary,
        "rows": rows,
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    text = header(name, json.loads(json.dumps(record, default=str)))  # the record as the JSON has it
    text += [markdown_table(columns, rows), ""] + [f"- {line}" for line in summary]
    md = out / f"{name}.md"
    md.write_text("\n".join(text) + "\n")
    return md
