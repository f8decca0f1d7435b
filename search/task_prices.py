"""A task's price for the simulator: the kernel seconds of each task of a plan under a cost model
(parts timed or estimated as in the search's tables, a forward part computed again for backward
as its forward, updates and reductions timed like parts, the copy a CPU worker makes of what
arrives in a message).  `CostModel.timer` gives it."""

from __future__ import annotations

from taskrt.planning.plan import DATA, TASK


def task_timer(model, plan, corun: bool = False):
    """A function giving the kernel seconds of each task of `plan` under cost model `model` (the
    runtime's own cost per task is in `CostModel.runtime`); with `corun`, of its parts while
    kernels run beside them on the other devices (`CostModel.part_time`).  It uses the model's
    caches of part and synchronization times, filling what is missing first."""
    sync = {}  # task key -> (device kind, phase, elements, gradients): timed like parts
    for task in plan.tasks:
        if task.phase in ("update", "reduce"):
            kind = model.kinds[model.kind_index[task.device]]
            lo, hi, _ = plan.shards[task.layer][task.key[1]].chunks[task.key[2]]
            sync[task.key] = (kind, task.phase, hi - lo, len(task.spec.grads))
    model._time_synchronization(set(sync.values()))
    if not model.estimated:  # parts not timed yet: measured together, not one call each
        missing = {}
        for task in plan.tasks:
            if task.phase in ("fwd", "recompute", "bwd", "loss"):
                kind, op = model.kinds[model.kind_index[task.device]], task.spec.op
                model._lookup(kind, op, task.spec.out, _need_dx(task), missing)
        model._measure_missing(missing)
    # On CPU workers a task first copies the arrays Dask hands it out of a message, which are
    # misaligned (taskrt.planning.tasks.Received): another device's values and the client's data tiles.
    received = {}
    bandwidth = model.calibration.get("fresh_copy_bandwidth", model.memory_bandwidth)
    if not model.estimated:
        for task in plan.tasks:
            if model.kinds[model.kind_index[task.device]].startswith("cpu"):
                nbytes = sum(plan.nbytes_of(d) or 0 for d in task.deps
                             if d.kind == DATA or (d.kind == TASK and plan.device_of(d) != task.device))
                if nbytes:
                    received[task.key] = nbytes / bandwidth

    def task_time(task) -> float:
        return received.get(task.key, 0.0) + kernel_time(task)

    def kernel_time(task) -> float:
        spec = task.spec
        if task.phase in ("fwd", "recompute"):  # a copy computed again: its forward's kernels
            return model.part_time(spec.op, spec.out, _need_dx(task), task.device, corun)[0]
        if task.phase == "bwd":
            return model.part_time(spec.op, spec.out, _need_dx(task), task.device, corun)[1]
        if task.phase == "loss":
            return sum(model.part_time(spec.op, spec.out, _need_dx(task), task.device, corun))
        if task.phase in ("slice", "reslice", "gslice", "rslice", "wgather"):  # copies into a fresh array
            return task.nbytes / model.calibration.get("fresh_copy_bandwidth", model.memory_bandwidth)
        if task.phase in ("update", "reduce"):
            return model._sync_times[sync[task.key]]
        if task.phase in ("fstats", "bstats", "running"):  # batch norm: a sum of small per-channel arrays
            bandwidth = model.calibration.get("fresh_copy_bandwidth", model.memory_bandwidth)
            return task.nbytes * len(task.deps) / bandwidth
        # fstat, bstat: batch norm's per-part statistics; the part's measured forward and backward
        # (measure_parts runs the op's whole-tile kernels) already include computing them
        return 0.0  # send, resend, wfetch, grad: a reference to an array that exists already

    return task_time


def _need_dx(task) -> tuple:
    """Which input gradients a forward, backward or loss task's part timing includes (a batch
    norm's backward, taskrt.planning.tasks.NormBackward, exists only where its input needs one)."""
    if task.phase in ("fwd", "recompute"):
        return tuple(False for _ in task.spec.op.in_shapes)
    if task.phase == "loss":
        return (True, False)
    return tuple(getattr(task.spec, "need_dx", (True,) * len(task.spec.op.in_shapes)))
