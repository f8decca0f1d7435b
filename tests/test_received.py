"""Arrays out of Dask messages (taskrt.planning.tasks.Received): a misaligned array is copied to aligned
memory before the task runs, an aligned one is passed as it is; the step graph wraps exactly the
tasks that read another device's values, data tiles or state."""

from __future__ import annotations

import numpy as np

from taskrt import models
from taskrt.execution.executor import step_graph
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.planning.plan import DATA, STATE, TASK
from taskrt.planning.tasks import Received
from taskrt.search.baselines import BASELINES


def misaligned(shape) -> np.ndarray:
    raw = np.zeros(int(np.prod(shape)) * 4 + 2, np.uint8)
    out = raw[2:].view(np.float32).reshape(shape)  # 2 bytes off, as Dask leaves received arrays
    out[...] = np.arange(out.size, dtype=np.float32).reshape(shape)
    return out


def seen(*values):
    return values


def test_a_misaligned_array_is_copied_and_an_aligned_one_is_not():
    odd, good = misaligned((3, 5)), np.ones((2, 2), np.float32)
    assert not odd.flags.aligned
    got_odd, (got_good, number) = Received(seen)(odd, (good, 7))
    assert got_odd.flags.aligned and np.array_equal(got_odd, odd) and got_odd is not odd
    assert got_good is good and number == 7


def test_the_step_graph_wraps_the_tasks_that_read_from_messages():
    g = models.lenet5(batch=8)
    machine = Machine.simulated(1, 2)
    plan = lower(g, BASELINES["data"](g, machine).validated(g, machine))
    state = {key: f"state-{key}" for key in plan.outputs["state"]}
    data = {key: f"data-{key}" for key in plan.data_nbytes}
    dsk, _, _ = step_graph(plan, "1-ab", state, data, {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0},
                           fused=False)
    for task in plan.tasks:
        fn = dsk[(f"{task.key[0]}-it1-ab", *task.key[1:])][0]
        reads = any(d.kind in (DATA, STATE) or (d.kind == TASK and plan.by_key[d.key].device != task.device)
                    for d in task.deps)
        assert isinstance(fn, Received) == reads, task.key
