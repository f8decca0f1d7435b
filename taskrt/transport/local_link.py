"""Messages between workers over sockets of their own, without either worker's event loop.

Through distributed's comms a message between two programs goes from the program's thread to the
worker's event loop, through its comm layer, and on the receiving worker from its event loop to
the waiting program's thread: 1.2-1.6 ms one way on loopback on a 2-core host, most of it Python
on the two event loops.  Here the sending program writes the message to a Unix socket itself, and
a thread of the receiving worker that does nothing but read its sockets hands it to the mailbox:
two thread wake-ups and a socket, a few tenths of a millisecond.

Each worker listens on a Unix socket named after its own address (`path_of`), in a directory only
its user can enter (the same trust as the shared memory segments beside it, `taskrt.transport.shared_memory`),
so a sender on the same host finds it without asking.  On a cluster whose workers speak plain TCP
it also listens on a TCP port of its host, which a sender on another host asks it for once
(`Links(resolve=)`): the same trust as distributed's own TCP comms, which carry pickles too.  On a
TLS cluster messages between hosts stay on distributed's comms, and so do they where a socket
cannot be reached (`taskrt.transport.mailbox`).  A message is a pickle (protocol 5) with its arrays' buffers
sent beside it, not copied into it; large arrays between workers of one host go through shared
memory anyway.  Messages from one worker to another arrive in order.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
import threading

import numpy as np
from distributed.comm import get_address_host, parse_address

HEADER = struct.Struct("<QI")  # the pickle's bytes, how many buffers
LENGTH = struct.Struct("<Q")


def available() -> bool:
    return hasattr(socket, "AF_UNIX")


def directory() -> str:
    """This user's directory of sockets, made private on first use."""
    path = os.path.join(tempfile.gettempdir(), f"taskrt-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def path_of(address: str) -> str:
    """The socket of the worker at `address` (tcp://host:port): unique on a host while it lives."""
    _, location = parse_address(address)
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in location)
    return os.path.join(directory(), f"{name}.sock")


class Listener:
    """A worker's sockets: `deliver(message)` is called on a reading thread for each message.
    `tcp`: a TCP port too, on the worker's host (`port`), for workers on other hosts."""

    def __init__(self, address: str, deliver, tcp: bool = False):
        self.path, self.deliver = path_of(address), deliver
        try:
            os.unlink(self.path)  # left by a worker killed on this port before
        except FileNotFoundError:
            pass
        self.closed, self.connections, self.servers, self.port = False, [], [], None
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        self.servers.append(server)
        if tcp:
            host = get_address_host(address)
            server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            server.bind((host, 0))
            self.port = server.getsockname()[1]
            self.servers.append(server)
        for server in self.servers:
            server.listen(64)
            threading.Thread(target=self._accept, args=(server,), name="taskrt-link-accept", daemon=True).start()

    def _accept(self, server):
        while not self.closed:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections.append(conn)
            if self.closed:
                conn.close()
                return
            threading.Thread(target=self._read, args=(conn,), name="taskrt-link-read", daemon=True).start()

    def _read(self, conn):
        try:
            while True:
                head = _exactly(conn, HEADER.size)
                if head is None:
                    return
                size, count = HEADER.unpack(head)
                lengths = [LENGTH.unpack(_exactly(conn, LENGTH.size))[0] for _ in range(count)]
                data = _exactly(conn, size)
                buffers = []
                for length in lengths:
                    buffer = np.empty(length, dtype=np.uint8)  # aligned for any dtype
                    _fill(conn, memoryview(buffer))
                    buffers.append(buffer)
                self.deliver(pickle.loads(data, buffers=buffers))
        except OSError:  # the peer closed, or this listener did
            return
        finally:
            conn.close()
            if conn in self.connections:
                self.connections.remove(conn)

    def close(self):
        self.closed = True
        for server in self.servers:
            server.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Links:
    """A worker's connections to the sockets of other workers, one per peer: on its host their Unix
    sockets; elsewhere, where `resolve(address)` gives one, the TCP port it names."""

    def __init__(self, resolve=None):
        self.lock = threading.Lock()
        self.resolve = resolve
        self.peers: dict = {}  # (address, near) -> (socket, lock) or None where there is none to reach

    def send(self, address: str, message, near: bool = True) -> bool:
        """Send `message` to the worker at `address` (`near`: on this host, through its Unix socket;
        otherwise over TCP); False where it has no socket to reach."""
        with self.lock:
            if (address, near) not in self.peers:
                self.peers[address, near] = _connect(address) if near else self._connect_tcp(address)
            peer = self.peers[address, near]
        if peer is None:
            return False
        sock, lock = peer
        buffers = []
        data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        head = HEADER.pack(len(data), len(raws)) + b"".join(LENGTH.pack(r.nbytes) for r in raws)
        try:
            with lock:
                _send_all(sock, [head, data, *raws])
        except OSError:
            with self.lock:
                self.peers.pop((address, near), None)
            sock.close()
            raise
        return True

    def _connect_tcp(self, address: str):
        port = self.resolve(address) if self.resolve is not None else None
        if port is None:
            return None
        host = get_address_host(address)
        try:
            sock = socket.create_connection((host, port), timeout=10)
        except OSError:  # a firewall between the hosts: distributed's comms reach it
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, threading.Lock()

    def close(self):
        with self.lock:
            for peer in self.peers.values():
                if peer is not None:
                    peer[0].close()
            self.peers.clear()


def _connect(address: str):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path_of(address))
    except OSError:  # not on this host after all, or a worker without a listener
        sock.close()
        return None
    return sock, threading.Lock()


def _send_all(sock, pieces: list) -> None:
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _exactly(conn, n: int):
    """`n` bytes from `conn`; None at a clean end before any."""
    if n == 0:
        return b""
    buffer = bytearray(n)
    if not _fill(conn, memoryview(buffer), allow_end=True):
        return None
    return buffer


def _fill(conn, view, allow_end: bool = False) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if allow_end and got == 0:
                return False
            raise ConnectionResetError("the sending worker closed its socket mid-message")
        got += n
    return True
