"""Every benchmark's page explains itself: what it measures, on what, how to rerun it, its goal and
whether the run met it, read off the run's record (bench.pages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taskrt.bench.__main__ import BENCHMARKS, ON_REQUEST
from taskrt.bench.pages import PAGES, header
from taskrt.bench.report import write_result

RESULTS = Path(__file__).resolve().parent.parent / "results"
LABELS = ("What it measures:", "On:", "Rerun:", "Goal:", "This run:")


def test_every_benchmark_has_a_page():
    assert set(PAGES) == set(BENCHMARKS) | set(ON_REQUEST)
    for name, page in PAGES.items():
        assert f"python -m taskrt.bench {name}" in page.rerun, name


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("*.json") if p.stem in PAGES))
def test_the_committed_records_give_a_verdict(name):
    """The verdict is read off the record the benchmark wrote, not left to the summary."""
    lines = header(name, json.loads((RESULTS / f"{name}.json").read_text()))
    assert lines[0].startswith(f"# {name}: ")
    for label in LABELS:
        assert sum(label in line for line in lines) == 1, (name, label)
    verdict = next(line for line in lines if "This run:" in line)
    assert "not read from" not in verdict and ("met" in verdict or "not judged" in verdict), verdict


def test_a_written_page_starts_with_its_header_then_the_table_and_summary(tmp_path):
    rows = [{"trainer": "single device", "steps": 2, "final_loss": 0.5, "test_accuracy": 0.9,
             "max_relative_loss_difference": 0.0},
            {"trainer": "layer-wise", "steps": 2, "final_loss": 0.5, "test_accuracy": 0.9,
             "max_relative_loss_difference": 2e-4}]
    md = write_result(tmp_path, "convergence", rows, [("trainer", "trainer")], {}, ["a summary line"])
    text = md.read_text()
    assert text.startswith("# convergence: ")
    assert text.index("This run:") < text.index("| trainer |") < text.index("- a summary line")
    assert "NOT met: largest relative difference from the single device's loss 2.0e-04" in text
    assert json.loads((tmp_path / "convergence.json").read_text())["quick"] is False


def test_a_record_of_another_shape_says_so_instead_of_failing():
    lines = header("kernels", {"rows": [{"model": "x"}]})
    assert any("not read from this run's record (KeyError" in line for line in lines)
    assert any("On:** not recorded" in line for line in lines)


def test_the_goals_say_the_numbers_the_benchmarks_judge_by():
    from taskrt.bench import gpu_steps, kernels, overhead, peer

    assert f"{kernels.GOAL:.0%}" in PAGES["kernels"].goal and f"{kernels.MOONSHOT:.0%}" in PAGES["kernels"].goal
    assert all(f"{v:g}x" in PAGES["overhead"].goal for v in {*overhead.GOALS.values(), overhead.HOP_GOAL})
    assert all(f"{v:g}x" in PAGES["peer"].goal for v in {*peer.GOALS.values(), *peer.TWO_DEVICE_GOALS.values()})
    assert f"{gpu_steps.GOAL}x" in PAGES["gpu"].goal and f"{gpu_steps.MEMORY_GOAL}x" in PAGES["gpu"].goal
    from taskrt.bench.goals import BF16_ACCURACY_POINTS, BF16_CURVE_FACTOR, GPU_TRANSFER_RATE_GOAL

    assert f"within {BF16_ACCURACY_POINTS} points" in PAGES["gpu"].goal
    assert f"at most {BF16_CURVE_FACTOR:g}x as far" in PAGES["gpu"].goal
    assert f"{GPU_TRANSFER_RATE_GOAL / 1e9:g} GB/s" in PAGES["gpu"].goal
    from taskrt.bench import accuracy, scaling

    assert f"{scaling.GOAL_RATIO:g}x" in PAGES["scaling"].goal
    assert f"{accuracy.GOAL_CASES} of the 15" in PAGES["accuracy"].goal
    assert f"{accuracy.GOAL_MEDIAN:.0%}" in PAGES["accuracy"].goal and f"{accuracy.GOAL:.0%}" in PAGES["accuracy"].goal


def test_the_accuracy_verdict_judges_cases_median_and_ranking():
    rows = [{"model": "m", "strategy": s, "devices": 2, "simulated_error": e, "within_goal": abs(e) <= 0.1}
            for s, e in (("data", 0.02), ("owt", 0.2))]
    record = {"rows": rows, "goal": 0.1, "goal_cases": 1, "goal_median": 0.07}
    assert any("NOT met: 1 of 2 cases within 10% (goal 1), median |error| 11.0%" in line
               for line in header("accuracy", {**record, "median_error": 0.11, "ranked_right": True}))
    assert any("met: 1 of 2 cases" in line and "NOT" not in line
               for line in header("accuracy", {**record, "median_error": 0.05, "ranked_right": True}))


def test_yes_and_no_written_as_text_read_as_such():
    """numpy's booleans reach the JSON as "True" and "False": "False" is a no."""
    rows = [{"model": "lenet5", "strategy": "data", "devices": 2, "simulated_error": 0.2, "within_goal": "False"},
            {"model": "lenet5", "strategy": "owt", "devices": 2, "simulated_error": 0.01, "within_goal": "True"}]
    lines = header("accuracy", {"rows": rows, "goal": 0.1})
    assert any("NOT met: 1 of 2 cases within 10%; missed: lenet5 data on 2 (+20.0%)" in line for line in lines)


def test_the_committed_accuracy_verdict_counts_as_its_summary_does():
    record = json.loads((RESULTS / "accuracy.json").read_text())
    counted = next(line for line in record["summary"] if line.startswith("simulated prediction within"))
    within, cases = counted.split(" in ")[1].split(" cases")[0].split(" of ")
    assert any(f"{within} of {cases} cases within" in line for line in header("accuracy", record))


def test_the_peer_page_judges_never_slower_than_one_device():
    from taskrt import models
    from taskrt.bench.overhead import data_parallel
    from taskrt.bench.peer import ONE_DEVICE_TOLERANCE, one_device_check

    graph = models.lenet5(batch=4, image_size=16, width=0.5)
    one, two = data_parallel(graph, 1).validated(graph), data_parallel(graph, 2).validated(graph)
    two.meta.update(device_count=2, device_counts={"1": {"simulated_step_s": 0.02}, "2": {"simulated_step_s": 0.01}})
    slower = one_device_check(graph, two, one, 1.0 + 2 * ONE_DEVICE_TOLERANCE, 1.0)
    assert not slower["never_slower"] and slower["simulated_ms_per_count"] == {"1": 20.0, "2": 10.0}
    assert one_device_check(graph, two, one, 1.0 + ONE_DEVICE_TOLERANCE / 2, 1.0)["never_slower"]
    same = one_device_check(graph, one, one, 1.2, 1.0)  # the search kept one device: the same strategy
    assert same["never_slower"] and same["searched_is_one_device"] and same["searched_devices"] == [0]
    rows = [{"model": "alexnet32", "goal": 0.8, "meets_goal": True, "taskrt_vs_pytorch": 1.1},
            {"model": "alexnet32", **slower}]
    lines = header("peer", {"rows": rows})
    verdict = next(line for line in lines if "This run:" in line)
    assert "met: local(1) at 1.10x" in verdict and "never slower than one device: NOT met" in verdict
    assert "two devices beat one" not in verdict  # a record without the check says nothing of it


def test_the_peer_page_judges_two_devices_against_one_and_pytorch():
    from taskrt.bench.peer import TWO_DEVICE_GOALS, two_device_check

    assert two_device_check("lenet5", 1.0, 2.0, 1.0)["beats_one"] is None  # no goal for LeNet-5
    fast = two_device_check("alexnet32", 0.4, 0.6, 0.35)
    assert fast["searched_vs_local1"] == 0.6 / 0.4 and fast["beats_one"]
    slow_vs_torch = two_device_check("vgg16_32", 0.4, 0.6, 0.3)  # 1.5x local(1), 0.75x PyTorch
    assert not slow_vs_torch["beats_one"] and slow_vs_torch["searched_vs_pytorch"] < TWO_DEVICE_GOALS["vs_pytorch"]
    rows = [{"model": "alexnet32", **fast}, {"model": "vgg16_32", **slow_vs_torch}]
    verdict = next(line for line in header("peer", {"rows": rows}) if "This run:" in line)
    assert "two devices beat one: NOT met" in verdict and "alexnet32: searched on local(2) at 1.50x local(1)" in verdict


def memory_record(ratio=1.0, refused=True, demo_difference=3e-15, under=True, exact=1e-14, bitwise=True,
                  increase_error=0.04, found=True):
    """A `bench memory` record in the shape bench/memory.py writes, its judged numbers as given."""
    rows = [{"model": "lenet5", "devices": 2, "strategy": "data", "device": d, "ratio": r}
            for d, r in enumerate([1.0, ratio])]
    demo = {"data_parallel": {"refused": refused}, "max_rel_difference": demo_difference, "under_memory": under}
    case = ({"model": "vgg16_32", "found": True, "float64_max_rel_difference": exact, "float32_bitwise_equal": bitwise,
             "increase_error": increase_error, "measured_increase_ms": 120.0} if found
            else {"model": "vgg16_32", "found": False, "why": "recomputing every layer needs more"})
    return {"rows": rows, "curves": [{"bound_search_ratio": 1.4}], "demonstration": demo, "recompute": [case]}


def test_the_memory_verdict_meets_all_goals_only_together():
    from taskrt.bench.verdicts import memory_verdict

    text = memory_verdict(memory_record())
    assert "NOT" not in text and text.count("met") == 4, text
    assert "within 0.0% of the measured" in text and "1.40x" in text
    assert "predicted peaks NOT met" in memory_verdict(memory_record(ratio=1.11))
    assert "predicted peaks met" in memory_verdict(memory_record(ratio=0.91))
    for missed in ({"refused": False}, {"demo_difference": 2e-9}, {"under": False}):
        assert "the demonstration NOT met" in memory_verdict(memory_record(**missed)), missed
    for missed in ({"exact": 1e-6}, {"bitwise": False}, {"increase_error": -0.12}):
        assert "recomputation on vgg16_32 NOT met" in memory_verdict(memory_record(**missed)), missed
    assert "recomputation on vgg16_32 NOT met: recomputing" in memory_verdict(memory_record(found=False))


def test_the_memory_verdict_says_what_did_not_run():
    from taskrt.bench.verdicts import memory_verdict

    record = memory_record()
    del record["demonstration"], record["recompute"]
    text = memory_verdict(record)
    assert "the demonstration NOT run" in text and "recomputation NOT run" in text
    assert "bit" not in text and "goal 2x" in text
    # a JSON record's yes and no are read as such
    assert "NOT met" in memory_verdict({**memory_record(), "demonstration": {
        "data_parallel": {"refused": "False"}, "max_rel_difference": 0.0, "under_memory": "True"}})
