"""search.optimize: the strategy with the lowest predicted step time under the cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from taskrt.graph.strategy import Strategy
from taskrt.search import budget as budgeting
from taskrt.search.cost import Breakdown, CostModel
from taskrt.search.eliminate import minimize
from taskrt.search.layer_space import Configs
from taskrt.search.memory import step_memory
from taskrt.search.recompute_search import fit_budget


def optimize(graph, machine, cost_model: CostModel | None = None, check_by_simulation: bool = False,
             check_by_measurement: bool = False, fewer_devices: bool | None = None, memory=None,
             schedule: bool | None = None) -> Strategy:
    """Node and edge elimination over the cost tables; exact for any graph.

    The returned Strategy's `meta` holds the predicted cost per layer (t_c, t_x, t_s, seconds),
    the total, how far eliminations reduced the graph, how long the search took (building the
    tables, eliminating, counting memory), and the memory per device of a step by kind
    (`memory_per_device`, bytes).  Replicated weights take the
    cheaper of the parameter server and the all-reduce per layer (each config's `sync`).

    Equation 1 adds layers up, so it cannot see one layer's synchronization overlapping another's
    backward, or devices sharing processor cores.  With `check_by_simulation`, the optimum is
    simulated against data, model and OWT parallelism and every configuration of the seed
    families (SplitBrain, the Pr x Pc grids); the search starts from the fastest and makes one
    greedy pass over the layers, keeping any config another close candidate gives a layer when
    the simulated step gets faster.  On a real cluster, where the simulation is a prediction
    rather than the measure, a change must win by more than 5% (SIMULATION_MARGIN).
    meta["chosen_by_simulation"] names the start, with every candidate's simulated time;
    meta["refined_layers"] and meta["refined_step_s"] the result.

    With `fewer_devices`, the search also runs on the machine's first k devices for k = 1, 2, 4,
    ... below the device count (`device_counts`), the simulation check included, and keeps the
    count whose strategy's simulated step (with the runtime's costs) is fastest: the runtime's
    own costs can make more devices slower than fewer.  The unused devices get no tasks.
    meta["device_count"] is the count kept; meta["device_counts"] each count's simulated and
    equation-1 step.  None (the default): on a Dask cluster, not on simulated hardware, whose
    runtime costs nothing (equation 1's space holds every strategy on fewer devices, and
    simulating each count's is most of the search's time on large simulated machines).

    With `check_by_measurement` (a running cluster only), the result and data, model and OWT
    parallelism are each trained a few steps on the machine (`search.measured`) and the fastest
    is returned; meta["chosen_by_measurement"] names it, with every candidate's median step.

    `memory`, a budget per device: None (the default) each device's own memory where the machine
    knows it, a number of bytes or a text such as "16GiB", "512MiB" or "2GB" for every device,
    False for none.  The result is the fastest strategy by equation 1 whose predicted step fits:
    when the unconstrained optimum's memory per device (search.memory) fits, it is returned as it
    is; otherwise search.pareto finds the fastest strategy whose memory measure
    (search.memory_tables: an upper bound of the peak, equal to it where every layer peaks on the
    same device) fits the smallest budget, exactly, and its memory per device is checked.  The
    simulation and measurement checks and `fewer_devices` take only candidates that fit.  Nothing
    fitting raises MemoryBudgetError (a MemoryError) naming the smallest peak found.
    meta["memory_budget"] is the bytes each device may hold (the smallest budget; None: no
    budget), meta["memory_bound"] whether the budget changed the result, and
    meta["search"]["budget_s"] the time the budget took (checking, and searching when it binds;
    meta["search"]["budget"] says how).

    `schedule`: whether the budget holds the peak under the runtime's schedule (the one a Trainer
    checks, `_within_schedule`) rather than the search's own count of every value a step ever
    holds; None (the default): on a Dask cluster, not on simulated machines.

    The strategy's `replan` searches again (`SearchAgain`): after a lost worker, the Trainer
    asks it for a strategy on the devices left, under the same budget.
    """
    cost_model = cost_model or CostModel(machine)
    budgets = budgeting.device_budgets(machine, memory)  # a bad value fails before any work

    def search_under(searched_budgets, measure=check_by_measurement):
        return _optimize(graph, machine, cost_model, check_by_simulation, measure, fewer_devices,
                         searched_budgets)

    if budgets and (not machine.is_simulated if schedule is None else schedule):
        # the searches it makes do not measure: the one result and the baselines that fit are
        # measured once at the end
        strategy = _within_schedule(graph, machine, cost_model, budgets,
                                    lambda searched: search_under(searched, measure=False))
        if check_by_measurement:
            strategy = _measured_within_schedule(graph, machine, cost_model, strategy, budgets)
    else:
        strategy = search_under(budgets)
    strategy.replan = SearchAgain(check_by_simulation, fewer_devices, memory, schedule)
    return strategy


SCHEDULE_ROUNDS = 3  # searches under a tighter budget when the schedule's peak does not fit


SCHEDULE_PROBES = 6  # searches under budgets from the widened one down, SCHEDULE_STEP apart
SCHEDULE_STEP = 0.01


def _within_schedule(graph, machine, cost_model, budgets, search_under):
    """On a Dask cluster: a strategy whose peak under the runtime's schedule fits `budgets`, the
    peak a Trainer checks before its first step (taskrt.planning.peak, exact).  The search's own
    count (search.memory) holds every value a step ever holds, 4-16% above that peak for the zoo's
    networks, so a budget between the two would bind the search, or find nothing, where the
    unconstrained optimum fits.  So: the unconstrained optimum when its schedule's peak fits;
    otherwise the search's count is held to the given budgets widened by how far the optimum's
    count is above its peak (the count's looseness for this network and machine), then to budgets
    SCHEDULE_STEP of that smaller each, down to the given ones, at most SCHEDULE_PROBES searches:
    the first result whose schedule fits is kept (the search is exact by its count, so a larger
    count budget's result is no slower), and the scan stops where nothing fits the count (nothing
    fits a smaller one either).  A smaller count does not always hold less under the schedule:
    recomputed copies alive in backward can raise it.  If no result fits, the search under the
    budgets themselves, as a search without the widening would, checked and tightened by
    `_fit_schedule`.  meta["memory_budget_searched"]: the budget the search's count was held to
    (bytes per device, the smallest)."""
    free = search_under(None)
    peaks = _schedule_peaks(graph, cost_model, free)
    counted = max(m["total"] for m in free.meta["memory_per_device"].values())
    looseness = counted / max(p.needed for p in peaks.values())
    if _schedule_fits(peaks, budgets):
        free.meta["memory_budget_searched"] = None
        return _fit_schedule(graph, machine, cost_model, free, budgets, search_under, peaks=peaks)
    for probe in range(SCHEDULE_PROBES):
        scale = looseness * (1 - SCHEDULE_STEP * probe)
        if scale <= 1:
            break
        searched = {d: int(b * scale) for d, b in budgets.items()}
        try:
            strategy = search_under(searched)
        except budgeting.MemoryBudgetError:
            break
        found = _schedule_peaks(graph, cost_model, strategy)
        if _schedule_fits(found, budgets):
            strategy.meta["memory_budget_searched"] = budgeting.smallest(
                searched, strategy.meta.get("device_count", machine.num_devices))
            return _fit_schedule(graph, machine, cost_model, strategy, budgets, search_under, peaks=found)
    try:
        strategy = search_under(budgets)
    except budgeting.MemoryBudgetError as error:
        raise _with_schedule_peak(error, graph, cost_model, widened=looseness > 1) from None
    strategy.meta["memory_budget_searched"] = strategy.meta.get("memory_budget")
    return _fit_schedule(graph, machine, cost_model, strategy, budgets, search_under)


def _schedule_peaks(graph, cost_model, strategy) -> dict:
    """{device: PeakMemory} of `strategy` under the runtime's schedule (taskrt.planning.peak)."""
    from taskrt.planning.lowering import lower
    from taskrt.planning.peak import peak_memory

    return peak_memory(lower(graph, strategy, itemsize=cost_model.itemsize), cost_model.itemsize,
                       len(cost_model.optimizer.slots))


def _schedule_fits(peaks: dict, budgets: dict) -> bool:
    """Whether each device's peak with its kernels' scratch (what a Trainer checks) fits its budget."""
    return all(p.needed <= budgets.get(d, np.inf) for d, p in peaks.items())


def _with_schedule_peak(error, graph, cost_model, widened: bool):
    """`error` (nothing fits by the search's count) saying what its least strategy needs under the
    runtime's schedule, the peak a Trainer checks."""
    if error.least is None:
        return error
    peaks = _schedule_peaks(graph, cost_model, error.least)
    device = max(peaks, key=lambda d: peaks[d].needed)
    out = budgeting.MemoryBudgetError(
        f"{error} (Under the runtime's schedule, which a Trainer checks, that strategy needs "
        f"{budgeting._size(peaks[device].needed)} on device {device}, its kernels' scratch "
        f"{budgeting._size(peaks[device].scratch)} included"
        + ("; the search, which counts every value a step ever holds, was also tried under the budget widened by "
           "how far that count is above the schedule's peak" if widened else "") + ".)", devices=(device,))
    out.least = error.least
    return out


def _fit_schedule(graph, machine, cost_model, strategy, budgets, search_under, peaks=None):
    """A strategy whose peak under the runtime's schedule (taskrt.planning.peak, what a Trainer
    checks before its first step) fits `budgets` as well as its step_memory does.  The search's
    sum counts one backward working set per device, where the schedule may hold several gradient
    pieces at once (a split over channels sends one from every device): if the peak is over, the
    search runs again with each budget scaled down by how far over it was, up to SCHEDULE_ROUNDS
    times.  The peak counted is the held values with the kernels' scratch on top
    (`PeakMemory.needed`), as the Trainer's check counts it.  `peaks`: the strategy's, where known.
    meta["schedule_peak_per_device"]: the held peaks of the result, meta["schedule_scratch_per_device"]:
    the scratch on top of them."""
    tighter = dict(budgets)
    for rounds in range(SCHEDULE_ROUNDS + 1):
        if peaks is None or rounds:
            peaks = _schedule_peaks(graph, cost_model, strategy)
        over = max(peaks[d].needed / budgets[d] for d in peaks if d in budgets)
        if over <= 1:
            strategy.meta["schedule_peak_per_device"] = {str(d): p.total for d, p in peaks.items()}
            strategy.meta["schedule_scratch_per_device"] = {str(d): p.scratch for d, p in peaks.items()}
            strategy.meta["memory_budget"] = budgeting.smallest(budgets, strategy.meta.get("device_count",
                                                                                             machine.num_devices))
            return strategy
        if rounds < SCHEDULE_ROUNDS:
            tighter = {d: int(b / over) for d, b in tighter.items()}
            strategy = search_under(tighter)
            strategy.meta["memory_budget_searched"] = budgeting.smallest(
                tighter, strategy.meta.get("device_count", machine.num_devices))
    device = max(peaks, key=lambda d: peaks[d].needed / budgets.get(d, np.inf))
    raise budgeting.MemoryBudgetError(
        f"no strategy for {graph.name!r} found whose peak under the runtime's schedule fits "
        f"{budgeting._size(budgets[device])} on device {device} of {machine.description}: the last tried holds "
        f"{budgeting._size(peaks[device].total)} there and its kernels' scratch "
        f"{budgeting._size(peaks[device].scratch)} on top (the search's own count: "
        f"{budgeting._size(strategy.meta['memory_per_device'][str(device)]['total'])}). Use more devices, a smaller "
        "batch, or a larger budget.", devices=(device,))


def _optimize(graph, machine, cost_model, check_by_simulation, check_by_measurement, fewer_devices,
              budgets) -> Strategy:
    """optimize's search under `budgets` ({device: bytes} or None), by the search's own count."""
    started = time.perf_counter()
    tables = cost_model.tables(graph)
    built = time.perf_counter()
    if fewer_devices is None:
        fewer_devices = not machine.is_simulated
    counts = device_counts(machine.num_devices) if fewer_devices else [machine.num_devices]
    found = {}  # device count -> (strategy, config index per layer in `tables`, its memory or None)
    refused = {}  # device count -> what raises its MemoryBudgetError (nothing there fits the budget)
    for k in counts:
        searched = _search_on(graph, machine, cost_model, tables, k, check_by_simulation, budgets)
        if callable(searched):
            refused[k] = searched
        elif searched is not None:  # None: some layer fits on no k devices
            found[k] = searched
    if not found and refused:
        raise refused[max(refused)]()
    if len(found) > 1:
        k = _fewest_fast(graph, machine, cost_model, {k: s for k, (s, _, _) in found.items()})
    else:
        (k,) = found
    strategy, choice, known = found[k]
    strategy.meta.setdefault("device_count", k)
    # optimize_s: node and edge elimination and undoing it, for every device count searched;
    # counts_s: the rest of searching the counts (the simulation check, simulating each result)
    eliminating = sum(s.meta["search"]["optimize_s"] for s, _, _ in found.values())
    strategy.meta["search"].update(tables_s=built - started, tables_parts_s=tables.seconds, optimize_s=eliminating,
                                   counts_s=time.perf_counter() - built - eliminating,
                                   configs=sum(len(c) for c in tables.configs.values()))
    strategy.meta["search"]["budget_s"] = sum(s.meta["search"].get("budget_s", 0.0) for s, _, _ in found.values())
    if check_by_measurement:
        strategy = _check_by_measurement(graph, machine, cost_model, strategy, budgets)
    counted = time.perf_counter()
    if known is not None and strategy.configs == found[k][0].configs:
        memory_of = known  # counted by the budget's check already
    else:
        # every layer has a valid config here: no need to validate the strategy again
        regions = cost_model.regions if check_by_simulation or check_by_measurement else (
            lambda layer, config: cost_model.regions(layer, config, choice[layer.name]))
        memory_of = step_memory(graph, strategy, cost_model.itemsize, regions, cost_model.channel_params,
                                len(cost_model.optimizer.slots))
    strategy.meta["memory_per_device"] = _json(memory_of)
    strategy.meta["search"]["memory_s"] = time.perf_counter() - counted
    strategy.meta["memory_budget"] = budgeting.smallest(budgets, k)
    strategy.meta.setdefault("memory_bound", False)
    return strategy


def device_counts(num_devices: int) -> list[int]:
    """The device counts `optimize(fewer_devices=True)` searches: 1, 2, 4, ... below `num_devices`,
    and `num_devices` itself."""
    return [1 << i for i in range(num_devices.bit_length()) if 1 << i < num_devices] + [num_devices]


def _search_on(graph, machine, cost_model, tables, k: int, check_by_simulation: bool, budgets=None):
    """The search restricted to configs on devices 0..k-1 (the first k devices as a machine of their
    own): its Strategy, with meta, the index in `tables` of each layer's config, and its memory
    per device where the budget's check counted it; None when some layer has no config there
    (none fits in memory); a function making the MemoryBudgetError when no strategy fits `budgets`."""
    keep = {name: np.flatnonzero(last_devices(tables.configs[name]) < k) for name in graph.layers}
    if any(len(kept) == 0 for kept in keep.values()):
        return None
    whole = {name: len(kept) == len(tables.configs[name]) for name, kept in keep.items()}

    def rows(name, values):  # the kept configs' entries; the table itself where all are kept
        return values if whole[name] else values[keep[name]]

    unary = {name: rows(name, tables.unary(name)) for name in graph.layers}
    edges = [(u, v, m if whole[u] and whole[v] else m[np.ix_(keep[u], keep[v])]) for u, v, _, m in tables.edges]
    started = time.perf_counter()
    result = minimize(unary, edges)
    eliminating = time.perf_counter() - started
    choice = {name: int(keep[name][i]) for name, i in result.choice.items()}
    memory, budget, bound, report = None, budgeting.smallest(budgets, k), False, None
    recomputed = frozenset()
    if budget is not None:
        checking = time.perf_counter()
        memory = budgeting.memory_of_choice(graph, cost_model, tables, choice)
        if not budgeting.fits(memory, budgets):  # the unconstrained optimum does not fit: search under the budget
            bound = True
            fitting, recomputed, report, again = fit_budget(graph, cost_model, tables, keep, unary,
                                                     [(u, v, m) for u, v, m in edges], budget, choice, result.cost)
            if fitting is None:
                return lambda: budgeting.nothing_fits(graph, machine, cost_model, tables, keep, edges, budgets, k,
                                                      recompute=True)
            fitted, memory = fitting
            choice = fitted
        budget_s = time.perf_counter() - checking
    configs = budgeting.strategy_of_choice(tables, choice, recomputed).configs
    t_c = {n: float(tables.compute[n][choice[n]]) for n in graph.layers}
    t_x = {name: 0.0 for name in graph.layers}
    for u, v, _, m in tables.edges:
        t_x[v] += float(m[choice[u], choice[v]])
    for name in recomputed:  # each recomputed layer's forward again, and its forward transfers again
        forward, resent = again.seconds_again(name, choice)
        t_c[name] += forward
        for consumer, seconds in resent.items():
            t_x[consumer] += seconds
    breakdown = Breakdown(t_c, {n: float(tables.sync[n][choice[n]]) for n in graph.layers}, t_x, tables.estimated)
    meta = {
        "predicted_step_s": breakdown.total,
        "estimated": tables.estimated,
        "per_layer_s": {n: {"t_c": breakdown.t_c[n], "t_x": breakdown.t_x[n], "t_s": breakdown.t_s[n]}
                        for n in graph.layers},
        "search": {"configs": sum(len(kept) for kept in keep.values()), "reduced_nodes": result.reduced_nodes,
                   "reduced_edges": result.reduced_edges, "eliminations": result.eliminations,
                   "method": result.method, "optimize_s": eliminating},
        "machine": machine.description,
    }
    if budget is not None:
        meta["memory_bound"] = bound
        meta["recomputed"] = sorted(recomputed, key=list(graph.layers).index)
        meta["search"]["budget_s"] = budget_s
        if report is not None:
            meta["search"]["budget"] = report
    strategy = Strategy(configs, name="layer-wise", meta=meta)
    if check_by_simulation and k > 1:
        view = machine if k == machine.num_devices else machine.subset(range(k))
        strategy = _check_by_simulation(graph, view, cost_model, strategy, budgets)
        strategy.meta["machine"] = machine.description
    elif check_by_simulation:  # on one device every strategy is the same one: the check's report of it
        seconds = _simulated_s(graph, cost_model, strategy)
        strategy.meta.update(chosen_by_simulation="layer-wise optimum",
                             simulated_step_s={"layer-wise optimum": seconds},
                             refined_layers=[], refined_step_s=seconds)
    return strategy, choice, memory


def _simulated_s(graph, cost_model, strategy) -> float:
    """The simulated step of `strategy` on the cost model's machine, with the runtime's costs."""
    from taskrt.planning.lowering import lower

    return float(cost_model.simulate(lower(graph, strategy, itemsize=cost_model.itemsize)).step_s)


def last_devices(configs) -> np.ndarray:
    """The highest device id of each config (configs on contiguous blocks: search.space)."""
    if isinstance(configs, Configs):
        return configs.first + configs.degrees.prod(axis=1) - 1
    return np.array([max(config.devices) for config in configs])


def _fewest_fast(graph, machine, cost_model, found: dict) -> int:
    """The device count (a key of `found`, {count: strategy}) whose strategy's step is fastest by
    simulation on `machine`: from the fewest devices up, a count is taken only when faster than
    the best so far, on a real cluster by more than SIMULATION_MARGIN (more devices cost the
    runtime more, the part of a step the simulation predicts least well).  Each count's
    simulated and equation-1 step go into meta["device_counts"] of every strategy."""
    margin = 0.0 if machine.is_simulated else SIMULATION_MARGIN
    simulated = {}
    for k, strategy in found.items():
        # the simulation check simulated its result already
        simulated[k] = float(strategy.meta.get("refined_step_s") or _simulated_s(graph, cost_model, strategy))
    best = min(found)
    for k in sorted(found):
        if simulated[k] < simulated[best] * (1 - margin):
            best = k
    report = {str(k): {"simulated_step_s": simulated[k], "predicted_step_s": found[k].meta["predicted_step_s"]}
              for k in sorted(found)}
    for k, strategy in found.items():
        strategy.meta.update(device_count=k, device_counts=report)
    return best


@dataclass(frozen=True)
class SearchAgain:
    """A searched strategy's `replan` (taskrt.graph.strategy.Strategy): the search run again for the
    machine left after a lost worker, under a fresh cost model (cached part timings are reused)."""

    check_by_simulation: bool = False
    fewer_devices: bool | None = None
    memory: object = None  # the budget as optimize took it (None: each device's own memory)
    schedule: bool | None = None  # optimize's

    def __call__(self, graph, machine) -> Strategy:
        return optimize(graph, machine, check_by_simulation=self.check_by_simulation,
                        fewer_devices=self.fewer_devices, memory=self.memory, schedule=self.schedule)


def memory_per_device(graph, strategy, itemsize=4, cost_model: CostModel | None = None) -> dict:
    """JSON-ready bytes per device of a training step under `strategy`, by kind: taskrt.planning.memory's
    accounting of the plan, counted without lowering it (search.memory), from `cost_model`'s
    region tables when given."""
    if cost_model is None:
        return _json(step_memory(graph, strategy.validated(graph), itemsize))
    return _json(step_memory(graph, strategy.validated(graph), itemsize, cost_model.regions,
                             cost_model.channel_params, len(cost_model.optimizer.slots)))


def _json(memory) -> dict:
    return {str(d): m.to_dict() for d, m in memory.items()}


SIMULATION_MARGIN = 0.05  # on a real cluster: how much faster by simulation a change must be to be taken


def candidates(graph, machine, optimum: Strategy) -> dict[str, Strategy]:
    """What the simulation check compares: the Eq. 1 optimum (also with every layer on one sync
    method), the baselines, and every valid configuration of the seed families (SplitBrain's mp,
    the Pr x Pc grids)."""
    from taskrt.search.baselines import BASELINES
    from taskrt.search.families import integrated_family, splitbrain_family

    out = {"layer-wise optimum": optimum}
    # the optimum with one sync method everywhere: Eq. 1 cannot see how either overlaps with backward
    for sync in ("ps", "allreduce"):
        out[f"layer-wise optimum, all {sync}"] = Strategy({n: replace(c, sync=sync) for n, c in optimum.items()})
    out.update({name: make(graph, machine) for name, make in BASELINES.items()})
    for family in (splitbrain_family(graph, machine), integrated_family(graph, machine, "batch"),
                   integrated_family(graph, machine, "grid")):
        out.update(family)
    return {name: strategy.validated(graph, machine) for name, strategy in out.items()}


def _fits(graph, cost_model, strategy, budgets) -> bool:
    """Whether `strategy`'s memory per device (search.memory) fits `budgets` (None: no budget)."""
    if not budgets:
        return True
    return budgeting.fits(step_memory(graph, strategy, cost_model.itemsize, cost_model.regions,
                                     cost_model.channel_params, len(cost_model.optimizer.slots)), budgets)


def _measured_within_schedule(graph, machine, cost_model, strategy, budgets) -> Strategy:
    """`_check_by_measurement` where the budget holds the schedule's peak (`_within_schedule`): the
    baselines measured are those whose schedule's peak fits; the result keeps its peaks in meta."""
    def fits(candidate):
        return _schedule_fits(_schedule_peaks(graph, cost_model, candidate), budgets)

    chosen = _check_by_measurement(graph, machine, cost_model, strategy, budgets, fits=fits)
    if chosen.configs != strategy.configs:
        chosen.meta["memory_per_device"] = memory_per_device(graph, chosen, cost_model.itemsize, cost_model)
    return _fit_schedule(graph, machine, cost_model, chosen, budgets, lambda tighter: chosen)


def _check_by_measurement(graph, machine, cost_model, optimum: Strategy, budgets=None, fits=None) -> Strategy:
    """The fastest on the machine of the optimum and the baselines that fit `budgets` (each distinct
    one timed once); `fits(strategy)`: whether a baseline fits, where not by the search's count."""
    from taskrt.search.baselines import BASELINES
    from taskrt.search.measured import pick_by_measurement

    fits = fits or (lambda strategy: _fits(graph, cost_model, strategy, budgets))
    pool = {"layer-wise": optimum.validated(graph, machine)}
    for name, make in BASELINES.items():
        strategy = make(graph, machine).validated(graph, machine)
        if all(strategy.configs != other.configs for other in pool.values()) and fits(strategy):
            pool[name] = strategy
    measured = pick_by_measurement(graph, machine, pool).meta["chosen_by_measurement"]
    chosen = pool[measured["chosen"]]
    meta = {**optimum.meta, "chosen_by_measurement": measured}
    if measured["chosen"] != "layer-wise":
        meta.update(_predicted(graph, cost_model, chosen))
    return Strategy(chosen.configs, name="layer-wise", meta=meta)


def _predicted(graph, cost_model, strategy) -> dict:
    """The meta entries of a strategy's predicted cost (equation 1), for a result other than the optimum."""
    breakdown = cost_model.breakdown(graph, strategy)
    return {"predicted_step_s": breakdown.total,
            "per_layer_s": {n: {"t_c": breakdown.t_c[n], "t_x": breakdown.t_x[n], "t_s": breakdown.t_s[n]}
                            for n in breakdown.t_c}}


def _check_by_simulation(graph, machine, cost_model, optimum: Strategy, budgets=None) -> Strategy:
    """The fastest candidate by simulation, then one greedy pass over the layers: each layer tries
    the configs the candidates within 1.5x of the fastest give it, and keeps one when the
    simulated step gets faster.  On a real cluster a candidate replaces the Eq. 1 optimum, and a
    refinement is kept, only when it is more than SIMULATION_MARGIN faster.  Under `budgets`,
    candidates and refinements that do not fit are not taken."""
    from tqdm import tqdm

    def simulated_s(strategy) -> float:
        return _simulated_s(graph, cost_model, strategy)

    # On a simulated machine the simulation is the measurement; on a real cluster it is a prediction
    # a few percent off, so a change must win by more than that to be worth the risk.
    margin = 0.0 if machine.is_simulated else SIMULATION_MARGIN
    pool = candidates(graph, machine, optimum)
    if budgets:  # the optimum fits already
        pool = {name: strategy for name, strategy in pool.items()
                if name == "layer-wise optimum" or _fits(graph, cost_model, strategy, budgets)}
    simulated = {name: simulated_s(strategy) for name, strategy in pool.items()}
    start = min(simulated, key=simulated.get)
    if simulated[start] > simulated["layer-wise optimum"] * (1 - margin):
        start = "layer-wise optimum"
    configs, best = dict(pool[start].configs), simulated[start]
    changed = []
    layers = [layer.name for layer in graph if not layer.is_input]
    close = [c for name, c in pool.items() if simulated[name] <= 1.5 * best]  # far slower ones rarely help a layer
    for name in tqdm(layers, desc="refining by simulation", leave=False, disable=not cost_model.progress or None):
        for option in dict.fromkeys(c.configs[name] for c in close):
            if option == configs[name]:
                continue
            trial = Strategy({**configs, name: option}).validated(graph, machine)
            seconds = simulated_s(trial)
            if seconds < best * (1 - max(margin, 1e-9)) and _fits(graph, cost_model, trial, budgets):
                configs, best = dict(trial.configs), seconds
                changed.append(name)
    meta = {**optimum.meta, "chosen_by_simulation": start, "simulated_step_s": simulated,
            "refined_layers": changed, "refined_step_s": best}
    chosen = Strategy(configs)
    if start != "layer-wise optimum" or changed:
        meta.update(_predicted(graph, cost_model, chosen))
    return Strategy(chosen.validated(graph, machine).configs, name="layer-wise", meta=meta)
