"""ParallelConfig (degrees, parts, uneven blocks), Strategy validation (StrategyError naming the
layer and the value), the default configs of input layers, the JSON file format and the table.
No cluster: machines are Machine.simulated."""

from __future__ import annotations

import json
import os
import re

import pytest

from taskrt import Graph, models
from taskrt.graph.config import ParallelConfig, blocks
from taskrt.graph.strategy import FORMAT, Strategy, StrategyError
from taskrt.machines.machine import Machine
from taskrt.ops.rect import Rect


def lenet(batch=8):
    return models.lenet5(batch=batch)


def serial(graph, **overrides):
    """Every non-input layer on device 0, unsplit, except `overrides`."""
    configs = {layer.name: ParallelConfig() for layer in graph if not layer.is_input}
    configs.update(overrides)
    return Strategy(configs)


def error(fn, *parts):
    """Call fn, expect a StrategyError whose message contains every string in `parts`."""
    with pytest.raises(StrategyError) as info:
        fn()
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# ---- ParallelConfig ---------------------------------------------------------------------------


def test_default_devices_are_0_to_p_minus_1():
    assert ParallelConfig().devices == (0,)
    assert ParallelConfig(n=2, h=3).devices == tuple(range(6))
    assert ParallelConfig(n=2, c=2, h=2, w=2).devices == tuple(range(16))
    assert ParallelConfig(n=2, c=3).total == 6


def test_parts_are_row_major_over_n_c_h_w():
    cfg = ParallelConfig(n=2, c=2, h=2, w=2, devices=tuple(range(10, 26)))
    parts = cfg.parts((4, 6, 8, 10))
    assert [p.index for p in parts] == list(range(16))
    assert [p.device for p in parts] == list(range(10, 26))
    expected = []
    for i in range(2):
        for j in range(2):
            for k in range(2):
                for m in range(2):
                    expected.append(Rect((2 * i, 3 * j, 4 * k, 5 * m), (2 * i + 2, 3 * j + 3, 4 * k + 4, 5 * m + 5)))
    assert [p.rect for p in parts] == expected


def test_parts_of_a_matrix_use_n_and_c_only():
    parts = ParallelConfig(n=2, c=3, devices=(5, 4, 3, 2, 1, 0)).parts((4, 9))
    assert [p.rect for p in parts] == [
        Rect((0, 0), (2, 3)), Rect((0, 3), (2, 6)), Rect((0, 6), (2, 9)),
        Rect((2, 0), (4, 3)), Rect((2, 3), (4, 6)), Rect((2, 6), (4, 9)),
    ]
    assert [p.device for p in parts] == [5, 4, 3, 2, 1, 0]


def test_uneven_blocks_give_the_first_blocks_one_more():
    assert blocks(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert blocks(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert blocks(5, 5) == tuple((i, i + 1) for i in range(5))
    assert blocks(6, 1) == ((0, 6),)
    parts = ParallelConfig(h=4).parts((1, 1, 10, 3))
    assert [p.rect.shape[2] for p in parts] == [3, 3, 2, 2]
    assert [(p.rect.lo[2], p.rect.hi[2]) for p in parts] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # the blocks tile the dimension exactly
    assert sum(p.rect.volume for p in parts) == 10 * 3


@pytest.mark.parametrize("dim", ["n", "c", "h", "w"])
@pytest.mark.parametrize("value", [0, -1, -3, True, False, 2.0, 1.5, "2", None])
def test_config_rejects_bad_degrees(dim, value):
    with pytest.raises(ValueError) as info:
        ParallelConfig(**{dim: value})
    assert f"{dim}={value!r}" in str(info.value)


@pytest.mark.parametrize("devices", [(0, 1.0), (True, 1), ("0", "1"), 5])
def test_config_rejects_devices_that_are_not_ints(devices):
    with pytest.raises(ValueError, match="devices must be"):
        ParallelConfig(n=2, devices=devices)


@pytest.mark.parametrize("cfg", [
    ParallelConfig(),
    ParallelConfig(n=2, devices=(3, 1)),
    ParallelConfig(n=2, c=3, h=1, w=2, devices=tuple(range(11, -1, -1))),
])
def test_config_dict_round_trip(cfg):
    data = cfg.to_dict()
    assert data == {"n": cfg.n, "c": cfg.c, "h": cfg.h, "w": cfg.w, "devices": list(cfg.devices)}
    assert json.loads(json.dumps(data)) == data
    back = ParallelConfig.from_dict(data)
    assert back == cfg and back.devices == cfg.devices


def test_sync_method_round_trips_and_is_checked(tmp_path):
    cfg = ParallelConfig(n=4, sync="allreduce")
    assert cfg.to_dict()["sync"] == "allreduce" and ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg != ParallelConfig(n=4) and "allreduce" in str(cfg)
    with pytest.raises(ValueError, match="sync='ring' is not one of 'ps', 'allreduce'"):
        ParallelConfig(n=2, sync="ring")
    layers = good_layers()
    layers["conv1"]["sync"] = "ring"
    error(lambda: Strategy.load(write(tmp_path, {"layers": layers})), "'conv1'", "sync='ring'", "'allreduce'")


def test_config_from_dict_defaults_missing_degrees_to_one():
    assert ParallelConfig.from_dict({"h": 2, "devices": [1, 0]}) == ParallelConfig(h=2, devices=(1, 0))


# ---- validation -------------------------------------------------------------------------------


def test_validated_fills_inputs_and_keeps_graph_order():
    g, m = lenet(), Machine.simulated(1, 2)
    v = serial(g).validated(g, m)
    assert list(v) == list(g.layers)
    assert v["image"] == ParallelConfig() and v["labels"] == ParallelConfig()
    assert v.validated(g, m) == v


def test_unknown_layer_is_named():
    g, m = lenet(), Machine.simulated(1, 2)
    s = serial(g, convX=ParallelConfig())
    error(lambda: s.validated(g, m), "'convX'", "lenet5")


def test_missing_non_input_layer_is_named():
    g, m = lenet(), Machine.simulated(1, 2)
    configs = dict(serial(g).configs)
    del configs["pool2"]
    error(lambda: Strategy(configs).validated(g, m), "'pool2'", "no parallel config")


def test_h_on_a_linear_layer_is_rejected():
    g, m = lenet(), Machine.simulated(1, 2)
    s = serial(g, fc1=ParallelConfig(h=2))
    msg = error(lambda: s.validated(g, m), "'fc1'", "'h'", "degree 2")
    assert "n, c" in msg  # says what it can split over


def test_c_on_the_loss_layer_is_rejected():
    g, m = lenet(), Machine.simulated(1, 2)
    s = serial(g, loss=ParallelConfig(c=2))
    msg = error(lambda: s.validated(g, m), "'loss'", "'c'", "degree 2")
    assert "splits over n" in msg


def test_degree_larger_than_the_dimension():
    g, m = lenet(), Machine.simulated(4, 8)
    # pool2 has 5 rows; fc3 has 10 classes
    s = serial(g, pool2=ParallelConfig(h=6))
    error(lambda: s.validated(g, m), "'pool2'", "h=6", "size 5")
    s = serial(g, fc3=ParallelConfig(c=11))
    error(lambda: s.validated(g, m), "'fc3'", "c=11", "size 10")
    s = serial(g, conv1=ParallelConfig(n=9))
    error(lambda: s.validated(g, m), "'conv1'", "n=9", "size 8")


def test_degree_equal_to_the_dimension_is_fine():
    g, m = lenet(), Machine.simulated(2, 4)
    serial(g, pool2=ParallelConfig(h=5), conv1=ParallelConfig(n=8)).validated(g, m)


def test_device_out_of_range_names_the_machines_range():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, conv2=ParallelConfig(n=2, devices=(1, 4)))
    error(lambda: s.validated(g, m), "'conv2'", "[4]", "0..3")


def test_negative_device():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, fc2=ParallelConfig(c=2, devices=(0, -1)))
    error(lambda: s.validated(g, m), "'fc2'", "[-1]", "0..3")
    # without a machine (as lower() validates) a negative id is still wrong
    error(lambda: s.validated(g), "'fc2'", "[-1]", "negative")


def test_duplicate_devices_within_a_layer():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, conv1=ParallelConfig(n=2, h=2, devices=(0, 1, 2, 1)))
    error(lambda: s.validated(g, m), "'conv1'", "[1]", "twice")


def test_more_devices_than_parts():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, fc1=ParallelConfig(n=2, devices=(0, 1, 2)))
    error(lambda: s.validated(g, m), "'fc1'", "3 devices", "[0, 1, 2]", "2 parts")


def test_fewer_devices_than_parts():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, fc1=ParallelConfig(n=2, c=2, devices=(0, 1, 2)))
    error(lambda: s.validated(g, m), "'fc1'", "3 devices", "4 parts")


def test_a_bad_first_consumer_is_blamed_not_the_defaulted_input():
    """The input's default is derived from its consumer; the consumer's error names the consumer."""
    g, m = lenet(), Machine.simulated(1, 4)
    few = serial(g, conv1=ParallelConfig(n=2, devices=(0,)))
    error(lambda: few.validated(g, m), "'conv1'", "1 devices", "2 parts")
    far = serial(g, conv1=ParallelConfig(n=2, devices=(0, 7)))
    msg = error(lambda: far.validated(g, m), "'conv1'", "[7]")
    assert "'image'" not in msg
    wide = serial(g, conv1=ParallelConfig(h=29, devices=tuple(range(29))))
    error(lambda: wide.validated(g, Machine.simulated(4, 8)), "'conv1'", "h=29", "size 28")
    loss = serial(g, loss=ParallelConfig(n=2, devices=(0, 9)))
    msg = error(lambda: loss.validated(g, m), "'loss'", "[9]")
    assert "'labels'" not in msg


def test_an_impossible_default_input_config_says_it_is_a_default():
    """conv (1x1, padding 2) turns 2 rows into 6; its h=4 split is fine, but the image it is copied to
    has only 2 rows: the error says the config was derived, and how to fix it."""
    g = Graph("pad")
    g.conv2d(g.input("image", (2, 1, 2, 2)), 3, 1, padding=2, name="conv")
    s = Strategy({"conv": ParallelConfig(h=4)})
    error(lambda: s.validated(g, Machine.simulated(1, 4)), "'image'", "h=4", "size 2", "default",
          "first consumer", "give 'image' a config")
    s = Strategy({"conv": ParallelConfig(h=4), "image": ParallelConfig(h=2, devices=(0, 2))})
    assert s.validated(g, Machine.simulated(1, 4))["image"].devices == (0, 2)


def test_given_input_configs_are_validated_too():
    g, m = lenet(), Machine.simulated(1, 4)
    s = serial(g, image=ParallelConfig(c=2))
    error(lambda: s.validated(g, m), "'image'", "c=2", "size 1")
    s = serial(g, labels=ParallelConfig(h=2))
    error(lambda: s.validated(g, m), "'labels'", "'h'")


# ---- default input configs --------------------------------------------------------------------


def test_default_image_follows_its_first_consumer_without_channel_split():
    g, m = lenet(), Machine.simulated(2, 4)
    # conv1 parts row-major over (n, c, h): devices 7..0; channel block 0 parts are indices
    # (n0,c0,h0)=0, (n0,c0,h1)=1, (n1,c0,h0)=4, (n1,c0,h1)=5.
    conv1 = ParallelConfig(n=2, c=2, h=2, devices=(7, 6, 5, 4, 3, 2, 1, 0))
    v = serial(g, conv1=conv1).validated(g, m)
    assert v["image"] == ParallelConfig(n=2, c=1, h=2, w=1, devices=(7, 6, 3, 2))
    # each image part lives where the channel-0 conv1 part of the same (n, h) block runs
    conv_parts = conv1.parts(g["conv1"].shape)
    for p in v["image"].parts(g["image"].shape):
        (q,) = [q for q in conv_parts if q.device == p.device]
        assert q.rect.lo[1] == 0 and q.rect.lo[0] == p.rect.lo[0]


def test_default_image_with_w_split():
    g, m = lenet(), Machine.simulated(2, 4)
    conv1 = ParallelConfig(c=2, w=2, devices=(1, 3, 5, 7))
    v = serial(g, conv1=conv1).validated(g, m)
    assert v["image"] == ParallelConfig(w=2, devices=(1, 3))


def test_default_image_of_a_channel_split_consumer_is_on_its_first_device():
    g, m = lenet(), Machine.simulated(1, 4)
    v = serial(g, conv1=ParallelConfig(c=3, devices=(2, 0, 1))).validated(g, m)
    assert v["image"] == ParallelConfig(devices=(2,))


def test_default_labels_follow_the_loss_n_split():
    g, m = lenet(), Machine.simulated(1, 4)
    v = serial(g, loss=ParallelConfig(n=4, devices=(3, 1, 0, 2))).validated(g, m)
    assert v["labels"] == ParallelConfig(n=4, devices=(3, 1, 0, 2))
    # the image follows conv1 (serial here), not the loss
    assert v["image"] == ParallelConfig()


def test_default_of_a_matrix_input_keeps_n_drops_c():
    g = Graph("mlp")
    x = g.input("x", (6, 10))
    y = g.linear(x, 4, name="fc")
    g.softmax_cross_entropy(y, name="loss")
    v = Strategy({"fc": ParallelConfig(n=3, c=2, devices=(5, 4, 3, 2, 1, 0)), "loss": ParallelConfig(n=2)})
    v = v.validated(g, Machine.simulated(1, 6))
    assert v["x"] == ParallelConfig(n=3, devices=(5, 3, 1))
    assert v["labels"] == ParallelConfig(n=2, devices=(0, 1))


def test_given_input_configs_are_kept():
    g, m = lenet(), Machine.simulated(1, 4)
    image = ParallelConfig(n=4, devices=(3, 2, 1, 0))
    v = serial(g, image=image).validated(g, m)
    assert v["image"] == image


# ---- JSON -------------------------------------------------------------------------------------


def mixed(g):
    return serial(g, conv1=ParallelConfig(n=2, h=2, devices=(3, 2, 1, 0)),
                  fc1=ParallelConfig(c=2, devices=(1, 2)), loss=ParallelConfig(n=2, devices=(0, 3)))


def test_save_load_round_trip(tmp_path):
    g, m = lenet(), Machine.simulated(1, 4)
    s = mixed(g).validated(g, m)
    s.name = "mixed"
    path = tmp_path / "s.json"
    s.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["name"] == "mixed"
    assert data["layers"]["fc1"] == {"n": 1, "c": 2, "h": 1, "w": 1, "devices": [1, 2]}
    back = Strategy.load(path, g, m)
    assert back == s and back.name == "mixed"
    assert list(back) == list(s)
    # without a graph, load returns the file's strategy as is
    assert Strategy.load(str(path)) == s


def test_load_validates_and_fills_defaults(tmp_path):
    g, m = lenet(), Machine.simulated(1, 4)
    s = mixed(g)  # inputs left out
    path = tmp_path / "s.json"
    s.save(path)
    assert "image" not in json.loads(path.read_text())["layers"]
    assert Strategy.load(path, g, m) == s.validated(g, m)
    error(lambda: Strategy.load(path, g, Machine.simulated(1, 2)), "'conv1'", "0..1")


def test_save_is_atomic_and_replaces(tmp_path):
    g = lenet()
    path = tmp_path / "sub" / "s.json"
    serial(g).save(path)
    first = path.read_text()
    mixed(g).save(path)
    assert path.read_text() != first
    assert Strategy.load(path) == mixed(g)
    assert os.listdir(path.parent) == ["s.json"]  # no temporary file left behind


def test_save_leaves_nothing_behind_when_the_write_fails(tmp_path, monkeypatch):
    import taskrt.graph.files

    g = lenet()
    path = tmp_path / "s.json"
    serial(g).save(path)
    before = path.read_text()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(taskrt.graph.files.os, "fsync", boom)
    with pytest.raises(OSError):
        mixed(g).save(path)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["s.json"]


def write(tmp_path, data=None, text=None):
    """A strategy file holding `data` as JSON, or the raw `text`."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data) if text is None else text)
    return path


def good_layers():
    return {"conv1": {"n": 2, "c": 1, "h": 1, "w": 1, "devices": [0, 1]}}


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    error(lambda: Strategy.load(path), "cannot read strategy file", str(path), "No such file")


def test_load_a_directory_or_a_binary_file(tmp_path):
    error(lambda: Strategy.load(tmp_path), "cannot read strategy file", str(tmp_path))
    path = tmp_path / "s.json"
    path.write_bytes(b'\xff\xfe{"layers": {}}')
    error(lambda: Strategy.load(path), str(path), "not a text (UTF-8) file")


def test_load_invalid_json_names_line_and_column(tmp_path):
    path = write(tmp_path, text='{"layers": {\n  "conv1": {"n": 2,, "devices": [0, 1]}\n}}')
    error(lambda: Strategy.load(path), str(path), "not valid JSON", "line 2", "column")


@pytest.mark.parametrize("top", [[1, 2], "layers", 3, None])
def test_load_top_level_not_an_object(tmp_path, top):
    path = write(tmp_path, top)
    error(lambda: Strategy.load(path), str(path), "expected an object", "'layers'")


@pytest.mark.parametrize("data", [{"format": FORMAT}, {"layers": [1]}, {"layers": "conv1"}, {"layers": None}])
def test_load_layers_missing_or_not_an_object(tmp_path, data):
    path = write(tmp_path, data)
    error(lambda: Strategy.load(path), str(path), "'layers' object")


def test_load_layer_config_not_an_object(tmp_path):
    path = write(tmp_path, {"layers": {"conv1": [2, 1, 1, 1]}})
    error(lambda: Strategy.load(path), str(path), "'conv1'", "must be an object", "[2, 1, 1, 1]")


def test_load_unknown_field(tmp_path):
    layers = good_layers()
    layers["conv1"]["depth"] = 2
    path = write(tmp_path, {"layers": layers})
    error(lambda: Strategy.load(path), "'conv1'", "unknown fields ['depth']", "devices")


def test_load_missing_devices(tmp_path):
    path = write(tmp_path, {"layers": {"conv1": {"n": 2}}})
    error(lambda: Strategy.load(path), "'conv1'", "missing field 'devices'")


@pytest.mark.parametrize("spec, parts", [
    ({"n": "2", "devices": [0, 1]}, ["n='2'", "positive int"]),
    ({"h": 0, "devices": []}, ["h=0"]),
    ({"c": 1.5, "devices": [0]}, ["c=1.5"]),
    ({"w": True, "devices": [0]}, ["w=True"]),
    ({"n": 2, "devices": ["0", "1"]}, ["devices must be ints"]),
    ({"n": 2, "devices": 2}, ["devices must be a list of ints", "2"]),
])
def test_load_bad_values(tmp_path, spec, parts):
    path = write(tmp_path, {"layers": {"conv1": spec}})
    with pytest.raises(StrategyError) as info:
        Strategy.load(path)
    msg = str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    for part in [str(path), "'conv1'", *parts]:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_load_wrong_format(tmp_path):
    path = write(tmp_path, {"format": "taskrt-strategy/99", "layers": good_layers()})
    error(lambda: Strategy.load(path), "'taskrt-strategy/99'", FORMAT)


def test_load_without_format_is_accepted(tmp_path):
    path = write(tmp_path, {"layers": good_layers()})
    assert Strategy.load(path)["conv1"] == ParallelConfig(n=2, devices=(0, 1))


# ---- table ------------------------------------------------------------------------------------


def test_table_lists_every_layer_with_degrees_and_devices():
    g, m = lenet(), Machine.simulated(1, 4)
    s = mixed(g).validated(g, m)
    lines = s.table(g).splitlines()
    assert len(lines) == len(g) + 1
    assert lines[0].split()[:3] == ["layer", "kind", "config"]
    for layer, line in zip(g, lines[1:]):
        cfg = s[layer.name]
        assert line.split()[0] == layer.name
        assert layer.kind in line
        assert f"{{n={cfg.n}, c={cfg.c}, h={cfg.h}, w={cfg.w}}}" in line
        assert line.endswith(str(list(cfg.devices)))
    conv1 = next(line for line in lines if line.startswith("conv1 "))
    assert "{n=2, c=1, h=2, w=1}" in conv1 and "[3, 2, 1, 0]" in conv1


@pytest.mark.parametrize("kwargs, part", [
    ({"n": True, "devices": (0,)}, "n=True"),
    ({"n": 2, "devices": (0, True)}, "devices must be ints"),
    ({"n": 2, "devices": (0, 1.0)}, "devices must be ints"),
    ({"c": 0, "devices": ()}, "c=0"),
    ({"n": 2, "devices": (0, 1), "sync": "ring"}, "sync='ring'"),
    ({"c": 2, "devices": (0, 1), "c_sizes": (1,)}, "c_sizes=[1]"),
])
def test_configs_given_tuples_are_checked_too(kwargs, part):
    """Degrees and devices already of the normalized types take a shorter check: it refuses the same values."""
    with pytest.raises(ValueError, match=re.escape(part)):
        ParallelConfig(**kwargs)
