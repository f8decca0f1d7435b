"""Profiled steps: per-task timing on the workers, per-device timelines measured beside simulated,
the Chrome trace, the Gantt chart, the dashboard's plot and `taskrt profile`."""

from __future__ import annotations

import json
from operator import getitem

import numpy as np
import pytest

from taskrt.cli import random_batch
from taskrt.data.arrays import InputError
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.observing.task_timing import ProfiledRun, Timed, profiled_graph, take_records
from taskrt.observing.timeline import (
    BUSY_LANES,
    DASK,
    KERNELS,
    TRANSFERS_IN,
    TRANSFERS_OUT,
    WAIT_DEPENDENCY,
    WAIT_END,
    WAIT_OTHERS,
    WAIT_RUNTIME,
    WAIT_START,
    WAITING,
    Busy,
    Span,
    short_name,
    simulated_step,
    union_s,
    waiting_spans,
)
from taskrt.planning.fusion import FusedRun
from taskrt.planning.simulate import Runtime, simulate
from taskrt.training.trainer import Trainer
from tests.graphs import small_lenet


def mixed(graph):
    """Two devices: n-split layers, an h-split second convolution (halo rows move), c-split
    fully-connected layers, the loss on device 0."""
    configs = {}
    for layer in graph:
        if layer.is_input:
            continue
        if layer.name == "conv2":
            configs[layer.name] = P(h=2, devices=(1, 0))
        elif layer.kind == "linear":
            configs[layer.name] = P(c=2)
        elif layer.kind == "softmax_cross_entropy":
            configs[layer.name] = P(devices=(0,))
        else:
            configs[layer.name] = P(n=2)
    return Strategy(configs, name="mixed-2")


class FlatCosts:
    """A cost model for tests: every task 0.2 ms, an ideal runtime (no calibration to wait for)."""

    def __init__(self, machine):
        self.machine = machine

    def simulate(self, plan, fused=True, executor="programs"):
        programs = executor == "programs"
        return simulate(plan, lambda task: 2e-4, self.machine, Runtime(fused=fused and not programs, programs=programs))


@pytest.fixture(scope="module")
def machine2():
    m = Machine.local(2, probe=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def profiled(machine2, tmp_path_factory):
    """A small LeNet-5 under a strategy with n, h and c splits, two steps profiled."""
    graph = small_lenet()
    trainer = Trainer(graph, mixed(graph), machine2, lr=0.05, momentum=0.9)
    batch = random_batch(graph, seed=1)
    trainer.step(*batch)
    path = tmp_path_factory.mktemp("profile") / "trace.json"
    profile = trainer.profile(*batch, steps=2, path=path, cost_model=FlatCosts(machine2))
    return trainer, profile, path


# ---- pure parts ------------------------------------------------------------------------------------
def test_union_counts_overlaps_once():
    assert union_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_s([]) == 0.0


def test_short_names_drop_the_step_tag():
    assert short_name(("conv1-fwd-it7-ab12", 0), "7-ab12") == "conv1-fwd 0"
    assert short_name(("fc1-update", 0, 1)) == "fc1-update 0,1"
    assert short_name(("dev0-fused-it3-x", 2), "3-x") == "dev0-fused 2"


def test_waiting_is_named_by_what_the_device_waits_for():
    def busy(a, b, ready=None, passive=False, lane=KERNELS):
        return Busy(Span(0, lane, f"task {a}", a, b), ready, "x" if ready else "", passive)

    spans = waiting_spans(0, [busy(2, 4), busy(6, 7, ready=5), busy(8, 8.5, passive=True, lane=TRANSFERS_OUT)],
                          0.0, 10.0, first_s=2.0, last_s=9.0)
    assert [(s.name, s.start_s, s.end_s) for s in spans] == [
        (WAIT_START, 0, 2), (WAIT_DEPENDENCY, 4, 5), (WAIT_RUNTIME, 5, 6), (WAIT_OTHERS, 7, 8),
        (WAIT_OTHERS, 8.5, 9), (WAIT_END, 9, 10)]
    assert dict(spans[1].detail)["for"] == "x"


def test_a_simulated_step_shows_every_task_and_transfer_and_adds_up(machine2):
    graph = small_lenet()
    from taskrt.planning.fusion import fused_plan
    from taskrt.planning.lowering import lower

    plan = lower(graph, mixed(graph).validated(graph, machine2), "train", 4)
    sim = simulate(plan, lambda task: 1e-3, machine2, Runtime(fused=True, task_s=2e-4, dispatch_s=1e-3))
    step = simulated_step(plan, sim, (0, 1), 0.5, 3, fused_plan(plan)[1])
    assert step.start_s == 0.5 and step.wall_s == sim.step_s
    kernels = {s.name: s for s in step.spans if s.lane == KERNELS}
    assert set(kernels) == {short_name(t.key) for t in plan.tasks}
    for task in plan.tasks:  # each kernel's 1 ms, after the runtime's 0.2 ms for a task of its own
        span = kernels[short_name(task.key)]
        assert span.device == task.device and span.end_s == pytest.approx(0.5 + sim.finish[task.key])
        assert span.seconds == pytest.approx(1e-3)
    assert len(step.on(0, TRANSFERS_IN) + step.on(1, TRANSFERS_IN)) == len(sim.transfers) > 0
    assert step.on(0, DASK) and step.on(1, DASK)
    for device in (0, 1):
        assert step.busy_s(device) + step.waiting_s(device) == pytest.approx(step.wall_s, rel=1e-9)


def test_profiled_runs_compute_what_runs_compute_and_time_each_step():
    take_records()
    run = FusedRun(((("a",), lambda x: x + 1, (("in", 0),)), (("b",), lambda x: 2 * x, (("own", ("a",)),))),
                   (("b",),), (), "a-program")
    profiled = profiled_graph({("run",): (run, 3), ("b-export",): (getitem, ("run",), 0),
                               ("data",): (np.negative, 5)})
    fn = profiled[("run",)][0]
    assert isinstance(fn, ProfiledRun) and fn.program is None  # never replayed as a CUDA graph
    assert profiled[("b-export",)][0] is getitem and isinstance(profiled[("data",)][0], Timed)
    assert fn(3) == run(3) == (8,)
    assert profiled[("data",)][0](5) == -5
    _, records = take_records()
    assert [(k, t) for k, t, *_ in records] == [(("run",), ("a",)), (("run",), ("b",)), (("data",), ("data",))]
    for (_, _, start, end, _), (_, _, later, _, _) in zip(records, records[1:]):
        assert start <= end <= later
    assert take_records()[1] == []  # taken once


# ---- on a cluster ----------------------------------------------------------------------------------
def test_trace_file_is_valid_with_measured_and_simulated_processes_for_every_device(profiled):
    trainer, profile, path = profiled
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert events and all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X") and all("dur" in e for e in events if e["ph"] == "X")
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"device {d} ({source})" for d in (0, 1) for source in ("measured", "simulated")}
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert len(pids) == 4  # every process has events
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all((pid, lane) in threads for pid in pids for lane in ("kernels", "transfers in", "waiting"))
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # every task of the plan timed once per profiled step, under the names the simulation uses
    plan_names = sorted(short_name(t.key) for t in trainer.plan.tasks)
    for step in profile.measured:
        assert sorted(s.name for s in step.spans if s.lane == KERNELS) == plan_names
    assert sorted(s.name for s in profile.simulated.spans if s.lane == KERNELS) == plan_names


def test_kernels_never_overlap_and_busy_plus_waiting_is_the_step_time(profiled):
    """Read back from the trace file, per measured device of the last step: kernels one after
    another on the device's thread, and busy time (kernels, data, transfers) plus waiting equal to
    the wall time the trainer measured for the step."""
    trainer, profile, path = profiled
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    last = profile.last.step
    assert trainer.stats.step == last
    for device in (0, 1):
        mine = [e for e in events if e["pid"] == device and e["args"].get("step") == last]
        kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] in ("kernels", "data"))
        assert len(kernels) > 5
        assert all(b[0] >= a[1] - 1e-3 for a, b in zip(kernels, kernels[1:]))  # microseconds
        busy = union_s([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] in BUSY_LANES])
        waiting = sum(e["dur"] for e in mine if e["cat"] == WAITING)
        assert busy > 0 and waiting > 0
        assert (busy + waiting) / 1e6 == pytest.approx(trainer.stats.wall_s, rel=0.05)
    assert profile.check() == []


def test_each_task_lies_inside_the_dask_task_that_ran_it(profiled):
    """The workers' per-task times and Dask's task stream agree (one clock): each timed task lies
    within its Dask task's compute span, and on each device a run's tasks take most of the run."""
    _, profile, _ = profiled
    step = profile.last
    runs = {(s.device, s.name): s for s in step.spans if s.lane == DASK}
    for span in step.spans:
        if span.lane in (KERNELS, "data"):
            run = runs[(span.device, dict(span.detail)["dask task"])]
            assert run.start_s - 2e-3 <= span.start_s <= span.end_s <= run.end_s + 2e-3, (span, run)


def test_profiling_leaves_later_steps_unprofiled_and_training_unchanged(machine2, profiled):
    graph = small_lenet()
    data = [random_batch(graph, seed) for seed in range(5)]
    plain = Trainer(graph, mixed(graph), machine2, lr=0.05, momentum=0.9, dtype="float64")
    expected = [plain.step(*batch) for batch in data]
    trainer = Trainer(graph, mixed(graph), machine2, lr=0.05, momentum=0.9, dtype="float64")
    losses = [trainer.step(*data[0])]
    losses += trainer.profile(*data[1], steps=1, path=None, png=False, cost_model=False).losses
    losses += trainer.profile(*data[2], steps=1, path=None, png=False, cost_model=False, reference=False).losses
    machine2.client.run(take_records)  # from here on, nothing is recorded
    later = [trainer.submit(*batch) for batch in data[3:]]
    losses += [future.result() for future in later]
    assert losses == expected  # the same computation, to the bit
    assert not trainer.executor.profiling and all(f.run.profiled is None for f in later)
    assert all(records == [] for _, records in machine2.client.run(take_records).values())


def test_profile_checks_its_arguments_before_any_step(profiled, tmp_path):
    trainer, _, _ = profiled
    batch = random_batch(trainer.graph)
    done = trainer.steps_done
    with pytest.raises(ValueError, match="steps must be a positive int"):
        trainer.profile(*batch, steps=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.profile(*batch, path=tmp_path / "missing" / "trace.json")
    with pytest.raises(InputError, match="expects shape"):
        trainer.profile(batch[0][:1], batch[1], path=None)
    with pytest.raises(ValueError, match="needs the batch"):
        trainer.profile(path=None)
    assert trainer.steps_done == done


def test_the_dashboard_shows_the_last_profiled_step(machine2, profiled):
    from bokeh.client import pull_session
    from bokeh.models import ColumnDataSource

    from taskrt.observing.dashboard import page_url

    trainer, profile, _ = profiled
    trainer.publisher.profiled(profile)  # the page shows the cluster's last profile: this one again
    with pull_session(url=page_url(machine2.client)) as session:
        sources = [s.data for s in session.document.select({"type": ColumnDataSource}) if "lane" in s.data]
    [bars] = sources
    assert set(bars["row"]) == {f"device {d} {s}" for d in (0, 1) for s in ("measured", "simulated")}
    measured = [(n, r - left) for n, row, lane, left, r in zip(bars["name"], bars["row"], bars["lane"], bars["left"],
                                                               bars["right"]) if row == "device 0 measured"
                and lane == KERNELS]
    assert sorted(n for n, _ in measured) == sorted(s.name for s in profile.last.on(0, KERNELS))
    assert max(bars["right"]) <= max(profile.last.wall_s, profile.simulated.wall_s) * 1e3 + 1e-6


def test_cli_profile_writes_the_trace_and_the_chart(tmp_path, monkeypatch, capsys):
    from taskrt import cli

    monkeypatch.setattr(cli, "profile_cost_model", lambda machine, cache=None: FlatCosts(machine))
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert cli.main(["profile", "lenet5", "--batch", "8", "--image-size", "16", "--steps", "1", "--warmup", "1",
                     "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "0       measured" in out and "1       simulated" in out and "inconsistent" not in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 1000, 1001}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_profile_names_a_bad_strategy_before_starting(tmp_path, capsys):
    from taskrt import cli

    with pytest.raises(SystemExit):
        cli.main(["profile", "lenet5", "--strategy", str(tmp_path / "none.json")])
    assert "expected data-parallel, search or a strategy JSON file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["profile", "lenet6"])
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow  # calibrates a fresh local(2) cluster's runtime costs and times its parts: a minute or more
def test_cli_profile_simulates_with_the_cost_model(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    trace = tmp_path / "lenet.json"
    done = subprocess.run([sys.executable, "-m", "taskrt", "profile", "lenet5", "--batch", "16", "--image-size", "16",
                           "--steps", "2", "--warmup", "2", "--trace", str(trace), "--png", str(tmp_path / "lenet.png"),
                           "--cache", str(tmp_path / "costs.json")], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated step" in done.stdout and "inconsistent" not in done.stdout
    other = json.loads(trace.read_text())["otherData"]
    assert other["simulated_step_ms"] > 0 and len(other["measured_step_ms"]) == 2
    assert (tmp_path / "lenet.png").stat().st_size > 10_000
