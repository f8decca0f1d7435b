"""Part "transfer" of `bench gpu`: a 64 MB device array from one worker's program to another's, two
workers sharing the GPU, through CUDA IPC (`taskrt.transport.gpu_ipc`) and through host memory (as before).

Ping-pong through the mailboxes (`taskrt.machines.calibration._ping_pong`, as `bench programs` times a tile
between CPU workers and the calibration a large value): "a" sends the array and waits for a one-byte
answer; "b" waits for it, waits for the device to have it (its copy is queued on the kernels'
stream) and answers.  One way is a round trip less the one-way time of a
small value (`hop`).  On CPU workers (`device="cpu"`, to try the part without a GPU) the arrays are
numpy's and go through shared memory.
"""

from __future__ import annotations

import statistics
import time

from taskrt.bench.goals import GPU_TRANSFER_RATE_GOAL as RATE_GOAL
from taskrt.bench.gpu_common import log

NBYTES = 64 * 2**20


def round_trips(machine, nbytes: int, rounds: int, ipc: bool) -> tuple[float, dict]:
    """Median seconds of a round trip of `nbytes` (the first left out), and what "b" saw."""
    from taskrt.machines.calibration import _ping_pong

    client, address = machine.client, machine.addresses()
    tag = f"bench-transfer-{time.time_ns()}"
    a, b = (client.submit(_ping_pong, role, address[1 - i], rounds, nbytes, tag, ipc=ipc,
                          resources={machine.tag(i): 1}, pure=False) for i, role in enumerate("ab"))
    times = a.result()
    return statistics.median(times[1:] if len(times) > 1 else times), b.result()


def transfer_part(rows: list, rounds: int = 12, device: str = "cuda", nbytes: int = NBYTES) -> None:
    from taskrt.machines.machine import Machine

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
