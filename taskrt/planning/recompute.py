"""Activation recomputation: a layer whose config says `recompute` keeps no output for backward.

Its forward output is read by forward tasks only, so a device drops it after its last forward
reader (`taskrt.planning.programs`' drops, a `FusedRun`'s last uses).  Every backward-phase task
that would read it (the layer's own backward where its op keeps its output, its consumers'
backward tasks, which read what their forward read, a batch norm's gradient sums and input
gradient, and the copies computed again of recomputed consumers) reads instead a copy computed
again: per part a "recompute" task, the forward part's own spec on the same device, inputs
and parameters, and in place of each slice or alias of the output that forward moved to
another device a "reslice" or "resend" of the copy, so that the same pieces travel again.  A
copy reads the layer's inputs as its forward did, or their copies where an input layer is
recomputed too: chains of recomputed layers are computed again in order.  Batch norm's
normalize reads the step's batch statistics, which are kept, and a random op draws from the
step's seed and number: every copy computes exactly the value forward computed.

Each copy is made when the first backward-phase task reading it is planned, right before it in
the plan's order, and its spec (`taskrt.planning.tasks.Recompute`) is late: fusion gives it the
stage of its earliest reader rather than of its inputs (`taskrt.planning.fusion.stages`), so
each device's order (the fused plan's, its program's) computes it just before the backward task
that reads it, or, where a slice of it travels, just before the slice is sent.  It waits for
nothing else: a device computes it while waiting for the reader's output gradient, if it must.
"""

from __future__ import annotations

from taskrt.planning.plan import TASK, Dep, Task
from taskrt.planning.tasks import Recompute

# the phase of a forward value's copy computed again, by the phase of the forward task
AGAIN = {"fwd": "recompute", "slice": "reslice", "send": "resend"}
PHASES = frozenset(AGAIN.values())


class Recomputation:
    """The copies computed again of the recomputed layers' forward values, for one lowering
    (`tasks`: its tasks so far, by key; `add(task) -> Dep`: adds one)."""

    def __init__(self, tasks: dict, add, layers):
        self.tasks, self.add, self.layers = tasks, add, frozenset(layers)
        self.copies: dict[Dep, Dep] = {}
        self.known: dict[Dep, bool] = {}

    def recomputed(self, dep: Dep) -> bool:
        """Whether `dep` is a recomputed layer's forward output, or a slice or an alias of one."""
        if dep.kind != TASK:
            return False
        if dep not in self.known:
            task = self.tasks[dep.key]
            if task.phase == "fwd":
                self.known[dep] = task.layer in self.layers
            else:
                self.known[dep] = task.phase in ("slice", "send") and self.recomputed(task.deps[0])
        return self.known[dep]

    def substitute(self, deps) -> tuple:
        """The dependencies of a backward-phase task reading `deps` (its forward's values, its
        output gradient's pieces, ...), in the same positions, each recomputed forward value
        replaced by its copy computed again."""
        return tuple(self.again(d) if self.recomputed(d) else d for d in deps)

    def again(self, dep: Dep) -> Dep:
        """The copy computed again of forward value `dep` (made once, where first read), after the
        copies it reads (depth first, without recursion: a chain may be a whole network long)."""
        stack = [dep]
        while stack:
            top = stack[-1]
            if top in self.copies:
                stack.pop()
                continue
            task = self.tasks[top.key]
            missing = [d for d in task.deps if self.recomputed(d) and d not in self.copies]
            if missing:
                stack.extend(reversed(missing))
                continue
            stack.pop()
            phase = AGAIN[task.phase]
            self.copies[top] = self.add(Task(
                (f"{task.layer}-{phase}", *task.key[1:]), phase, task.layer, task.device, Recompute(task.spec),
                self.substitute(task.deps), task.nbytes, task.flops))
        return self.copies[dep]
