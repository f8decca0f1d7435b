"""Recomputation in `bench memory` (issue 54, goal 4): a memory budget that only recomputation
meets, a strategy meeting it trained against one device, and the time recomputation costs a step,
measured against the simulator's prediction.

The budget, by the search's own count (`optimize(schedule=False)`): the search without
recomputation (`least_keeping`) is met down to some budget B_keep;
the same strategy with every layer that may be recomputed recomputed needs less, P_all. A budget
between the two is met only by recomputing. The strategy for it is the search's
(`search.optimize(..., memory=budget)`, when the search chooses recomputation), or else the least
budget's strategy with the layers of the largest outputs recomputed, one at a time, until it fits
(`by_hand`); `source` says which.

Exactness: the strategy trained in float64 on the workers against `SingleDeviceTrainer` in float64
(equal to rounding, 1e-12 relative, as tests/test_recompute.py checks), and in float32 its losses
against the same configs without recomputation (bit for bit: a copy computed again is the same
computation on the same inputs).

Time: the strategy and the same configs without recomputation take turns in interleaved rounds
(two steps each, the second timed); the measured increase is the median of the rounds' paired
differences, so the host's drift over the rounds cancels; the simulated increase is the difference
of the simulator's steps (`CostModel.simulate`, as bench accuracy predicts). tests/measure_recompute.py
runs the same measurement for fixed strategies.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from taskrt import search
from taskrt.bench.measure import interleaved_times
from taskrt.graph.strategy import Strategy
from taskrt.planning.lowering import lower
from taskrt.planning.memory import plan_memory
from taskrt.planning.peak import peak_memory
from taskrt.search.measured import random_batch
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer

MIB = 2**20
EXACT_STEPS = 4  # float64 steps against one device
HYPER = {"lr": 1e-3, "momentum": 0.9, "seed": 0}


def recomputed_layers(strategy) -> list[str]:
    return [name for name, config in strategy.items() if config.recompute]


def recomputable(graph) -> list[str]:
    """Layers whose outputs may be computed again in backward: not the inputs, not the losses."""
    losses = {layer.name for layer in graph.losses}
    return [layer.name for layer in graph if not layer.is_input and layer.name not in losses]


def with_recompute(strategy, layers) -> Strategy:
    layers = set(layers)
    return Strategy({n: dataclasses.replace(c, recompute=n in layers) for n, c in strategy.items()},
                    name=f"{strategy.name or 'searched'}, {len(layers)} recomputed")


def without_recompute(strategy) -> Strategy:
    return Strategy({n: dataclasses.replace(c, recompute=False) for n, c in strategy.items()},
                    name=f"{strategy.name or 'searched'}, none recomputed")


def memory_of(graph, strategy, machine, itemsize: int = 4, slots: int = 1) -> dict:
    """The most any device holds by the search's sum (`plan_memory`) and under the runtime's
    schedule (`peak_memory`), in bytes: `by_hand`'s strategy must fit both."""
    plan = lower(graph, strategy.validated(graph, machine), itemsize=itemsize)
    return {"sum": max(m.total for m in plan_memory(plan, itemsize, slots).values()),
            "schedule": max(p.total for p in peak_memory(plan, itemsize, slots).values())}


def fitting(graph, machine, cost_model, budget: int, keep_only: bool):
    """The search's strategy under `budget`, or None when nothing fits (with `keep_only`, also
    when what fits recomputes)."""
    try:
        # the search's own count of every value a step holds: on a cluster a budget otherwise holds the
        # schedule's peak, which recomputation lowers only where the activations make it
        strategy = search.optimize(graph, machine, cost_model, memory=int(budget), schedule=False)
    except search.MemoryBudgetError:
        return None
    return None if keep_only and recomputed_layers(strategy) else strategy


def least_keeping(graph, machine, cost_model, high: int, steps: int = 7):
    """The least budget (bisected to 1/2**steps of `high`) the search meets without recomputing,
    and its strategy: (budget, strategy), or (None, None) when not even `high` is met."""
    top = fitting(graph, machine, cost_model, high, keep_only=True)
    if top is None:
        return None, None
    low, best = 0.0, (high, top)
    hi = float(high)
    for _ in range(steps):
        middle = (low + hi) / 2
        found = fitting(graph, machine, cost_model, middle, keep_only=True)
        if found is None:
            low = middle
        else:
            hi, best = middle, (int(middle), found)
    return best


def by_hand(graph, machine, strategy, budget: int) -> Strategy | None:
    """`strategy` with the layers of the largest outputs recomputed, one at a time, until both of
    its memory counts fit `budget`; None when recomputing every layer does not."""
    order = sorted(recomputable(graph), key=lambda n: -int(np.prod(graph[n].shape)))
    chosen = []
    for name in order:
        chosen.append(name)
        candidate = with_recompute(strategy, chosen)
        if max(memory_of(graph, candidate, machine).values()) <= budget:
            return candidate.validated(graph, machine)
    return None


def choose(graph, machine, cost_model, high: int) -> dict:
    """A budget only recomputation meets on `machine` and the strategy meeting it (see the module
    docstring), with the figures that place the budget."""
    keep_budget, keeping = least_keeping(graph, machine, cost_model, high)
    if keeping is None:
        return {"found": False, "why": f"the search meets no budget up to {high / MIB:.0f} MiB"}
    everything = with_recompute(keeping, recomputable(graph))
    all_memory = memory_of(graph, everything, machine)
    lowest = max(all_memory.values())
    out = {"keep_budget": keep_budget, "keeping": keeping.name or "searched",
           "keeping_memory": memory_of(graph, keeping, machine), "all_recomputed_memory": all_memory}
    if lowest >= keep_budget:
        return {**out, "found": False,
                "why": f"recomputing every layer needs {lowest / MIB:.1f} MiB, not less than the "
                       f"{keep_budget / MIB:.1f} MiB the search meets without it"}
    budget = int((lowest + keep_budget) / 2)
    searched = fitting(graph, machine, cost_model, budget, keep_only=False)
    if searched is not None and recomputed_layers(searched):
        strategy, source = searched, "search.optimize under the budget"
    else:
        strategy, source = by_hand(graph, machine, keeping, budget), (
            "by hand: the least budget's strategy with its largest outputs recomputed (the search "
            + ("returned a strategy without recomputation" if searched is not None else "found none") + ")")
    if strategy is None:
        return {**out, "found": False, "budget": budget, "why": "no strategy found for the budget"}
    return {**out, "found": True, "budget": budget, "source": source, "strategy": strategy,
            "memory": memory_of(graph, strategy, machine)}


def exactness(graph, strategy, machine, steps: int = EXACT_STEPS) -> dict:
    """float64 on the workers against one device, same data and initialization."""
    x, y = random_batch(graph, 1)
    x = x.astype(np.float64)
    reference = SingleDeviceTrainer(graph, dtype="float64", **HYPER)
    trainer = Trainer(graph, strategy, machine, dtype="float64", check_memory=False, **HYPER)
    one = [reference.step(x, y) for _ in range(steps)]
    two = [trainer.step(x, y) for _ in range(steps)]
    difference = max(abs(a - b) / max(abs(a), 1e-300) for a, b in zip(one, two))
    return {"float64_losses": two, "single_device_losses": one, "float64_max_rel_difference": difference}


def paired_rounds(trainers: dict, x, y, rounds: int) -> tuple[dict, dict]:
    """Step times of each trainer in interleaved rounds (two steps each, the second timed) after a
    warm-up step, and every loss each returned."""
    losses = {k: [] for k in trainers}
    runners = {k: (lambda x, y, k=k, t=t: losses[k].append(t.step(x, y))) for k, t in trainers.items()}
    return interleaved_times(runners, x, y, rounds, "recomputation's cost"), losses


def time_cost(graph, strategy, machine, cost_model, rounds: int) -> dict:
    """The increase in step time `strategy`'s recomputation costs, measured (paired rounds against
    the same configs without it) and simulated; the float32 losses of both."""
    x, y = random_batch(graph, 0)
    strategies = {"plain": without_recompute(strategy).validated(graph, machine), "recompute": strategy}
    trainers = {k: Trainer(graph, s, machine, check_memory=False, **HYPER) for k, s in strategies.items()}
    times, losses = paired_rounds(trainers, x, y, rounds)
    simulated = {}
    for k, t in trainers.items():
        runtime = cost_model.runtime(t.plan, t.executor.fused, t.executor_kind)
        simulated[k] = cost_model.simulate(t.plan, t.executor.fused, runtime, t.executor_kind).step_s
    differences = [a - b for a, b in zip(times["recompute"], times["plain"])]
    q1, q3 = np.percentile(differences, [25, 75])
    measured = statistics.median(differences)
    predicted = simulated["recompute"] - simulated["plain"]
    return {"measured_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "simulated_ms": {k: v * 1e3 for k, v in simulated.items()},
            "measured_increase_ms": measured * 1e3, "measured_increase_iqr_ms": [q1 * 1e3, q3 * 1e3],
            "simulated_increase_ms": predicted * 1e3,
            "increase_error": predicted / measured - 1 if measured else None,
            "step_error": simulated["recompute"] / statistics.median(times["recompute"]) - 1,
            "float32_bitwise_equal": losses["recompute"] == losses["plain"],
            "float32_losses": losses["recompute"]}


def case(label: str, graph, machine, cost_model, rounds: int) -> dict:
    """One network's row: the budget, the strategy and where it came from, its exactness and time."""
    high = int(max(memory_of(graph, search.data_parallel(graph, machine), machine).values()) * 1.05)
    chosen = choose(graph, machine, cost_model, high)
    row = {"model": label, "batch": graph.inputs[0].shape[0], "devices": machine.num_devices,
           **{k: v for k, v in chosen.items() if k != "strategy"}}
    if not chosen["found"]:
        return row
    strategy = chosen["strategy"]
    row["recomputed"] = recomputed_layers(strategy)
    row["strategy_json"] = strategy.to_dict()
    row.update(exactness(graph, strategy, machine))
    row.update(time_cost(graph, strategy, machine, cost_model, rounds))
    return row
