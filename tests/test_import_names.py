"""Installed, taskrt is importable only under its own name: a user's own ops.py, search.py and
bench.py beside their script shadow nothing of taskrt's (its kernels, search and benchmarks are
taskrt.ops, taskrt.search and taskrt.bench), on the client and on the workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    import numpy as np

    import bench  # the user's own modules, beside the script
    import ops
    import search
    import taskrt as tr
    from taskrt import search as taskrt_search

    assert ops.MINE and search.MINE and bench.MINE
    assert callable(taskrt_search.optimize) and tr.Rect.__module__ == "taskrt.ops.rect"


    def worker_sees_own_modules(dask_worker=None):
        import taskrt.ops.rect  # noqa: F401
        return sys.modules["taskrt.ops"].__file__, sys.modules.get("ops") is None or sys.modules["ops"].MINE


    if __name__ == "__main__":
        g = tr.models.lenet5(batch=8)
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal(g.inputs[0].shape), rng.integers(0, 10, 8)
        with tr.Machine.local(1, probe=False) as machine:
            strategy = tr.Strategy({l.name: tr.ParallelConfig() for l in g if not l.is_input})
            loss = tr.Trainer(g, strategy, machine, lr=0.01).step(x, y)
            [(ops_file, fine)] = machine.client.run(worker_sees_own_modules).values()
        assert np.isfinite(loss) and fine and ops_file.endswith("__init__.py"), (loss, fine, ops_file)
        print("trained", loss)
""")


def test_a_script_beside_its_own_ops_search_and_bench_trains_a_step(tmp_path):
    for name in ("ops", "search", "bench"):
        (tmp_path / f"{name}.py").write_text("MINE = True\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout


def test_the_benchmarks_run_as_taskrt_bench_from_anywhere(tmp_path):
    (tmp_path / "bench.py").write_text("raise SystemExit('the user bench.py ran')\n")
    done = subprocess.run([sys.executable, "-m", "taskrt.bench", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "taskrt.bench" in done.stdout, done.stderr[-2000:]
