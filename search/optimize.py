"""search.optimize: the strategy with the lowest predicted step time under the cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from search.cost import Breakdown, CostModel
from search.eliminate import minimize
from search.memory import step_memory
from taskrt.strategy import Strategy


def optimize(graph, machine, cost_model: CostModel | None = None, check_by_simulation: bool = False,
             check_by_measurement: bool = False) -> Strategy:
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

    With `check_by_measurement` (a running cluster only), the result and data, model and OWT
    parallelism are each trained a few steps on the machine (`search.measured`) and the fastest
    is returned; meta["chosen_by_measurement"] names it, with every candidate's median step.

    The strategy's `replan` searches again (`SearchAgain`): after a lost worker, the Trainer
    asks it for a strategy on the devices left.
    """
    cost_model = cost_model or CostModel(machine)
    started = time.perf_counter()
    tables = cost_model.tables(graph)
    built = time.perf_counter()
    unary = {name: tables.unary(name) for name in graph.layers}
    edges = [(u, v, m) for u, v, _, m in tables.edges]
    result = minimize(unary, edges)
    finished = time.perf_counter()
    choice = result.choice
    configs = {name: tables.configs[name][i] for name, i in choice.items()}
    t_x = {name: 0.0 for name in graph.layers}
    for u, v, _, m in tables.edges:
        t_x[v] += float(m[choice[u], choice[v]])
    breakdown = Breakdown({n: float(tables.compute[n][choice[n]]) for n in graph.layers},
                          {n: float(tables.sync[n][choice[n]]) for n in graph.layers}, t_x, tables.estimated)
    meta = {
        "predicted_step_s": breakdown.total,
        "estimated": tables.estimated,
        "per_layer_s": {n: {"t_c": breakdown.t_c[n], "t_x": breakdown.t_x[n], "t_s": breakdown.t_s[n]}
                        for n in graph.layers},
        "search": {"tables_s": built - started, "tables_parts_s": tables.seconds, "optimize_s": finished - built,
                   "configs": sum(
            len(c) for c in tables.configs.values()), "reduced_nodes": result.reduced_nodes,
            "reduced_edges": result.reduced_edges, "eliminations": result.eliminations, "method": result.method},
        "machine": machine.description,
    }
    strategy = Strategy(configs, name="layer-wise", meta=meta)
    if check_by_simulation:
        strategy = _check_by_simulation(graph, machine, cost_model, strategy)
    if check_by_measurement:
        strategy = _check_by_measurement(graph, machine, cost_model, strategy)
    counted = time.perf_counter()
    # every layer has a valid config here: no need to validate the strategy again
    regions = cost_model.regions if check_by_simulation or check_by_measurement else (
        lambda layer, config: cost_model.regions(layer, config, choice[layer.name]))
    strategy.meta["memory_per_device"] = _json(step_memory(graph, strategy, cost_model.itemsize, regions,
                                                           cost_model.channel_params))
    strategy.meta["search"]["memory_s"] = time.perf_counter() - counted
    strategy.replan = SearchAgain(check_by_simulation)
    return strategy


@dataclass(frozen=True)
class SearchAgain:
    """A searched strategy's `replan` (taskrt.strategy.Strategy): the search run again for the
    machine left after a lost worker, under a fresh cost model (cached part timings are reused)."""

    check_by_simulation: bool = False

    def __call__(self, graph, machine) -> Strategy:
        return optimize(graph, machine, check_by_simulation=self.check_by_simulation)


def memory_per_device(graph, strategy, itemsize=4, cost_model: CostModel | None = None) -> dict:
    """JSON-ready bytes per device of a training step under `strategy`, by kind: taskrt.memory's
    accounting of the plan, counted without lowering it (search.memory), from `cost_model`'s
    region tables when given."""
    if cost_model is None:
        return _json(step_memory(graph, strategy.validated(graph), itemsize))
    return _json(step_memory(graph, strategy.validated(graph), itemsize, cost_model.regions,
                             cost_model.channel_params))


def _json(memory) -> dict:
    return {str(d): m.to_dict() for d, m in memory.items()}


SIMULATION_MARGIN = 0.05  # on a real cluster: how much faster by simulation a change must be to be taken


def candidates(graph, machine, optimum: Strategy) -> dict[str, Strategy]:
    """What the simulation check compares: the Eq. 1 optimum (also with every layer on one sync
    method), the baselines, and every valid configuration of the seed families (SplitBrain's mp,
    the Pr x Pc grids)."""
    from search.baselines import BASELINES
    from search.families import integrated_family, splitbrain_family

    out = {"layer-wise optimum": optimum}
    # the optimum with one sync method everywhere: Eq. 1 cannot see how either overlaps with backward
    for sync in ("ps", "allreduce"):
        out[f"layer-wise optimum, all {sync}"] = Strategy({n: replace(c, sync=sync) for n, c in optimum.items()})
    out.update({name: make(graph, machine) for name, make in BASELINES.items()})
    for family in (splitbrain_family(graph, machine), integrated_family(graph, machine, "batch"),
                   integrated_family(graph, machine, "grid")):
        out.update(family)
    return {name: strategy.validated(graph, machine) for name, strategy in out.items()}


def _check_by_measurement(graph, machine, cost_model, optimum: Strategy) -> Strategy:
    """The fastest on the machine of the optimum and the baselines (each distinct one timed once)."""
    from search.baselines import BASELINES
    from search.measured import pick_by_measurement

    pool = {"layer-wise": optimum.validated(graph, machine)}
    for name, make in BASELINES.items():
        strategy = make(graph, machine).validated(graph, machine)
        if all(strategy.configs != other.configs for other in pool.values()):
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


def _check_by_simulation(graph, machine, cost_model, optimum: Strategy) -> Strategy:
    """The fastest candidate by simulation, then one greedy pass over the layers: each layer tries
    the configs the candidates within 1.5x of the fastest give it, and keeps one when the
    simulated step gets faster.  On a real cluster a candidate replaces the Eq. 1 optimum, and a
    refinement is kept, only when it is more than SIMULATION_MARGIN faster."""
    from tqdm import tqdm

    from taskrt.lowering import lower

    def simulated_s(strategy) -> float:
        plan = lower(graph, strategy, itemsize=cost_model.itemsize)
        return cost_model.simulate(plan).step_s

    # On a simulated machine the simulation is the measurement; on a real cluster it is a prediction
    # a few percent off, so a change must win by more than that to be worth the risk.
    margin = 0.0 if machine.is_simulated else SIMULATION_MARGIN
    pool = candidates(graph, machine, optimum)
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
            if seconds < best * (1 - max(margin, 1e-9)):
                configs, best = dict(trial.configs), seconds
                changed.append(name)
    meta = {**optimum.meta, "chosen_by_simulation": start, "simulated_step_s": simulated,
            "refined_layers": changed, "refined_step_s": best}
    chosen = Strategy(configs)
    if start != "layer-wise optimum" or changed:
        meta.update(_predicted(graph, cost_model, chosen))
    return Strategy(chosen.validated(graph, machine).configs, name="layer-wise", meta=meta)
