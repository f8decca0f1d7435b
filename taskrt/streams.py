"""Dask's message streams, made prompt.

Dask batches the messages on each of its streams: client to scheduler at most one batch every
10 ms, scheduler to a worker every 5 ms, worker to scheduler every 2 ms.  A step is a few coarse
tasks (taskrt.fusion) whose latency matters more than the number of messages, and each hop from
a finished task to its dependent waited for the next batch: 6.0 ms per hop on a chain of no-op
tasks on Machine.local, 2.0 ms with every stream at 1 ms; a step's graph reached its worker up to
10 ms after submission.  The intervals are attributes of Dask's streams, not settings: a stream
without one is left as it is, which costs only speed.
"""

from __future__ import annotations

import logging

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

MESSAGE_INTERVAL_S = 0.001


def prompt_messages(client) -> None:
    """Every stream of the client's cluster at MESSAGE_INTERVAL_S, for the workers there now and
    those that join later (a nanny's restart included)."""
    _prompt(getattr(client, "scheduler_comm", None))
    try:
        client.register_plugin(PromptWorker(), name="taskrt-prompt-worker")
        client.register_plugin(PromptScheduler(), name="taskrt-prompt-scheduler")
    except Exception as error:  # noqa: BLE001  (e.g. a scheduler that cannot import taskrt: only slower)
        logging.getLogger("taskrt").info("Dask's message intervals left as they are: %r", error)


def _prompt(stream) -> None:
    if stream is not None and hasattr(stream, "interval"):
        stream.interval = MESSAGE_INTERVAL_S


class PromptWorker(WorkerPlugin):
    """A worker's stream to the scheduler."""

    def setup(self, worker):
        _prompt(getattr(worker, "batched_stream", None))


class PromptScheduler(SchedulerPlugin):
    """The scheduler's streams to its workers and clients."""

    def start(self, scheduler):
        for stream in [*getattr(scheduler, "stream_comms", {}).values(),
                       *getattr(scheduler, "client_comms", {}).values()]:
            _prompt(stream)

    def add_worker(self, scheduler, worker):
        _prompt(getattr(scheduler, "stream_comms", {}).get(worker))

    def add_client(self, scheduler, client):
        _prompt(getattr(scheduler, "client_comms", {}).get(client))
