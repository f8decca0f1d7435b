"""Long work the user waits for, said as it happens: a progress bar on a terminal, one line per
phase in a log (the `taskrt` logger).

    with phase("measuring 120 part kernels on a cpu device", total=120, cached_in=path) as advance:
        ...
        advance(8)

In a log, a phase says what it does as it starts, and how long it took when it took
LOG_DONE_S or more.  Where nothing configured Python's logging, the `taskrt` logger writes its lines to stderr itself
(as Dask's loggers do); `logging.getLogger("taskrt").setLevel(logging.WARNING)` silences them.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

LOG = logging.getLogger("taskrt")
LOG_DONE_S = 2.0  # a phase as long as this also says when it ends, in a log


def logger() -> logging.Logger:
    """The `taskrt` logger, with a handler of its own on stderr where no one configured logging."""
    if not LOG.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("taskrt: %(message)s"))
        LOG.addHandler(handler)
        LOG.propagate = False
        if LOG.level == logging.NOTSET:
            LOG.setLevel(logging.INFO)
    return LOG


def on_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextmanager
def phase(what: str, total: int | None = None, cached_in=None, enabled: bool = True):
    """A phase of work: `what` it does, in `total` units (None: one).  `cached_in`: where its
    result is kept for next time, said with it.  Yields `advance(units)`.  On a terminal, a bar
    that stays when done; elsewhere, a line as it starts and one with its time as it ends."""
    if not enabled:
        yield lambda units=1: None
        return
    note = f" (once; kept in {cached_in} for next time)" if cached_in else ""
    started = time.perf_counter()
    if on_terminal():
        from tqdm import tqdm

        with tqdm(total=total, desc=what + note, leave=True, dynamic_ncols=True, file=sys.stderr) as bar:
            yield bar.update
        return
    log = logger()
    log.info("%s%s ...", what, note)
    yield lambda units=1: None
    seconds = time.perf_counter() - started
    if seconds >= LOG_DONE_S:  # a short phase's start says enough
        log.info("%s: done in %.1f s", what, seconds)
