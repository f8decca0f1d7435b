"""Independent subnet training: n = 1 is plain SGD, partitions are disjoint and covering, blocks go
back where they came from, a seed reproduces a run, and a round's planned bytes are what moves."""

from __future__ import annotations

import numpy as np
import pytest

from taskrt import Graph, GraphError
from taskrt.planning.params import unpack
from taskrt.training.ist import (
    CutBlock,
    ISTTrainer,
    LocalSGDTrainer,
    WriteBack,
    flatten_state,
    layer_layout,
    partition,
    plan_round,
    site_blocks,
    units_of,
)
from taskrt.training.reference import SingleDeviceTrainer


def mlp(batch=8, features=6, hidden=(5, 7), classes=3, norm=True):
    g = Graph("mlp")
    x = g.input("x", (batch, features))
    for i, width in enumerate(hidden, start=1):
        x = g.linear(x, width, bias=False, name=f"fc{i}")
        if norm:
            x = g.batch_norm(x, name=f"bn{i}")
        x = g.relu(x, name=f"relu{i}")
    x = g.linear(x, classes, bias=False, name="out")
    g.softmax_cross_entropy(x, name="loss")
    return g


def batches(graph, sites, steps, seed):
    rng = np.random.default_rng(seed)
    batch, features = graph["x"].shape
    return [[(rng.standard_normal((batch, features)), rng.integers(0, 3, batch)) for _ in range(steps)]
            for _ in range(sites)]


def test_partition_is_disjoint_covering_and_seeded():
    g = mlp(hidden=(9, 10))
    units = units_of(g)
    for sites in (1, 2, 3, 4):
        m = partition(g, units, sites, seed=5, round_=2)
        for layer, width in zip(m, (9, 10)):
            together = np.concatenate(layer)
            assert sorted(together.tolist()) == list(range(width))  # covering and disjoint
            assert max(map(len, layer)) - min(map(len, layer)) <= 1
    a, b = partition(g, units, 3, 5, 2), partition(g, units, 3, 5, 2)
    assert all(np.array_equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))
    c = partition(g, units, 3, 5, 3)
    assert any(not np.array_equal(x, y) for la, lc in zip(a, c) for x, y in zip(la, lc))


def test_blocks_written_back_land_where_they_came_from():
    g = mlp(hidden=(6, 8))
    units = units_of(g)
    sites = 3
    m = partition(g, units, sites, seed=1, round_=0)
    rng = np.random.default_rng(0)
    widths, inputs = [6, 8, 3], 6
    for i, unit in enumerate(units):
        layout = layer_layout(g, unit, widths[i], widths[i - 1] if i else inputs)
        state = {k: rng.standard_normal(shape) for k, shape in layout}
        flat = flatten_state(state, layout)
        finals, spec_sites = [], []
        for s in range(sites):
            rows, cols = site_blocks(units, m, s, inputs, 3)[i]
            lay = layer_layout(g, unit, len(rows) if rows is not None else widths[i],
                               len(cols) if cols is not None else (widths[i - 1] if i else inputs))
            block = CutBlock(layout, rows, cols, lay)(flat)
            finals.append(block + (s + 1) * 1000.0)  # each site marks what it trained
            spec_sites.append((rows, cols, 0, lay))
        new = unpack(WriteBack(layout, tuple(spec_sites), "replace")(flat, *finals), layout)
        owner_rows = np.full(widths[i], -1) if i < len(units) - 1 else None
        owner_cols = np.full(widths[i - 1], -1) if i > 0 else None
        for s in range(sites):
            if owner_rows is not None:
                owner_rows[m[i][s]] = s
            if owner_cols is not None:
                owner_cols[m[i - 1][s]] = s
        w, w0 = new["weight"], state["weight"]
        for r in range(w.shape[0]):
            for c in range(w.shape[1]):
                owners = {o for o in (owner_rows[r] if owner_rows is not None else None,
                                      owner_cols[c] if owner_cols is not None else None) if o is not None}
                if len(owners) == 1:  # inside one site's block: that site's value
                    assert w[r, c] == w0[r, c] + (owners.pop() + 1) * 1000.0
                else:  # between two sites' neurons: nobody trained it this round
                    assert w[r, c] == w0[r, c]
        if unit.norm:
            for s in range(sites):
                expected = state["norm.weight"][m[i][s]] + (s + 1) * 1e3
                np.testing.assert_array_equal(new["norm.weight"][m[i][s]], expected)


def test_one_site_is_plain_sgd(machine4):
    g = mlp()
    steps = 3
    ist = ISTTrainer(g, machine4, local_steps=steps, lr=0.1, seed=2, dtype="float64", sites=1)
    reference = SingleDeviceTrainer(g, lr=0.1, seed=2, dtype="float64")
    for r in range(2):
        data = batches(g, 1, steps, seed=r)
        ist.round(data)
        for x, y in data[0]:
            reference.step(x, y)
    got, expected = ist.parameters(), reference.parameters()
    assert set(got) == set(expected)
    for layer in expected:
        for k in expected[layer]:
            np.testing.assert_allclose(got[layer][k], expected[layer][k], rtol=1e-12, atol=1e-14)
    for layer, b in reference.buffers().items():
        for k in b:
            np.testing.assert_allclose(ist.buffers()[layer][k], b[k], rtol=1e-12, atol=1e-14)
    x = batches(g, 1, 1, seed=9)[0][0][0]
    np.testing.assert_allclose(ist.predict(x), reference.predict(x), rtol=1e-10, atol=1e-12)


def test_seed_reproduces_a_run_and_planned_bytes_are_measured(machine4):
    g = mlp()
    runs = []
    for _ in range(2):
        t = ISTTrainer(g, machine4, local_steps=2, lr=0.05, seed=7, dtype="float64", sites=3)
        for r in range(2):
            t.round(batches(g, 3, 2, seed=r))
            assert t.stats.measured_bytes == t.stats.planned_bytes
        runs.append(t.parameters())
    for layer in runs[0]:
        for k in runs[0][layer]:
            np.testing.assert_array_equal(runs[0][layer][k], runs[1][layer][k])
    other = ISTTrainer(g, machine4, local_steps=2, lr=0.05, seed=8, dtype="float64", sites=3)
    other.round(batches(g, 3, 2, seed=0))
    assert not np.array_equal(other.parameters()["fc1"]["weight"], runs[0]["fc1"]["weight"])


def test_local_sgd_averages_whole_copies(machine4):
    g = mlp()
    t = LocalSGDTrainer(g, machine4, local_steps=2, lr=0.05, seed=1, dtype="float64", sites=2)
    data = batches(g, 2, 2, seed=3)
    t.round(data)
    assert t.stats.measured_bytes == t.stats.planned_bytes
    copies = []
    for site in data:
        ref = SingleDeviceTrainer(g, lr=0.05, seed=1, dtype="float64")
        for x, y in site:
            ref.step(x, y)
        copies.append(ref.parameters())
    for layer, p in t.parameters().items():
        for k, v in p.items():
            np.testing.assert_allclose(v, (copies[0][layer][k] + copies[1][layer][k]) / 2, rtol=1e-12, atol=1e-14)


def test_round_plan_slices_match_the_seed_traffic_formula():
    """Floats the sites receive per round: rows of the input layer, columns of the output layer,
    1/n^2 of each hidden matrix per site (with their batch norms' 4 floats per neuron)."""
    g = mlp(hidden=(8, 8), norm=False)
    units = units_of(g)
    for n in (1, 2, 4):
        plan = plan_round(g, units, n, 1, partition(g, units, n, 0, 0), 0.1, 4)
        floats = sum(t.nbytes for t in plan.tasks if t.phase == "slice") // 4
        assert floats == 6 * 8 + 8 * 3 + 8 * 8 // n


def test_clear_errors():
    g = Graph("bad")
    x = g.input("x", (4, 3))
    y = g.linear(x, 2, name="out")
    g.softmax_cross_entropy(y, name="loss")
    with pytest.raises(GraphError, match="at least one hidden layer"):
        units_of(g)
    g = mlp()
    g2 = Graph("biased")
    x = g2.input("x", (4, 3))
    x = g2.relu(g2.linear(x, 4, name="fc1"), name="r")
    g2.softmax_cross_entropy(g2.linear(x, 2, name="out"), name="loss")
    with pytest.raises(GraphError, match="'out': IST needs the output layer without bias"):
        units_of(g2)
    with pytest.raises(GraphError, match="5 neurons cannot be split over 6 sites"):
        partition(g, units_of(g), 6, 0, 0)


def test_sites_in_process_train_what_sites_on_devices_train(machine4):
    """machine None: the same round plan, its tasks one after another in this process."""
    g = mlp()
    for kind in (ISTTrainer, LocalSGDTrainer):
        on_devices = kind(g, machine4, local_steps=2, lr=0.05, seed=4, dtype="float64", sites=3)
        in_process = kind(g, None, local_steps=2, lr=0.05, seed=4, dtype="float64", sites=3)
        for r in range(2):
            data = batches(g, 3, 2, seed=10 + r)
            on_devices.round(data)
            in_process.round(data)
        assert set(in_process.stats.task_seconds) == {t.key for t in in_process.plan.tasks}
        assert in_process.stats.planned_bytes == on_devices.stats.planned_bytes
        for got, expected in ((in_process.parameters(), on_devices.parameters()),
                              (in_process.buffers(), on_devices.buffers())):
            for layer in expected:
                for k in expected[layer]:
                    np.testing.assert_allclose(got[layer][k], expected[layer][k], rtol=1e-12, atol=1e-14)


def test_in_process_needs_a_site_count():
    with pytest.raises(ValueError, match="without a machine, sites must be an int >= 1"):
        ISTTrainer(mlp(), None, local_steps=2)
