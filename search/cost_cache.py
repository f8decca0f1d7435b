"""The cost model's cache on disk: part timings by device kind and tile signature, and each
cluster's calibrated runtime costs, as JSON (by default ~/.cache/taskrt/costs.json), so that a
second search on the same machine measures nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from taskrt.graph.files import write_atomic

CACHE_FORMAT = "taskrt-costs/4"  # parts: [forward s, backward s (with packing the parameter gradient)], from
# kernels started with the core's cache evicted


def default_cache_path() -> Path:
    root = os.environ.get("TASKRT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "taskrt")
    return Path(root) / "costs.json"


class CostCache:
    """Measured part times by device kind and tile signature, persisted as JSON."""

    def __init__(self, path=None):
        self.path = Path(path) if path else None
        self.data = {"format": CACHE_FORMAT, "parts": {}, "overhead": {}}
        if self.path and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
                if loaded.get("format") == CACHE_FORMAT:
                    self.data = loaded
            except (OSError, ValueError):
                pass  # an unreadable cache is a cold cache

    def get(self, kind, signature):
        return self.data["parts"].get(kind, {}).get(signature)

    def put_many(self, kind, values: dict):
        self.data["parts"].setdefault(kind, {}).update(values)
        self.save()

    def save(self):
        if self.path:
            write_atomic(self.path, json.dumps(self.data, indent=0, sort_keys=True))


def corun_kind(kind: str) -> str:
    """The cache's name for the part timings of a device kind taken with every device at once."""
    return f"{kind}|beside others"
