"""The time-memory curve of `bench memory` (issue 54): per network, the budgeted search's strategy
under budgets shrinking from the unconstrained strategy's memory down to where nothing fits, each
with its predicted step time (simulated with the machine's measured costs, and equation 1) and its
peak per device (under the runtime's schedule, `peak_memory`, which the Trainer checks and the
workers measure; and the search's own sum), beside data parallelism, OWT and SplitBrain; drawn as
results/memory.png, time against peak memory per device, one panel per network.

The budgets: the least budget the search meets is found by bisection, then BUDGETS budgets spaced
geometrically from the unconstrained strategy's own need down to it (on a cluster its peak under the
schedule with the kernels' scratch, which a budget holds there; else the search's sum), and one below
it (nothing fits).
Each search is timed too, beside the unconstrained search's on the same warm cost model
(issue 54's goal 2, at most 2x; docs/design.md measures it from a fresh cost model on simulated
P100s)."""

from __future__ import annotations

import time

from taskrt import search
from taskrt.planning.lowering import lower
from taskrt.planning.memory import plan_memory
from taskrt.planning.peak import peak_memory

MIB = 2**20
BUDGETS = 10
BISECTION_STEPS = 7


def point(graph, strategy, machine, cost_model, kind: str, budget=None, search_s=None) -> dict:
    """One point of the curve: a strategy's predicted step and its peak per device."""
    strategy = strategy.validated(graph, machine)
    plan = lower(graph, strategy)
    slots = len(cost_model.optimizer.slots)
    runtime = cost_model.runtime(plan)
    peaks = peak_memory(plan, cost_model.itemsize, slots)
    schedule = {d: p.total for d, p in peaks.items()}
    summed = {d: m.total for d, m in plan_memory(plan, cost_model.itemsize, slots).items()}
    recomputed = sorted(n for n, c in strategy.items() if c.recompute)
    return {"kind": kind, "strategy": strategy.name or ("searched" if budget is not None else kind),
            "budget_mib": budget / MIB if budget else None,
            "simulated_ms": cost_model.simulate(plan, runtime=runtime).step_s * 1e3,
            "equation1_ms": cost_model.breakdown(graph, strategy).total * 1e3,
            "peak_mib": max(schedule.values()) / MIB, "sum_mib": max(summed.values()) / MIB,
            "needed_mib": max(p.needed for p in peaks.values()) / MIB,  # with the kernels' scratch: what a budget holds
            "peak_per_device_mib": [round(v / MIB, 2) for v in schedule.values()],
            "devices_used": len({d for _, c in strategy.items() for d in c.devices}),
            "recomputed": recomputed, "meta_recomputed": strategy.meta.get("recomputed"),
            "memory_bound": strategy.meta.get("memory_bound"), "search_s": search_s}


def timed_search(graph, machine, cost_model, memory):
    start = time.perf_counter()
    try:
        strategy = search.optimize(graph, machine, cost_model, memory=memory)
    except search.MemoryBudgetError as error:
        return None, time.perf_counter() - start, str(error)
    return strategy, time.perf_counter() - start, None


def least_budget(graph, machine, cost_model, high: float) -> float:
    """The least budget (within 1/2**BISECTION_STEPS of `high`) the search meets."""
    low = 0.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if timed_search(graph, machine, cost_model, int(middle))[0] is None:
            low = middle
        else:
            high = middle
    return high


def curve(label: str, graph, machine, cost_model, budgets: int = BUDGETS) -> dict:
    """The searched points under shrinking budgets and the baselines' points, for one network."""
    timed_search(graph, machine, cost_model, False)  # builds the cost tables: the searches after time the search
    free, free_s, _ = timed_search(graph, machine, cost_model, False)
    counted = max(m["total"] for m in free.meta["memory_per_device"].values())
    points = [point(graph, free, machine, cost_model, "unconstrained", search_s=free_s)]
    # on a cluster a budget holds the schedule's peak (kernels' scratch included), else the search's count
    top = int(points[0]["needed_mib"] * MIB) if not machine.is_simulated else counted
    least = least_budget(graph, machine, cost_model, top)
    ratio = (least / top) ** (1 / max(budgets - 1, 1))
    for k in range(budgets + 1):
        budget = int(top * ratio ** k) if k < budgets else int(least * 0.97)  # the last: below the least
        strategy, seconds, refused = timed_search(graph, machine, cost_model, budget)
        if strategy is None:
            points.append({"kind": "searched", "strategy": "nothing fits", "budget_mib": budget / MIB,
                           "search_s": seconds, "refused": refused})
        else:
            points.append(point(graph, strategy, machine, cost_model, "searched", budget, seconds))
    baselines = {"data parallel": search.data_parallel(graph, machine), "OWT": search.owt(graph, machine),
                 **search.splitbrain_family(graph, machine)}
    for name, strategy in baselines.items():
        points.append({**point(graph, strategy, machine, cost_model, name.split(" mp=")[0]), "strategy": name})
    bound = [p["search_s"] for p in points if p["kind"] == "searched" and p.get("memory_bound")]
    return {"model": label, "batch": graph.inputs[0].shape[0], "devices": machine.num_devices,
            "least_budget_mib": least / MIB, "unconstrained_sum_mib": counted / MIB, "points": points,
            "unconstrained_search_s": free_s,
            "bound_search_ratio": (sorted(bound)[len(bound) // 2] / free_s) if bound and free_s else None,
            "bound_search_ratio_max": (max(bound) / free_s) if bound and free_s else None}


STYLE = {"data parallel": ("tab:orange", "s"), "OWT": ("tab:green", "^"), "splitbrain": ("tab:purple", "D"),
         "unconstrained": ("k", "*")}


def draw(curves: list[dict], path, machine_text: str) -> None:
    """Predicted step time against peak memory per device, one panel per network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.6 * len(curves), 6.2), squeeze=False)
    for ax, c in zip(axes[0], curves):
        searched = sorted((p for p in c["points"] if p["kind"] == "searched" and "peak_mib" in p),
                          key=lambda p: -p["budget_mib"])
        ax.plot([p["needed_mib"] for p in searched], [p["simulated_ms"] for p in searched], "o-", color="tab:blue",
                label="searched under a budget (peak under the schedule)")
        ax.plot([p["sum_mib"] for p in searched], [p["simulated_ms"] for p in searched], ".--", color="tab:blue",
                alpha=0.5, label="the same strategies' sum (the search's count)")
        again = [p for p in searched if p["recomputed"]]
        if again:
            ax.plot([p["needed_mib"] for p in again], [p["simulated_ms"] for p in again], "o", mfc="none",
                    mec="tab:red", ms=11, mew=1.5, label="searched, recomputing some layers")
        for p in c["points"]:
            if p["kind"] in STYLE:
                color, marker = STYLE[p["kind"]]
                name = "unconstrained search" if p["kind"] == "unconstrained" else p["strategy"]
                ax.plot(p["needed_mib"], p["simulated_ms"], marker, color=color, ms=9, label=f"{name} (schedule)")
                ax.plot(p["sum_mib"], p["simulated_ms"], marker, color=color, ms=9, mfc="none", label=f"{name} (sum)")
        ax.axvline(c["least_budget_mib"], color="grey", linestyle=":", linewidth=1,
                   label=f"least budget met ({c['least_budget_mib']:.0f} MiB)")
        ax.set_xlabel("MiB per device (filled: the schedule's peak with scratch;\nhollow: the search's sum)")
        ax.set_ylabel("simulated step time (ms)")
        ax.set_title(f"{c['model']}, batch {c['batch']}, {c['devices']} devices")
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(f"fastest strategy under shrinking memory budgets ({machine_text})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
