"""Part "transfer" of `bench gpu`: a 64 MB device array from one worker's program to another's, two
workers sharing the GPU, through CUDA IPC (`taskrt.gpu_ipc`) and through host memory (as before).

Ping-pong through the mailboxes, as `bench programs` times a tile between CPU workers: "a" sends the
array and waits for a one-byte answer; "b" waits for it, waits for the device to have it (its copy
is queued on the kernels' stream) and answers.  One way is a round trip less the one-way time of a
small value (`hop`).  On CPU workers (`device="cpu"`, to try the part without a GPU) the arrays are
numpy's and go through shared memory.
"""

from __future__ import annotations

import statistics
import time

NBYTES = 64 * 2**20
RATE_GOAL = 10e9  # bytes/s, a 64 MB device array between two workers on one GPU


def log(message: str) -> None:
    print(f"[bench gpu] {message}", flush=True)


def _ping_pong(role: str, peer: str, rounds: int, nbytes: int, tag: str, ipc: bool) -> dict:
    """On a worker: `rounds` round trips with the worker at `peer`; "a" returns the seconds of each,
    "b" whether the first array arrived equal and whether every one came through CUDA IPC."""
    from distributed import get_worker

    from taskrt.device import is_gpu, synchronize
    from taskrt.mailbox import mailbox_of

    box = mailbox_of(get_worker())
    if ipc:
        box.gpu_peers.pop(peer, None)  # asked again
    else:
        box.gpu_peers[peer] = False  # through host memory, as without taskrt.gpu_ipc
    if is_gpu():
        import cupy as xp
    else:
        import numpy as xp
    payload = xp.full(max(nbytes // 4, 1), 1.5, dtype=xp.float32)
    ack = xp.zeros(1, dtype=xp.uint8)
    synchronize()
    def through_ipc() -> int:
        return box.gpu_receiver.reads if box.gpu_receiver is not None else 0

    times, equal, before = [], None, through_ipc()
    for i in range(rounds):
        if role == "a":
            start = time.perf_counter()
            box.send(peer, ("ping", tag, i), tag, payload).result()
            box.take(("pong", tag, i), tag, peer)
            times.append(time.perf_counter() - start)
        else:
            got = box.take(("ping", tag, i), tag, peer)
            synchronize()  # the array is on this device
            if equal is None:
                equal = bool((got == 1.5).all()) and got.shape == payload.shape
            box.send(peer, ("pong", tag, i), tag, ack).result()
    return {"times": times} if role == "a" else {"equal": equal, "ipc": through_ipc() - before == rounds}


def round_trips(machine, nbytes: int, rounds: int, ipc: bool) -> tuple[float, dict]:
    """Median seconds of a round trip of `nbytes` (the first left out), and what "b" saw."""
    client, address = machine.client, machine.addresses()
    tag = f"bench-transfer-{time.time_ns()}"
    a, b = (client.submit(_ping_pong, role, address[1 - i], rounds, nbytes, tag, ipc,
                          resources={machine.tag(i): 1}, pure=False) for i, role in enumerate("ab"))
    times = a.result()["times"]
    return statistics.median(times[1:] if len(times) > 1 else times), b.result()


def transfer_part(rows: list, rounds: int = 12, device: str = "cuda", nbytes: int = NBYTES) -> None:
    from taskrt.machine import Machine

    with Machine.local(2, gpu=device == "cuda") as machine:
        hop = round_trips(machine, 8, 3 * rounds, ipc=True)[0] / 2
        for ipc in (True, False):
            log(f"transfer: {nbytes / 2**20:.0f} MB between two workers, {'CUDA IPC' if ipc else 'host memory'}")
            round_trip, seen = round_trips(machine, nbytes, rounds, ipc)
            one_way = max(round_trip - hop, 1e-9)
            rows.append({"path": "CUDA IPC" if ipc else "host memory", "nbytes": nbytes,
                         "round_trip_ms": round_trip * 1e3, "hop_ms": hop * 1e3, "one_way_ms": one_way * 1e3,
                         "gb_s": nbytes / one_way / 1e9,
                         "arrived_equal": seen["equal"], "through_ipc": seen["ipc"] if ipc else False,
                         "goal": ("met" if nbytes / one_way >= RATE_GOAL else "missed") if ipc else None})
            log("  " + transfer_summary(rows[-1:])[0])


def transfer_summary(rows) -> list[str]:
    lines = []
    for r in rows:
        goal = f" (goal >= {RATE_GOAL / 1e9:.0f} GB/s: {r['goal']})" if r.get("goal") else ""
        went = "" if r["path"] == "host memory" or r["through_ipc"] else " (NOT through IPC: host memory)"
        lines.append(f"a {r['nbytes'] / 2**20:.0f} MB device array between two workers on one GPU through "
                     f"{r['path']}{went}: {r['one_way_ms']:.2f} ms one way, {r['gb_s']:.1f} GB/s{goal}; "
                     f"arrived equal: {r['arrived_equal']}")
    return lines
