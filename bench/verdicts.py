"""One verdict per benchmark, read off its run's record (the dict that goes to
results/<name>.json): "met ..." or "NOT met ..." in words, for the page's "This run" line
(`bench.pages`)."""

from __future__ import annotations

import math
import statistics


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
    from taskrt.bench.goals import BF16_ACCURACY_POINTS, BF16_CURVE_FACTOR, MEMORY_GOAL
    from taskrt.bench.goals import GPU_STEP_GOAL as GOAL
    from taskrt.bench.goals import GPU_TRANSFER_RATE_GOAL as RATE_GOAL

    steps = [r for r in record["rows"] + record.get("bf16", []) if "runtime_ms" in r]
    kernels = [r["taskrt_of_cudnn"] for r in record.get("kernels", []) if r.get("taskrt_of_cudnn") is not None]
    bf16 = [r for r in record.get("bf16", []) if "curve_bf16" in r]
    bf16_ok = all(r["accuracy_met"] and r["curve_met"] for r in bf16)
    parts = [f"steps at least {GOAL}x PyTorch's: {sum(r['of_torch'] >= GOAL for r in steps)} of {len(steps)}",
             f"peak memory at most {MEMORY_GOAL}x: "
             f"{sum(r.get('memory_of_torch', math.inf) <= MEMORY_GOAL for r in steps)} of {len(steps)}"]
    if kernels:
        parts.append(f"conv kernels at least 50% of cuDNN: {sum(v >= 0.5 for v in kernels)} of {len(kernels)}")
    if bf16:
        parts.append(f"bf16's held-out accuracy within {BF16_ACCURACY_POINTS} points of fp32's and its loss curve "
                     f"at most {BF16_CURVE_FACTOR:g}x another fp32 run's distance: " + met(bf16_ok))
    transfers = [r for r in record.get("transfer", []) if r.get("goal")]
    if transfers:
        parts.append(f"a device array between workers at least {RATE_GOAL / 1e9:.0f} GB/s: "
                     + met(all(r["goal"] == "met" for r in transfers)))
    ok = (all(r["of_torch"] >= GOAL and r.get("memory_of_torch", math.inf) <= MEMORY_GOAL for r in steps)
          and all(v >= 0.5 for v in kernels) and bf16_ok
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


def memory_verdict(record) -> str:
    """Goals 1, 3 and 4 of issue 54 (goal 2, the search's time under a budget, shown beside)."""
    from taskrt.bench.goals import (
        MEMORY_EXACT,
        MEMORY_PEAK_GOAL,
        MEMORY_RECOMPUTE_GOAL,
        MEMORY_SEARCH_GOAL,
    )

    rows = record["rows"]
    worst = max(abs(r["ratio"] - 1) for r in rows)
    parts = [f"predicted peaks {met(worst <= MEMORY_PEAK_GOAL)}: every one of {len(rows)} devices' peaks within "
             f"{worst:.1%} of the measured (goal {MEMORY_PEAK_GOAL:.0%})"]
    ratios = [c["bound_search_ratio"] for c in record.get("curves") or [] if c.get("bound_search_ratio")]
    if ratios:
        parts.append(f"a search under a binding budget took at most {max(ratios):.2f}x the unconstrained search's time "
                     f"(per network, the median over its budgets; {met(max(ratios) <= MEMORY_SEARCH_GOAL)}, goal "
                     f"{MEMORY_SEARCH_GOAL:g}x)")
    demo = record.get("demonstration")
    if demo is None:
        parts.append("the demonstration NOT run")
    else:
        ok = (truth(demo["data_parallel"]["refused"]) and demo["max_rel_difference"] <= MEMORY_EXACT
              and truth(demo["under_memory"]))
        parts.append(f"the demonstration {met(ok)}: data parallelism "
                     + ("refused before any step" if truth(demo["data_parallel"]["refused"]) else "NOT refused")
                     + f", the search's strategy within {demo['max_rel_difference']:.1e} of one device's loss "
                     f"(float64, goal {MEMORY_EXACT:g}), its measured peaks "
                     + ("under" if truth(demo["under_memory"]) else "NOT under") + " the devices' memory")
    cases = record.get("recompute")
    if not cases:
        parts.append("recomputation NOT run")
    for r in cases or []:
        if not r["found"]:
            parts.append(f"recomputation on {r['model']} NOT met: {r['why']}")
            continue
        exact = r["float64_max_rel_difference"] <= MEMORY_EXACT and truth(r["float32_bitwise_equal"])
        close = r["increase_error"] is not None and abs(r["increase_error"]) <= MEMORY_RECOMPUTE_GOAL
        parts.append(f"recomputation on {r['model']} {met(exact and close)}: loss "
                     + ("exact" if exact else "NOT exact") + f" ({r['float64_max_rel_difference']:.0e} in float64), "
                     f"time cost simulated {r['increase_error']:+.0%} off the measured "
                     f"{r['measured_increase_ms']:.0f} ms (goal {MEMORY_RECOMPUTE_GOAL:.0%})")
    return "; ".join(parts)
