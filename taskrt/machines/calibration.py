"""What the runtime costs on a cluster, measured (`Machine.calibrate`): Dask's time per task and
per dependent hop, a graph's submission and intake, scatters, the client's bandwidth, the end of
a run to the client, a device's memory bandwidth, the processor time the runtime itself
spends per task, message and byte, and the scheduler's own time per task; for the programs
executor (taskrt.execution.program_executor), a value's hop from one program to another through the
mailboxes, its processor time, and a program's own time per task.  The cost model prices the runtime with it
(search.runtime_costs); the functions whose names start with an underscore run on workers."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from operator import getitem

import numpy as np

from taskrt.machines.link_probe import _payload, _touch

INLINE_PROBE_BYTES = 2**20  # the most a graph carries (taskrt.execution.executor.INLINE_DATA_BYTES)
# Hops are timed between tasks that compute this long (a short kernel): a worker's event loop then
# shares the processor with the task, as in a step.  Between no-op tasks a hop cost 0.1-0.8 ms
# less on local(2), on one device and between two (three rounds of chains of 50).
HOP_WORK_S = 0.002


def calibrate(machine) -> dict:
    """What the runtime costs on this cluster, measured: Dask's time per task and per dependent
    hop (`task_overhead`), graph submission per task, from sending a one-task graph to its task
    starting (`first_start_s`), asking the scheduler for the workers (`check_s`, as every step
    does first), one scatter call, the client's
    bandwidth to a worker, directly and carried in a graph through the scheduler, the end of
    a run to the client, and a device's memory bandwidth (an array copy)."""

    import dask

    out = task_overhead(machine)
    client, tag = machine.client, uuid.uuid4().hex[:8]
    address = machine.addresses()
    submit = []
    for r in range(3):
        dsk = {(f"taskrt-submit-{tag}-{r}", i): (_noop,) for i in range(200)}
        with dask.annotate(resources={machine.tag(0): 1}):
            start = time.perf_counter()
            futures = client.get(dsk, list(dsk), sync=False)
            submit.append((time.perf_counter() - start) / len(dsk))
        client.gather(futures)
        del futures
    small, large = np.zeros(8), np.zeros(4 * 2**20 // 8)
    scatter, big = [], []
    for _ in range(5):
        start = time.perf_counter()
        [f] = client.scatter([small], workers=[address[0]], hash=False, direct=True)
        scatter.append(time.perf_counter() - start)
        start = time.perf_counter()
        [g] = client.scatter([large], workers=[address[0]], hash=False, direct=True)
        big.append(time.perf_counter() - start)
        del f, g
    inline, first = {8: [], INLINE_PROBE_BYTES: []}, []
    for r in range(7):  # a graph carrying a step's data (taskrt.execution.executor.INLINE_DATA_BYTES), small and not
        for nbytes in inline:
            key = (f"taskrt-inline-{tag}-{r}-{nbytes}", 0)
            with dask.annotate(resources={machine.tag(0): 1}):
                sent, start = time.time(), time.perf_counter()
                [future] = client.get({key: (_started, np.zeros(nbytes // 8))}, [key], sync=False)
                started = future.result()
            inline[nbytes].append(time.perf_counter() - start)
            if nbytes == 8:  # the least a step waits for its first task (the hosts' clocks agree)
                first.append(started - sent)
            del future
    from taskrt.transport.worker_reads import ask

    answer = []
    for r in range(5):  # a step's reads on its workers (taskrt.transport.worker_reads): end of a run to the client
        key = (f"taskrt-answer-{tag}-{r}", 0)
        with dask.annotate(resources={machine.tag(0): 1}):
            [future] = client.get({key: (_sleep_until_done, 0.02)}, [key], sync=False)
        ended = client.sync(ask, client, address[0], [(key, None, key, 0)], 5.0)
        if ended is not None:
            answer.append(time.time() - ended[0])
        del future
    check = []
    for _ in range(7):  # a step first asks which devices have a worker (Trainer._check_state)
        start = time.perf_counter()
        machine.live_devices()
        check.append(time.perf_counter() - start)
    out.update(program_costs(machine))
    copy = client.run(_copy_rate, workers=[address[0]])[address[0]]
    fresh = client.run(_copy_rate, fresh=True, workers=[address[0]])[address[0]]
    out.update(cpu_costs(machine))
    out.update({
        "submit_per_task_s": statistics.median(submit),
        "scatter_s": statistics.median(scatter),
        "client_bandwidth": large.nbytes / max(statistics.median(big) - statistics.median(scatter), 1e-9),
        "memory_bandwidth": copy,
        "fresh_copy_bandwidth": fresh,
        "answer_s": statistics.median(answer) if answer else out["per_hop_s"],
        "first_start_s": max(statistics.median(first), 0.0),  # a one-task graph sent: its task starts
        "check_s": statistics.median(check),  # one question to the scheduler: the workers now
        # what carrying a byte in a graph adds (on a quiet local host: below the noise, 0)
        "inline_per_byte_s": max(statistics.median(inline[INLINE_PROBE_BYTES]) - statistics.median(inline[8]),
                                 0.0) / INLINE_PROBE_BYTES,
    })
    return out


def cpu_costs(machine, tasks: int = 300, nbytes: int = 16 * 2**20, messages: int = 4, small: int = 50) -> dict:
    """Processor time the runtime itself spends (workers, and this process where the local
    scheduler runs): per task, per message between two devices (beyond the task reading it;
    `small` messages of 1 KiB) and per byte moved between them (`messages` of `nbytes`).  On
    a machine whose devices share few cores this time competes with the kernels."""

    import dask

    client, tag = machine.client, uuid.uuid4().hex[:8]
    address = machine.addresses()

    def total():
        return sum(client.run(_process_cpu).values()) + _process_cpu()

    with dask.annotate(resources={machine.tag(0): 1}):
        dsk = {(f"taskrt-cpu-{tag}", i): (_noop,) for i in range(tasks)}
        before, scheduler_before = total(), client.run_on_scheduler(_process_cpu)
        client.gather(client.get(dsk, list(dsk), sync=False))
        per_task = (total() - before) / tasks
        # the scheduler's process (on Machine.local, this one: the client's share of a task counts too)
        scheduler_per_task = (client.run_on_scheduler(_process_cpu) - scheduler_before) / tasks
    per_byte = per_message = 0.0
    if machine.num_devices > 1:
        per_message = cpu_per_message(machine, total, small)
        rounds = []
        for r in range(3):  # the first round's receiver takes its first large messages: the median counts
            # the payloads are made first: filling them is a kernel's work, not moving bytes
            payloads = [client.submit(_payload, nbytes, key=f"taskrt-cpu-bytes-{tag}-{r}-{i}",
                                      workers=[address[0]], allow_other_workers=False, pure=False)
                        for i in range(messages)]
            client.gather([client.submit(_touch, p, workers=[address[0]], allow_other_workers=False, pure=False)
                           for p in payloads])
            time.sleep(0.05)
            before = total()
            for payload in payloads:
                client.submit(_touch, payload, workers=[address[1]], allow_other_workers=False,
                              pure=False).result()
            time.sleep(0.05)
            # the touch tasks are tasks, and each brings one message: both are counted apart
            rounds.append(max((total() - before) - messages * (per_task + per_message), 0.0) / (messages * nbytes))
            del payloads, payload
        per_byte = statistics.median(rounds)
    return {"cpu_per_task_s": per_task, "cpu_per_message_s": per_message, "cpu_per_byte_s": per_byte,
            "cores": effective_cores(machine), "scheduler_per_task_s": scheduler_per_task}


LARGE_MESSAGE_BYTES = 32 * 2**20


def program_costs(machine, rounds: int = 200, tasks: int = 2000, repeats: int = 5, large_rounds: int = 5) -> dict:
    """What the programs executor (taskrt.execution.program_executor) costs beyond kernels and links: a
    small value's hop from one device's program to another's (`program_hop_s`: half the median
    round trip of a ping-pong through the mailboxes, taskrt.transport.mailbox), the processor time of all
    processes per such message (`program_cpu_per_message_s`), and a program's own time per task
    (`program_task_s`: a run of no-op tasks, as a program runs a device's tasks); on one host, a
    32 MiB value's rate between two programs (`program_bandwidth`), the processor time per byte
    taken as the sender's copy (`program_cpu_per_byte_s`).  One device: no hop to measure, only the time per task."""
    client, address = machine.client, machine.addresses()
    out = {"program_task_s": statistics.median(
        client.submit(_run_seconds, tasks, repeats, workers=[address[0]], allow_other_workers=False,
                      pure=False).result())}
    if machine.num_devices < 2:
        return out

    def total():
        return sum(client.run(_process_cpu).values()) + _process_cpu()

    warm, tag = (f"taskrt-{what}-{uuid.uuid4().hex[:8]}" for what in ("warm", "hop"))
    client.gather([client.submit(_ping_pong, role, address[1 - i], 5, 8, warm, workers=[address[i]],
                                 allow_other_workers=False, pure=False) for i, role in enumerate("ab")])
    before = total()
    a, b = (client.submit(_ping_pong, role, address[1 - i], rounds, 8, tag, workers=[address[i]],
                          allow_other_workers=False, pure=False) for i, role in enumerate("ab"))
    times = a.result()
    b.result()
    cpu = total() - before
    out["program_hop_s"] = statistics.median(times) / 2
    # both programs' threads wait without using the processor: what is counted is the messages'
    out["program_cpu_per_message_s"] = max(cpu, 0.0) / (2 * rounds)
    # the same as messages between hosts go: over TCP sockets of the programs' own, or on a TLS
    # cluster over distributed's comms (on one host: on loopback)
    tag = f"taskrt-remote-{uuid.uuid4().hex[:8]}"
    between = "tcp" if address[0].startswith("tcp://") else "comms"
    a, b = (client.submit(_ping_pong, role, address[1 - i], rounds, 8, tag, between, workers=[address[i]],
                          allow_other_workers=False, pure=False) for i, role in enumerate("ab"))
    out["program_remote_hop_s"] = statistics.median(a.result()) / 2
    b.result()
    if len({d.node for d in machine.devices[:2]}) == 1:
        # a large value between two programs on one host (through shared memory where there is some)
        large, tag = LARGE_MESSAGE_BYTES, f"taskrt-large-{uuid.uuid4().hex[:8]}"
        a, b = (client.submit(_ping_pong, role, address[1 - i], large_rounds, large, tag, workers=[address[i]],
                              allow_other_workers=False, pure=False) for i, role in enumerate("ab"))
        times = a.result()[1:]  # the first fills the sender's segment for the first time
        b.result()
        one_way = max(statistics.median(times) - out["program_hop_s"], 1e-9)  # the answer is small
        out["program_bandwidth"] = large / one_way
        # its time is the sender's copy, on the sender's core (too short for the processor clock's
        # 10 ms ticks to time apart from the messages')
        out["program_cpu_per_byte_s"] = 1.0 / out["program_bandwidth"]
    return out


def _ping_pong(role: str, peer: str, rounds: int, nbytes: int, tag: str, link: str = "auto",
               reused: bool = False, ipc: bool = True):
    """On a worker: `rounds` round trips with the program at `peer`, through the mailboxes
    (taskrt.transport.mailbox): "a" sends `nbytes` and waits for a one-byte answer, "b" answers once the value
    is on its device; "a" returns the seconds of each round trip, "b" whether the first value
    arrived equal and whether every one came through CUDA IPC.  `link`: as `Mailbox.send`'s.
    `reused`: the value made on `ops.reuse`'s memory, as kernels make weights and gradients (on one
    host: lent, not copied); else on the heap, as other values are.  On a GPU worker the value is a
    device array, as programs exchange there (`ipc` False: through host memory, as without
    `taskrt.transport.gpu_ipc`)."""
    from distributed import get_worker

    from taskrt.gpu.device import is_gpu, synchronize, to_device
    from taskrt.ops import reuse
    from taskrt.transport.mailbox import mailbox_of

    box = mailbox_of(get_worker())
    if ipc:
        box.gpu_peers.pop(peer, None)  # asked again
    else:
        box.gpu_peers[peer] = False
    shape, ack = (max(nbytes // 8, 1),), np.zeros(1, dtype=np.uint8)
    payload = reuse.empty(shape, np.float64) if reused else np.empty(shape)
    payload[:] = 1.0
    if is_gpu():
        payload = to_device(payload)
        synchronize()

    def through_ipc() -> int:
        return box.gpu_receiver.reads if box.gpu_receiver is not None else 0

    times, equal, before = [], None, through_ipc()
    for i in range(rounds):
        if role == "a":
            start = time.perf_counter()
            box.send(peer, ("ping", tag, i), tag, payload, link).result()
            box.take(("pong", tag, i), tag, peer)
            times.append(time.perf_counter() - start)
        else:
            got = box.take(("ping", tag, i), tag, peer)
            synchronize()  # a device array's copy is queued on the device: it is there now
            if equal is None:
                equal = bool((got == 1.0).all()) and got.shape == shape
            box.send(peer, ("pong", tag, i), tag, ack, link).result()
    return times if role == "a" else {"equal": equal, "ipc": through_ipc() - before == rounds}


def _run_seconds(tasks: int, repeats: int) -> list:
    """Seconds per task of a run of `tasks` no-op tasks, each reading the one before (as a program
    runs a device's tasks: taskrt.planning.fusion.FusedRun), `repeats` times after one untimed run."""
    from taskrt.planning.fusion import FusedRun

    steps = ((0, _noop, ()),) + tuple((i, _noop, (("own", i - 1),)) for i in range(1, tasks))
    run = FusedRun(steps, (tasks - 1,))
    out = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        out.append((time.perf_counter() - start) / tasks)
    return out[1:]


def cpu_per_message(machine, total, count: int, rounds: int = 3) -> float:
    """Processor time of one small message between devices 0 and 1: tasks reading small values
    made on device 0, run on device 1 against the same tasks run on device 0 (median of rounds)."""
    client, address = machine.client, machine.addresses()

    def touch_all(values, device):
        before = total()
        client.gather([client.submit(_touch, v, workers=[address[device]], allow_other_workers=False,
                                     pure=False) for v in values])
        time.sleep(0.05)
        return total() - before

    estimates = []
    for _ in range(rounds):
        values = [client.submit(_payload, 1024, workers=[address[0]], allow_other_workers=False, pure=False)
                  for _ in range(count)]
        client.gather(values)
        local = touch_all(values, 0)
        remote = touch_all(values, 1)
        estimates.append(max(remote - local, 0.0) / count)
        del values
    return statistics.median(estimates)


def effective_cores(machine, repeats: int = 5, rounds: int = 3) -> float:
    """How many kernels the host really runs at once: the same convolution timed alone on one
    device, then on min(devices, cores) devices at once; the sum of the speeds relative to
    alone (two virtual cores may not give two cores' worth of work).  Alone and together
    alternate for a few rounds and the median counts, as the machine's speed drifts."""

    cores = os.cpu_count() or 1
    k = min(machine.num_devices, cores)
    if k < 2:
        return float(cores)
    client = machine.client
    address = machine.addresses()

    def timed(devices):
        return client.gather([client.submit(_conv_seconds, repeats, workers=[address[i]],
                                            allow_other_workers=False, pure=False) for i in devices])

    estimates = []
    for _ in range(rounds):
        [alone] = timed([0])
        together = timed(range(k))
        estimates.append(cores - k + sum(alone / t for t in together))
    return float(min(cores, statistics.median(estimates)))


def task_overhead(machine, independent: int = 200, chain: int = 50, repeats: int = 3) -> dict:
    """Dask's own cost on this cluster, measured with trivial tasks pinned to device 0: seconds
    per independent no-op task (throughput), per dependent hop (a task waiting on the one
    before; between tasks that compute for HOP_WORK_S, the work not counted),
    and per export (taking a value out of a tuple, as after a fused run); with two devices or
    more, per dependent hop that alternates between devices 0 and 1 (`per_cross_hop_s`)."""

    import dask

    from taskrt.machines.worker_setup import INLINE

    client, tag = machine.client, uuid.uuid4().hex[:8]
    per_task, per_hop, per_export = [], [], []
    with dask.annotate(resources={machine.tag(0): 1}):
        for r in range(repeats):
            dsk = {(f"taskrt-noop-{tag}-{r}", i): (_noop,) for i in range(independent)}
            start = time.perf_counter()
            client.gather(client.get(dsk, list(dsk), sync=False))
            per_task.append((time.perf_counter() - start) / independent)
            per_hop.append(hop_seconds(machine, f"taskrt-chain-{tag}-{r}", chain, lambda i: 0))
            # a fused run's exports: values taken out of one result, on the workers' event loop
            name = f"taskrt-export-{tag}-{r}"
            dsk = {(name, -1): (_numbers, independent), **{(name, i): (getitem, (name, -1), i)
                                                             for i in range(independent)}}
            with dask.annotate(executor=lambda key: INLINE if key[1] >= 0 else "default"):
                start = time.perf_counter()
                client.gather(client.get(dsk, [(name, i) for i in range(independent)], sync=False))
            per_export.append((time.perf_counter() - start) / independent)
    out = {"per_task_s": statistics.median(per_task), "per_hop_s": statistics.median(per_hop),
           "export_s": statistics.median(per_export)}
    if machine.num_devices > 1:  # a hop to another device: its worker also fetches the value
        out["per_cross_hop_s"] = statistics.median(
            hop_seconds(machine, f"taskrt-cross-{tag}-{r}", chain, lambda i: i % 2) for r in range(repeats))
    return out


def hop_seconds(machine, name: str, chain: int, device_of) -> float:
    """Seconds per hop of a chain of `chain` tasks, task i on device `device_of(i)`, each
    computing HOP_WORK_S (not counted)."""
    import dask

    dsk = {(name, 0): (_compute, HOP_WORK_S),
           **{(name, i): (_compute, HOP_WORK_S, (name, i - 1)) for i in range(1, chain)}}
    tags = {key: {machine.tag(device_of(key[1])): 1} for key in dsk}
    with dask.annotate(resources=lambda key: tags[key]):
        start = time.perf_counter()
        machine.client.gather(machine.client.get(dsk, [(name, chain - 1)], sync=False))
    return (time.perf_counter() - start) / chain - HOP_WORK_S


def _noop(*args):
    return None


def _compute(seconds, *args):
    """Keep the processor busy for `seconds` (small matrix products, as kernels do)."""
    a = np.full((64, 64), 0.01, dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.tanh(a @ a)


def _started(*args):
    """The time the task starts."""
    return time.time()


def _numbers(count):
    return tuple(range(count))


def _sleep_until_done(seconds):
    """Sleep, then return the time the task ends."""
    time.sleep(seconds)
    return time.time()


def _conv_seconds(repeats):
    """Median seconds of a mid-sized convolution's forward and backward (a typical kernel)."""

    from taskrt.ops import Conv2d
    from taskrt.ops.rect import Rect

    op = Conv2d(((8, 64, 28, 28),), 64, (3, 3), (1, 1), (1, 1), "relu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(op.in_shapes[0]).astype(np.float32)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in op.param_shapes().items()}
    out = Rect.full(op.out_shape)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = op.forward([x], params, out)
        op.backward(y, [x], y, params, out, [True])
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _process_cpu(dask_worker=None, dask_scheduler=None) -> float:
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def _copy_rate(dask_worker=None, fresh=False, nbytes=32 * 2**20, repeats=5):
    """Bytes per second of an array copy on this worker's device: into a reused buffer (read and
    write counted once each), or with `fresh` the bytes copied into newly allocated memory (what a
    slice task does: its output is fresh, so the copy pays the page faults too)."""
    from taskrt.gpu import device

    xp = device.array_module()
    src = xp.ones(nbytes // 8)
    dst = None if fresh else xp.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        device.synchronize()
        start = time.perf_counter()
        if fresh:
            copied = src.copy()
        else:
            xp.copyto(dst, src)
        device.synchronize()
        times.append(time.perf_counter() - start)
        if fresh:
            del copied
    return (1 if fresh else 2) * nbytes / float(np.median(times[1:]))  # the first run warms up
