"""The overhead benchmark's reference: Dask running a step's own task graph (bench.overhead.dask_replica)
must run every plan task once, on the plan's device, for at least the task's measured compute time."""

from __future__ import annotations

import time

from taskrt import models
from taskrt.bench.measure import compute_times
from taskrt.bench.overhead import dask_replica, data_parallel
from taskrt.execution.executor import step_key
from taskrt.machines.machine import Machine
from taskrt.search.measured import random_batch
from taskrt.training.trainer import Trainer


def test_the_dask_replica_runs_the_plans_tasks_on_their_devices_for_their_times():
    graph = models.lenet5(batch=8)
    with Machine.local(2, probe=False) as machine:
        trainer = Trainer(graph, data_parallel(graph, 2), machine, fused=False)
        x, y = random_batch(graph)
        machine.client.get_task_stream()  # the first call starts the scheduler's recording
        trainer.step(x, y)
        since = time.time()
        future = trainer.submit(x, y)
        future.result()
        run = future.run
        times = compute_times(machine.client, run.keys, since - 1)
        assert {step_key(t.key, run.tag) for t in run.plan.tasks} <= set(times)
        kernel, _ = run.plan.critical_path(lambda t: times[step_key(t.key, run.tag)])
        replica_since = time.time()
        wall, replica_kernel = dask_replica(machine, run.plan, times, run.tag)
        address = machine.addresses()
        ran = {}
        for record in machine.client.get_task_stream(start=replica_since - 1):
            if "replica" in str(record["key"]):
                ran[record["key"]] = record["worker"]
        assert len(ran) == len(run.plan.tasks)
        by_key = {(f"{t.key[0]}-replica-{run.tag}", *t.key[1:]): t.device for t in run.plan.tasks}
        assert {key: address[by_key[key]] for key in ran} == ran
        assert kernel <= replica_kernel < wall
