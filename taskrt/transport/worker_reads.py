"""Reading a step's losses on its workers, the moment the runs computing them end.

Through the scheduler, the end of a step reaches the client late: the worker tells the scheduler
that a fused run ended, the scheduler then sends the worker the task that takes the loss out of the
run (a getitem), the worker tells it that one ended, the scheduler tells the client, and the client
asks for the value: four messages and a round trip after the run, 7-9 ms of a 31-35 ms LeNet-5
step on Machine.local(1).  Here the client asks each worker of the step once, directly: the worker
answers when the step's runs there have ended, with the losses read out of them (or out of the
getitem, if it ran first).

A step longer than the wait answers TIMED_OUT, and the trainer asks again once it has checked that
its devices are still there.  Anything unusual (a task that failed, a worker lost) answers None,
and the trainer waits for the step's futures the usual way, which reports or recovers from it.
"""

from __future__ import annotations

import asyncio

from distributed import WorkerPlugin

from taskrt.gpu.device import to_host_async
from taskrt.planning.fusion import RunValue, export_source, run_of
from taskrt.planning.plan import keys_of


class StepWatch(WorkerPlugin):
    """Worker plugin: wakes the readers waiting for a key whenever that key changes state."""

    name = "taskrt-step-watch"

    def setup(self, worker):
        self.waiters: dict = {}  # key -> [asyncio futures]

    def transition(self, key, start, finish, **kwargs):
        for waiter in self.waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)


def reads_of(dsk: dict, device_of, outputs: dict) -> dict[int, list]:
    """What the client waits for on each device: {device: [(run, index, key, loss)]}: value `index`
    of `run` (or `run` itself, for index None), also the output `key` (None for a value kept in its
    run, `taskrt.planning.fusion.held_outputs`), is there once `key` or `run` is in memory.  `loss`: the
    loss's place in the step's losses, whose values come back; None for each of the step's
    `done` keys, awaited through one output read out of it."""
    held = [run_of(k)  # a value kept in its run: the client holds the run
            for name, v in outputs.items() if name != "done" for k in keys_of(v)]
    reads, losses = {}, outputs.get("loss", [])
    for i, key in enumerate(losses):
        if isinstance(key, RunValue):
            reads.setdefault(device_of(key.run), []).append((key.run, key.index, None, i))
        else:
            reads.setdefault(device_of(key), []).append((*export_source(dsk, key), key, i))
    read = {run_of(k) for k in losses}
    for run in outputs["done"]:
        if run in read:  # the losses read already wait for it
            continue
        key = run if run in held else next(k for k in held if export_source(dsk, k)[0] == run)
        reads.setdefault(device_of(key), []).append((*export_source(dsk, key), key, None))
    return reads


TIMED_OUT = "timed out"  # a worker's answer when the step's runs there had not ended in time


async def read_when_done(items, timeout: float, dask_worker=None):
    """On a worker: wait for each (run, index, key, loss) of `reads_of`, at most `timeout` seconds
    in all; the losses' values in order, TIMED_OUT, or None if a task failed."""
    watch = dask_worker.plugins.get(StepWatch.name)
    if watch is None:
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    values = []
    for run, index, key, loss in items:
        names = (run,) if key is None else (run, key)
        while not any(k in dask_worker.data for k in names):
            states = [getattr(dask_worker.state.tasks.get(k), "state", None) for k in names]
            remaining = deadline - loop.time()
            if "error" in states:
                return None
            if remaining <= 0:
                return TIMED_OUT
            waiter = loop.create_future()
            for k in names:
                watch.waiters.setdefault(k, []).append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                return TIMED_OUT
            finally:
                for k in names:
                    if waiter in watch.waiters.get(k, ()):
                        watch.waiters[k].remove(waiter)
        if loss is not None:
            value = (dask_worker.data[key] if key in dask_worker.data else
                     dask_worker.data[run] if index is None else dask_worker.data[run][index])
            values.append(await to_host_async(value))  # a GPU's loss, once the GPU has computed it
    return values


async def ask(client, address: str, items, timeout: float):
    """Send `read_when_done(items, timeout)` straight to the worker at `address` (not through the
    scheduler, as `Client.run` would); its answer, or None."""
    from distributed.protocol.pickle import dumps

    response = await client.rpc(address).run(function=dumps(read_when_done), args=dumps((items, timeout)),
                                             kwargs=dumps({}), wait=True)
    return response.get("result") if response.get("status") == "OK" else None
