"""A plan run in this process: the same task specs the executor sends to the workers, called one
after another in plan order (plans list their tasks in dependency order).

    values = run_plan(plan, data=data_tiles(plan, arrays), buffers=state, seconds=timings)

For what needs no cluster: training every site of a round in turn (IST's sites simulated at any
count), and each task's kernel seconds for the simulator (`seconds`: task key -> wall seconds).
"""

from __future__ import annotations

import time

from taskrt.ops.rect import Rect
from taskrt.planning.params import pack, slice_params
from taskrt.planning.plan import BUFFER, DATA, HYPER, STATE, TASK, Plan


def data_tiles(plan: Plan, arrays: dict) -> dict:
    """{(input layer, part): tile} of each input array, as the executor scatters them."""
    out = {}
    for layer, parts in plan.data.items():
        full = arrays[layer]
        for part in parts:
            out[(layer, part.index)] = full[part.rect.relative_to(Rect.full(full.shape))].copy()
    return out


def run_plan(plan: Plan, state=None, data=None, hyper=None, buffers=None, seconds: dict | None = None) -> dict:
    """Every task's value, {task key: value}; `state`, `data`, `buffers` keyed as the plan's
    dependencies name them (as for `Executor.submit`), `hyper` the step's hyper-parameters."""
    given = {STATE: state or {}, DATA: data or {}, BUFFER: buffers or {}}
    values = {}
    for task in plan.tasks:
        args = []
        for dep in task.deps:
            if dep.kind == TASK:
                args.append(values[dep.key])
            elif dep.kind == HYPER:
                args.append(dict(hyper or {}))
            else:
                args.append(given[dep.kind][dep.key])
        start = time.perf_counter()
        values[task.key] = task.spec(*args)
        if seconds is not None:
            seconds[task.key] = time.perf_counter() - start
    return values


def shard_states(plan: Plan, params: dict, *slots: dict) -> dict:
    """{(layer, shard, chunk): (weights, *slots)}: each chunk of each shard's flat state, the
    values a training plan's STATE dependencies name.  `slots`: the optimizer's state, one
    {layer: {name: array}} per slot (SGD's momentum buffer; Adam's two moments)."""
    out = {}
    for layer, shards in plan.shards.items():
        for shard in shards:
            flats = [pack(slice_params(values[layer], shard.rects)) for values in (params, *slots)]
            for k, (lo, hi, _) in enumerate(shard.chunks):
                out[(layer, shard.index, k)] = tuple(flat[lo:hi].copy() for flat in flats)
    return out


def buffer_tiles(plan: Plan, running: dict) -> dict:
    """{(layer, channel group): (2, channels) running statistics}: a plan's BUFFER dependencies."""
    return {(layer, b.index): running[layer][:, b.channels[0] : b.channels[1]].copy()
            for layer, buffers in plan.buffers.items() for b in buffers}
