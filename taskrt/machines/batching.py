"""Dask's message batching, shortened on the clusters `Machine.local` starts.

Each of Dask's message streams holds a message back until `interval` has passed since its last
send (`distributed.batched.BatchedSend`: scheduler to worker 5 ms, worker to scheduler 2 ms,
scheduler to client 2 ms, client to scheduler 10 ms), trading latency for fewer messages.  A
training step waits on such messages at every hop between devices: on local(2) a dependent hop of
no-op tasks took 6 ms, most of it the scheduler holding the next task back because it had sent the
worker the one before a moment ago.  With every interval at INTERVAL_S (A/B in one process, local(2),
medians of 3 rounds): LeNet-5 model parallel 196 -> 134 ms a step, data parallel 72 -> 65 ms,
AlexNet-32 model parallel 619 -> 546 ms; Dask's hop 6.1 -> 2.4 ms, its throughput of independent
no-op tasks 0.8 -> 1.2 ms a task; one-device steps (one message each way) unchanged.  No interval
at all was slower than 0.5 ms on 2 cores (more, smaller messages).

A cluster given to `Machine.from_client` keeps its own settings.
"""

from __future__ import annotations

from distributed import SchedulerPlugin, WorkerPlugin

INTERVAL_S = 0.0005


def _shorten(stream) -> None:
    if stream is not None and hasattr(stream, "interval"):
        stream.interval = INTERVAL_S


class SchedulerBatching(SchedulerPlugin):
    """The scheduler's streams to workers and clients, those there now and those to come."""

    name = "taskrt-scheduler-batching"

    async def start(self, scheduler):
        for stream in [*scheduler.stream_comms.values(), *scheduler.client_comms.values()]:
            _shorten(stream)

    def add_worker(self, scheduler=None, worker=None, **kwargs):
        _shorten(scheduler.stream_comms.get(worker))

    def add_client(self, scheduler=None, client=None, **kwargs):
        _shorten(scheduler.client_comms.get(client))


class WorkerBatching(WorkerPlugin):
    """A worker's stream to the scheduler (workers that join later get it too)."""

    name = "taskrt-worker-batching"

    def setup(self, worker):
        _shorten(getattr(worker, "batched_stream", None))


def shorten_batching(client) -> None:
    """Every stream of `client`'s cluster sends after at most INTERVAL_S, the client's own included."""
    client.register_plugin(SchedulerBatching())
    client.register_plugin(WorkerBatching())
    _shorten(client.scheduler_comm)


def intervals(client) -> dict:
    """The batching interval of each stream, seconds: {"client": s, "scheduler": [s...], "workers": {address: s}}."""
    def scheduler_side(dask_scheduler=None):
        return [s.interval for s in [*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()]]

    def worker_side(dask_worker=None):
        return dask_worker.batched_stream.interval

    return {"client": client.scheduler_comm.interval, "scheduler": client.run_on_scheduler(scheduler_side),
            "workers": client.run(worker_side)}
