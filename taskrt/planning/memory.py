"""Memory per device: what one training step keeps on each device, by kind, from the plan.

    memory = plan_memory(plan)            # {device: DeviceMemory}
    memory[0].total, memory[0].to_dict()

Kinds (bytes):
- parameters: the weights a device computes with (the shard's state where it holds all of it,
  otherwise the copy it fetched or gathered), plus the master chunks it owns under "allreduce";
- gradients: its parameter gradients, plus the replicas' gradients it receives to sum (a
  parameter server receives whole shards, an all-reduce owner one chunk from each replica);
- optimizer: the optimizer's state of the chunks it owns (`slots` arrays per chunk: SGD's
  momentum buffer, Adam's two moments), their updated copies in training, and an accumulated
  gradient when accumulating;
- activations: what forward keeps for backward: its outputs, the slices it cut for others, the
  data tiles it was sent and every piece it received (backward reuses what forward fetched);
  none of a recomputed layer's (taskrt.planning.recompute): forward drops them;
- transient: the largest working set of backward beyond those: one task's (an output gradient
  assembled from its pieces and the input gradients it produces), plus the copies computed
  again that are alive while its layer's backward runs: a recomputed layer's copies on a
  device (its parts, the slices cut of them, the pieces received) live from the first layer
  whose backward reads them (or reads a copy made from them) to the last, in backward's order
  of layers.

The sum counts everything a step holds at some time on a device, with no order and no sharing:
an upper bound of the peak under the runtime's schedule (taskrt.planning.peak, what a worker
measures), cheap enough for the search to count without lowering (search.memory).  `part_footprint` is the same
accounting for one part of one layer, which the search uses to drop configs that cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from taskrt.planning.plan import DATA, TASK, Plan
from taskrt.planning.recompute import PHASES

KINDS = ("parameters", "gradients", "optimizer", "activations", "transient")


@dataclass(frozen=True)
class DeviceMemory:
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    transient: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) for kind in KINDS)

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def part_footprint(op, out, itemsize: int) -> DeviceMemory:
    """One part's share of a device's memory (output Rect `out` of `op`): its parameter shard with
    gradient and velocity (at worst it holds the whole shard's state), its input tiles and output
    kept for backward, and its backward working set (output gradient and input gradients)."""
    inputs = sum(r.volume for r in op.input_rects(out) if r is not None)
    params = sum(r.volume for r in op.param_rects(out).values())
    return DeviceMemory(params * itemsize, params * itemsize, params * itemsize,
                        (inputs + out.volume) * itemsize, (inputs + out.volume) * itemsize)


def plan_memory(plan: Plan, itemsize: int = 4, slots: int = 1,
                accumulating: bool = False) -> dict[int, DeviceMemory]:
    """Bytes per device, by kind, for one step of `plan` (see the module docstring): `slots`
    arrays of optimizer state per chunk (SGD 1, Adam 2), one more when `accumulating`."""
    devices = {t.device for t in plan.tasks} | {p.device for parts in plan.data.values() for p in parts}
    out = {d: dict.fromkeys(KINDS, 0) for d in devices}
    training = plan.mode != "predict"
    for shards in plan.shards.values():
        for shard in shards:
            chunks = shard.chunks
            for d in shard.devices:
                out.setdefault(d, dict.fromkeys(KINDS, 0))
                out[d]["parameters"] += shard.nbytes  # the weights it computes with
                out[d]["gradients"] += shard.nbytes * training  # its own gradient
            replicas = len(shard.devices)
            for lo, hi, d in chunks:
                chunk = (hi - lo) * itemsize
                out[d]["optimizer"] += chunk * (slots + accumulating)
                if plan.mode == "train":  # the updated weights and slots, beside the old till the step ends
                    out[d]["parameters"] += chunk
                    out[d]["optimizer"] += chunk * slots
                if len(chunks) > 1:  # a master chunk beside the gathered copy
                    out[d]["parameters"] += chunk
                if training:
                    out[d]["gradients"] += (replicas - 1) * (shard.nbytes if len(chunks) == 1 else chunk)
    for layer, parts in plan.data.items():
        for part in parts:
            out[part.device]["activations"] += plan.data_nbytes[(layer, part.index)]
    recomputed = {t.layer for t in plan.tasks if t.phase == "recompute"}
    working: dict[tuple, int] = {}  # (layer, device) -> its largest backward task's working set
    for task in plan.tasks:
        if task.phase in ("fwd", "slice") and task.nbytes and task.layer not in recomputed:
            out[task.device]["activations"] += task.nbytes
        if task.phase in ("bwd", "loss"):
            spec = task.spec
            key = (task.layer, task.device)
            working[key] = max(working.get(key, 0), part_footprint(spec.op, spec.out, itemsize).transient)
    again: dict[tuple, int] = {}  # (recomputed layer, device) -> bytes of its copies there
    for task in plan.tasks:
        if task.phase in PHASES and task.phase != "resend":
            again[(task.layer, task.device)] = again.get((task.layer, task.device), 0) + task.nbytes
    for transfer in plan.transfers():
        origin = _forward_origin(plan, transfer.dep)
        if origin is not None and origin not in recomputed:
            out[transfer.dst]["activations"] += transfer.nbytes
        elif transfer.dep.kind == TASK and plan.by_key[transfer.dep.key].phase in PHASES:
            layer = plan.by_key[transfer.dep.key].layer
            again[(layer, transfer.dst)] = again.get((layer, transfer.dst), 0) + transfer.nbytes
    order = {}  # each layer's position in forward's order
    for task in plan.tasks:
        if task.phase in ("fwd", "loss"):
            order.setdefault(task.layer, len(order))
    spans = _live_spans(plan, order) if recomputed else {}
    for (_, device), nbytes in working.items():
        out[device]["transient"] = max(out[device]["transient"], nbytes)
    for layer, position in order.items():  # backward's working set there, with the copies alive
        alive: dict[int, int] = {}
        for (name, device), nbytes in again.items():
            if spans[name][0] <= position <= spans[name][1]:
                alive[device] = alive.get(device, 0) + nbytes
        for device, nbytes in alive.items():
            out[device]["transient"] = max(out[device]["transient"], working.get((layer, device), 0) + nbytes)
    return {d: DeviceMemory(**out[d]) for d in sorted(out)}


def _live_spans(plan, order) -> dict[str, tuple[int, int]]:
    """Per recomputed layer, the positions (in forward's order of layers) of the last and first
    layers whose backward reads its copies: backward runs from the first to the last, and a copy
    read by another layer's copy is read when that one is made (its first reader)."""
    readers: dict[str, set] = {}  # recomputed layer -> the tasks reading its copies
    for task in plan.tasks:
        for dep in task.deps:
            if dep.kind == TASK and plan.by_key[dep.key].phase in PHASES:
                readers.setdefault(plan.by_key[dep.key].layer, set()).add(task)
    spans: dict[str, tuple[int, int]] = {}
    for layer in sorted(readers, key=order.__getitem__, reverse=True):  # a copy's readers' copies first
        first, last = [], []
        for reader in readers[layer]:
            if reader.phase in PHASES:
                if reader.layer != layer:  # a copy made of a copy: read when it is made
                    first.append(spans[reader.layer][1])
            else:
                first.append(order[reader.layer])
                last.append(order[reader.layer])
        spans[layer] = (min(last, default=max(first)), max(first))
    return spans


def _forward_origin(plan, dep) -> str | None:
    """The layer whose forward value `dep` is (data, a forward output or a slice of one, through
    aliases: what forward fetches), or None."""
    while dep.kind == TASK:
        task = plan.by_key[dep.key]
        if task.phase != "send":
            return task.layer if task.phase in ("fwd", "slice") else None
        dep = task.deps[0]
    return dep.key[0] if dep.kind == DATA else None


def summary(memory: dict[int, DeviceMemory]) -> str:
    """One line per device, in MiB, by kind."""
    rows = [f"{'device':>6} " + " ".join(f"{k:>12}" for k in (*KINDS, "total")) + "   (MiB)"]
    for d, m in memory.items():
        values = [getattr(m, k) for k in KINDS] + [m.total]
        rows.append(f"{d:>6} " + " ".join(f"{v / 2**20:12.2f}" for v in values))
    return "\n".join(rows)
