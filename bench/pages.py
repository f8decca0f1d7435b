"""What each benchmark's results page says about itself before its numbers: what it measures, on
what, how to rerun it, its goal, and whether the run met it (`Page`, one per benchmark in PAGES).

`bench.report.write_result` puts the header on every page it writes; the benchmarks that write
their own pages (data, gpu, hypergraph, ist, seeds) start them with `header(name, record)`.  A
page's verdict is read off the run's record, the same dict that goes to results/<name>.json.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass


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


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def truth(value) -> bool | None:
    """A record's yes or no: numpy's booleans reach the JSON as the text "True" or "False"."""
    return {"True": True, "False": False, "None": None}.get(value, value) if isinstance(value, str) else value


# ---- one verdict per benchmark, read off its record ------------------------------------------------
def programs_verdict(record) -> str:
    from taskrt.bench.goals import HOP_GOAL_S, TASKS_GOAL
    from taskrt.bench.goals import PROGRAMS_RATE_GOAL as RATE_GOAL

    rows, hops = record["rows"], record["hops"]
    worst = max(r["programs_tasks_per_device"] for r in rows)
    return (f"Dask tasks per step and device at most {worst:g} ({met(worst <= TASKS_GOAL)}, goal {TASKS_GOAL}); "
            f"a value between programs {hops['hop_s'] * 1e3:.2f} ms ({met(hops['hop_s'] <= HOP_GOAL_S)}, goal "
            f"{HOP_GOAL_S * 1e3:g} ms); a 64 MB tile (goal {RATE_GOAL / 1e9:g} GB/s) of weights or gradients, "
            f"lent in place, at {hops.get('lent_rate', 0.0) / 1e9:.1f} GB/s "
            f"({met(hops.get('lent_rate', 0.0) >= RATE_GOAL)}), of activations, copied, at "
            f"{hops['large_rate'] / 1e9:.2f} GB/s ({met(hops['large_rate'] >= RATE_GOAL)}); programs' step "
            f"{min(r['speedup'] for r in rows):.2f}x to {max(r['speedup'] for r in rows):.2f}x as fast as "
            "a Dask task per fused run (no goal)" + _fit_verdict(record.get("fit")))


def _fit_verdict(fits) -> str:
    if not fits:
        return ""
    most = max(f["auto_tasks"] for f in fits)
    return (f"; `fit` with several steps to a program: at most {most:.2g} Dask tasks per step and device "
            f"(moonshot: almost none in the steady state), a whole fit's step "
            + ", ".join(f"{f['speedup']:.2f}x" for f in fits)
            + " as fast as with one step to a program (LeNet-5, " + ", ".join(
                f"batch {f['batch']} on local({f['devices']})" for f in fits) + ")")


def kernels_verdict(record) -> str:
    from taskrt.bench.goals import KERNELS_GOAL as GOAL
    from taskrt.bench.goals import KERNELS_MOONSHOT as MOONSHOT

    large = [r["of_gemm"] for r in record["rows"] if truth(r["large"])]
    below = sum(v < GOAL for v in large)
    return (f"{met(below == 0)}: {min(large):.0%} to {max(large):.0%} of GEMM (median {statistics.median(large):.0%}) "
            f"on {len(large)} large layers" + (f", {below} below {GOAL:.0%}" if below else "")
            + f"; the moonshot {MOONSHOT:.0%} reached by {sum(v >= MOONSHOT for v in large)} of {len(large)}")


def overhead_verdict(record) -> str:
    one = [r for r in record["single_device"] if r.get("goal")]
    two = record["rows"]
    from taskrt.bench.goals import OVERHEAD_HOP_GOAL as HOP_GOAL

    ok = all(truth(r["meets_goal"]) for r in one) and all(r["vs_replica"] <= HOP_GOAL for r in two)
    return (f"{met(ok)}: one device, local(1) / in-process "
            + ", ".join(f"{r['model']} {r['ratio']:.2f}x (goal {r['goal']}x)" for r in one)
            + "; two devices, overhead / Dask's own on the same graph "
            + ", ".join(f"{r['model']} {r['vs_replica']:.2f}x" for r in two) + f" (goal {HOP_GOAL}x)")


def search_verdict(record) -> str:
    judged = [r for r in record["rows"] if truth(r.get("meets_goal")) is not None]
    missed = [f"{r['model']} on {r['devices']} ({r['end_to_end_s'] * 1e3:.1f} against {r['goal_s'] * 1e3:g} ms)"
              for r in judged if not truth(r["meets_goal"])]
    return (f"{met(not missed)}: {len(judged) - len(missed)} of {len(judged)} searches with a figure in the paper "
            "within a quarter of its time" + (f"; missed by {', '.join(missed)}" if missed else ""))


MEASURED = "layer-wise, measured"  # bench strategies' row of the search's measured pick


def verdicts(rows) -> list[str]:
    """Does layer-wise (and the measured pick) reach the best baseline's throughput?  Within the
    noise counts as a tie."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["strategy"]: r for r in rows if r["model"] == model}
        best = max((mine[s] for s in ("data", "model", "owt")), key=lambda r: r["images_per_s"])
        for searched in ("layer-wise", MEASURED):
            if searched in mine:
                lines.append(_verdict(model, mine[searched], best))
    return lines


def _verdict(model, lw, best) -> str:
    """One searched row against the best baseline; marks the row with its verdict."""
    ratio = lw["images_per_s"] / best["images_per_s"]
    noise = max(lw["iqr_ms"] / lw["measured_ms"], best["iqr_ms"] / best["measured_ms"], 0.03)
    if ratio >= 1 + noise:
        verdict = "wins"
    elif ratio >= 1 - noise:
        verdict = "ties (within noise)"
    else:
        verdict = "LOSES"
    lw["verdict"] = verdict
    picked = lw.get("measured_pick")
    return (f"{model}: {lw['strategy']}{f' (picked {picked})' if picked else ''} {lw['images_per_s']:.1f} images/s "
            f"vs best baseline {best['strategy']} {best['images_per_s']:.1f} = {ratio:.2f}x, "
            f"noise +-{noise:.0%}: {verdict}")


def strategies_verdict(record) -> str:
    lines = verdicts([dict(r) for r in record["rows"]])
    loses = [line.split(":")[0] for line in lines if line.endswith("LOSES")]
    equal = all(truth(r["bytes_match_logs"]) for r in record["rows"])
    lost = f", loses on {', '.join(loses)}" if loses else ""
    return (f"{met(not loses and equal)}: the searched strategy wins or ties (within noise) on "
            f"{len(lines) - len(loses)} of {len(lines)} comparisons{lost}; bytes equal the transfer logs: {equal}")


def accuracy_verdict(record) -> str:
    rows = record["rows"]
    misses = [f"{r['model']} {r['strategy']} on {r['devices']} ({r['simulated_error']:+.1%})"
              for r in rows if not truth(r["within_goal"])]
    if "goal_cases" not in record:  # a record of the goal before (every case within 10%)
        return (f"{met(not misses)}: {len(rows) - len(misses)} of {len(rows)} cases within {record['goal']:.0%}"
                + (f"; missed: {', '.join(misses)}" if misses else ""))
    within, median, ranked = len(rows) - len(misses), record["median_error"], truth(record["ranked_right"])
    ok = within >= record["goal_cases"] and median <= record["goal_median"] and ranked
    return (f"{met(ok)}: {within} of {len(rows)} cases within {record['goal']:.0%} (goal {record['goal_cases']}), "
            f"median |error| {median:.1%} (goal <= {record['goal_median']:.0%}), the simulation's fastest strategy "
            f"{'measured fastest or within noise' if ranked else 'measured SLOWER beyond noise'} on every network"
            + (f"; missed: {', '.join(misses)}" if misses else ""))


SCALING_TOLERANCE = 0.005  # the simulated optimum of equation 1 may trail another strategy's simulation by this


def scaling_verdict(record) -> str:
    rows, behind = record["rows"], []
    for model, devices in dict.fromkeys((r["model"], r["devices"]) for r in rows):
        mine = {r["strategy"]: r["images_per_s"] for r in rows if (r["model"], r["devices"]) == (model, devices)}
        best = max(v for k, v in mine.items() if k != "layer-wise")
        if mine["layer-wise"] < best * (1 - SCALING_TOLERANCE):
            behind.append(f"{model} on {devices} ({mine['layer-wise'] / best:.2f}x)")
    top = max(r["devices"] for r in rows)
    gains = [f"{m} {lw / best:.2f}x" for m in dict.fromkeys(r["model"] for r in rows)
             for lw, best in [_layer_wise_over_best(rows, m, top)]]
    text = (f"{met(not behind)} by simulation: layer-wise at least the best other strategy at every device count"
            + (f" except {', '.join(behind)}" if behind else "") + f"; at {top} devices {', '.join(gains)}")
    ratios = record.get("ratios")
    if ratios:
        goal = record["goal_ratio"]
        over = [name for name, r in ratios.items() if r["programs"] > goal]
        text += (f". taskrt's runtime at {top} devices, {met(not over)}: the free runtime's throughput over "
                 "taskrt's with programs " + ", ".join(f"{n} {r['programs']:.2f}x" for n, r in ratios.items())
                 + f" (goal <= {goal}x" + (f"; over it: {', '.join(over)}" if over else "") + "); with a Dask task "
                 "per fused run " + ", ".join(f"{n} {r['tasks']:.2f}x" for n, r in ratios.items()))
    return text


def _layer_wise_over_best(rows, model, devices) -> tuple[float, float]:
    mine = {r["strategy"]: r["images_per_s"] for r in rows if (r["model"], r["devices"]) == (model, devices)}
    return mine["layer-wise"], max(v for k, v in mine.items() if k != "layer-wise")


CONVERGENCE_TOLERANCE = 1e-4


def convergence_verdict(record) -> str:
    rows = record["rows"]
    worst = max(r["max_relative_loss_difference"] for r in rows)
    accuracies = {r["test_accuracy"] for r in rows}
    same = len(accuracies) == 1
    return (f"{met(worst <= CONVERGENCE_TOLERANCE and same)}: largest relative difference from the single "
            f"device's loss {worst:.1e} over {rows[0]['steps']} steps; test accuracy "
            f"{'the same for every trainer' if same else 'DIFFERS'} ({max(accuracies):.2%})")


# float32: replayed steps may run under another strategy, whose sums are taken in another order
ELASTIC_TOLERANCE = 1e-4


def elastic_verdict(record) -> str:
    r = record["rows"][0]
    share = r["snapshot_ms"] / (r["snapshot_every"] * r["step_ms_snapshots_off"])
    ok = share <= 0.05 and r["max_rel_difference"] <= ELASTIC_TOLERANCE
    return (f"{met(ok)}: a snapshot every {r['snapshot_every']} step(s) costs {share:.1%} of the step; after the "
            f"SIGKILL the final parameters differ from the uninterrupted run's by {r['max_rel_difference']:.1e} "
            f"(recovery {r['recovery_s']:.2f} s)")


def peer_verdict(record) -> str:
    judged = [r for r in record["rows"] if r.get("goal")]
    if not judged:
        verdict = "not judged: this run measured no network the goal names (AlexNet-32, VGG-16-32)"
    else:
        verdict = (f"{met(all(truth(r['meets_goal']) for r in judged))}: local(1) at "
                   + ", ".join(f"{r['taskrt_vs_pytorch']:.2f}x PyTorch's throughput on {r['model']}" for r in judged)
                   + f" (goal {judged[0]['goal']}x)")
    checked = [r for r in record["rows"] if "never_slower" in r]
    if checked:  # issue 39, on records that have it
        verdict += (f"; never slower than one device: {met(all(truth(r['never_slower']) for r in checked))} ("
                    + ", ".join(f"{r['model']}: {r['device_count']} device(s) kept, searched at "
                                f"{r['searched_vs_one_device']:.2f}x one device's throughput" for r in checked) + ")")
    beats = [r for r in record["rows"] if r.get("beats_one") is not None]
    if beats:  # issue 39's goal 3, on records that have it
        verdict += (f"; two devices beat one: {met(all(truth(r['beats_one']) for r in beats))} ("
                    + ", ".join(f"{r['model']}: searched on local(2) at {r['searched_vs_local1']:.2f}x local(1), "
                                f"{r['searched_vs_pytorch']:.2f}x PyTorch on two threads" for r in beats) + ")")
    return verdict


MEASURED_TOLERANCE = 0.05  # the searched strategy's median step may trail the best other's by this (noise)


def searched_behind(rows, tolerance: float = 0.0) -> list[tuple]:
    """(model, devices, the fastest other's step over the searched one's) wherever, on more than
    one device, the searched strategy's median step is above the fastest other's by more than
    `tolerance`."""
    out = []
    for model, devices in dict.fromkeys((r["model"], r["devices"]) for r in rows if r["devices"] > 1):
        at = {r["strategy"]: r["measured_ms"] for r in rows if (r["model"], r["devices"]) == (model, devices)}
        best = min(v for k, v in at.items() if k != "searched")
        if at["searched"] > best * (1 + tolerance):
            out.append((model, devices, best / at["searched"]))
    return out


def scaling_measured_verdict(record) -> str:
    rows = record["rows"]
    ran = sorted({r["devices"] for r in rows if r["devices"] > 1})
    behind = [f"{model} on {devices} ({ratio:.2f}x of the best)"
              for model, devices, ratio in searched_behind(rows, MEASURED_TOLERANCE)]
    missing = [n for n in (2, 4, 8) if n not in ran]
    ok = not behind and not missing
    searched = ("" if not ran else "; the searched strategy within noise of the fastest everywhere" if not behind
                else "; the searched strategy slower than another on " + ", ".join(behind))
    return (f"{met(ok)}: measured on {', '.join(map(str, ran)) or 'no'} devices of {record['cores']} cores"
            + (f" (not run: {', '.join(map(str, missing))})" if missing else "") + searched)


def data_verdict(record) -> str:
    from taskrt.bench.goals import GOAL_BYTES

    goals = record["goals"]
    words = {True: "met", False: "NOT met", None: "not judged (one model)"}

    def said(value):
        return words[truth(value)]

    return (f"at most {GOAL_BYTES} B of sample data per step: {said(goals['bytes'])}; no slower anywhere (beyond "
            f"the noise): {said(goals['no slower'])}; faster where the batch is largest (beyond the noise): "
            f"{said(goals['faster'])}")


def gpu_verdict(record) -> str:
    from taskrt.bench.goals import BF16_LOSS_GOAL, MEMORY_GOAL
    from taskrt.bench.goals import GPU_STEP_GOAL as GOAL
    from taskrt.bench.goals import GPU_TRANSFER_RATE_GOAL as RATE_GOAL

    steps = [r for r in record["rows"] + record.get("bf16", []) if "runtime_ms" in r]
    kernels = [r["taskrt_of_cudnn"] for r in record.get("kernels", []) if r.get("taskrt_of_cudnn") is not None]
    bf16 = [r for r in record.get("bf16", []) if "loss_rel_diff" in r]
    parts = [f"steps at least {GOAL}x PyTorch's: {sum(r['of_torch'] >= GOAL for r in steps)} of {len(steps)}",
             f"peak memory at most {MEMORY_GOAL}x: "
             f"{sum(r.get('memory_of_torch', math.inf) <= MEMORY_GOAL for r in steps)} of {len(steps)}"]
    if kernels:
        parts.append(f"conv kernels at least 50% of cuDNN: {sum(v >= 0.5 for v in kernels)} of {len(kernels)}")
    if bf16:
        parts.append("bf16's loss within " + f"{BF16_LOSS_GOAL:.0%} of fp32's: "
                     + met(all(r["loss_rel_diff"] <= BF16_LOSS_GOAL for r in bf16)))
    transfers = [r for r in record.get("transfer", []) if r.get("goal")]
    if transfers:
        parts.append(f"a device array between workers at least {RATE_GOAL / 1e9:.0f} GB/s: "
                     + met(all(r["goal"] == "met" for r in transfers)))
    ok = (all(r["of_torch"] >= GOAL and r.get("memory_of_torch", math.inf) <= MEMORY_GOAL for r in steps)
          and all(v >= 0.5 for v in kernels) and all(r["loss_rel_diff"] <= BF16_LOSS_GOAL for r in bf16)
          and all(r["goal"] == "met" for r in transfers))
    return f"{met(ok)}: " + "; ".join(parts)


def gpu_on(record) -> str:
    gpu, machine = record.get("gpu") or {}, record.get("machine") or {}
    when = f"; {record['date'][:10]}" if record.get("date") else ""
    return (f"{gpu.get('gpu', 'a GPU')}, driver {gpu.get('driver')}, torch {gpu.get('torch')} (cuDNN "
            f"{gpu.get('cudnn')}), cupy {gpu.get('cupy')}; host {machine.get('cpu')}, {machine.get('cores')} cores"
            f"{when}")


def hypergraph_verdict(record) -> str:
    from taskrt.bench.goals import THESIS_VOLUME

    timing = [r for r in record["tables"] if r["method"] == "coarse hypergraph"]
    widest = max(timing, key=lambda r: r["N"])
    thesis = THESIS_VOLUME["coarse hypergraph"]
    above = [str(r["N"]) for r in timing if r["volume_mv"] > thesis[r["N"]]]
    where = f" (above it at N = {', '.join(above)}: see the exact optimum below)" if above else ""
    return (f"{met(widest['seconds'] < 1)}: the coarse-grain partition takes {widest['seconds']} s at N = "
            f"{widest['N']}; beside the thesis, its volume is at most the thesis's at {len(timing) - len(above)} of "
            f"{len(timing)} N{where}")


def ist_verdict(record) -> str:
    parts, ok = [], True
    hidden = record["network"][1]
    formula = all(math.isclose(r["ist_traffic_plan"], r["ist_traffic"], rel_tol=1e-6)
                  for r in record["rows"] if hidden % r["n"] == 0)
    ok &= formula
    parts.append(f"IST's floats per step equal the formula where n divides the layers: {formula}")
    logged = all(truth(m["ist_equal"]) and truth(m["dp_equal"]) for m in record["measured"])
    ok &= logged
    parts.append(f"planned bytes equal the transfer logs: {logged}")
    measured = (record.get("table1") or {}).get("measured")
    if measured:
        top = str(record["table1"]["setting"]["targets"][-1])
        dp, ist = (measured["runs"][m]["reached"].get(top) for m in ("dp", "ist"))
        if dp and ist:
            sooner = dp[1] / ist[1]
            ok &= sooner >= 2
            parts.append(f"IST reaches {top} {sooner:.1f}x sooner than data parallelism on local(2) (goal 2x)")
        else:
            ok = False
            parts.append(f"IST or data parallelism did not reach {top} on local(2)")
    else:
        ok = False
        parts.append("Table 1 was not measured in this run")
    return f"{met(ok)}: " + "; ".join(parts)


def seeds_verdict(record) -> str:
    explained = all(truth(r["explained"]) for r in record["model_vs_plan"])
    table1 = all(truth(r["equal"]) for r in record["table_1"])
    ratios = [r["search vs best family"] for r in record["search"]]
    ok = explained and table1 and min(ratios) >= 0.995
    return (f"{met(ok)}: the plan's volumes equal seed 001's model or differ as explained: {explained}; seed 000's "
            f"Table 1 counts equal: {table1}; the search against the best family by simulation: "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x")


def gholami_verdict(record) -> str:
    best = record["rows"]
    fig6 = {r["P"]: r for r in best if r["figure"] == "fig6"}
    fig7 = {r["P"]: r for r in best if r["figure"] == "fig7"}
    small, large = min(fig6), max(fig6)
    pure = fig6[small]["best_grid"] == f"1x{small}"
    cuts = 1 < fig6[large]["comm_speedup"] < fig7[large]["comm_speedup"]
    return (f"{met(pure and cuts)}: at P = {small} the best grid is {fig6[small]['best_grid']} (pure batch: {pure}); "
            f"at P = {large} communication {fig6[large]['comm_speedup']:.1f}x less with one grid (Fig. 6, best "
            f"{fig6[large]['best_grid']}; the paper 16x32, 5.0x) and {fig7[large]['comm_speedup']:.1f}x with the "
            "conv layers batch parallel (Fig. 7; the paper 9.7x)")


QUICK = "`--quick`:"

def optim_verdict(record) -> str:
    from taskrt.bench.goals import OPTIM_GOAL

    judged = [r for r in record["rows"] if truth(r.get("meets_goal")) is not None]
    ratios = ", ".join(f"{r['model']} {r['adamw_vs_sgd']:.3f}x" for r in record["rows"])
    if not judged:
        return f"not judged (no network the goal names ran): AdamW / SGD {ratios}"
    return (f"{met(all(truth(r['meets_goal']) for r in judged))}: an AdamW step / an SGD-with-momentum step "
            f"{ratios} (goal at most {OPTIM_GOAL}x)")


def zoo_verdict(record) -> str:
    from taskrt.bench.goals import ZOO_SEARCH_S, ZOO_SPEED, ZOO_TWO_DEVICES

    rows = record["rows"]
    equal = sum(bool(truth(r["equal"])) for r in rows)
    fast = [r for r in rows if r.get("local1_vs_pytorch") is not None and r["family"] in ZOO_SPEED]
    speed_ok = all(r["local1_vs_pytorch"] >= ZOO_SPEED[r["family"]] for r in fast)
    two = [r for r in rows if r.get("local2_vs_local1") is not None and r["family"] in ZOO_TWO_DEVICES]
    two_ok = all(r["local2_vs_local1"] >= ZOO_TWO_DEVICES[r["family"]] for r in two)
    search_ok = all(r["search_s"] < ZOO_SEARCH_S for r in rows)
    ok = equal == len(rows) and speed_ok and two_ok and search_ok
    return (f"{met(ok)}: {equal} of {len(rows)} families equal PyTorch's step; speed "
            + ", ".join(f"{r['family']} {r['local1_vs_pytorch']:.2f}x" for r in fast)
            + f" ({met(speed_ok)}); two devices "
            + ", ".join(f"{r['family']} {r['local2_vs_local1']:.2f}x" for r in two)
            + f" ({met(two_ok)}); searches under {ZOO_SEARCH_S:g} s ({met(search_ok)})")


PAGES = {
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
        "searched strategy to be no slower than) and `Machine.local(1)`, all in the same interleaved rounds. "
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
        "at least 50% of cuDNN's rate, bf16's loss within 2% of fp32's, a 64 MB device array between two workers "
        "at least 10 GB/s.",
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
