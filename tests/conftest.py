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
    from taskrt.machine import Machine

    m = Machine.local(4, probe=False)
    yield m
    m.close()
