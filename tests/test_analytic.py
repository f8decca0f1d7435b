"""The analytic communication model of Gholami et al. (search.analytic): identities between its equations,
layer dimensions read from graphs, hand-computed terms, Eq. 5, sweeps and bad input."""

from __future__ import annotations

import math
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import taskrt
from taskrt import models
from taskrt.search import analytic as an
from taskrt.search.analytic import Grid, Interconnect, LayerDims


@cache
def alexnet_graph():
    return models.alexnet(batch=2048, image_size=224)


@cache
def alexnet():
    return an.layer_dims(alexnet_graph())


@cache
def mlp():
    g = taskrt.Graph("mlp")
    x = g.input("x", shape=(64, 100))
    h = g.linear(x, 50, activation="relu", bias=False, name="fc1")
    h = g.linear(h, 20, activation="relu", name="fc2")
    h = g.linear(h, 10, name="fc3")
    g.softmax_cross_entropy(h, name="loss")
    return an.layer_dims(g)


NETWORKS = {"alexnet": alexnet, "mlp": mlp}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def assert_same(a: an.Breakdown, b: an.Breakdown):
    """Same total and, layer by layer, the same seconds and words in every term either one has."""
    assert close(a.total_s, b.total_s), (a.total_s, b.total_s)
    assert [c.layer for c in a.layers] == [c.layer for c in b.layers]
    for ca, cb in zip(a.layers, b.layers):
        for name in {t.name for t in ca.terms} | {t.name for t in cb.terms}:
            ta, tb = ca.term(name), cb.term(name)
            assert close(ta.latency_s, tb.latency_s) and close(ta.bandwidth_s, tb.bandwidth_s), (ca.layer, name)
            assert close(ta.words, tb.words), (ca.layer, name, ta.words, tb.words)


# ---- layer dimensions ---------------------------------------------------------------------------
def test_alexnet_layer_dims_by_hand():
    layers = {layer.name: layer for layer in alexnet()}
    assert list(layers) == ["conv1", "conv2", "conv3", "conv4", "conv5", "fc1", "fc2", "fc3"]
    conv1 = layers["conv1"]  # 224x224x3 -> 11x11/4 padding 2 -> (224 + 4 - 11) // 4 + 1 = 55
    assert (conv1.kind, conv1.X_C, conv1.X_H, conv1.X_W, conv1.kh, conv1.kw) == ("conv", 3, 224, 224, 11, 11)
    assert (conv1.Y_C, conv1.Y_H, conv1.Y_W) == (64, 55, 55)
    assert conv1.d_in == 224 * 224 * 3 and conv1.d_out == 55 * 55 * 64
    assert conv1.weights == 64 * 3 * 11 * 11 and conv1.biases == 64
    conv2 = layers["conv2"]  # reads pool1's output: (55 - 3) // 2 + 1 = 27
    assert (conv2.X_C, conv2.X_H, conv2.d_in, conv2.d_out) == (64, 27, 27 * 27 * 64, 27 * 27 * 192)
    conv3 = layers["conv3"]  # reads pool2's output: 13x13x192
    assert (conv3.d_in, conv3.d_out, conv3.weights) == (13 * 13 * 192, 13 * 13 * 384, 384 * 192 * 9)
    fc1 = layers["fc1"]  # the convolution over pool5's 6x6x256 maps
    assert (fc1.kind, fc1.X_C, fc1.X_H, fc1.X_W, fc1.kh, fc1.kw) == ("fc", 256, 6, 6, 6, 6)
    assert (fc1.d_in, fc1.d_out, fc1.weights) == (9216, 4096, 9216 * 4096)
    fc3 = layers["fc3"]
    assert (fc3.X_C, fc3.X_H, fc3.kh, fc3.d_in, fc3.d_out, fc3.weights) == (4096, 1, 1, 4096, 1000, 4096 * 1000)


def test_weights_exclude_biases():
    g = alexnet_graph()
    bias_count = sum(math.prod(layer.param_shapes["bias"]) for layer in g if "bias" in layer.param_shapes)
    assert sum(layer.biases for layer in alexnet()) == bias_count == 10_344
    assert sum(layer.weights for layer in alexnet()) == g.num_params() - bias_count == 61_090_496
    mlp_layers = {layer.name: layer for layer in mlp()}
    assert (mlp_layers["fc1"].weights, mlp_layers["fc1"].biases) == (100 * 50, 0)  # built with bias=False
    assert (mlp_layers["fc2"].X_C, mlp_layers["fc2"].kh, mlp_layers["fc2"].biases) == (50, 1, 20)


def test_graph_without_weight_layers_is_rejected():
    g = taskrt.Graph("none")
    x = g.input("x", shape=(4, 3, 8, 8))
    g.pool2d(x, 2, name="pool")
    with pytest.raises(ValueError, match="no conv2d or linear"):
        an.layer_dims(g)


# ---- identities between the equations -----------------------------------------------------------
@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("p", [1, 2, 8, 96, 512])
def test_eq8_corners_are_eq4_and_eq3(network, p):
    layers = NETWORKS[network]()
    assert_same(an.eq8_integrated(layers, 1, p, 2048), an.eq4_batch_parallel(layers, p))
    assert_same(an.eq8_integrated(layers, p, 1, 2048), an.eq3_model_parallel(layers, p, 2048))


@pytest.mark.parametrize("network", NETWORKS)
def test_eq9_without_domain_is_eq8_and_all_domain_is_eq7(network):
    layers = NETWORKS[network]()
    assert_same(an.eq9_integrated_domain(layers, 4, 8, 256, domain=()), an.eq8_integrated(layers, 4, 8, 256))
    everything = [layer.name for layer in layers]
    assert_same(an.eq9_integrated_domain(layers, 16, 1, 256, domain=everything),
                an.eq7_domain_parallel(layers, 16, 256))


@settings(max_examples=60, deadline=None)
@given(network=st.sampled_from(sorted(NETWORKS)), pr=st.integers(1, 64), pc=st.integers(1, 64),
       batch=st.integers(1, 4096))
def test_identities_hold_for_any_grid(network, pr, pc, batch):
    layers = NETWORKS[network]()
    eq8 = an.eq8_integrated(layers, pr, pc, batch)
    assert_same(an.eq8_integrated(layers, 1, pr * pc, batch), an.eq4_batch_parallel(layers, pr * pc))
    assert_same(an.eq8_integrated(layers, pr * pc, 1, batch), an.eq3_model_parallel(layers, pr * pc, batch))
    assert_same(an.eq9_integrated_domain(layers, pr, pc, batch, domain=()), eq8)
    uniform = {layer.name: Grid(pr, pc) for layer in layers}
    assert_same(an.eq8_per_layer(layers, uniform, batch, count_redistribution=True), eq8)
    # Eq. 8 moves the weight gradient of |W| / Pr words over Pc processes: never more than pure batch
    assert eq8.term(an.ALLREDUCE_DW).words <= an.eq4_batch_parallel(layers, pr * pc).words


def test_redistribution_from_batch_to_model_is_eq6():
    layers = alexnet()
    p = 64
    grids = {layer.name: Grid(1, p) if layer.kind == "conv" else Grid(p, 1) for layer in layers}
    per_layer = an.eq8_per_layer(layers, grids, 2048, count_redistribution=True)
    eq6 = an.eq6_redistribution(layers[5], p, 2048).layer("fc1").term(an.REDISTRIBUTE)
    assert per_layer.layer("fc1").term(an.REDISTRIBUTE) == eq6
    assert eq6.words == 2048 * (63 / 64) * 9216 and eq6.messages == 6
    # only fc1 changes layout; without counting it, the breakdown is the rest
    uncounted = an.eq8_per_layer(layers, grids, 2048, count_redistribution=False)
    assert [c.layer for c in per_layer.layers if c.term(an.REDISTRIBUTE).total_s] == ["fc1"]
    assert close(per_layer.total_s - eq6.total_s, uncounted.total_s)
    # conv layers on 1 x P cost what Eq. 4 says for them
    eq4 = an.eq4_batch_parallel(layers, p)
    for name in ("conv1", "conv3", "conv5"):
        assert close(per_layer.layer(name).total_s, eq4.layer(name).total_s)


# ---- terms computed by hand -----------------------------------------------------------------------
UNIT = Interconnect(alpha_s=10.0, bandwidth_bytes_per_s=0.5, word_bytes=2)  # 10 s a message, 4 s a word
FC_A = LayerDims("a", "fc", X_C=4, X_H=1, X_W=1, Y_C=3, Y_H=1, Y_W=1, kh=1, kw=1, weights=12)
FC_B = LayerDims("b", "fc", X_C=3, X_H=1, X_W=1, Y_C=2, Y_H=1, Y_W=1, kh=1, kw=1, weights=6)
CONV = LayerDims("c", "conv", X_C=2, X_H=4, X_W=5, Y_C=3, Y_H=4, Y_W=5, kh=3, kw=3, weights=54)


def test_units():
    assert UNIT.beta_s_per_word == 4.0 and UNIT.beta_s_per_byte == 2.0
    assert an.TABLE1.beta_s_per_word == 4 / 6e9 and an.TABLE1.alpha_s == 2e-6


def test_ceil_log2():
    assert [an.ceil_log2(p) for p in (1, 2, 3, 4, 5, 8, 9, 512)] == [0, 1, 2, 2, 3, 3, 4, 9]


def test_eq8_two_layers_by_hand():
    cost = an.eq8_integrated([FC_A, FC_B], pr=2, pc=2, batch=8, net=UNIT)
    a, b = cost.layer("a"), cost.layer("b")
    # a: all-gather of B/Pc (Pr-1)/Pr d_1 = 4 * 1/2 * 3 words in ceil(log 2) = 1 message; no input gradient
    assert (a.term("allgather_y").messages, a.term("allgather_y").words) == (1, 6)
    assert [t.name for t in a.terms] == ["allgather_y", "allreduce_dw"]
    # a: weight gradient 2 (Pc-1)/Pc |W|/Pr = 2 * 1/2 * 12/2 words, 2 ceil(log 2) messages
    assert (a.term("allreduce_dw").messages, a.term("allreduce_dw").words) == (2, 6)
    # b: all-gather 4 * 1/2 * 2; input gradient 2 * 4 * 1/2 * d_1 = 12; weight gradient 2 * 1/2 * 6/2 = 3
    assert [(t.name, t.messages, t.words) for t in b.terms] == [
        ("allgather_y", 1, 4), ("allreduce_dx", 2, 12), ("allreduce_dw", 2, 3)]
    assert a.term("allgather_y").latency_s == 10 and a.term("allgather_y").bandwidth_s == 24
    assert a.total_s == 10 + 24 + 20 + 24
    assert b.total_s == 10 + 16 + 20 + 48 + 20 + 12
    assert cost.total_s == 78 + 126 and cost.words == 6 + 6 + 4 + 12 + 3
    assert cost.latency_s == 10 + 20 + 10 + 20 + 20
    assert cost.term("allreduce_dw").words == 9 and cost.term("halo_x").words == 0


def test_eq3_and_eq4_two_layers_by_hand():
    model = an.eq3_model_parallel([FC_A, FC_B], p=4, batch=8, net=UNIT)  # ceil(log 4) = 2, (P-1)/P = 3/4
    assert [(t.name, t.messages, t.words) for t in model.layer("a").terms] == [("allgather_y", 2, 18)]
    assert [(t.name, t.messages, t.words) for t in model.layer("b").terms] == [
        ("allgather_y", 2, 12), ("allreduce_dx", 4, 36)]
    batch = an.eq4_batch_parallel([FC_A, FC_B], p=4, net=UNIT)
    assert [(c.layer, c.terms[0].messages, c.terms[0].words) for c in batch.layers] == [("a", 4, 18), ("b", 4, 9)]
    assert batch.total_s == 4 * 10 + 18 * 4 + 4 * 10 + 9 * 4


def test_domain_halos_by_hand():
    domain = an.eq7_domain_parallel([CONV], p=4, batch=2, net=UNIT)
    # B X_W X_C floor(kh/2) = 2*5*2*1, B Y_W Y_C floor(kw/2) = 2*5*3*1, 2 (P-1)/P |W| = 81
    assert [(t.name, t.messages, t.words) for t in domain.layer("c").terms] == [
        ("halo_x", 1, 20), ("halo_y", 1, 30), ("allreduce_dw", 4, 81)]
    mixed = an.eq9_integrated_domain([CONV, LayerDims("b", "fc", 60, 1, 1, 2, 1, 1, 1, 1, weights=120)],
                                     pr=2, pc=2, batch=8, domain={"c"}, net=UNIT)
    # domain layer: B/Pc samples = 4; weights replicated on all P = 4
    assert [(t.name, t.messages, t.words) for t in mixed.layer("c").terms] == [
        ("halo_x", 1, 40), ("halo_y", 1, 60), ("allreduce_dw", 4, 81)]
    assert [t.name for t in mixed.layer("b").terms] == ["allgather_y", "allreduce_dx", "allreduce_dw"]
    # no neighbour when the domain is in one piece, no halo for a 1x1 kernel
    assert [t.name for t in an.eq7_domain_parallel([CONV], 1, 2).layer("c").terms] == ["allreduce_dw"]
    assert [t.name for t in an.eq7_domain_parallel([FC_A], 4, 2).layer("a").terms] == ["allreduce_dw"]


def test_layout_change_by_hand():
    def change(before, after, batch=8):
        cost = an.eq8_per_layer([FC_A, FC_B], {"a": before, "b": after}, batch, UNIT, count_redistribution=True)
        term = cost.layer("b").term(an.REDISTRIBUTE)
        return term.messages, term.words

    # batch (1x8) -> 4x2: all-gather of b's input over the 4 processes of its Pr group, B/Pc = 4 samples
    assert change(Grid(1, 8), Grid(4, 2)) == (2, 4 * (3 / 4) * 3)
    # 4x2 -> 1x8: the input gradient, in backward, over the same 4 processes
    assert change(Grid(4, 2), Grid(1, 8)) == (2, 4 * (3 / 4) * 3)
    # 2x4 -> 8x1: groups of 2 nest in groups of 8: g = 4 holders of different samples, B/1 = 8 samples
    assert change(Grid(2, 4), Grid(8, 1)) == (2, 8 * (3 / 4) * 3)
    assert change(Grid(2, 4), Grid(2, 4)) == (0, 0)
    with pytest.raises(ValueError, match="must divide"):
        change(Grid(2, 3), Grid(3, 2))


# ---- Eq. 5 --------------------------------------------------------------------------------------
def test_eq5_threshold_of_alexnet_conv4():
    conv4 = next(layer for layer in alexnet() if layer.name == "conv4")
    assert (conv4.kh, conv4.X_H, conv4.X_C, conv4.Y_H, conv4.Y_W) == (3, 13, 384, 13, 13)
    threshold = an.eq5_batch_threshold(conv4)
    assert threshold == 2 * 9 * 384 / (3 * 169)  # 13.63: model parallelism moves less for B <= 13
    assert math.floor(threshold) == 13
    assert an.PAPER_EQ5_BATCH_LIMIT == 12  # the paper's text says B <= 12 for this layer
    # Eq. 5 is the ratio 2|W| / (3 B d_i): equal volumes at B = B*
    assert math.isclose(2 * conv4.weights / (3 * threshold * conv4.d_out), 1.0, rel_tol=1e-12)


# ---- sweeps and compute -------------------------------------------------------------------------
def test_sweep_grids_best_and_speedups():
    layers = alexnet()
    fig6, = an.grid_sweep(layers, 2048, [12], "grid", compute_s=6.0, count_redistribution=True)
    assert [str(r.grid) for r in fig6.grids] == ["1x12", "2x6", "4x3"]  # Pr powers of two dividing P
    assert all(r.compute_s == 0.5 for r in fig6.grids)  # 6 s on one process / 12
    for r in fig6.grids:
        assert r.comm_s == an.eq8_integrated(layers, r.grid.pr, r.grid.pc, 2048).total_s
    assert fig6.best.total_s == min(r.total_s for r in fig6.grids) and fig6.baseline.grid == Grid(1, 12)
    assert fig6.total_speedup == fig6.baseline.total_s / fig6.best.total_s >= 1
    fig7, = an.grid_sweep(layers, 2048, [512], "batch", compute_s=0.0, count_redistribution=False)
    at_32 = next(r for r in fig7.grids if r.grid == Grid(32, 16))
    for cost in at_32.comm.layers:
        if cost.layer.startswith("conv"):
            assert cost.total_s == an.eq4_batch_parallel(layers, 512).layer(cost.layer).total_s
    assert at_32.batch_comm_s == at_32.comm.term(an.ALLREDUCE_DW).total_s
    # Fig. 7 moves at most what Fig. 6 moves on the same fc grid... and less on AlexNet at P = 512
    fig6_512, = an.grid_sweep(layers, 2048, [512], "grid", compute_s=0.0, count_redistribution=False)
    assert fig7.best.comm_s < fig6_512.best.comm_s
    one, = an.grid_sweep(layers, 2048, [1], "grid", compute_s=1.0, count_redistribution=True)
    assert one.comm_speedup == one.total_speedup == 1.0 and one.best.comm_s == 0


def test_figure_grids():
    grids = an.figure_grids(alexnet(), Grid(8, 64), "batch")
    assert grids["conv1"] == grids["conv5"] == Grid(1, 512) and grids["fc1"] == grids["fc3"] == Grid(8, 64)
    assert set(an.figure_grids(alexnet(), Grid(8, 64), "grid").values()) == {Grid(8, 64)}


def test_training_flops_and_knl_bound():
    # torchvision AlexNet: 714,188,480 multiply-adds per 224x224 image
    assert an.training_flops(alexnet(), 1) == 3 * 2 * 714_188_480
    assert an.KNL_7250_PEAK_FLOPS == 68 * 1.4e9 * 64
    assert an.knl_compute_s(alexnet(), 2048) == 3 * 2 * 714_188_480 * 2048 / an.KNL_7250_PEAK_FLOPS


def test_implied_compute_reproduces_the_speedup_pair():
    comm = 0.08
    c = an.implied_compute_s(comm, 2.1, 5.0)
    assert math.isclose((c + comm) / (c + comm / 5.0), 2.1, rel_tol=1e-12)
    with pytest.raises(ValueError, match="total_speedup < comm_speedup"):
        an.implied_compute_s(comm, 5.0, 2.1)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda: an.eq4_batch_parallel(alexnet(), 0), "P must be a positive int, got 0"),
    (lambda: an.eq3_model_parallel(alexnet(), 4, -1), "batch size B must be a positive int, got -1"),
    (lambda: an.eq8_integrated(alexnet(), True, 4, 8), "Pr must be a positive int, got True"),
    (lambda: an.eq8_integrated(alexnet(), 2, 2.5, 8), "Pc must be a positive int, got 2.5"),
    (lambda: an.eq9_integrated_domain(alexnet(), 2, 2, 8, domain={"pool1"}), r"domain layers \['pool1'\]"),
    (lambda: an.eq8_per_layer(alexnet(), {"conv1": Grid(1, 4)}, 8, count_redistribution=True), "missing"),
    (lambda: an.eq8_per_layer([FC_A, FC_B], {"a": Grid(1, 4), "b": Grid(2, 4)}, 8, count_redistribution=True),
     "same P"),
    (lambda: an.figure_grids(alexnet(), Grid(2, 2), "model"), "conv must be one of"),
    (lambda: an.grid_sweep(alexnet(), 8, [4], "grid", compute_s=-1.0, count_redistribution=True), "compute_s"),
    (lambda: LayerDims("x", "fc", 4, 1, 1, 3, 1, 1, 1, 1, weights=11), "Eq. 2 gives kh kw X_C Y_C = 12"),
    (lambda: LayerDims("x", "pool", 4, 1, 1, 3, 1, 1, 1, 1, weights=12), "kind must be"),
    (lambda: LayerDims("x", "fc", 0, 1, 1, 3, 1, 1, 1, 1, weights=0), "X_C must be a positive int, got 0"),
    (lambda: Interconnect(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s"),
    (lambda: Interconnect(alpha_s=-1e-6), "alpha_s"),
    (lambda: an.eq4_batch_parallel([], 4), "non-empty"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- the benchmark ------------------------------------------------------------------------------
def test_bench_figures_are_consistent():
    from taskrt.bench.gholami import PAPER_P, run_fig6_fig7

    result = run_fig6_fig7(quick=True)
    for figure in ("fig6", "fig7"):
        for p in (8, 64, 512):
            rows = [row for row in result["rows"] if row["figure"] == figure and row["P"] == p]
            assert sum(row["best"] for row in rows) == 1
            best = next(row for row in rows if row["best"])
            assert best["total_s"] == min(row["total_s"] for row in rows)
    best512 = [row for row in result["best"] if row["P"] == PAPER_P]
    assert [(row["paper_total_speedup"], row["paper_comm_speedup"]) for row in best512] == [(2.1, 5.0), (2.5, 9.7)]
    assert any("B <= 12" in line and "13.63" in line for line in result["summary"])


@pytest.mark.parametrize("keywords", [{"groups": 2}, {"dilation": 2}])
def test_grouped_or_dilated_convolutions_are_named_not_miscounted(keywords):
    g = taskrt.Graph("grouped")
    x = g.input("x", shape=(4, 4, 8, 8))
    g.conv2d(x, 4, kernel=3, padding=2, name="odd", **keywords)
    with pytest.raises(ValueError, match="layer 'odd': a conv2d with groups=.*dense, undilated"):
        an.layer_dims(g)
