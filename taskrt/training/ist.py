"""Independent subnet training (IST, Yuan et al.) and local SGD as training modes of the runtime.

    trainer = ISTTrainer(g, machine, local_steps=J, lr=0.01, seed=0)
    loss = trainer.round(batches)      # batches[s][j] = (x, y): site s's j-th local batch
    trainer.parameters(); trainer.buffers()

For networks of linear layers (each optionally followed by a batch norm and a ReLU) ending in a
bias-free linear layer and a softmax cross-entropy.  Every round draws, from (seed, round), a
random partition of each hidden layer's neurons into one disjoint group per site.  A round is a
Plan for the same executor as a training step:

- "slice" tasks on the parameters' home device cut each site's blocks: input-layer rows
  W1[m_s^1, :], hidden blocks W^l[m_s^l, m_s^(l-1)], output-layer columns W^t[:, m_s^(t-1)], and
  the batch norms' scale, shift and running statistics of the site's neurons;
- J "local" tasks per site, pinned to it, each one plain SGD step of the site's subnet on its own
  batch (no communication between sites);
- "writeback" tasks on the home device put every site's blocks back where they came from (no
  averaging: the subnets share no parameters).

Parameters live on the home device (device 0) between rounds, as futures; only blocks travel, and
the plan counts every byte.  Without a machine (`ISTTrainer(g, None, sites=8, ...)`) the same
plan runs in this process, the sites one after another (`taskrt.planning.inprocess`): any number of sites
trained on one core, each task's seconds in `trainer.stats.task_seconds`.

`LocalSGDTrainer` is the same round with every site holding the whole network and the
write-back averaging the sites' copies (Lin et al.'s local SGD).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from math import prod

import numpy as np

from taskrt.data.arrays import bind_inputs
from taskrt.execution.executor import Executor, futures_of
from taskrt.graph.config import Part
from taskrt.graph.graph import Graph, GraphError
from taskrt.ops import array_module
from taskrt.ops.rect import Rect
from taskrt.planning.inprocess import data_tiles, run_plan
from taskrt.planning.params import init_buffers, init_parameters, resolve_dtype, unpack
from taskrt.planning.plan import BUFFER, DATA, TASK, Buffer, Dep, Plan, Task
from taskrt.planning.tasks import Spec

HOME = 0  # the device that keeps the whole network between rounds


# ---- the network as IST sees it ----------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One linear layer and what follows it: its batch norm and ReLU layers (names, or None)."""

    linear: str
    norm: str | None
    relu: str | None

    @property
    def layers(self) -> list[str]:
        return [name for name in (self.linear, self.norm, self.relu) if name]


def units_of(graph: Graph) -> list[Unit]:
    """The chain input -> (linear [-> batch_norm] [-> relu])* -> loss, or a clear error."""
    inputs = [l for l in graph.inputs if l.op.dtype != "int64"]
    if len(inputs) != 1 or len(inputs[0].shape) != 2:
        raise GraphError(f"graph {graph.name!r}: IST needs one (n, features) input, got "
                         f"{[(l.name, l.shape) for l in inputs]}")
    units, previous, pending = [], inputs[0].name, None
    for layer in graph:
        if layer.is_input:
            continue
        if layer.kind != "softmax_cross_entropy" and layer.inputs != (previous,):
            raise GraphError(f"layer {layer.name!r}: IST needs a chain of layers, but it reads {list(layer.inputs)} "
                             f"instead of the layer before it, {previous!r}")
        if layer.kind == "linear":
            if pending:
                units.append(Unit(**pending))
            pending = {"linear": layer.name, "norm": None, "relu": layer.name if layer.op.activation else None}
        elif layer.kind in ("batch_norm", "relu") and pending:
            pending["norm" if layer.kind == "batch_norm" else "relu"] = layer.name
        elif layer.kind == "softmax_cross_entropy":
            if layer.inputs[0] != previous or graph[previous].kind != "linear":
                raise GraphError(f"layer {layer.name!r}: IST needs the loss to read the last linear layer directly")
        else:
            raise GraphError(f"layer {layer.name!r} ({layer.kind}): IST trains linear layers, batch norms and "
                             "ReLUs only")
        previous = layer.name
    if pending:
        units.append(Unit(**pending))
    if len(units) < 2:
        raise GraphError(f"graph {graph.name!r}: IST needs at least one hidden layer (got {len(units)} linear layer)")
    last = graph[units[-1].linear]
    if last.op.bias:
        raise GraphError(f"layer {last.name!r}: IST needs the output layer without bias (every subnet computes all "
                         "outputs, so a bias there would be shared); build it with bias=False")
    return units


def partition(graph: Graph, units: list[Unit], sites: int, seed: int, round_: int) -> list[list[np.ndarray]]:
    """m[l][s]: sorted neuron indices of hidden layer l given to site s, a random partition drawn
    from (seed, round): disjoint, covering, sizes as equal as possible."""
    rng = np.random.default_rng([seed, round_])
    out = []
    for unit in units[:-1]:
        width = graph[unit.linear].shape[1]
        if width < sites:
            raise GraphError(f"layer {unit.linear!r}: {width} neurons cannot be split over {sites} sites")
        out.append([np.sort(part) for part in np.array_split(rng.permutation(width), sites)])
    return out


def site_blocks(units, m, s, inputs: int, classes: int):
    """(rows, columns) of each unit's weight that site s gets (None: all)."""
    out = []
    for i, _ in enumerate(units):
        rows = m[i][s] if i < len(units) - 1 else None
        cols = m[i - 1][s] if i > 0 else None
        out.append((rows, cols))
    return out


def _cut(arr, rows, cols):
    if rows is not None:
        arr = arr[rows]
    if cols is not None:
        arr = arr[:, cols]
    return arr


# ---- a layer's state as one flat array (what travels is a plain array: exact byte counts) ------
def layer_layout(graph, unit: Unit, rows_size: int, cols_size: int) -> tuple:
    """((key, shape), ...) of a unit's state for a block of rows x cols: linear weight and bias,
    batch norm scale, shift and running statistics."""
    lin = graph[unit.linear]
    layout = [("weight", (rows_size, cols_size))]
    if lin.op.bias:
        layout.append(("bias", (rows_size,)))
    if unit.norm:
        layout += [("norm.weight", (rows_size,)), ("norm.bias", (rows_size,)), ("norm.running", (2, rows_size))]
    return tuple(layout)


def flatten_state(state: dict, layout) -> np.ndarray:
    xp = array_module(*state.values())
    return xp.concatenate([xp.asarray(state[k]).ravel() for k, _ in layout])


# ---- task specs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CutBlock(Spec):
    """A site's block of one unit's state: rows (neurons of this layer), columns (of the previous)."""

    layout: tuple
    rows: np.ndarray | None
    cols: np.ndarray | None
    block_layout: tuple

    def __call__(self, flat):
        state = unpack(flat, self.layout)
        block = {}
        for key, _ in self.block_layout:
            arr = state[key]
            if key == "weight":
                block[key] = _cut(arr, self.rows, self.cols)
            elif key == "norm.running":
                block[key] = arr if self.rows is None else arr[:, self.rows]
            else:
                block[key] = arr if self.rows is None else arr[self.rows]
        return flatten_state(block, self.block_layout)


@dataclass(frozen=True)
class LocalStep(Spec):
    """One SGD step of a site's subnet on its batch.  Dependencies: the unit blocks (first step)
    or the previous step's flat site state, then x and labels.  Returns the flat site state."""

    graph: Graph  # the subnet: the network with each hidden layer narrowed to the site's neurons
    units: tuple
    layouts: tuple  # per unit, its block layout
    lr: float
    first: bool

    def __call__(self, *values):
        xp = array_module(values[0])
        if self.first:
            blocks = [unpack(v, lay) for v, lay in zip(values[: len(self.units)], self.layouts)]
            x, y = values[len(self.units)], values[len(self.units) + 1]
        else:
            flat, x, y = values
            blocks, start = [], 0
            for lay in self.layouts:
                size = sum(prod(s) for _, s in lay)
                blocks.append(unpack(flat[start : start + size], lay))
                start += size
        params, running = _split_blocks(self.units, blocks)
        _, grads, stats = forward_backward(self.graph, params, running, x, y, train=True)
        new_blocks = []
        for unit, block, lay in zip(self.units, blocks, self.layouts):
            new = dict(block)
            for key, g in grads[unit.linear].items():  # plain SGD, as the seed
                new[key] = block[key] - self.lr * g
            if unit.norm:
                g = grads[unit.norm]
                new["norm.weight"] = block["norm.weight"] - self.lr * g["weight"]
                new["norm.bias"] = block["norm.bias"] - self.lr * g["bias"]
                new["norm.running"] = self.graph[unit.norm].op.update_running(block["norm.running"], stats[unit.norm])
            new_blocks.append(flatten_state(new, lay))
        return xp.concatenate(new_blocks)


@dataclass(frozen=True)
class WriteBack(Spec):
    """A unit's new state from the sites' final states: each site's block back where it came
    from ("replace", IST), or the mean of the sites' whole copies ("average", local SGD).
    Dependencies: the unit's current state, then each site's final flat state."""

    layout: tuple
    sites: tuple  # per site: (rows, cols, offset of this unit in the site's state, block layout)
    mode: str

    def __call__(self, flat, *finals):
        state = {k: v.copy() for k, v in unpack(flat, self.layout).items()}
        pieces = []
        for final, (rows, cols, offset, lay) in zip(finals, self.sites):
            size = sum(prod(s) for _, s in lay)
            pieces.append((rows, cols, unpack(final[offset : offset + size], lay)))
        if self.mode == "average":
            for key in state:
                state[key] = sum(block[key] for _, _, block in pieces) / len(pieces)
            return flatten_state(state, self.layout)
        for rows, cols, block in pieces:
            for key, value in block.items():
                if key == "weight":
                    r = slice(None) if rows is None else rows
                    c = slice(None) if cols is None else cols
                    state[key][np.ix_(np.arange(state[key].shape[0])[r], np.arange(state[key].shape[1])[c])] = value
                elif key == "norm.running":
                    state[key][:, slice(None) if rows is None else rows] = value
                else:
                    state[key][slice(None) if rows is None else rows] = value
        return flatten_state(state, self.layout)


def _split_blocks(units, blocks):
    params, running = {}, {}
    for unit, block in zip(units, blocks):
        params[unit.linear] = {k: block[k] for k in ("weight", "bias") if k in block}
        if unit.norm:
            params[unit.norm] = {"weight": block["norm.weight"], "bias": block["norm.bias"]}
            running[unit.norm] = block["norm.running"]
    return params, running


def forward_backward(graph, params, running, x, y, train=True, backward=True, infer=False):
    """(mean loss, gradients, batch statistics of each batch norm) of a chain network on one batch,
    with the ops' kernels (as SingleDeviceTrainer computes them)."""
    acts, stats = {}, {}
    for layer in graph:
        if layer.is_input:
            acts[layer.name] = x if layer.op.dtype != "int64" else y
            continue
        xs = [acts[src] for src in layer.inputs]
        p = params.get(layer.name, {})
        if layer.kind == "batch_norm":
            if infer:
                acts[layer.name] = layer.op.infer(xs[0], running[layer.name], p)
                continue
            stats[layer.name] = layer.op.partial_stats(xs[0])
        acts[layer.name] = layer.op.forward(xs, p, Rect.full(layer.shape))
    (loss_layer,) = graph.losses
    loss = float(acts[loss_layer.name].mean())
    grads = {}
    if not backward:
        return loss, grads, stats
    dacts = {loss_layer.name: np.full(loss_layer.shape, 1.0 / loss_layer.shape[0], dtype=x.dtype)}
    for layer in reversed(list(graph)):
        if layer.is_input or layer.name not in dacts:
            continue
        xs = [acts[src] for src in layer.inputs]
        need = [not graph[src].is_input for src in layer.inputs]
        dxs, dp = layer.op.backward(dacts[layer.name], xs, acts[layer.name], params.get(layer.name, {}),
                                    Rect.full(layer.shape), need)
        if dp:
            grads[layer.name] = dp
        for src, dx in zip(layer.inputs, dxs):
            if dx is not None:
                dacts[src] = dacts[src] + dx if src in dacts else dx
    return loss, grads, stats


def subnet_graph(graph: Graph, units, widths, batch: int) -> Graph:
    """The network with hidden layer l narrowed to widths[l] neurons and batch size `batch`."""
    sub = Graph(f"{graph.name}.subnet")
    (inp,) = [l for l in graph.inputs if l.op.dtype != "int64"]
    x = sub.input(inp.name, (batch, inp.shape[1]))
    for i, unit in enumerate(units):
        lin = graph[unit.linear]
        width = widths[i] if i < len(units) - 1 else lin.shape[1]
        x = sub.linear(x, width, activation=lin.op.activation, bias=lin.op.bias, name=unit.linear)
        if unit.norm:
            op = graph[unit.norm].op
            x = sub.batch_norm(x, eps=op.eps, momentum=op.momentum, name=unit.norm)
        if unit.relu and unit.relu != unit.linear:
            x = sub.relu(x, name=unit.relu)
    (loss,) = graph.losses
    labels = graph[loss.inputs[1]]
    y = sub.input(labels.name, (batch,), dtype="int64")
    sub.softmax_cross_entropy(x, y, name=loss.name)
    return sub


# ---- the round's plan -------------------------------------------------------------------------
def plan_round(graph, units, sites: int, local_steps: int, m, lr: float, itemsize: int, mode="replace",
               devices=None) -> Plan:
    """The Plan of one round: slices on the home device, J local steps per site, write-backs.

    `m`: the round's partition (see `partition`), or None for local SGD (every site whole)."""
    devices = tuple(range(sites)) if devices is None else tuple(devices)
    inputs = graph[units[0].linear].op.in_shapes[0][1]
    classes = graph[units[-1].linear].shape[1]
    (image,) = [l for l in graph.inputs if l.op.dtype != "int64"]
    batch = image.shape[0]
    widths_full = [graph[u.linear].shape[1] for u in units]
    full_layouts = [layer_layout(graph, u, widths_full[i], widths_full[i - 1] if i else inputs)
                    for i, u in enumerate(units)]
    buffers = {u.linear: [Buffer(u.linear, 0, (0, widths_full[i]), HOME,
                                 sum(prod(s) for _, s in full_layouts[i]) * itemsize)] for i, u in enumerate(units)}
    tasks, data, data_nbytes = [], {}, {}
    finals, site_info = [], []
    for s in range(sites):
        device = devices[s]
        blocks = [(None, None)] * len(units) if m is None else site_blocks(units, m, s, inputs, classes)
        widths = [len(r) if r is not None else widths_full[i] for i, (r, _) in enumerate(blocks)]
        layouts = tuple(layer_layout(graph, u, widths[i], widths[i - 1] if i else inputs)
                        for i, u in enumerate(units))
        sub = subnet_graph(graph, units, widths[:-1], batch)
        deps = []
        for i, unit in enumerate(units):
            rows, cols = blocks[i]
            nbytes = sum(prod(sh) for _, sh in layouts[i]) * itemsize
            flops = 0
            tasks.append(Task((f"{unit.linear}-slice", s), "slice", unit.linear, HOME,
                              CutBlock(full_layouts[i], rows, cols, layouts[i]), (Dep(BUFFER, (unit.linear, 0)),),
                              nbytes, flops))
            deps.append(Dep(TASK, (f"{unit.linear}-slice", s)))
        site_bytes = sum(sum(prod(sh) for _, sh in lay) for lay in layouts) * itemsize
        flops = subnet_flops(sub, units)
        data[f"site{s}.x"] = [Part(j, Rect((j * batch, 0), ((j + 1) * batch, inputs)), device)
                              for j in range(local_steps)]
        data[f"site{s}.y"] = [Part(j, Rect((j * batch,), ((j + 1) * batch,)), device) for j in range(local_steps)]
        for j in range(local_steps):
            data_nbytes[(f"site{s}.x", j)] = batch * inputs * itemsize
            data_nbytes[(f"site{s}.y", j)] = batch * 8
            xy = (Dep(DATA, (f"site{s}.x", j)), Dep(DATA, (f"site{s}.y", j)))
            previous = tuple(deps) if j == 0 else (Dep(TASK, (f"site{s}-local", j - 1)),)
            tasks.append(Task((f"site{s}-local", j), "local", f"site{s}", device,
                              LocalStep(sub, tuple(units), layouts, lr, j == 0), previous + xy, site_bytes, flops))
        last = Dep(TASK, (f"site{s}-local", local_steps - 1))
        finals.append(last)
        offsets, start = [], 0
        for lay in layouts:
            offsets.append(start)
            start += sum(prod(sh) for _, sh in lay)
        site_info.append((blocks, offsets, layouts))
    for i, unit in enumerate(units):
        sites_spec = tuple((site_info[s][0][i][0], site_info[s][0][i][1], site_info[s][1][i], site_info[s][2][i])
                           for s in range(sites))
        tasks.append(Task((f"{unit.linear}-writeback", 0), "writeback", unit.linear, HOME,
                          WriteBack(full_layouts[i], sites_spec, mode), (Dep(BUFFER, (unit.linear, 0)), *finals),
                          buffers[unit.linear][0].nbytes, 0))
    outputs = {"state": {(u.linear, 0): (f"{u.linear}-writeback", 0) for u in units}}
    return Plan("train", tasks, {}, data, data_nbytes, outputs, buffers)


def subnet_flops(sub: Graph, units) -> int:
    """Matrix-multiply FLOPs of one SGD step of a (sub)network: 2 B N_in N_out forward, twice that
    backward (the seed's 4 B sum N_(l-1) N_l counts forward and one backward product; the input
    layer needs no input gradient, so its backward is one product: 4 B N_0 N_1 in all)."""
    total = 0
    for i, unit in enumerate(units):
        lin = sub[unit.linear]
        fwd = lin.op.flops(Rect.full(lin.shape))
        total += fwd * (2 if i == 0 else 3)
    return total


# ---- trainers -------------------------------------------------------------------------------
class _RoundTrainer:
    mode = "replace"

    def __init__(self, graph, machine=None, local_steps=1, lr=0.01, seed=0, dtype="float32", sites=None):
        """`machine`: one site per device (or the first `sites` devices); None: the sites'
        tasks run one after another in this process (`sites` then says how many)."""
        if not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
        self.graph, self.machine = graph, machine
        self.units = units_of(graph)
        if machine is None:
            if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
                raise ValueError(f"without a machine, sites must be an int >= 1 (how many to simulate), got {sites!r}")
            self.sites = sites
        else:
            self.sites = machine.num_devices if sites is None else int(sites)
            if not 1 <= self.sites <= machine.num_devices:
                raise ValueError(f"sites must be between 1 and the machine's {machine.num_devices} devices, "
                                 f"got {sites!r}")
        self.local_steps, self.lr, self.seed = local_steps, float(lr), seed
        self.dtype = resolve_dtype(dtype)
        self.executor = None if machine is None else Executor(machine)
        self.rounds_done = 0
        self.plan: Plan | None = None
        self.stats = None
        self._token = uuid.uuid4().hex[:6]
        params = init_parameters(graph, seed, self.dtype)
        running = init_buffers(graph, self.dtype)
        address = None if machine is None else machine.addresses()
        self._state = {}
        inputs = graph[self.units[0].linear].op.in_shapes[0][1]
        widths = [graph[u.linear].shape[1] for u in self.units]
        for i, unit in enumerate(self.units):
            layout = layer_layout(graph, unit, widths[i], widths[i - 1] if i else inputs)
            state = {"weight": params[unit.linear]["weight"]}
            if "bias" in params[unit.linear]:
                state["bias"] = params[unit.linear]["bias"]
            if unit.norm:
                state.update({"norm.weight": params[unit.norm]["weight"], "norm.bias": params[unit.norm]["bias"],
                              "norm.running": running[unit.norm]})
            flat = flatten_state(state, layout)
            if machine is not None:
                [flat] = machine.client.scatter([flat], workers=[address[HOME]], hash=False, direct=True)
            self._state[(unit.linear, 0)] = flat  # a future on the home device, or the array itself
        self._layouts = {u.linear: layer_layout(graph, u, widths[i], widths[i - 1] if i else inputs)
                         for i, u in enumerate(self.units)}

    def partition(self, round_: int):
        return partition(self.graph, self.units, self.sites, self.seed, round_)

    def plan_of(self, round_: int) -> Plan:
        m = self.partition(round_) if self.mode == "replace" else None
        return plan_round(self.graph, self.units, self.sites, self.local_steps, m, self.lr, self.dtype.itemsize,
                          self.mode)

    def round(self, batches) -> None:
        """One round: `batches[s][j]` = (x, labels) of site s's j-th local step."""
        if len(batches) != self.sites or any(len(b) != self.local_steps for b in batches):
            raise ValueError(f"a round needs {self.sites} sites x {self.local_steps} local batches, got "
                             f"{len(batches)} x {[len(b) for b in batches]}")
        started = time.perf_counter()
        plan = self.plan_of(self.rounds_done)
        arrays = {}
        for s, site in enumerate(batches):
            bound = [bind_inputs(self.graph, tuple(b), self.dtype) for b in site]
            (xname,) = [l.name for l in self.graph.inputs if l.op.dtype != "int64"]
            (yname,) = [l.name for l in self.graph.inputs if l.op.dtype == "int64"]
            arrays[f"site{s}.x"] = np.concatenate([b[xname] for b in bound])
            arrays[f"site{s}.y"] = np.concatenate([b[yname] for b in bound])
        if self.machine is None:
            self._round_in_process(plan, arrays, started)
            return
        futures = self.executor.scatter(plan, arrays)
        tag = f"r{self.rounds_done}-{self._token}"
        run = self.executor.submit(plan, self.rounds_done, tag, {}, futures, {}, self._state)
        new = run.outputs["state"]
        from distributed import wait

        computed = futures_of(new.values())  # a run keeps the values nothing else reads (taskrt.planning.fusion)
        with self.machine.client.as_current():
            wait(computed)
        for future in computed:
            if future.status != "finished":
                future.result()  # raises the failed task's error
        self._state = self.executor.cut_lineage(new, tag)
        self.rounds_done += 1
        self.plan = plan
        self.stats = RoundStats(self.rounds_done, time.perf_counter() - started, len(plan.tasks),
                                plan.bytes_by_pair(), lambda keys=run.keys: self.executor.measured_bytes(keys))

    def _round_in_process(self, plan, arrays, started):
        seconds = {}
        values = run_plan(plan, data=data_tiles(plan, arrays), buffers=self._state, seconds=seconds)
        self._state = {name: values[key] for name, key in plan.outputs["state"].items()}
        self.rounds_done += 1
        self.plan = plan
        self.stats = RoundStats(self.rounds_done, time.perf_counter() - started, len(plan.tasks),
                                plan.bytes_by_pair(), None, seconds)

    def _flats(self) -> dict:
        keys = list(self._state)
        if self.machine is None:
            values = [self._state[k] for k in keys]
        else:
            values = self.machine.client.gather([self._state[k] for k in keys])
        return {k[0]: unpack(np.asarray(v), self._layouts[k[0]]) for k, v in zip(keys, values)}

    def parameters(self) -> dict:
        """Whole-network parameters, {layer: {"weight": ..., "bias": ...}} (as Trainer.parameters)."""
        out = {}
        for unit, state in zip(self.units, self._flats().values()):
            out[unit.linear] = {k: state[k].copy() for k in ("weight", "bias") if k in state}
            if unit.norm:
                out[unit.norm] = {"weight": state["norm.weight"].copy(), "bias": state["norm.bias"].copy()}
        return out

    def buffers(self) -> dict:
        out = {}
        for unit, state in zip(self.units, self._flats().values()):
            if unit.norm:
                out[unit.norm] = {"running_mean": state["norm.running"][0].copy(),
                                  "running_var": state["norm.running"][1].copy()}
        return out

    def predict(self, x, calibrate=None) -> np.ndarray:
        """Logits of the whole network.  Batch norms normalize with their running statistics, or,
        given `calibrate` (training samples), with the statistics of the whole network on them
        (the seed's Sec. 3.3: mu and sigma recomputed with the full network before inference)."""
        params, buffers = self.parameters(), self.buffers()
        running = {k: np.stack([v["running_mean"], v["running_var"]]) for k, v in buffers.items()}
        return full_network_logits(self.graph, self.units, params, running, np.asarray(x, dtype=self.dtype),
                                   None if calibrate is None else np.asarray(calibrate, dtype=self.dtype))


def full_network_logits(graph, units, params, running, x, calibrate=None):
    """Forward of the whole network (any number of samples) with the given running statistics, or
    with the statistics of the whole network on `calibrate`."""
    (loss,) = graph.losses
    logits_name = loss.inputs[0]
    if calibrate is not None:
        running = dict(running)
        acts = calibrate
        for layer in graph:
            if layer.is_input or layer.kind == "softmax_cross_entropy":
                continue
            if layer.kind == "batch_norm":
                stats = layer.op.partial_stats(acts)
                running[layer.name] = np.stack([stats[1], stats[2] / stats[0]])
            acts = _apply(layer, acts, params, running)
    acts = x
    for layer in graph:
        if layer.is_input or layer.kind == "softmax_cross_entropy":
            continue
        acts = _apply(layer, acts, params, running)
        if layer.name == logits_name:
            return acts
    raise AssertionError(logits_name)


def _apply(layer, x, params, running):
    p = params.get(layer.name, {})
    if layer.kind == "batch_norm":
        return layer.op.infer(x, running[layer.name], p)
    shape = (x.shape[0], *layer.shape[1:])
    return layer.op.forward([x], p, Rect.full(shape))


@dataclass
class RoundStats:
    round: int
    wall_s: float
    tasks: int
    planned_bytes: dict
    _measure: object = None  # reads the workers' transfer logs (None: the round ran in this process)
    task_seconds: dict | None = None  # in this process: each task's seconds

    @property
    def measured_bytes(self) -> dict:
        return {} if self._measure is None else self._measure()


class ISTTrainer(_RoundTrainer):
    """Independent subnet training: disjoint random subnets per round, J local steps, write-back."""

    mode = "replace"


class LocalSGDTrainer(_RoundTrainer):
    """Local SGD: every site trains the whole network for J steps, then the copies are averaged."""

    mode = "average"
