import pytest


@pytest.fixture(scope="session")
def machine4():
    """Four single-threaded local workers, shared by the tests that need a cluster."""
    from taskrt.machine import Machine

    m = Machine.local(4, probe=False)
    yield m
    m.close()
