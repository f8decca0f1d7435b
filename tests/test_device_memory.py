"""What a CPU worker's device says it can hold: Dask's memory limit less its own footprint and the
freed arrays it keeps for reuse."""

import os

import dask
import pytest

import taskrt as tr
from taskrt.machines.machine import usable_memory


def test_usable_memory_is_the_limit_below_the_pause_less_the_process():
    with dask.config.set({"distributed.worker.memory.pause": 0.8}):
        assert usable_memory(1000, 100) == pytest.approx(800 - 100 - 250 - 125)
        assert usable_memory(1000, 900) == 0.0
    with dask.config.set({"distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95}):
        assert usable_memory(1000, 100) == pytest.approx(950 - 100 - 250 - 125)  # where the nanny ends it
    assert usable_memory(None, 100) is None
    assert usable_memory(0, 100) is None


def test_a_local_worker_reports_its_limit_less_its_own_footprint():
    with tr.Machine.local(1, memory_limit="1GiB", probe=False) as machine:
        memory = machine.devices[0].memory
        # no pause, which would stall training for good: the memory a worker holds is not freed by one
        pauses = machine.client.run(lambda dask_worker: dask_worker.memory_manager.memory_pause_fraction)
        trims = machine.client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    assert 0.3 * 2**30 < memory < 0.7 * 2**30
    assert list(pauses.values()) == [False]
    assert list(trims.values()) == [str(2**30 // 8)]  # glibc keeps no more free heap than the memory leaves room for


def test_the_free_heap_kept_is_capped_by_a_memory_limit_only():
    from taskrt.machines.local_cluster import kept_heap

    assert kept_heap("1GiB") == 2**27 and kept_heap(2**34) == 2**30 and kept_heap(None) == 2**30
