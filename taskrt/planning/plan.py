"""Plan: one training step as plain data (no Dask).

Each task has a device, a callable spec and its dependencies.  A dependency is another task's
output, a parameter shard's state from the previous step, a data tile the trainer scatters, or
the step's hyper-parameters.  Which bytes move between which devices is not stored: it follows
from the dependencies (a value is moved once to each other device that reads it), so the
executor, the simulator and the cost model all read the same numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Any

from taskrt.graph.config import Part, blocks
from taskrt.ops.rect import Rect

TASK, STATE, DATA, HYPER, BUFFER = "task", "state", "data", "hyper", "buffer"
# phases whose values are a shard's weights or gradient (or a chunk of one), as large as the shard:
# their kernels make them on `ops.reuse`'s memory
PARAMETER_PHASES = frozenset({"wfetch", "grad", "rslice", "update", "reduce"})


@dataclass(frozen=True)
class Dep:
    kind: str  # TASK, STATE, DATA, HYPER or BUFFER
    key: tuple  # task key; (layer, shard, chunk) for STATE; (layer, part) for DATA; () for HYPER;
    # (layer, channel group) for BUFFER


HYPER_DEP = Dep(HYPER, ())


@dataclass(frozen=True)
class Task:
    key: tuple  # (f"{layer}-{phase}", *index)
    phase: str  # fwd, bwd, loss, slice, gslice, send, grad, wfetch, update, reduce; batch norm:
    # fstat, fstats, running (forward statistics), bstat, bstats (gradient sums)
    layer: str
    device: int
    spec: Any  # callable(*dependency values)
    deps: tuple[Dep, ...]
    nbytes: int | None  # size of the output when it is a single array (what may travel)
    flops: int = 0


@dataclass(frozen=True)
class Shard:
    """The part of a layer's parameters some of its parts read; replicas share one shard.

    Its state (master weights and velocity, packed flat) lives in chunks: with sync "ps" one
    chunk on the server; with "allreduce" one contiguous chunk per replica device, each device
    updating its own chunk (reduce-scatter) and gathering the others' (all-gather)."""

    layer: str
    index: int
    rects: dict  # parameter name -> Rect
    layout: tuple  # ((name, shape), ...) packing order
    server: int  # the first device reading it: holds the whole state under sync "ps"
    devices: tuple[int, ...]  # every device that reads it
    nbytes: int
    sync: str = "ps"

    @property
    def size(self) -> int:
        """Elements of the flat shard."""
        return sum(prod(shape) for _, shape in self.layout)

    @property
    def chunks(self) -> tuple[tuple[int, int, int], ...]:
        """(lo, hi, device) of each chunk of the flat state, in order."""
        if self.sync == "ps" or len(self.devices) == 1:
            return ((0, self.size, self.server),)
        return tuple((lo, hi, d) for (lo, hi), d in zip(chunk_bounds(self.size, len(self.devices)), self.devices))


@dataclass(frozen=True)
class Buffer:
    """Running statistics of one channel group of a batch norm, a (2, channels) array (mean,
    variance) kept on the device that combines the group's batch statistics."""

    layer: str
    index: int
    channels: tuple[int, int]  # [lo, hi)
    device: int
    nbytes: int


def chunk_bounds(size: int, replicas: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of each replica's chunk of a flat shard of `size` elements under "allreduce":
    as equal as possible, the first ones larger; no empty chunks (at most `size` of them)."""
    return blocks(size, min(replicas, size))


@dataclass(frozen=True)
class Transfer:
    dep: Dep
    src: int
    dst: int
    nbytes: int
    reader: tuple = ()  # key of the first task on `dst` that reads it


@dataclass
class Plan:
    mode: str  # "train", "gradients" or "predict"
    tasks: list[Task]
    shards: dict[str, list[Shard]]
    data: dict[str, list[Part]]  # input layer -> its parts (where the trainer puts each tile)
    data_nbytes: dict[tuple, int]
    outputs: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, list[Buffer]] = field(default_factory=dict)

    def __post_init__(self):
        self.by_key = {t.key: t for t in self.tasks}
        self._transfers: list[Transfer] | None = None  # a plan does not change: derived once
        self.derived: dict = {}  # and so what other modules derive from it, found once (taskrt.planning.fusion)

    def device_of(self, dep: Dep) -> int | None:
        if dep.kind == TASK:
            return self.by_key[dep.key].device
        if dep.kind == STATE:
            layer, shard, chunk = dep.key
            return self.shards[layer][shard].chunks[chunk][2]
        if dep.kind == DATA:
            layer, part = dep.key
            return self.data[layer][part].device
        if dep.kind == BUFFER:
            layer, group = dep.key
            return self.buffers[layer][group].device
        return None

    def nbytes_of(self, dep: Dep) -> int | None:
        if dep.kind == TASK:
            return self.by_key[dep.key].nbytes
        if dep.kind == DATA:
            return self.data_nbytes[dep.key]
        if dep.kind == BUFFER:
            layer, group = dep.key
            return self.buffers[layer][group].nbytes
        return None

    def transfers(self) -> list[Transfer]:
        """Every value that moves: once per (value, reading device) with the device elsewhere."""
        if self._transfers is None:
            self._transfers = self._derive_transfers()
        return self._transfers

    def _derive_transfers(self) -> list[Transfer]:
        seen, out = set(), []
        for task in self.tasks:
            for dep in task.deps:
                src = self.device_of(dep)
                if src is None or src == task.device or (dep, task.device) in seen:
                    continue
                seen.add((dep, task.device))
                nbytes = self.nbytes_of(dep)
                if nbytes is None:
                    raise AssertionError(f"task {task.key} reads {dep} from device {src}: only arrays may travel")
                out.append(Transfer(dep, src, task.device, nbytes, task.key))
        return out

    def check_single_reader(self) -> None:
        """Each travelling key is read by one other device, so Dask can fetch it only from home."""
        readers: dict[Dep, set] = {}
        for t in self.transfers():
            readers.setdefault(t.dep, set()).add(t.dst)
        shared = {dep: devices for dep, devices in readers.items() if len(devices) > 1}
        if shared:
            raise AssertionError(f"keys read by several remote devices: {shared}")

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        counts = Counter()
        for t in self.transfers():
            counts[(t.src, t.dst)] += t.nbytes
        return dict(counts)

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers())

    def critical_path(self, duration) -> tuple[float, list[tuple]]:
        """Longest chain of dependent tasks, weighting each task by `duration(task)`.

        Tasks are stored in dependency order, so one pass suffices.  Returns (length, keys).
        """
        finish: dict[tuple, float] = {}
        previous: dict[tuple, tuple | None] = {}
        for task in self.tasks:
            parents = [d.key for d in task.deps if d.kind == TASK]
            best = max(parents, key=finish.__getitem__, default=None)
            finish[task.key] = (finish[best] if best else 0.0) + duration(task)
            previous[task.key] = best
        if not finish:
            return 0.0, []
        key = max(finish, key=finish.__getitem__)
        length, path = finish[key], []
        while key is not None:
            path.append(key)
            key = previous[key]
        return length, path[::-1]

    def phase_counts(self) -> dict[str, int]:
        return dict(Counter(t.phase for t in self.tasks))

    def __repr__(self):
        return f"Plan({self.mode}, {len(self.tasks)} tasks, {self.bytes_moved:,} bytes moved)"


def keys_of(output) -> list:
    """The keys of one output of a plan or a step: a list of keys, or a dict's values."""
    return list(output.values()) if isinstance(output, dict) else list(output)


def output_keys(outputs: dict) -> list:
    """Every key of a plan's or a step's outputs ({name: a list of keys, or a dict of them})."""
    return [k for output in outputs.values() for k in keys_of(output)]


def map_outputs(outputs: dict, fn) -> dict:
    """`outputs` with `fn` applied to every key, each output keeping its form (list or dict)."""
    return {name: {n: fn(k) for n, k in output.items()} if isinstance(output, dict) else [fn(k) for k in output]
            for name, output in outputs.items()}


def rect_nbytes(rect: Rect, itemsize: int) -> int:
    return rect.volume * itemsize
