"""Lowering (graph, strategy) -> Plan, as pure planning: which tasks exist, which bytes move
between which devices.  Expected byte counts are computed by hand or from the ops' region rules,
never read back from the plan.  No Dask."""

from __future__ import annotations

from collections import Counter
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import Graph, models
from taskrt.graph.config import ParallelConfig
from taskrt.graph.strategy import Strategy
from taskrt.ops.windows import halo
from taskrt.planning.lowering import lower
from taskrt.planning.plan import DATA, TASK
from tests.strategies import random_strategies

F32 = 4


def everywhere(graph, cfg, **overrides):
    """The same config on every layer (inputs included), except `overrides`."""
    return Strategy({**{layer.name: cfg for layer in graph}, **overrides})


def param_bytes(graph, itemsize=F32):
    return itemsize * sum(prod(shape) for layer in graph for shape in layer.param_shapes.values())


def origin(plan, dep):
    """(layer, phase) of the value a travelling key carries: through send aliases and slices."""
    if dep.kind == DATA:
        return dep.key[0], "data"
    task = plan.by_key[dep.key]
    if task.phase in ("send", "slice", "gslice", "rslice"):
        return origin(plan, task.deps[0])
    return task.layer, task.phase


def moved(plan, layer, phase):
    """Bytes per (src, dst) of every transfer whose value comes from `layer`'s `phase` task."""
    out = Counter()
    for t in plan.transfers():
        if origin(plan, t.dep) == (layer, phase):
            out[(t.src, t.dst)] += t.nbytes
    return dict(out)


def ancestors(plan):
    """Keys of every task some plan output depends on."""
    stack = [k for v in plan.outputs.values() for k in (v.values() if isinstance(v, dict) else v)]
    seen = set()
    while stack:
        key = stack.pop()
        if key not in seen:
            seen.add(key)
            stack += [d.key for d in plan.by_key[key].deps if d.kind == TASK]
    return seen


def mlp():
    g = Graph("mlp")
    x = g.input("x", (4, 8))
    y = g.linear(x, 6, name="fc1")
    z = g.linear(y, 4, name="fc2")
    g.softmax_cross_entropy(z, name="loss")
    return g


def two_convs(shape=(2, 3, 8, 8), cin=4, cout=5):
    """image -> a (3x3 pad 1) -> b (3x3 pad 1) -> flatten -> fc -> loss."""
    g = Graph("convs")
    x = g.input("image", shape)
    a = g.conv2d(x, cin, 3, padding=1, name="a")
    b = g.conv2d(a, cout, 3, padding=1, name="b")
    f = g.flatten(b, name="flat")
    y = g.linear(f, 3, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def serial(graph, **overrides):
    return Strategy({**{layer.name: ParallelConfig() for layer in graph if not layer.is_input}, **overrides})


# ---- data parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [2, 4])
def test_data_parallel_moves_exactly_the_parameter_synchronization(devices):
    g = models.lenet5(batch=8)
    s = everywhere(g, ParallelConfig(n=devices, devices=tuple(range(devices))))
    plan = lower(g, s)
    counts = plan.phase_counts()
    layers = [layer for layer in g if not layer.is_input and layer.kind != "softmax_cross_entropy"]
    needed = g.needs_backward()
    assert counts["fwd"] == devices * len(layers)
    assert counts["bwd"] == devices * sum(1 for layer in layers if layer.name in needed)
    assert counts["loss"] == devices
    for part in range(devices):
        for layer in layers:
            assert plan.by_key[(f"{layer.name}-fwd", part)].device == part
            assert plan.by_key[(f"{layer.name}-bwd", part)].device == part
    assert "slice" not in counts and "gslice" not in counts
    n_param_layers = sum(1 for layer in g if layer.param_shapes)
    # beyond the first replica, each further one reads the fetched weights through an alias
    assert counts.get("send", 0) == n_param_layers * (devices - 2)
    assert all(plan.by_key[t.deps[0].key].phase == "wfetch" for t in plan.tasks if t.phase == "send")
    assert counts["update"] == n_param_layers
    assert counts["wfetch"] == n_param_layers
    assert counts["grad"] == n_param_layers * (devices - 1)

    # Each replica fetches its shard's weights from the server and sends its gradient back.
    pbytes = param_bytes(g)
    assert g.num_params() == 61_706 and pbytes == F32 * 61_706
    assert plan.bytes_moved == 2 * (devices - 1) * pbytes
    expected = {}
    for d in range(1, devices):
        expected[(0, d)] = pbytes
        expected[(d, 0)] = pbytes
    assert plan.bytes_by_pair() == expected
    plan.check_single_reader()


def test_data_parallel_with_default_inputs_is_the_same_plan():
    g = models.lenet5(batch=8)
    cfg = ParallelConfig(n=2, devices=(0, 1))
    explicit = lower(g, everywhere(g, cfg))
    default = lower(g, Strategy({layer.name: cfg for layer in g if not layer.is_input}))
    assert [t.key for t in explicit.tasks] == [t.key for t in default.tasks]
    assert explicit.bytes_by_pair() == default.bytes_by_pair()
    assert {name: [p.device for p in parts] for name, parts in default.data.items()} == {
        "image": [0, 1], "labels": [0, 1]}


# ---- model parallel fully-connected layer -----------------------------------------------------


def test_channel_split_fc_reads_the_whole_input():
    """fc2 split c=2 reads fc1's output split n=2: each fc2 part needs every row of it, so each
    device receives the other device's fc1 tile (and, backward, the rows of its gradient)."""
    g = mlp()
    s = Strategy({"fc1": ParallelConfig(n=2, devices=(0, 1)), "fc2": ParallelConfig(c=2, devices=(0, 1)),
                  "loss": ParallelConfig(devices=(0,))})
    plan = lower(g, s)
    tile = (4 // 2) * 6 * F32  # one fc1 tile: 2 rows x 6 features
    assert moved(plan, "fc1", "fwd") == {(0, 1): tile, (1, 0): tile}
    # fc2's input gradient: each fc2 part's dx covers all 4 rows; the remote fc1 part needs 2 of them
    assert moved(plan, "fc2", "bwd") == {(0, 1): tile, (1, 0): tile}
    # fc1 is replicated over n: its weights go out to device 1, its gradient comes back
    fc1_params = (6 * 8 + 6) * F32
    assert moved(plan, "fc1", "wfetch") == {(0, 1): fc1_params}
    assert moved(plan, "fc1", "grad") == {(1, 0): fc1_params}
    # fc2 is sharded over c: no synchronization
    assert moved(plan, "fc2", "wfetch") == {} and moved(plan, "fc2", "grad") == {}
    # the loss on device 0 reads fc2's second column block (4 x 2) and sends its gradient back
    logits = 4 * 2 * F32
    assert moved(plan, "fc2", "fwd") == {(1, 0): logits}
    assert moved(plan, "loss", "loss") == {(0, 1): logits}
    assert plan.bytes_moved == 2 * tile + 2 * tile + 2 * fc1_params + 2 * logits
    plan.check_single_reader()


def test_channel_split_fc_in_lenet():
    g = models.lenet5(batch=8)
    s = everywhere(g, ParallelConfig(n=2, devices=(0, 1)), fc1=ParallelConfig(c=2, devices=(0, 1)))
    plan = lower(g, s)
    # flatten (8, 400) split n=2: each fc1 part reads all 8 rows, i.e. the other device's 4 x 400 tile
    tile = 4 * 400 * F32
    assert moved(plan, "flatten", "fwd") == {(0, 1): tile, (1, 0): tile}
    assert moved(plan, "fc1", "bwd") == {(0, 1): tile, (1, 0): tile}
    # fc2 (n=2) reads rows of both fc1 column blocks: a 4 x 60 slice each way, and back
    rows = 4 * 60 * F32
    assert moved(plan, "fc1", "fwd") == {(0, 1): rows, (1, 0): rows}
    assert moved(plan, "fc2", "bwd") == {(0, 1): rows, (1, 0): rows}
    assert moved(plan, "fc1", "wfetch") == {} and moved(plan, "fc1", "grad") == {}
    plan.check_single_reader()


# ---- spatial split ----------------------------------------------------------------------------


def test_spatial_split_moves_only_halo_rows():
    """a and b both split h=2 over devices 0 and 1: b's 3x3 pad-1 window reaches one row into
    the other half, so exactly one row of a's output moves each way (and one row of its
    gradient back)."""
    n, cin, size = 2, 4, 8
    g = two_convs((n, 3, size, size), cin=cin)
    h2 = ParallelConfig(h=2, devices=(0, 1))
    plan = lower(g, serial(g, a=h2, b=h2))
    row = n * cin * 1 * size * F32
    assert moved(plan, "a", "fwd") == {(0, 1): row, (1, 0): row}
    assert moved(plan, "b", "bwd") == {(0, 1): row, (1, 0): row}
    # the image follows a (h=2 on 0, 1): one halo row of its 3 channels each way as well
    assert moved(plan, "image", "data") == {(0, 1): n * 3 * size * F32, (1, 0): n * 3 * size * F32}
    plan.check_single_reader()


def test_spatial_split_after_an_unsplit_conv():
    """a whole on device 0; b split h=2 with its second half on device 1: that half reads a's
    rows [3, 8) (its own 4 rows and one halo row), which move; the first half reads in place."""
    n, cin, size = 2, 4, 8
    g = two_convs((n, 3, size, size), cin=cin)
    plan = lower(g, serial(g, a=ParallelConfig(devices=(0,)), b=ParallelConfig(h=2, devices=(0, 1))))
    lo, hi, _, _ = halo(4, 8, 3, 1, 1, size)
    assert (lo, hi) == (3, 8)
    rows = n * cin * (hi - lo) * size * F32
    assert moved(plan, "a", "fwd") == {(0, 1): rows}
    assert moved(plan, "b", "bwd") == {(1, 0): rows}  # the gradient of the rows it read
    plan.check_single_reader()


# ---- in-place use -----------------------------------------------------------------------------


def strided():
    """a (8 rows) -> b: a 1x1 stride-2 conv, whose 4 output rows read rows [0, 7) of a."""
    g = Graph("strided")
    x = g.input("image", (2, 3, 8, 8))
    a = g.conv2d(x, 4, 3, padding=1, name="a")
    b = g.conv2d(a, 4, 1, stride=2, name="b")
    f = g.flatten(b, name="flat")
    g.softmax_cross_entropy(g.linear(f, 3, name="fc"), name="loss")
    return g


def test_sub_rect_on_the_same_device_is_read_in_place():
    g = strided()
    assert g["b"].op.input_rects(ParallelConfig().parts(g["b"].shape)[0].rect)[0].hi[2:] == (7, 7)
    plan = lower(g, serial(g))
    assert "slice" not in plan.phase_counts() and "gslice" not in plan.phase_counts()
    assert plan.bytes_moved == 0
    fwd = plan.by_key[("b-fwd", 0)]
    (piece,) = fwd.spec.inputs.pieces[0]
    assert fwd.deps[piece.dep].key == ("a-fwd", 0)
    assert piece.rect.hi[2:] == (7, 7) and piece.src.hi[2:] == (8, 8)  # a sub-rect of the whole tile


def test_sub_rect_on_another_device_moves_through_one_slice():
    g = strided()
    plan = lower(g, serial(g, b=ParallelConfig(devices=(1,)), flat=ParallelConfig(devices=(1,))))
    slices = [t for t in plan.tasks if t.phase == "slice"]
    assert len(slices) == 1
    (sl,) = slices
    assert sl.device == 0 and sl.layer == "a" and sl.deps[0].key == ("a-fwd", 0)
    assert sl.nbytes == 2 * 4 * 7 * 7 * F32  # rows and columns [0, 7), not the whole 8
    assert moved(plan, "a", "fwd") == {(0, 1): 2 * 4 * 7 * 7 * F32}


def test_h_split_consumer_slices_only_for_the_remote_part():
    g = two_convs()
    plan = lower(g, serial(g, a=ParallelConfig(devices=(0,)), b=ParallelConfig(h=2, devices=(0, 1))))
    slices = [t for t in plan.tasks if t.phase == "slice"]
    assert [(t.layer, t.device) for t in slices] == [("a", 0)]
    local = plan.by_key[("b-fwd", 0)]
    assert [d.key for d in local.deps if d.kind == TASK and d.key[0].startswith("a-")] == [("a-fwd", 0)]


# ---- no unneeded tasks ------------------------------------------------------------------------


def pooled():
    g = Graph("pooled")
    x = g.input("image", (4, 2, 8, 8))
    p = g.pool2d(x, 2, name="pool")
    c = g.conv2d(p, 3, 3, padding=1, name="conv")
    f = g.flatten(c, name="flat")
    g.softmax_cross_entropy(g.linear(f, 5, name="fc"), name="loss")
    return g


@pytest.mark.parametrize("mode", ["train", "gradients"])
def test_pool_on_the_input_has_no_backward(mode):
    g = pooled()
    plan = lower(g, everywhere(g, ParallelConfig(n=2, devices=(0, 1))), mode=mode)
    layers = {t.layer for t in plan.tasks if t.phase == "bwd"}
    assert layers == {"conv", "flat", "fc"}
    conv_bwd = plan.by_key[("conv-bwd", 0)]
    assert conv_bwd.spec.need_dx == (False,)


@pytest.mark.parametrize("graph", [models.lenet5(batch=4), pooled()], ids=["lenet5", "pooled"])
def test_predict_has_forward_only_up_to_the_logits(graph):
    s = everywhere(graph, ParallelConfig(n=2, devices=(0, 1)))
    plan = lower(graph, s, mode="predict")
    phases = set(plan.phase_counts())
    assert phases <= {"fwd", "wfetch", "slice", "send"}
    assert not {"bwd", "update", "loss", "grad", "reduce", "gslice"} & phases
    assert all(t.layer != "loss" for t in plan.tasks)
    assert "labels" not in plan.data
    logits = graph["loss"].inputs[0]
    assert plan.outputs == {"logits": [(f"{logits}-fwd", 0), (f"{logits}-fwd", 1)]}
    # only the weights' way out: no gradient comes back
    assert plan.bytes_moved == (2 - 1) * param_bytes(graph)


def test_predict_with_a_target_stops_there():
    g = models.lenet5(batch=4)
    plan = lower(g, everywhere(g, ParallelConfig(n=2, devices=(0, 1))), mode="predict", target="pool1")
    assert {t.layer for t in plan.tasks} == {"conv1", "pool1"}
    assert set(plan.shards) == {"conv1"}


def test_gradients_mode_reduces_instead_of_updating():
    g = models.lenet5(batch=8)
    s = everywhere(g, ParallelConfig(n=2, devices=(0, 1)))
    train, grads = lower(g, s, mode="train"), lower(g, s, mode="gradients")
    tc, gc = train.phase_counts(), grads.phase_counts()
    assert "reduce" not in tc and "update" not in gc
    assert gc["reduce"] == tc["update"] == sum(1 for layer in g if layer.param_shapes)
    assert set(grads.outputs) == {"loss", "grads"} and set(train.outputs) == {"loss", "state", "buffers"}
    assert train.outputs["buffers"] == {}  # no batch norms, no running statistics
    assert all(key[0].endswith("-reduce") for key in grads.outputs["grads"].values())
    # the same bytes move: the gradient sum is not sent back to the replicas
    assert grads.bytes_by_pair() == train.bytes_by_pair()


@pytest.mark.parametrize("mode", ["train", "gradients", "predict"])
@pytest.mark.parametrize("make", [lambda: models.lenet5(batch=4), pooled, strided, two_convs, mlp],
                         ids=["lenet5", "pooled", "strided", "two_convs", "mlp"])
def test_every_task_feeds_an_output(mode, make):
    g = make()
    layers = [layer for layer in g if not layer.is_input]
    # a mix of splits over two devices
    configs = {}
    for i, layer in enumerate(layers):
        dims = [d for d in layer.dims if layer.shape[layer.dims.index(d)] >= 2]
        dim = dims[i % len(dims)]
        configs[layer.name] = ParallelConfig(**{dim: 2}, devices=(i % 2, 1 - i % 2))
    plan = lower(g, Strategy(configs), mode=mode)
    assert ancestors(plan) == {t.key for t in plan.tasks}
    assert len({t.key for t in plan.tasks}) == len(plan.tasks)


def test_bogus_mode():
    g = mlp()
    with pytest.raises(ValueError, match="bogus"):
        lower(g, serial(g), mode="bogus")


# ---- random strategies ------------------------------------------------------------------------


def carried(plan, dep):
    """(volume, itemsize) of what a travelling key holds, read from the task specs' Rects."""
    if dep.kind == DATA:
        layer, index = dep.key
        return plan.data[layer][index].rect.volume, 8 if layer == "labels" else F32
    task = plan.by_key[dep.key]
    if task.phase == "send":
        return carried(plan, task.deps[0])
    if task.phase in ("slice", "gslice", "rslice"):
        piece = task.spec.piece
        assert piece.src.contains(piece.rect) and not piece.rect.empty
        _, itemsize = carried(plan, task.deps[0]) if task.deps[0].kind == DATA else (None, F32)
        return piece.rect.volume, itemsize
    if task.phase == "fwd":
        return task.spec.out.volume, F32
    if task.phase == "wfetch":  # the weights of one chunk of the shard's state
        lo, hi, _ = plan.shards[task.layer][task.key[1]].chunks[task.key[2]]
        return hi - lo, F32
    if task.phase == "grad":
        shard = plan.shards[task.layer][_shard_of_part(plan, task.layer, task.device)]
        return sum(r.volume for r in shard.rects.values()), F32
    raise AssertionError(f"{task.key} ({task.phase}) should not travel")


def _shard_of_part(plan, layer, device):
    (index,) = [s.index for s in plan.shards[layer] if device in s.devices]
    return index


def region_bytes(graph, strategy, mode="train"):
    """Bytes per (src, dst) that the region rules imply, computed without the plan.

    Forward: each part of each layer reads input_rects(part) of each input; every intersection
    with a producer part on another device moves once to that device.  Backward: each part of
    each layer that needs backward receives, from every consumer part on another device, the
    intersection of what that part read with its own Rect.  Parameters, sync "ps": every device
    holding a replica of a shard other than the shard's server (its first part's device)
    receives the weights and sends its gradient back; sync "allreduce": the flat shard is cut
    into one chunk per replica (as equal as possible, the first ones larger), and every replica
    receives every other replica's chunk of the weights and sends it that chunk of its gradient."""
    s = strategy.validated(graph)
    parts = {layer.name: s[layer.name].parts(layer.shape) for layer in graph}
    itemsize = {layer.name: 8 if layer.name == "labels" else F32 for layer in graph}
    needed = graph.needs_backward()
    moves = set()
    for layer in graph:
        if layer.is_input:
            continue
        for p in parts[layer.name]:
            for j, (src, need) in enumerate(zip(layer.inputs, layer.op.input_rects(p.rect))):
                if need is None:
                    continue
                for q in parts[src]:
                    inter = q.rect.intersect(need)
                    if q.device != p.device and not inter.empty:
                        moves.add(("fwd", src, q.index, inter, q.device, p.device, itemsize[src]))
                if layer.name in needed and src in needed:
                    for q in parts[src]:
                        inter = q.rect.intersect(need)
                        if q.device != p.device and not inter.empty:
                            moves.add(("bwd", layer.name, p.index, j, inter, p.device, q.device, F32))
    out = Counter()
    for *_, inter, src_dev, dst_dev, size in moves:
        out[(src_dev, dst_dev)] += inter.volume * size
    for layer in graph:
        if not layer.param_shapes:
            continue
        shards = {}
        for p in parts[layer.name]:
            shards.setdefault(tuple(sorted(layer.op.param_rects(p.rect).items())), []).append(p.device)
        for rects, devices in shards.items():
            size = sum(r.volume for _, r in rects)
            if s[layer.name].sync == "ps" or len(devices) == 1:
                for d in devices[1:]:
                    out[(devices[0], d)] += size * F32
                    out[(d, devices[0])] += size * F32
                continue
            count = min(len(devices), size)
            chunk = [size // count + (i < size % count) for i in range(count)]
            for owner, elements in zip(devices, chunk):
                for d in devices:
                    if d != owner:
                        out[(owner, d)] += elements * F32
                        out[(d, owner)] += elements * F32
    return {pair: b for pair, b in out.items() if b}


def check_random_plan(graph, strategy):
    plan = lower(graph, strategy)
    plan.check_single_reader()
    transfers = plan.transfers()
    for t in transfers:
        volume, size = carried(plan, t.dep)
        assert t.nbytes == volume * size, t
        assert t.src != t.dst
    pairs = plan.bytes_by_pair()
    assert sum(pairs.values()) == sum(t.nbytes for t in transfers) == plan.bytes_moved
    assert pairs == region_bytes(graph, strategy)
    assert ancestors(plan) == {t.key for t in plan.tasks}
    again = lower(graph, strategy)
    assert [t.key for t in again.tasks] == [t.key for t in plan.tasks]
    assert [t.nbytes for t in again.tasks] == [t.nbytes for t in plan.tasks]
    assert again.transfers() == transfers


LENET = models.lenet5(batch=4, image_size=16, width=0.5)
VGG = models.vgg16(batch=2, image_size=32, num_classes=5, width=1 / 32)
RANDOM = settings(max_examples=50, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@RANDOM
@given(random_strategies(LENET, max_devices=8))
def test_random_lenet_plans(drawn):
    _, strategy = drawn
    check_random_plan(LENET, strategy)


@RANDOM
@given(random_strategies(VGG, max_devices=8))
def test_random_vgg_plans(drawn):
    _, strategy = drawn
    check_random_plan(VGG, strategy)


@pytest.mark.parametrize("make", [pooled, strided, two_convs, mlp], ids=["pooled", "strided", "two_convs", "mlp"])
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_small_plans_match_the_region_rules(make, data):
    g = make()
    _, strategy = data.draw(random_strategies(g, max_devices=6))
    check_random_plan(g, strategy)


# ---- collective parameter synchronization ---------------------------------------------------


def mlp_no_bias():
    g = Graph("mlp_nb")
    x = g.input("x", shape=(8, 12))
    y = g.linear(x, 10, activation="relu", bias=False, name="fc1")
    g.softmax_cross_entropy(g.linear(y, 6, bias=False, name="fc2"), name="loss")
    return g


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_allreduce_moves_two_r_minus_one_over_r_of_each_shard_per_device(replicas):
    """Data parallel: each device sends and receives 2 (R-1)/R of every replicated shard (the
    bandwidth of ring all-reduce), where the parameter server receives and sends (R-1) shards."""
    g = mlp_no_bias()
    ps = lower(g, everywhere(g, ParallelConfig(n=replicas)))
    ar = lower(g, everywhere(g, ParallelConfig(n=replicas, sync="allreduce")))
    sizes = {"fc1": 10 * 12, "fc2": 6 * 10}  # elements per shard (bias-free)
    for layer, size in sizes.items():
        chunk = [size // replicas + (i < size % replicas) for i in range(replicas)]
        for d in range(replicas):
            out_bytes = sum(b for (s, _), b in moved(ar, layer, "wfetch").items() if s == d)
            in_bytes = sum(b for (_, t), b in moved(ar, layer, "bwd").items() if t == d)
            assert out_bytes == (replicas - 1) * chunk[d] * F32  # its chunk of the weights to every other replica
            assert in_bytes == (replicas - 1) * chunk[d] * F32  # every other replica's gradient of its chunk
        # the parameter server: all traffic at device 0
        assert sum(b for (s, _), b in moved(ps, layer, "wfetch").items() if s == 0) == (replicas - 1) * size * F32
    # the same bytes in total, spread over every device instead of concentrated on one
    assert ar.bytes_moved == ps.bytes_moved
    counts = ar.phase_counts()
    assert counts["rslice"] == 2 * replicas * (replicas - 1)  # each replica cuts every other owner's chunk
    assert counts["wgather"] == counts["update"] == 2 * replicas
    assert "grad" not in counts


def test_allreduce_state_is_chunked_over_the_replicas():
    g = mlp_no_bias()
    grid = ParallelConfig(n=2, c=2, devices=(3, 1, 0, 2), sync="allreduce")
    plan = lower(g, Strategy({"fc1": grid, "fc2": grid, "loss": ParallelConfig(n=2, devices=(3, 0))}))
    (s0, s1) = plan.shards["fc1"]
    assert s0.devices == (3, 0) and s1.devices == (1, 2)  # channel block 0 on parts 0 and 2
    assert [c[2] for c in s0.chunks] == [3, 0] and s0.chunks[0][:2] == (0, 30) and s0.chunks[1][:2] == (30, 60)
    assert set(plan.outputs["state"]) == {(name, s, k) for name in ("fc1", "fc2") for s in (0, 1) for k in (0, 1)}
    # an unreplicated layer keeps one chunk on its device whatever its sync says
    split = ParallelConfig(c=2, sync="allreduce")
    single = lower(g, Strategy({"fc1": split, "fc2": split, "loss": ParallelConfig(devices=(0,))}))
    assert all(len(s.chunks) == 1 for shards in single.shards.values() for s in shards)
    assert "wgather" not in single.phase_counts() and "rslice" not in single.phase_counts()


def test_allreduce_never_makes_empty_chunks():
    g = Graph("tiny")
    x = g.input("x", shape=(8, 2))
    g.softmax_cross_entropy(g.linear(x, 1, bias=False, name="fc"), g.input("y", shape=(8,), dtype="int64"),
                            name="loss")
    plan = lower(g, everywhere(g, ParallelConfig(n=4, sync="allreduce")))
    (shard,) = plan.shards["fc"]
    assert [c[:2] for c in shard.chunks] == [(0, 1), (1, 2)] and [c[2] for c in shard.chunks] == [0, 1]
