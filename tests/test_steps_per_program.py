"""Several training steps to one program per device (`fit(steps_per_program=...)`): the same losses
and parameters as one step at a time, whatever the strategy; one Dask task per device for all of
them; the same bytes between devices; and programs cut where a checkpoint is due."""

from __future__ import annotations

import numpy as np
import pytest
from dask.utils import key_split
from distributed import get_task_stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import search
from taskrt.data.datasets import Synthetic
from taskrt.execution.program_executor import MAX_WINDOW, WINDOW_S, auto_steps_per_program, windowable
from taskrt.training.checkpoint import Checkpoints, read_checkpoint
from taskrt.training.fit import batches
from taskrt.training.trainer import Trainer
from tests.graphs import inception_block, mixed_lenet_strategy, small_lenet
from tests.strategies import random_strategies

HYPER = {"lr": 0.05, "momentum": 0.9, "dtype": "float64"}
GRAPHS = {"lenet5": small_lenet, "inception_block": lambda: inception_block(batch=4, channels=4, size=7)}


def lr_of(step, total):
    return 0.05 / (1 + step)  # a learning rate of its own for every step


def one_step_at_a_time(graph, strategy, machine, dataset, epochs, seed):
    """Losses and parameters of `fit`'s batches submitted one step at a time, each with its rate."""
    reference = Trainer(graph, strategy, machine, **HYPER)
    order = [i for _, i in batches(len(dataset), graph.inputs[0].shape[0], epochs, seed, True, "drop")]
    losses = []
    for step, indices in enumerate(order):
        reference.lr = lr_of(step, len(order))
        losses.append(reference.submit_from(dataset, indices).result())
    return losses, reference


def assert_same_parameters(a, b):
    for layer in a:
        for name in a[layer]:
            np.testing.assert_array_equal(a[layer][name], b[layer][name], err_msg=f"{layer}.{name}")


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_several_steps_to_a_program_compute_what_one_step_at_a_time_computes(machine4, name, data):
    """Random strategies: 7 steps as programs of 3, 3 and 1 steps give the losses, parameters and
    running statistics of the same steps one at a time, bit for bit, each step with its own rate."""
    graph = GRAPHS[name]()
    _, strategy = data.draw(random_strategies(graph, max_devices=machine4.num_devices))
    image = graph.inputs[0]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    dataset = Synthetic(29, shape=image.shape[1:], classes=classes, seed=data.draw(st.integers(0, 99)))
    trainer = Trainer(graph, strategy, machine4, **HYPER)
    history = trainer.fit(dataset, seed=2, progress=False, lr_schedule=lr_of, steps_per_program=3)
    losses, reference = one_step_at_a_time(graph, strategy, machine4, dataset, 1, 2)
    assert list(history.losses) == losses
    assert_same_parameters(trainer.parameters(), reference.parameters())
    assert_same_parameters(trainer.buffers(), reference.buffers())
    assert trainer.stats.measured_bytes == trainer.stats.planned_bytes
    assert trainer.steps_done == 7


def test_programs_of_several_steps_are_one_dask_task_per_device(machine4):
    """Six steps of a strategy with values between three devices, three to a program: two programs
    per device, each reading its steps' tiles as they start, where one step at a time has six
    programs and six reads."""
    graph = small_lenet()
    strategy = mixed_lenet_strategy(graph)
    dataset = Synthetic(24, shape=(1, 16, 16), classes=10, seed=0)
    counts = {}
    for per_program in (3, 1):
        trainer = Trainer(graph, strategy, machine4, **HYPER)
        assert windowable(trainer.plan)
        with get_task_stream(machine4.client) as stream:
            history = trainer.fit(dataset, seed=1, progress=False, steps_per_program=per_program)
        names = [key_split(task["key"]) for task in stream.data]
        counts[per_program] = {n: names.count(n) for n in set(names) if n.startswith("dev")}
        assert trainer.stats.wall_s > 0 and trainer.stats.measured_bytes == trainer.stats.planned_bytes
        counts[per_program, "losses"] = history.losses
    assert {"dev0-program", "dev1-program", "dev2-program", "dev0-read"} <= set(counts[1])
    assert counts[1] == {name: 6 for name in counts[1]}
    assert counts[3] == {name: 2 for name in counts[1] if name.endswith("-program")}  # reads inside them
    assert counts[3, "losses"] == counts[1, "losses"]


def test_steps_per_program_ends_a_program_where_a_checkpoint_is_due_and_checks_its_value(machine4, tmp_path):
    graph = small_lenet()
    trainer = Trainer(graph, mixed_lenet_strategy(graph), machine4, checkpoints=Checkpoints(tmp_path, every=5),
                      **HYPER)
    assert trainer.steps_per_program(10, 8) == 5  # steps 1..5: the checkpoint of step 5 is due
    trainer.steps_done = 5
    assert trainer.steps_per_program(10, 8) == 5 and trainer.steps_per_program(3, 8) == 3
    assert trainer.steps_per_program(1, 8) == 1
    assert trainer.steps_per_program(10, "auto") == 1  # no step timed yet
    trainer.steps_done = 0
    dataset = Synthetic(8, shape=(1, 16, 16), classes=10, seed=0)
    for bad in (0, MAX_WINDOW + 1, "all", True, 2.0):
        with pytest.raises(ValueError, match=rf"steps_per_program must be 'auto' or an int in \[1, {MAX_WINDOW}\]"):
            trainer.fit(dataset, steps_per_program=bad, progress=False)
    assert trainer.steps_done == 0
    by_task = Trainer(graph, mixed_lenet_strategy(graph), machine4, executor="tasks", **HYPER)
    with pytest.raises(ValueError, match="steps_per_program=3 needs the trainer's executor 'programs'.*'tasks'"):
        by_task.fit(dataset, steps_per_program=3, progress=False)
    with pytest.raises(ValueError, match="steps_per_program=2 needs"):
        by_task.evaluate(dataset, steps_per_program=2)
    assert by_task.steps_done == 0 and by_task.fit(dataset, progress=False).losses  # "auto": one step a program


def test_checkpoints_due_inside_a_window_are_written_at_their_step(machine4, tmp_path):
    """Nine steps, three to a program, a checkpoint every four: programs of steps 1-3, 4, 5-7, 8
    and 9, and the checkpoints of steps 4 and 8 hold the parameters one step at a time reaches there."""
    graph = small_lenet()
    strategy = mixed_lenet_strategy(graph)
    dataset = Synthetic(36, shape=(1, 16, 16), classes=10, seed=7)
    trainer = Trainer(graph, strategy, machine4, checkpoints=Checkpoints(tmp_path, every=4, keep=5), **HYPER)
    trainer.fit(dataset, seed=3, progress=False, steps_per_program=3)
    saved = trainer.checkpoints.saved()
    assert [read_checkpoint(p)[0]["steps_done"] for p in saved] == [4, 8]
    reference = Trainer(graph, strategy, machine4, **HYPER)
    order = [i for _, i in batches(36, 4, 1, 3, True, "drop")]
    for step, indices in enumerate(order[:8], start=1):
        reference.submit_from(dataset, indices).result()
        if step in (4, 8):
            _, params, _ = read_checkpoint(saved[step // 4 - 1])
            expected = reference.parameters()
            for layer in expected:
                for name in expected[layer]:
                    np.testing.assert_array_equal(params[layer][name], expected[layer][name], err_msg=f"{layer}.{name}")


@pytest.mark.parametrize("name", list(GRAPHS))
def test_evaluate_with_several_batches_to_a_program_gives_what_one_at_a_time_gives(machine4, name):
    """30 samples in batches of 4 (the last one partly filled), three to a program: the same mean loss
    and accuracy, bit for bit, as one batch to a program, the batch norms' running statistics read
    by every batch; three programs per device instead of eight."""
    graph = GRAPHS[name]()
    image = graph.inputs[0]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    strategy = mixed_lenet_strategy(graph) if name == "lenet5" else search.data_parallel(graph, machine4)
    trainer = Trainer(graph, strategy, machine4, **HYPER)
    trainer.fit(Synthetic(8, shape=image.shape[1:], classes=classes, seed=1), progress=False)  # running stats move
    test = Synthetic(30, shape=image.shape[1:], classes=classes, seed=2)
    results, programs = {}, {}
    for per_program in (3, 1):
        with get_task_stream(machine4.client) as stream:
            results[per_program] = trainer.evaluate(test, steps_per_program=per_program)
        names = [key_split(task["key"]) for task in stream.data]
        programs[per_program] = {n: names.count(n) for n in set(names) if n.endswith("-program")}
    assert results[3] == results[1] and results[3].samples == 30
    assert set(programs[3].values()) == {3} and set(programs[1].values()) == {8}


def test_auto_takes_about_a_quarter_of_a_second_of_steps_and_one_of_long_steps():
    assert auto_steps_per_program(WINDOW_S / 5) == 5
    assert auto_steps_per_program(WINDOW_S / 5 * 1.01) == 4  # never more than WINDOW_S's worth
    assert auto_steps_per_program(0.0) == auto_steps_per_program(1e-4) == MAX_WINDOW
    assert auto_steps_per_program(WINDOW_S * 0.9) == auto_steps_per_program(5.0) == 1
