"""A mistake on the command line is one line naming the argument and what is valid, a non-zero exit
and no traceback, before anything starts: unknown models, bad machine specs, missing files, bad
numbers, for every subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from taskrt.cli import main


def one_line(capsys, argv) -> str:
    """The one line `taskrt argv` ends with (its exit code checked non-zero)."""
    with pytest.raises(SystemExit) as ended:
        main(argv)
    err = capsys.readouterr().err
    text = err if isinstance(ended.value.code, int) else f"{err}{ended.value.code}\n"
    assert ended.value.code not in (0, None) and text.count("\n") == 1 and "Traceback" not in text, text
    return text


RUN = [
    (["--epochs", "0"], "--epochs: expected a whole number of at least 1, got '0'"),
    (["--epochs", "ten"], "--epochs: expected a whole number of at least 1, got 'ten'"),
    (["--batch", "-4"], "--batch: expected a whole number of at least 1"),
    (["--lr", "0"], "--lr: expected a positive number, got '0'"),
    (["--lr", "nan"], "--lr: expected a positive number, got 'nan'"),
    (["--seed", "-1"], "--seed: expected a whole number of at least 0"),
    (["--devices", "0"], "--devices: expected a whole number of at least 1"),
    (["--epoch", "3"], "unrecognized arguments: --epoch 3"),
]


@pytest.mark.parametrize("args, said", RUN)
def test_run(capsys, args, said):
    assert said in one_line(capsys, ["run", *args])


SEARCH = [
    (["--model", "nosuch"], "--model: unknown model 'nosuch'; known models: lenet5, alexnet"),
    ([], "the following arguments are required: --model"),
    (["--model", "lenet5", "--machine", "local:x"], "--machine: 'local:x': expected local:<devices>"),
    (["--model", "lenet5", "--machine", "gpu:2"], "--machine: 'gpu:2': expected local:<devices>"),
    (["--model", "lenet5", "--machine", "simulated:4"], "expected simulated:<nodes>x<devices per node>"),
    (["--model", "lenet5", "--machine", "simulated:2x2:Z100"], "unknown device kind 'Z100'; known: P100"),
    (["--model", "lenet5", "--devices", "3"], "--devices 3 does not match --machine simulated:4x4 (16 devices)"),
    (["--model", "lenet5", "--batch-per-device", "0"], "--batch-per-device: expected a whole number of at least 1"),
    (["--model", "alexnet", "--image-size", "4", "--machine", "simulated:1x2"],
     "alexnet: image_size must be at least 8, got 4"),
    (["--model", "lenet5", "--out", "/no/such/folder/s.json"], "--out: cannot write '/no/such/folder/s.json'"),
    (["--model", "lenet5", "--cache", "/no/such/folder/c.json"], "--cache: cannot write"),
    (["--model", "lenet5", "--placement", "left"], "--placement: invalid choice: 'left'"),
    (["--model", "lenet5", "--machine", "simulated:1x2", "--measure"], "--measure times the candidates on a running"),
]


@pytest.mark.parametrize("args, said", SEARCH)
def test_search(capsys, args, said):
    assert said in one_line(capsys, ["search", *args])


PROFILE = [
    (["nosuch"], "model: unknown model 'nosuch'; known models: lenet5"),
    (["lenet5", "--strategy", "no-such-file.json"], "--strategy: 'no-such-file.json': expected data-parallel, search"),
    (["lenet5", "--steps", "0"], "--steps: expected a whole number of at least 1"),
    (["lenet5", "--warmup", "-1"], "--warmup: expected a whole number of at least 0"),
    (["lenet5", "--trace", "/no/such/folder/t.json"], "--trace: cannot write"),
    (["lenet5", "--png", "/no/such/folder/t.png"], "--png: cannot write"),
    (["lenet5", "--serve", "-5"], "--serve: expected a number of seconds of at least 0"),
    (["lenet5", "--classes", "0"], "--classes: expected a whole number of at least 1"),
    (["alexnet", "--image-size", "4"], "alexnet: image_size must be at least 8, got 4"),
]


@pytest.mark.parametrize("args, said", PROFILE)
def test_profile(capsys, args, said):
    assert said in one_line(capsys, ["profile", *args])


BENCH = [
    (["nosuch"], "name: invalid choice: 'nosuch'"),
    (["kernels", "--budget", "0"], "--budget: expected a positive number of seconds, got '0'"),
    (["kernels", "--budget", "soon"], "--budget: expected a positive number of seconds, got 'soon'"),
    (["kernels", "--out", __file__], "is a file, not a folder for results"),
]


@pytest.mark.parametrize("args, said", BENCH)
def test_bench(capsys, args, said):
    assert said in one_line(capsys, ["bench", *args])


def test_no_subcommand_or_an_unknown_one(capsys):
    assert "the following arguments are required" in one_line(capsys, [])
    assert "invalid choice: 'serch'" in one_line(capsys, ["serch"])


@pytest.mark.parametrize("argv", [["search", "--model", "nosuch"], ["run", "--epochs", "0"],
                                  ["profile", "lenet5", "--strategy", "none.json"], ["bench", "nosuch"]])
def test_as_a_user_runs_it_one_line_and_no_traceback(argv):
    done = subprocess.run([sys.executable, "-m", "taskrt", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"taskrt {argv[0]}: ")


def test_help_texts_say_what_each_command_does_and_its_defaults(capsys):
    for argv in (["--help"], ["run", "--help"], ["search", "--help"], ["profile", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    text = capsys.readouterr().out
    assert "later stages" not in text and "trains LeNet-5 on the bundled digits" in text
    assert "passes over the training images (default: 10)" in text and "(default: 64)" in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "`all` runs these" in text and "These run by name only" in text
