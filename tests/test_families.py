"""The strategy families of seeds 000 (SplitBrain) and 001 (the Pr x Pc grid): their configs,
clear errors for impossible groupings, membership in the search space (so `optimize` is never
worse than any of them under its own cost model), and exact equivalence with one device."""

from __future__ import annotations

import dataclasses

import pytest

from taskrt import models, search
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.machine import Machine
from taskrt.search.families import FamilyError, integrated, integrated_family, splitbrain, splitbrain_family
from tests.test_equivalence import check_equivalence


def small_vgg(batch=8):
    return models.splitbrain_vgg(batch=batch, image_size=16, width=1 / 16)


def small_alexnet(batch=8):
    return models.alexnet(batch=batch, image_size=16, num_classes=8, width=1 / 16)


def degrees(cfg):
    return (cfg.n, cfg.c, cfg.h, cfg.w)


@pytest.mark.parametrize("mp", [1, 2, 4, 8])
def test_splitbrain_shards_fc_layers_within_groups(mp):
    g, m = small_vgg(), Machine.simulated(2, 4)
    s = splitbrain(g, m, mp)
    for layer in g:
        cfg = s[layer.name]
        assert cfg.devices == tuple(range(8)) and cfg.sync == "allreduce"
        if layer.kind == "linear" and layer.shape[1] >= mp:
            assert degrees(cfg) == (8 // mp, mp, 1, 1), layer.name
        else:
            assert degrees(cfg) == (8, 1, 1, 1), layer.name
    # group k holds the samples of block k on devices 4k..4k+3 (mp = 4): part (i, j) on device i * mp + j
    if mp == 4:
        parts = s["fc0"].parts(g["fc0"].shape)
        assert [(p.rect.lo[0], p.rect.lo[1], p.device) for p in parts[:5]] == [
            (0, 0, 0), (0, 16, 1), (0, 32, 2), (0, 48, 3), (4, 0, 4)]


def test_splitbrain_keeps_narrow_fc_layers_data_parallel():
    g = models.splitbrain_vgg(batch=16, image_size=16, width=1 / 64)  # fc0, fc1: 16 features; fc2: 10 classes
    s = splitbrain(g, Machine.simulated(1, 16), 16)
    assert degrees(s["fc0"]) == degrees(s["fc1"]) == (1, 16, 1, 1)
    assert degrees(s["fc2"]) == (16, 1, 1, 1)


@pytest.mark.parametrize("conv", ["batch", "grid"])
def test_integrated_grid_configs(conv):
    g, m = small_alexnet(), Machine.simulated(2, 4)
    s = integrated(g, m, pr=2, pc=4, conv=conv)
    for layer in g:
        cfg = degrees(s[layer.name])
        if layer.kind == "linear" or (conv == "grid" and layer.kind in ("conv2d", "pool2d", "flatten")):
            assert cfg == (4, 2, 1, 1), layer.name
        else:
            assert cfg == (8, 1, 1, 1), layer.name


def test_integrated_domain_layers_split_height():
    g, m = small_alexnet(), Machine.simulated(1, 4)
    s = integrated(g, m, pr=2, pc=2, conv="batch", domain=2)
    assert degrees(s["conv1"]) == degrees(s["pool1"]) == degrees(s["conv2"]) == degrees(s["pool2"]) == (2, 1, 2, 1)
    assert degrees(s["conv3"]) == (4, 1, 1, 1) and degrees(s["fc1"]) == (2, 2, 1, 1)
    named = integrated(g, m, pr=2, pc=2, domain=["conv2"])
    assert degrees(named["conv1"]) == (4, 1, 1, 1) and degrees(named["conv2"]) == (2, 1, 2, 1)


@pytest.mark.parametrize("call, message", [
    (lambda g, m: splitbrain(g, m, 3), "must divide the 8 devices; valid: [1, 2, 4, 8]"),
    (lambda g, m: splitbrain(g, m, 0), "mp must be a positive int, got 0"),
    (lambda g, m: splitbrain(g, m, 2, sync="ring"), "sync must be one of"),
    (lambda g, m: integrated(g, m, 2, 2), "pr * pc = 4 processes but the machine has 8 devices; valid (pr, pc): [(1,"),
    (lambda g, m: integrated(g, m, 2, 4, conv="model"), "conv must be one of ('batch', 'grid'), got 'model'"),
    (lambda g, m: integrated(g, m, 2, 4, domain=["nope"]), "domain layer 'nope' is not in graph"),
    (lambda g, m: integrated(g, m, 2, 4, domain=["fc1"]), "'fc1' (linear) cannot be split over h"),
    (lambda g, m: integrated(g, m, 2, 4, domain=9), "domain=9 convolutions, but the graph has 5"),
    (lambda g, m: integrated(g, m, 8, 1), "'fc3' (linear): degree c=8 is larger than the dimension"),
])
def test_impossible_groupings_are_explained(call, message):
    g = models.alexnet(batch=8, image_size=16, num_classes=5, width=1 / 16)
    with pytest.raises(FamilyError) as info:
        call(g, Machine.simulated(2, 4))
    assert message in str(info.value)


def test_batch_smaller_than_the_devices():
    with pytest.raises(FamilyError, match="batch 4 is smaller than the 8 devices"):
        splitbrain(small_vgg(batch=4), Machine.simulated(2, 4), 2)


GRAPHS = {"splitbrain_vgg": small_vgg, "alexnet": small_alexnet,
          "lenet5": lambda: models.lenet5(batch=8, image_size=16, width=0.5)}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_families_lie_in_the_search_space_and_optimize_is_never_worse(name):
    g, m = GRAPHS[name](), Machine.simulated(2, 4)
    cm = search.CostModel(m, cache=False)
    space = cm.space(g)
    best = search.optimize(g, m, cm).meta["predicted_step_s"]
    families = {**splitbrain_family(g, m), **integrated_family(g, m, "batch"), **integrated_family(g, m, "grid")}
    assert len(families) >= 8
    for family, strategy in families.items():
        for layer in g:
            assert dataclasses.replace(strategy[layer.name], sync="ps") in space[layer.name], (family, layer.name)
        for sync in ("ps", "allreduce"):
            variant = Strategy({n: dataclasses.replace(c, sync=sync) for n, c in strategy.items()})
            assert cm.breakdown(g, variant).total >= best * (1 - 1e-12), (family, sync)


@pytest.mark.parametrize("make", [
    lambda g, m: splitbrain(g, m, 2),
    lambda g, m: splitbrain(g, m, 4, sync="ps"),
    lambda g, m: integrated(g, m, 2, 2, conv="grid"),
    lambda g, m: integrated(g, m, 2, 2, conv="batch", domain=2),
], ids=["splitbrain-mp2", "splitbrain-mp4-ps", "grid-2x2", "domain-2x2"])
def test_families_compute_what_one_device_computes(machine4, make):
    g = small_alexnet(batch=4)
    check_equivalence(g, make(g, machine4), machine4, "float64")


def test_a_single_device_family_is_trivial():
    g = small_vgg(batch=2)
    s = splitbrain(g, Machine.simulated(1, 1), 1)
    assert all(cfg == P(devices=(0,), sync="allreduce") for cfg in s.configs.values())
