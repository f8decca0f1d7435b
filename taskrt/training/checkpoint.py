"""Checkpoint files: written atomically, checked on reading, kept periodically.

A checkpoint is an .npz archive: a JSON `meta` entry (format, graph, strategy, optimizer and
hyper-parameters, step count, and a SHA-256 digest of every array) beside the arrays
`param/<layer>/<name>`, the optimizer's state `state/<slot>/<layer>/<name>` (its slots under
`torch.optim`'s names) and `running/<layer>/stats`.  Format 1 (SGD's `velocity/<layer>/<name>`)
is still read, as the momentum buffer.  Reading checks the archive, the digests and, when the caller says
which graph it expects, that the checkpoint is for that graph, and names what differs.

    Checkpoints("ckpts", every=100, keep=3)   # a Trainer option: a checkpoint every 100 steps
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from taskrt.graph.files import write_atomic

FORMAT = "taskrt-checkpoint/2"
READ_FORMATS = ("taskrt-checkpoint/1", FORMAT)
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, truncated, corrupted, or for another graph."""


def array_digest(value: np.ndarray) -> str:
    value = np.ascontiguousarray(value)
    h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
    h.update(value.tobytes())
    return h.hexdigest()


def write_checkpoint(path, meta: dict, params: dict, slots: dict, running: dict | None = None) -> None:
    """Write `meta` and the state (parameters {layer: {name: array}}, the optimizer's `slots`
    {slot: {layer: {name: array}}}, the batch norms' running statistics {layer: (2, C) array}) to
    `path` atomically."""
    arrays = {}
    for layer, p in params.items():
        for k, v in p.items():
            arrays[f"param/{layer}/{k}"] = np.asarray(v)
            for slot, values in slots.items():
                arrays[f"state/{slot}/{layer}/{k}"] = np.asarray(values[layer][k])
    for layer, r in (running or {}).items():
        arrays[f"running/{layer}/stats"] = np.asarray(r)
    meta = {**meta, "format": FORMAT, "digests": {name: array_digest(v) for name, v in arrays.items()}}
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    write_atomic(path, buffer.getvalue())


def read_checkpoint(path, graph=None) -> tuple[dict, dict, dict]:
    """(meta, params, optimizer slots {slot: {layer: {name: array}}}) of a checkpoint, every array
    checked against its digest; with `graph`, also checked to be a checkpoint of that graph.  The
    batch norms' running statistics are in meta["running"] ({layer: (2, C) array})."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            start = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"cannot read checkpoint {path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if start != b"PK\x03\x04":  # every .npz archive is a zip file (numpy would take it for a pickle)
        what = "an empty file" if not start else f"a file that starts with {start!r}"
        raise CheckpointError(f"{path} is not a taskrt checkpoint: it is {what}, not an .npz archive "
                              "(Trainer.save and Checkpoints write those)")
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            arrays = {}
            for name in names:
                try:
                    arrays[name] = f[name]
                except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
                    raise CheckpointError(f"checkpoint {path} is corrupted: entry {name!r} cannot be read "
                                          f"({e})") from None
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"cannot read checkpoint {path}: no such file") from None
    except (zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: truncated or not an .npz archive ({e})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if "meta" not in arrays:
        raise CheckpointError(f"{path} is not a taskrt checkpoint (no metadata)")
    try:
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupted: its metadata is not JSON ({e})") from None
    if meta.get("format") not in READ_FORMATS:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not one of {', '.join(READ_FORMATS)}")
    digests = meta.get("digests")
    if not isinstance(digests, dict):
        raise CheckpointError(f"{path}: no digests in its metadata (written by an older taskrt?)")
    missing = sorted(set(digests) - set(arrays))
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: array(s) {missing} are missing")
    for name, value in arrays.items():
        if name not in digests:
            raise CheckpointError(f"checkpoint {path} has an array {name!r} its metadata does not list")
        if array_digest(value) != digests[name]:
            raise CheckpointError(f"checkpoint {path} is corrupted: array {name!r} does not match its digest")
    if graph is not None:
        check_same_graph(meta["graph"], graph.to_dict(), path)
    params, slots, running = {}, {}, {}
    for key, value in arrays.items():
        kind, _, rest = key.partition("/")
        if kind == "state":
            slot, _, rest = rest.partition("/")
        elif kind == "velocity":  # format 1: SGD's momentum
            slot = "momentum_buffer"
        layer, name = rest.rsplit("/", 1)
        if kind == "running":
            running[layer] = value
        elif kind == "param":
            params.setdefault(layer, {})[name] = value
        else:
            slots.setdefault(slot, {}).setdefault(layer, {})[name] = value
    return {**meta, "running": running}, params, slots


def check_same_graph(saved: dict, expected: dict, path) -> None:
    """Raise CheckpointError naming the first difference between two `Graph.to_dict()`s."""
    where = f"checkpoint {path} is for another graph"
    ours = {spec["name"]: spec for spec in expected["layers"]}
    theirs = {spec["name"]: spec for spec in saved["layers"]}
    only_here = [name for name in ours if name not in theirs]
    only_there = [name for name in theirs if name not in ours]
    if only_here or only_there:
        raise CheckpointError(f"{where} ({saved['name']!r}): layers {only_here} are not in the checkpoint, "
                              f"layers {only_there} are only in the checkpoint")
    for name, spec in ours.items():
        other = theirs[name]
        for field in sorted(set(spec) | set(other)):
            if spec.get(field) != other.get(field):
                raise CheckpointError(f"{where}: layer {name!r} has {field} {other.get(field)!r} in the checkpoint, "
                                      f"{spec.get(field)!r} in this graph")


@dataclass(frozen=True)
class Checkpoints:
    """Periodic checkpoints: every `every` steps into `directory` as step-<step>.npz, keeping
    the last `keep` files."""

    directory: str | Path
    every: int
    keep: int = 3

    def __post_init__(self):
        for field, value in (("every", self.every), ("keep", self.keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Checkpoints: {field} must be a positive int (steps or files), got {value!r}")
        object.__setattr__(self, "directory", Path(self.directory))

    def path(self, step: int) -> Path:
        return self.directory / f"{PREFIX}{step:08d}.npz"

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def saved(self) -> list[Path]:
        """The checkpoints in the folder, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob(f"{PREFIX}*.npz") if p.stem[len(PREFIX):].isdigit())

    def latest(self) -> Path | None:
        saved = self.saved()
        return saved[-1] if saved else None

    def write(self, step: int, meta: dict, params: dict, slots: dict, running: dict | None = None) -> Path:
        path = self.path(step)
        write_checkpoint(path, meta, params, slots, running)
        for old in self.saved()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path
