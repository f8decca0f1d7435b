"""Values sent straight from one device's program to another's, over distributed's comms.

Each worker has a mailbox (`Mailbox`, a worker plugin): a handler on the worker's server
('taskrt_put') puts each value that arrives under its key in the step, and the program that needs
it takes it from there, waiting if it has not arrived yet.  A program sends from its own thread:
the message is written by the worker's event loop, through the worker's pool of connections, as
a one-way message (no answer to wait for), so the program goes on computing meanwhile.  An array
of at least `shared_memory.MIN_BYTES` to a worker on the same host goes through shared memory and
the message says where (`taskrt.transport.shared_memory`): in place when a kernel made it there (the large
results on `ops.reuse`'s memory, which on a worker is shared), else copied there once; other
values travel as the message's own frames, not copied into it (distributed's serialization).  A
device array of at least that size to a GPU worker on the same host goes through CUDA IPC
(`taskrt.transport.gpu_ipc`): copied into a buffer of the sender's on the device, the message says which.

Each value that arrives is logged in the worker's `transfer_incoming_log` (and each sent in the
sender's `transfer_outgoing_log`) in Dask's own form, under its key: the bytes a step moved are
counted as the per-task executor's (`Executor.measured_bytes`), and a profiled step shows them.

A program never waits for a value that cannot come: a step's programs are aborted together
('taskrt_abort': by the client when it gives a step up, by a program of the step that failed),
and a program that has waited `WATCH_S` asks the scheduler whether the sender's worker is still
there, failing with `PeerLost` when it is not, so that the trainer's recovery takes over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict

from dask.sizeof import sizeof
from distributed import WorkerPlugin
from distributed.protocol import to_serialize

from taskrt.ops import reuse
from taskrt.transport import gpu_ipc, local_link, shared_memory

WATCH_S = 1.0  # a program waiting this long for a value asks whether its sender is still there
ASK_TIMEOUT_S = 10.0  # for the scheduler's answer to that
ABORTED_KEPT = 4096  # aborted steps remembered (a value that arrives for one later is dropped)


class ProgramAborted(RuntimeError):
    """The step this program belongs to was given up (by the client, or one of its programs failed)."""


class PeerLost(RuntimeError):
    """The worker a program waits for a value from is gone (or, for the state a program reads on its
    worker, the worker that held it)."""


class Mailbox(WorkerPlugin):
    """Worker plugin: the values sent to this worker's programs, and the handlers that receive them."""

    name = "taskrt-mailbox"

    def setup(self, worker):
        found = getattr(worker, "_taskrt_mailbox", None)
        if found is not None:  # registered again (another machine on the same cluster): keep what it holds
            self.__dict__.update(found.__dict__)
            return
        self.worker = worker
        self.loop = worker.loop.asyncio_loop
        self.values: dict = {}  # key -> (value, arrived at)
        self.by_tag: dict = {}  # step tag -> keys of its values here
        self.aborted: OrderedDict = OrderedDict()  # step tag -> why
        self.failed: OrderedDict = OrderedDict()  # key of a program that failed here -> its error
        self.cond = threading.Condition()
        # arrays to a worker on the same host through shared memory (taskrt.transport.shared_memory)
        self.shm_sender = shared_memory.Sender() if shared_memory.available() else None
        self.shm_receiver = shared_memory.Receiver()
        self.shm_blocks = None
        if self.shm_sender is not None:
            shared_memory.sweep()
            # large results made in shared memory, lent to workers on this host without a copy
            self.shm_blocks = shared_memory.Blocks()
            reuse.set_source(self.shm_blocks)
        # messages over sockets of their own, past both event loops (taskrt.transport.local_link): to workers on
        # this host over Unix sockets; to others over TCP where the cluster speaks plain TCP (not TLS)
        self.links, self.listener = None, None
        self.tcp = worker.address.startswith("tcp://")
        if local_link.available():
            try:
                self.listener = local_link.Listener(worker.address, self._delivered, tcp=self.tcp)
                self.links = local_link.Links(resolve=self._link_port)
            except OSError:  # no socket here (a path too long, no /tmp): distributed's comms only
                self.listener = None
        # device arrays to a GPU worker on the same host through CUDA IPC (taskrt.transport.gpu_ipc), made when needed
        self.gpu_sender, self.gpu_receiver, self.gpu_peers = None, None, {}
        worker.handlers["taskrt_link"] = self.link_port
        worker.handlers["taskrt_gpu"] = self.takes_gpu_ipc
        worker.handlers["taskrt_put"] = self.put
        worker.handlers["taskrt_abort"] = self.abort
        worker._taskrt_mailbox = self

    # ---- on the worker's event loop --------------------------------------------------------
    def teardown(self, worker):
        if getattr(self, "shm_sender", None) is not None:
            self.shm_sender.close()
        if getattr(self, "gpu_sender", None):
            self.gpu_sender.close()
        if getattr(self, "shm_blocks", None) is not None:
            previous = reuse.set_source(None)
            if previous is not self.shm_blocks:  # another's: left as it was
                reuse.set_source(previous)
            self.shm_blocks.close()
        if getattr(self, "listener", None) is not None:
            self.listener.close()
            self.links.close()

    def _delivered(self, message: dict):  # on a thread of the local link
        self.put(**message)

    def takes_gpu_ipc(self) -> bool:
        """Whether this worker takes device arrays through CUDA IPC (it computes on a GPU)."""
        from taskrt.gpu.device import is_gpu

        return is_gpu() and shared_memory.available()

    def link_port(self):
        """This worker's TCP port for messages from workers on other hosts (None: there is none)."""
        return self.listener.port if self.listener is not None else None

    def _ask(self, question, otherwise):
        """The answer of coroutine `question`, run on the worker's event loop from a program's
        thread; `otherwise` where none comes within ASK_TIMEOUT_S or it fails."""
        try:
            return asyncio.run_coroutine_threadsafe(question, self.loop).result(ASK_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (no answer: the caller's default)
            return otherwise

    def _takes_gpu_ipc(self, address: str) -> bool:  # on a program's thread, once per peer on this host
        if address not in self.gpu_peers:
            self.gpu_peers[address] = self.takes_gpu_ipc() and self._ask(self.worker.rpc(address).taskrt_gpu(), False)
        return self.gpu_peers[address]

    def _gpu_sender(self) -> gpu_ipc.Sender | None:
        with self.cond:
            if self.gpu_sender is None:
                try:
                    self.gpu_sender = gpu_ipc.Sender()
                except OSError:  # no room in /dev/shm for its flags: through host memory from now on
                    self.gpu_sender = False
            return self.gpu_sender or None

    def _link_port(self, address: str):  # on a program's thread, once per peer on another host
        # None from an older worker, or no answer: distributed's comms
        return self._ask(self.worker.rpc(address).taskrt_link(), None)

    def put(self, key=None, tag=None, value=None, sender=None, sent=None, slot=None, gpu_slot=None):
        if slot is not None:  # the array lies in the sender's shared memory
            value = self.shm_receiver.read(shared_memory.Slot.from_message(slot))
        elif gpu_slot is not None:  # in a buffer of the sender's on the GPU
            with self.cond:
                if self.gpu_receiver is None:
                    self.gpu_receiver = gpu_ipc.Receiver()
            value = self.gpu_receiver.read(gpu_ipc.Slot.from_message(gpu_slot))
        arrived = time.time()
        nbytes = sizeof(value)
        delay = self.worker.scheduler_delay
        # Dask reads its logs on the event loop: appended there (this runs on a local link's thread too)
        self.loop.call_soon_threadsafe(self.worker.transfer_incoming_log.append, {
            "start": sent + delay, "stop": arrived + delay, "middle": (sent + arrived) / 2 + delay,
            "duration": arrived - sent, "keys": {key: nbytes}, "total": nbytes,
            "bandwidth": nbytes / max(arrived - sent, 1e-9), "who": sender})
        with self.cond:
            if tag in self.aborted:
                return
            self.values[key] = value
            self.by_tag.setdefault(tag, set()).add(key)
            self.cond.notify_all()

    def abort(self, tags=(), reason="the step was given up"):
        with self.cond:
            for tag in tags:
                self.aborted[tag] = reason
                for key in self.by_tag.pop(tag, ()):
                    self.values.pop(key, None)
            while len(self.aborted) > ABORTED_KEPT:
                self.aborted.popitem(last=False)
            self.cond.notify_all()

    async def _write(self, address: str, msg: dict):
        pool = self.worker.rpc
        comm = await pool.connect(address)
        try:
            await comm.write(msg, on_error="raise")
        except BaseException:
            comm.abort()
            raise
        pool.reuse(address, comm)

    # ---- on a program's thread -------------------------------------------------------------
    def send(self, address: str, key, tag, value, link: str = "auto"):
        """Send `value` to the mailbox of the worker at `address`; returns a concurrent future of
        the message being written.  `link`: "auto" (a Unix socket on this host, TCP to another
        where the cluster speaks plain TCP, else distributed's comms), "tcp" (over TCP even on this
        host) or "comms" (distributed's)."""
        if link not in ("auto", "tcp", "comms"):
            raise ValueError(f"link must be 'auto', 'tcp' or 'comms', got {link!r}")
        nbytes = sizeof(value)
        start = time.time()
        msg = {"op": "taskrt_put", "reply": False, "key": key, "tag": tag, "sender": self.worker.address,
               "sent": start}
        slot, near = None, shared_memory.same_host(self.worker.address, address)
        if self.shm_sender is not None and near and shared_memory.eligible(value):
            # in place when it lies in this worker's shared blocks, else copied (None: no room, over TCP)
            slot = self.shm_blocks.lend(value, address) or self.shm_sender.write(value)
        if slot is not None:
            msg["slot"] = slot.as_message()
        elif near and gpu_ipc.eligible(value) and self._takes_gpu_ipc(address):
            sender = self._gpu_sender()
            gpu_slot = sender and sender.write(value if value.flags.c_contiguous else value.copy())
            if gpu_slot is not None:  # else every buffer is in use: through host memory
                msg["gpu_slot"] = gpu_slot.as_message()
        future = None
        # To another host only small values take the program's own TCP socket: a large one is written
        # by the event loop while the program computes on (it would hold the program for its bytes)
        if self.links is not None and link != "comms":
            if near and link == "auto":
                future = self._send_link(address, msg, value, True)
            elif self.tcp and (link == "tcp" or nbytes < shared_memory.MIN_BYTES):
                future = self._send_link(address, msg, value, False)
        if future is None:
            if "slot" not in msg and "gpu_slot" not in msg:
                msg["value"] = to_serialize(value)
            future = asyncio.run_coroutine_threadsafe(self._write(address, msg), self.loop)

        def logged(_, worker=self.worker):
            stop = time.time()
            self.loop.call_soon_threadsafe(worker.transfer_outgoing_log.append, {
                "start": start + worker.scheduler_delay, "stop": stop + worker.scheduler_delay,
                "middle": (start + stop) / 2 + worker.scheduler_delay, "duration": stop - start, "who": address,
                "keys": {key: nbytes}, "total": nbytes, "compressed": 0,
                "bandwidth": nbytes / max(stop - start, 1e-9)})

        future.add_done_callback(logged)
        return future

    def _send_link(self, address, msg, value, near: bool):
        """`msg` through the link (`near`: a Unix socket, else TCP), written from this thread: a done
        future, or None where the worker at `address` has no socket to reach."""
        message = {k: v for k, v in msg.items() if k not in ("op", "reply")}
        if "slot" not in message and "gpu_slot" not in message:
            message["value"] = value
        future = concurrent.futures.Future()
        try:
            if not self.links.send(address, message, near):
                return None
        except OSError as error:
            future.set_exception(OSError(f"could not send {msg['key']} to the worker at {address}: {error}"))
            return future
        future.set_result(None)
        return future

    def take(self, key, tag, sender: str):
        """The value sent under `key`, once it is here; ProgramAborted if step `tag` is given up
        meanwhile, PeerLost if the worker at `sender` is gone."""
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: key in self.values or tag in self.aborted, WATCH_S):
                    if key in self.values:
                        value, keys = self.values.pop(key), self.by_tag.get(tag)
                        if keys is not None:
                            keys.discard(key)
                            if not keys:
                                del self.by_tag[tag]
                        return value
                    raise ProgramAborted(f"step {tag}: {self.aborted[tag]}")
            if not self._alive(sender):
                if self.shm_blocks is not None:  # what it was lent here is read by no one now
                    self.shm_blocks.forget(sender)
                raise PeerLost(f"the worker at {sender} is gone: its value {key} never came")

    def still_coming(self, key) -> bool:
        """Whether the scheduler still has task `key` to run here (sent to this worker but not yet
        heard of, or not yet placed); False where it cannot say."""
        async def ask():
            scheduler = self.worker.scheduler
            state = (await scheduler.get_task_status(keys=[key])).get(key)
            if state == "processing":
                here = await scheduler.processing(workers=[self.worker.address])
                return key in here.get(self.worker.address, ())
            return state in ("waiting", "queued", "no-worker")

        return self._ask(ask(), False)  # no answer from the scheduler: the program before counts as lost

    def _alive(self, address: str) -> bool:
        answer = self._ask(self.worker.scheduler.ncores(workers=[address]), None)
        return answer is None or address in answer  # no answer from the scheduler: wait on, the client decides

    def program_failed(self, key, error: BaseException):
        """Keep the error of the program `key` for the device's next program, which reads its result
        here (taskrt.execution.program_executor) and fails with it, as Dask fails a task's dependents."""
        with self.cond:
            self.failed[key] = error
            while len(self.failed) > ABORTED_KEPT:
                self.failed.popitem(last=False)

    def forget(self, tag):
        """Drop step `tag`'s values still here and any that come later (its program failed)."""
        self.abort([tag], "a program of the step failed")

    def tell_peers(self, addresses, tags, reason: str):
        """Abort steps `tags` on the workers at `addresses` (their program here failed), without waiting."""
        msg = {"op": "taskrt_abort", "reply": False, "tags": list(tags), "reason": reason}
        for address in addresses:
            asyncio.run_coroutine_threadsafe(self._write(address, dict(msg)), self.loop)


def mailbox_of(worker) -> Mailbox:
    found = getattr(worker, "_taskrt_mailbox", None)
    if found is None:
        raise RuntimeError("this worker has no taskrt mailbox: use a Machine (it registers "
                           "taskrt.transport.mailbox.Mailbox)")
    return found


async def abort_on(client, addresses, tags, reason: str) -> None:
    """Abort steps `tags` on the workers at `addresses` (their programs fail with ProgramAborted);
    a worker that does not answer is skipped."""
    async def one(address):
        try:
            await asyncio.wait_for(client.rpc(address).taskrt_abort(tags=list(tags), reason=reason), ASK_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (a lost worker runs no program)
            pass

    await asyncio.gather(*[one(a) for a in addresses])
