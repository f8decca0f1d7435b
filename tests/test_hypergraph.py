"""Seed 003's hypergraph models: the PaToH format (the thesis's Fig. 3.5), the closed-form volume
against the explicit hypergraph, the naive partitions, Mt-KaHyPar, and partitions run on the
runtime as uneven channel splits, exactly, moving the bytes the model counts."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import taskrt as tr
from taskrt import models
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy, StrategyError
from taskrt.machines.machine import Machine
from taskrt.planning.lowering import lower
from taskrt.search import hypergraph as hg
from tests.test_equivalence import check_equivalence

# The thesis's Fig. 3.5: the CNN of Fig. 3.4 (input, convs of 4, 3 and 2 filters) plus three
# fully connected layers, net costs and vertex weights growing by one per layer.
FIG_3_5 = """0 13 12 38 3
1 0 1 2 3 4
2 1 5 6 7
2 2 5 6 7
2 3 5 6 7
2 4 5 6 7
3 5 8 9
3 6 8 9
3 7 8 9
4 8 10
4 9 10
5 10 11
6 11 12
1 2 2 2 2 3 3 3 4 4 5 6 7
"""


def fig_3_4():
    g = tr.Graph("fig3.4")
    x = g.input("image", (2, 1, 6, 6))
    for i, filters in enumerate((4, 3, 2), start=1):
        x = g.conv2d(x, filters, 3, padding=1, activation="relu", name=f"conv{i}")
    x = g.flatten(x, name="flatten")
    for i in (1, 2):
        x = g.linear(x, 1, activation="relu", name=f"fc{i}")
    g.softmax_cross_entropy(g.linear(x, 1, name="fc3"), name="loss")
    return g


def small_vgg(batch=4):
    return models.vgg16(batch=batch, image_size=32, num_classes=10, width=1 / 16)


def test_patoh_format_round_trips_the_thesis_example():
    h = hg.from_patoh(FIG_3_5)
    assert (h.num_vertices, h.num_nets, len(h.pins)) == (13, 12, 38)
    assert hg.to_patoh(h) == FIG_3_5
    assert hg.to_patoh(hg.from_patoh(hg.to_patoh(h, base=1))) == FIG_3_5


def test_the_coarse_grain_model_of_fig_3_4_has_the_thesis_nets():
    built = hg.coarse_grain(fig_3_4()).hypergraph()
    thesis = hg.from_patoh(FIG_3_5)
    assert built.nets() == thesis.nets()
    # the thesis's weights on our structure write the thesis's file
    relabelled = hg.Hypergraph(thesis.weights, thesis.costs, built.start, built.pins)
    assert hg.to_patoh(relabelled) == FIG_3_5


@pytest.mark.parametrize("text, message", [
    ("0 2 1 3 3\n1 0 1\n1 1\n", "3 pins announced, 2 found"),
    ("0 2 1 2 3\n1 0 5\n1 1\n", "outside vertices"),
    ("0 2 2 2 3\n1 0 1\n", "2 nets announced"),
    ("2 2 1 2 3\n1 0 1\n1 1\n", "base 2 must be 0 or 1"),
    ("0 2 1 2 3\n1 0 1\n1\n", "2 vertex weights expected, 1 found"),
])
def test_bad_patoh_files_are_explained(text, message):
    with pytest.raises(hg.HypergraphError, match=message):
        hg.from_patoh(text)


def test_vgg16_model_matches_its_layers():
    m = hg.coarse_grain(models.vgg16(batch=32))
    assert [v.name for v in m.layers][:3] == ["image", "conv1_1", "conv1_2"]
    assert int(m.sizes.sum()) == 3 + 4224 + 4096 + 4096 + 1000
    conv1_2 = m.layers[m.index("conv1_2")]
    assert conv1_2.followers == (("pool1", 1),)
    # one filter of conv1_2: 2 * 3*3*64 * 224*224 * 32 FLOPs forward, twice that backward, plus its pooling
    assert conv1_2.work - conv1_2.follower_work == pytest.approx(3 * 2 * 9 * 64 * 224 * 224 * 32)
    flatten_net = next(n for n in m.nets if n.tensor == "flatten")
    assert flatten_net.cost == 32 * 7 * 7 * 4  # one pool5 map at batch 32
    assert m.layers[m.index("conv5_3")].followers == (("pool5", 1), ("flatten", 49))


def test_graphs_with_merging_branches_are_refused():
    g = tr.Graph("branches")
    x = g.input("x", (2, 3, 8, 8))
    a = g.conv2d(x, 4, 3, padding=1, name="a")
    b = g.conv2d(x, 4, 3, padding=1, name="b")
    g.softmax_cross_entropy(g.linear(g.flatten(g.concat([a, b], name="join")), 3))
    with pytest.raises(hg.HypergraphError, match=r"'join' \(concat\).*branches that merge"):
        hg.coarse_grain(g)
    with pytest.raises(hg.HypergraphError, match=r"batch_norm layers are not modelled"):
        hg.coarse_grain(models.inception_v3(batch=2, image_size=75, width=1 / 16))


def test_grouped_convolutions_are_refused():
    g = tr.Graph("grouped")
    x = g.input("x", (2, 4, 8, 8))
    y = g.conv2d(x, 4, 3, padding=1, groups=4, name="depthwise")
    g.softmax_cross_entropy(g.linear(g.flatten(y), 3))
    with pytest.raises(hg.HypergraphError, match=r"'depthwise' \(conv2d, groups=4\).*own group's channels"):
        hg.coarse_grain(g)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_closed_form_volume_equals_the_explicit_hypergraph(data):
    model = hg.coarse_grain(small_vgg())
    h = model.hypergraph()  # a vertex per filter
    k = data.draw(st.integers(1, 5))
    parts = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=h.num_vertices,
                                        max_size=h.num_vertices)))
    counts = model.counts_of(parts, k)
    lam = h.connectivity(parts)
    assert model.volume(counts) == int((h.costs * (lam - 1)).sum())
    assert model.sent(counts).tolist() == h.sent(parts, k).tolist()
    work = np.bincount(parts, weights=np.repeat(model.work, model.sizes), minlength=k)
    assert np.allclose(model.part_work(counts), work)


def test_horizontal_balances_every_layer():
    model = hg.coarse_grain(small_vgg())
    part = hg.horizontal(model, 8)
    assert (part.counts.max(axis=1) - part.counts.min(axis=1) <= 1).all()
    assert part.metrics().max_avg < 1.05


def test_layer_wise_keeps_layers_whole_and_needs_enough_layers():
    model = hg.coarse_grain(small_vgg())
    part = hg.layer_wise(model, 16)
    assert ((part.counts > 0).sum(axis=1) == 1).all()
    assert sorted(set(np.argmax(part.counts, axis=1)[1:])) == list(range(16))  # one filter layer each
    with pytest.raises(hg.HypergraphError, match="at least 17 layers"):
        hg.layer_wise(model, 17)


@pytest.mark.parametrize("k", [2, 3, 8])
def test_incremental_fills_parts_in_order(k):
    model = hg.coarse_grain(small_vgg())
    part = hg.incremental(model, k)
    order = [p for row in part.counts for p in np.flatnonzero(row)]
    assert order == sorted(order)  # parts are used one after the other
    work = model.part_work(part.counts)
    assert (work[:-1] >= model.total_work / k).all()  # each full part passed the average


def test_counts_that_do_not_cover_a_layer_are_refused():
    model = hg.coarse_grain(small_vgg())
    counts = hg.horizontal(model, 2).counts
    counts[3, 0] -= 1
    with pytest.raises(hg.HypergraphError, match="conv2_1"):
        model.volume(counts)


def test_a_missing_partitioner_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "mtkahypar", None)
    monkeypatch.setattr(hg, "_MTKAHYPAR", {})
    with pytest.raises(hg.HypergraphError, match="pip install mtkahypar"):
        hg.partition(hg.coarse_grain(small_vgg()), 2)


@pytest.mark.parametrize("k", [2, 4])
def test_mt_kahypar_balances_and_beats_the_naive_partitions(k):
    pytest.importorskip("mtkahypar")
    model = hg.coarse_grain(small_vgg())
    part = hg.partition(model, k, epsilon=0.1, seed=1, threads=1)
    again = hg.partition(model, k, epsilon=0.1, seed=1, threads=1)
    assert (part.counts == again.counts).all()  # seeded: reproducible
    metrics = part.metrics()
    assert metrics.max_avg <= 1.1 + 0.01  # within epsilon (weights rounded to the partitioner's units)
    assert metrics.volume < hg.horizontal(model, k).metrics().volume


def _brute_force_optimum(model, k, epsilon):
    """The least volume over every assignment of each layer's filter counts to k parts."""
    import itertools

    def splits(size):
        return [c for c in itertools.product(range(size + 1), repeat=k) if sum(c) == size]

    cap = (1 + epsilon) * model.total_work / k
    best = None
    for rows in itertools.product(*(splits(v.size) for v in model.layers)):
        counts = np.array(rows)
        if (model.part_work(counts) <= cap * (1 + 1e-12)).all():
            volume = model.volume(counts)
            best = volume if best is None else min(best, volume)
    return best


@pytest.mark.parametrize("k, epsilon", [(2, 0.1), (2, 0.5), (3, 0.3)])
def test_the_exact_partition_equals_brute_force(k, epsilon):
    model = hg.coarse_grain(fig_3_4())
    exact = hg.optimal(model, k, epsilon=epsilon)
    assert exact.info["optimal"] and exact.runnable
    assert (model.part_work(exact.counts) <= (1 + epsilon) * model.total_work / k * (1 + 1e-9)).all()
    assert exact.metrics().volume == _brute_force_optimum(model, k, epsilon)


def test_the_exact_partition_is_no_worse_than_any_other():
    pytest.importorskip("mtkahypar")
    model = hg.coarse_grain(small_vgg())
    exact = hg.optimal(model, 3, epsilon=0.1)
    assert exact.info["optimal"]
    for part in (hg.partition(model, 3, threads=1), hg.incremental(model, 3), hg.horizontal(model, 3)):
        if part.metrics().max_avg <= 1.1:
            assert exact.metrics().volume <= part.metrics().volume
    assert exact.info["bound"] == pytest.approx(exact.metrics().volume, rel=1e-6)


def test_work_atoms_keep_every_atom_small_against_a_part():
    model = hg.coarse_grain(models.vgg16(batch=32))
    for k in (2, 16, 128):
        atoms = model.work_atoms(k)
        cap = model.total_work / k / 10
        for v, count, ranges in zip(model.layers, atoms, model.atoms(atoms)):
            assert len(ranges) == count and ranges[0][0] == 0 and ranges[-1][1] == v.size
            assert count >= min(v.size, 16)
            assert max(hi - lo for lo, hi in ranges) * v.work <= cap or count == v.size
    with pytest.raises(hg.HypergraphError, match="one count per layer"):
        model.atoms([1, 2])


def test_partition_settings_are_checked():
    model = hg.coarse_grain(small_vgg())
    for kwargs, message in [({"preset": "fast"}, "preset='fast'"), ({"vcycles": -1}, "vcycles=-1"),
                            ({"atoms": "many"}, "atoms='many'")]:
        with pytest.raises(hg.HypergraphError, match=message):
            hg.partition(model, 2, **kwargs)


def test_fine_grain_model_and_its_partitions():
    g = fig_3_4()
    fine = hg.fine_grain(g, max_atoms=None)
    # per filter layer: filters * input channels channel vertices and a reduction vertex per filter; inputs
    layers = [(4, 1), (3, 4), (2, 3), (1, 2), (1, 1), (1, 1)]
    assert fine.hypergraph.num_vertices == 1 + sum(f * c + f for f, c in layers)
    # a reduction net per filter, a map net per map read
    assert fine.hypergraph.num_nets == sum(f for f, _ in layers) + (1 + 4 + 3 + 2 + 1 + 1)
    part = hg.incremental(fine, 3)
    assert not part.runnable and part.metrics().volume > 0
    with pytest.raises(hg.HypergraphError, match="reductions over input"):
        hg.to_strategy(g, part)


def test_fine_grain_volume_counts_partial_sums():
    g = fig_3_4()
    fine = hg.fine_grain(g, max_atoms=None)
    h = fine.hypergraph
    parts = np.zeros(h.num_vertices, dtype=np.int64)
    conv2 = np.flatnonzero(fine.layer_of == 2)  # conv2's channel and reduction vertices
    channel = conv2[0]  # filter 0, channel 0 of conv2
    parts[channel] = 1
    # conv1's map 0 now also goes to part 1, and part 1 sends its partial sum back
    expected = 2 * 6 * 6 * 4 * 2
    assert int(h.sent(parts, 2).sum()) == expected
    assert h.sent(parts, 2).tolist() == [expected // 2, expected // 2]


@pytest.mark.parametrize("method", ["layer-wise", "horizontal", "incremental", "hypergraph", "optimal"])
def test_partitions_run_exactly_and_move_the_bytes_the_model_counts(machine4, method):
    g = small_vgg(batch=2)
    model = hg.coarse_grain(g)
    if method == "hypergraph":
        pytest.importorskip("mtkahypar")
        part = hg.partition(model, 4, seed=0, threads=1)
    elif method == "optimal":
        part = hg.optimal(model, 4, time_limit=20)
    else:
        part = {"layer-wise": hg.layer_wise, "horizontal": hg.horizontal, "incremental": hg.incremental}[method](
            model, 4)
    strategy = hg.to_strategy(g, part, machine4)
    plan = lower(g, strategy)
    fc3 = part.counts[model.index("fc3")]
    logits = int((fc3.sum() - fc3[strategy["loss"].devices[0]]) * 2 * 4)  # the loss reads every logit
    assert hg.forward_bytes(plan) == model.volume(part.counts) + logits
    if method in ("horizontal", "hypergraph", "optimal"):  # the others run in the slow suite
        check_equivalence(g, strategy, machine4, "float64")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["layer-wise", "incremental"])
def test_naive_partitions_run_exactly(machine4, method):
    g = small_vgg(batch=2)
    model = hg.coarse_grain(g)
    part = {"layer-wise": hg.layer_wise, "incremental": hg.incremental}[method](model, 4)
    check_equivalence(g, hg.to_strategy(g, part, machine4), machine4, "float64")


def test_a_partition_needs_enough_devices():
    g = small_vgg()
    with pytest.raises(hg.HypergraphError, match="needs 8 devices; the machine has 4"):
        hg.to_strategy(g, hg.horizontal(hg.coarse_grain(g), 8), Machine.simulated(1, 4))


# ---- uneven channel splits in ParallelConfig and Strategy ----------------------------------------
def test_uneven_channel_splits_are_parts_and_json():
    cfg = P(c=3, devices=(2, 0, 1), c_sizes=(5, 1, 2))
    assert [p.rect.lo[1] for p in cfg.parts((4, 8, 3, 3))] == [0, 5, 6]
    assert [p.rect.hi[1] for p in cfg.parts((4, 8, 3, 3))] == [5, 6, 8]
    assert P.from_dict(cfg.to_dict()) == cfg
    assert "c_sizes" not in P(c=2).to_dict()


@pytest.mark.parametrize("kwargs, message", [
    ({"c": 2, "c_sizes": (3,)}, "must be 2 positive ints"),
    ({"c": 2, "c_sizes": (3, 0)}, "must be 2 positive ints"),
    ({"c": 1, "c_sizes": "ab"}, "must be 1 positive ints"),
])
def test_bad_channel_sizes_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P(**kwargs)


def test_a_strategy_checks_channel_sizes_against_the_layer():
    g = small_vgg()
    strategy = Strategy({name: P() for name in g.layers if not g[name].is_input})
    strategy.configs["conv1_1"] = P(c=2, c_sizes=(3, 3))
    with pytest.raises(StrategyError, match=r"'conv1_1'.*add up to 6; the layer has 4 channels"):
        strategy.validated(g)
    strategy.configs["conv1_1"] = P()
    strategy.configs["loss"] = P(c_sizes=(1,))
    with pytest.raises(StrategyError, match="'loss'.*no channel dimension"):
        strategy.validated(g)


def test_the_cost_tables_refuse_uneven_splits():
    from taskrt.search.regions import part_table

    with pytest.raises(ValueError, match="unevenly.*simulating its plan"):
        part_table((4, 8), [P(c=2, c_sizes=(5, 3))])
