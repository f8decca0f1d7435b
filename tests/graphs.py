"""Small graphs for the tests: undirected shapes for the optimizer (edge lists over node names), an
Inception-style block built with the graph API, and a small LeNet-5 with a mixed strategy that
uses every split the trainer tests need; parameters compared bit for bit."""

from __future__ import annotations

import numpy as np

from taskrt import Graph, models
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy


def small_lenet():
    return models.lenet5(batch=4, image_size=16, width=0.5)


def mixed_lenet_strategy(graph, fc_devices=(1, 2), name=""):
    """n-split convolutions on (0, 1), an h-split conv2 on (2, 0), c-split fully-connected layers
    on `fc_devices`."""
    configs = {}
    for layer in graph:
        if layer.is_input:
            continue
        if layer.name == "conv2":
            configs[layer.name] = P(h=2, devices=(2, 0))
        elif layer.kind == "linear":
            configs[layer.name] = P(c=2, devices=fc_devices)
        else:
            configs[layer.name] = P(n=2, devices=(0, 1))
    return Strategy(configs, name=name)


def _names(k, prefix="v"):
    return [f"{prefix}{i}" for i in range(k)]


def chain(k):
    v = _names(k)
    return v, list(zip(v, v[1:]))


def diamond():
    return ["a", "b", "c", "d"], [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]


def inception(branches):
    """stem -> `branches` branches (one of them two layers deep) -> join -> tail."""
    nodes, edges = ["stem"], []
    for i in range(branches):
        nodes.append(f"b{i}")
        edges.append(("stem", f"b{i}"))
    nodes.append("deep")
    edges += [("b0", "deep"), ("deep", "join")]
    edges += [(f"b{i}", "join") for i in range(1, branches)]
    nodes += ["join", "tail"]
    edges.append(("join", "tail"))
    return nodes, edges


def tree(parents):
    """A tree from `parents[i]` < i + 1 for node i + 1 (node 0 is the root)."""
    v = _names(len(parents) + 1)
    return v, [(v[p], v[i + 1]) for i, p in enumerate(parents)]


def parallel_edges():
    """Two edges a-b, three b-c (one reversed), a self-loop on c and a chain to d."""
    return ["a", "b", "c", "d"], [("a", "b"), ("a", "b"), ("b", "c"), ("c", "b"), ("b", "c"), ("c", "c"),
                                  ("c", "d")]


def components():
    """A chain of three and a diamond, not connected."""
    return ["p0", "p1", "p2", "a", "b", "c", "d"], [("p0", "p1"), ("p1", "p2"), ("a", "b"), ("a", "c"),
                                                    ("b", "d"), ("c", "d")]


def single():
    return ["only"], []


def complete(k):
    v = _names(k, "k")
    return v, [(v[i], v[j]) for i in range(k) for j in range(i + 1, k)]


def grid(rows, cols):
    v = [f"g{r}{c}" for r in range(rows) for c in range(cols)]
    edges = [(f"g{r}{c}", f"g{r}{c + 1}") for r in range(rows) for c in range(cols - 1)]
    edges += [(f"g{r}{c}", f"g{r + 1}{c}") for r in range(rows - 1) for c in range(cols)]
    return v, edges


def densenet(k):
    """stem -> a block of `k` layers, each connected to every later one -> tail."""
    nodes, edges = complete(k)
    return ["stem", *nodes, "tail"], [("stem", nodes[0]), *edges, (nodes[-1], "tail")]


# name -> (builder, series-parallel: eliminations alone reduce it to nothing)
SHAPES = {
    "single": (single, True),
    "chain": (lambda: chain(5), True),
    "diamond": (diamond, True),
    "inception3": (lambda: inception(3), True),
    "inception4": (lambda: inception(4), True),
    "tree": (lambda: tree([0, 0, 1, 1, 2, 4]), True),
    "parallel_edges": (parallel_edges, True),
    "components": (components, True),
    "k4": (lambda: complete(4), False),
    "grid3x3": (lambda: grid(3, 3), False),
    "densenet4": (lambda: densenet(4), False),
    "densenet5": (lambda: densenet(5), False),
}


def inception_block(batch=4, channels=8, size=9, classes=5) -> Graph:
    """stem conv -> {1x1 | 1x1, 1x7, 7x1 | 1x1, 7x1, 1x7 | 3x3 avg pool, 1x1} -> concat -> linear -> loss."""
    g = Graph("inception_block")
    x = g.input("image", (batch, 3, size, size))
    stem = g.conv2d(x, channels, 3, padding=1, activation="relu", name="stem")
    b1 = g.conv2d(stem, 4, 1, activation="relu", name="b1_1x1")
    b2 = g.conv2d(stem, 4, 1, activation="relu", name="b2_1x1")
    b2 = g.conv2d(b2, 4, (1, 7), padding=(0, 3), activation="relu", name="b2_1x7")
    b2 = g.conv2d(b2, 6, (7, 1), padding=(3, 0), activation="relu", name="b2_7x1")
    b3 = g.conv2d(stem, 4, 1, activation="relu", name="b3_1x1")
    b3 = g.conv2d(b3, 4, (7, 1), padding=(3, 0), activation="relu", name="b3_7x1")
    b3 = g.conv2d(b3, 6, (1, 7), padding=(0, 3), activation="relu", name="b3_1x7")
    b4 = g.pool2d(stem, 3, stride=1, padding=1, mode="avg", name="b4_pool")
    b4 = g.conv2d(b4, 2, 1, activation="relu", name="b4_1x1")
    y = g.concat([b1, b2, b3, b4], name="concat")
    y = g.flatten(y, name="flatten")
    y = g.linear(y, classes, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    return g


def assert_same_parameters(actual: dict, expected: dict) -> None:
    """Two trainers' parameters ({layer: {name: array}}) equal bit for bit, layer by layer."""
    assert {layer: set(p) for layer, p in actual.items()} == {layer: set(p) for layer, p in expected.items()}
    for layer, params in expected.items():
        for name, value in params.items():
            np.testing.assert_array_equal(actual[layer][name], value, err_msg=f"{layer}.{name}")


def alternating_strategy(graph) -> Strategy:
    """Layers in turn split over samples, over height (or channels) and kept whole on device 1: many
    runs per device and values sent between them, on two devices."""
    configs = {}
    for i, layer in enumerate(lay for lay in graph if not lay.is_input):
        dims = layer.op.dims
        second = P(h=2) if "h" in dims and layer.shape[2] > 1 else P(c=2) if "c" in dims else P(n=2)
        configs[layer.name] = [P(n=2), second, P(devices=(1,))][i % 3]
    return Strategy(configs)


def with_and_without_graphs(machine, graph, strategy, batches, before=None, after=None) -> dict:
    """{True: (losses, parameters) of `batches` stepped with each run replayed as a CUDA graph once
    it can be, False: the same steps launched kernel by kernel}.  `before()` runs before each
    trainer is made, `after(graphs)` after its steps (to count the workers' captures)."""
    from taskrt.training.trainer import Trainer

    results = {}
    for graphs in (True, False):
        if before is not None:
            before()
        trainer = Trainer(graph, strategy, machine, lr=0.05, momentum=0.9, cuda_graphs=graphs)
        results[graphs] = [trainer.step(x, y) for x, y in batches], trainer.parameters()
        if after is not None:
            after(graphs)
    return results
