"""Tables computed on a helper thread: a search starts each edge's t_x kernels there as soon as
both its layers are prepared, while the calling thread prepares the next layers and the t_c and
t_s tables (the kernels release the GIL, so on two cores the two overlap)."""

from __future__ import annotations

import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_HELPER: tuple | None = None  # (process id, executor): a forked child starts its own
_SWITCH = threading.Lock()
_switch = {"users": 0, "saved": None}


class Kernels:
    """Tables whose kernels run on one helper thread as soon as they are started, while this
    thread goes on preparing other tables; `tables()` runs on this thread too whatever the
    helper has not begun, and gives every table.  The t_x kernels release the GIL, so on two
    cores they overlap this thread's Python.  Meanwhile Python's switch interval is shortened
    (SWITCH_INTERVAL_S): a helper wanting the GIL back to start its next kernel would otherwise
    wait up to 5 ms for this thread to let it go at every kernel (slower than one thread)."""

    SWITCH_INTERVAL_S = 1e-4

    def __init__(self):
        self.results = {}  # key -> its table, None until its kernel has run
        self.queue = queue.SimpleQueue()
        self.helper = None

    def __contains__(self, key) -> bool:
        return key in self.results

    def __enter__(self) -> Kernels:
        global _HELPER
        if (os.cpu_count() or 1) >= 2:
            if _HELPER is None or _HELPER[0] != os.getpid():
                _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="taskrt-tables"))
            with _SWITCH:
                if _switch["users"] == 0:
                    _switch["saved"] = sys.getswitchinterval()
                    sys.setswitchinterval(min(self.SWITCH_INTERVAL_S, _switch["saved"]))
                _switch["users"] += 1
            self.helper = _HELPER[1].submit(self._drain, True)
        return self

    def __exit__(self, *exc):
        self._stop()  # after an error before tables(): what is still queued is dropped
        return False

    def start(self, key, job):
        """The table `key` is what `job()` gives; it starts."""
        self.results[key] = None
        self.queue.put((key, job))

    def tables(self) -> dict:
        """Every started table by key, once its kernel is done (this thread runs those the helper
        has not begun)."""
        self._drain(False)
        self._stop()
        return self.results

    def _drain(self, wait: bool):
        """Run queued jobs; the helper (`wait`) until told to stop, this thread until none is left."""
        while True:
            try:
                item = self.queue.get() if wait else self.queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                return
            key, job = item
            self.results[key] = job()

    def _stop(self):
        """Stop the helper (its error, if it had one, raised here), dropping any job still queued,
        and give back the switch interval."""
        if self.helper is None:
            return
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        self.queue.put(None)
        try:
            self.helper.result()
        finally:
            self.helper = None
            with _SWITCH:
                _switch["users"] -= 1
                if _switch["users"] == 0:
                    sys.setswitchinterval(_switch["saved"])
