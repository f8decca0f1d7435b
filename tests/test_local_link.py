"""taskrt.transport.local_link: messages between workers on one host over Unix sockets."""

import queue

import numpy as np
import pytest

from taskrt.transport import local_link

pytestmark = pytest.mark.skipif(not local_link.available(), reason="no Unix sockets here")


@pytest.fixture
def listener():
    got = queue.Queue()
    listener = local_link.Listener("tcp://127.0.0.1:1", got.put)
    yield listener, got
    listener.close()


def test_messages_arrive_whole_and_in_order(listener):
    _, got = listener
    links = local_link.Links()
    sent = [{"key": ("x", i), "value": np.arange(n, dtype=dtype).reshape(-1, 1)}
            for i, (n, dtype) in enumerate([(0, "f4"), (1, "f8"), (1000, "i8"), (300_000, "f4"), (7, "u1")])]
    sent.append({"key": "plain", "value": {"lr": 0.1, "shape": (2, 3)}})
    for message in sent:
        assert links.send("tcp://127.0.0.1:1", message)
    for message in sent:
        received = got.get(timeout=5)
        assert received["key"] == message["key"]
        if isinstance(message["value"], np.ndarray):
            np.testing.assert_array_equal(received["value"], message["value"])
            assert received["value"].dtype == message["value"].dtype
            assert received["value"].ctypes.data % 16 == 0  # aligned, as kernels expect
        else:
            assert received["value"] == message["value"]
    links.close()


def test_a_worker_without_a_socket_is_not_reached():
    links = local_link.Links()
    assert links.send("tcp://127.0.0.1:2", {"key": 1}) is False  # the caller uses distributed's comms
    links.close()


def test_a_closed_listener_fails_the_send(listener):
    server, got = listener
    links = local_link.Links()
    assert links.send("tcp://127.0.0.1:1", {"key": 0})
    assert got.get(timeout=5) == {"key": 0}
    server.close()
    with pytest.raises(OSError):
        for _ in range(100):  # the first writes may still land in the socket's buffer
            links.send("tcp://127.0.0.1:1", {"key": 1, "value": np.zeros(100_000)})
    links.close()


def test_socket_paths_are_private_and_distinct():
    import os
    import stat

    a, b = local_link.path_of("tcp://127.0.0.1:1000"), local_link.path_of("tcp://127.0.0.1:1001")
    assert a != b and os.path.dirname(a) == local_link.directory()
    assert stat.S_IMODE(os.stat(local_link.directory()).st_mode) == 0o700
    assert local_link.path_of("tls://[::1]:5") != local_link.path_of("tls://[::1]:6")


def test_workers_on_other_hosts_are_reached_over_tcp_where_they_name_a_port():
    got = queue.Queue()
    listener = local_link.Listener("tcp://127.0.0.1:3", got.put, tcp=True)
    try:
        assert listener.port
        links = local_link.Links(resolve=lambda address: listener.port)
        value = np.arange(1000.0)
        assert links.send("tcp://127.0.0.1:3", {"key": "far", "value": value}, near=False)
        received = got.get(timeout=5)
        assert received["key"] == "far"
        np.testing.assert_array_equal(received["value"], value)
        assert local_link.Links(resolve=lambda address: None).send("tcp://127.0.0.1:3", {}, near=False) is False
        links.close()
    finally:
        listener.close()


def test_the_mailbox_rejects_an_unknown_way():
    from taskrt.transport.mailbox import Mailbox

    with pytest.raises(ValueError, match="'auto', 'tcp' or 'comms'"):
        Mailbox().send("tcp://127.0.0.1:4", "k", "1", np.zeros(1), link="udp")
