import random

import dask.sizeof
import distributed.utils_comm
import pytest

# The scheduler of a local cluster runs in this process, on a thread of its own, and draws from
# the `random` module (which worker to gather a key from; which items of a long list to size).
# Hypothesis sees the module's state change during a draw and warns that a strategy uses it:
# Dask's draws get generators of their own here, so a draw sees only its own.
distributed.utils_comm.random = random.Random(0)
dask.sizeof.random = random.Random(0)


@pytest.fixture(scope="session")
def machine4():
    """Four single-threaded local workers, shared by the tests that need a cluster."""
    from taskrt.machines.machine import Machine

    m = Machine.local(4, probe=False)
    yield m
    m.close()


@pytest.fixture(scope="session")
def calibrated4(machine4, tmp_path_factory):
    """A cost cache holding `machine4`'s runtime calibration alone, measured once for the session
    (about 10 s on two cores), without the fits to training steps a CostModel adds (a minute and a
    half more; tests/test_step_costs.py tests those): the models these tests build take it as it is."""
    from taskrt.search.cost_cache import CostCache
    from taskrt.search.runtime_costs import CALIBRATION_FORMAT, calibration_key

    cache = CostCache(tmp_path_factory.mktemp("calibration") / "costs.json")
    cache.data["overhead"][calibration_key(machine4)] = {**machine4.calibrate(), "format": CALIBRATION_FORMAT}
    cache.save()
    return cache.path


@pytest.fixture
def cost_cache4(calibrated4, tmp_path):
    """A fresh cost cache for `machine4` with its calibration already in it and no part timings:
    for tests of part timings, searches and simulations rather than of the calibration."""
    import shutil

    path = tmp_path / "costs.json"
    shutil.copy(calibrated4, path)
    return path
