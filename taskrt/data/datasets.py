"""Datasets the workers read themselves: the client names which samples form a batch, and each
device reads only its part of each input tile (`taskrt.data.reading`).

    train = tr.ArrayDataset({"images": x, "labels": y})            # placed once on each device that reads it
    files = tr.NpyDataset({"images": "x.npy", "labels": "y.npy"})   # memory-mapped by each worker
    fake = tr.Synthetic(1_000_000, shape=(3, 224, 224), classes=1000, seed=0)   # generated where it is read
    train, test = tr.digits(image_size=32)                          # scikit-learn's bundled digits

A dataset has named fields of equal length, each with a per-sample shape and dtype.  Its fields
feed the graph's input layers: by default the float input gets "images" and the int64 input
"labels"; `inputs={layer: field}` names them otherwise.  `bind_dataset` checks, before any step,
that the fields fit the graph (shapes, dtypes, label range, length).

The same `read(field, indices, window)` runs on the client and on workers: `indices` the samples,
`window` one slice per per-sample dimension.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numpy as np

from taskrt.data import synthetic
from taskrt.data.arrays import InputError, load_digits

IMAGES, LABELS = "images", "labels"  # the fields the float and int64 inputs read by default


class DatasetError(InputError):
    """A dataset that does not fit the graph, or a file that cannot be read; raised before any step."""


class DataReadError(InputError):
    """A read on a worker failed (a file that disappeared, shrank or changed while training)."""


@dataclass(frozen=True)
class FieldSpec:
    """One field of a dataset: the shape and dtype of each sample."""

    shape: tuple
    dtype: np.dtype


class Dataset:
    """What every dataset offers; see ArrayDataset, NpyDataset, Synthetic."""

    name: str
    inputs: dict | None  # {input layer: field}, None for the default mapping
    placed = False  # True: its arrays are sent to the devices once (`arrays`), the reads use those copies

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def fields(self) -> dict[str, FieldSpec]:
        raise NotImplementedError

    def where(self, field: str) -> str:
        """Where a field's values come from, for messages."""
        return f"field {field!r} of dataset {self.name!r}"

    def label_range(self, field: str) -> tuple[int, int]:
        """The smallest and largest value of an integer field."""
        values = self.read(field, np.arange(len(self)), ())
        return int(values.min()), int(values.max())

    def read(self, field: str, indices, window: tuple) -> np.ndarray:
        """Samples `indices` of `field`, cut to `window` (one slice per per-sample dimension)."""
        raise NotImplementedError


def _check_fields(name, arrays_or_specs: dict):
    if not isinstance(arrays_or_specs, dict) or not arrays_or_specs:
        raise DatasetError(f"dataset {name!r}: fields must be a non-empty dict {{field name: ...}}, "
                           f"got {arrays_or_specs!r:.80}")
    for key in arrays_or_specs:
        if not isinstance(key, str):
            raise DatasetError(f"dataset {name!r}: field names must be strings, got {key!r}")


def _check_inputs(name, inputs, fields):
    if inputs is None:
        return None
    if not isinstance(inputs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in inputs.items()):
        raise DatasetError(f"dataset {name!r}: inputs must be a dict {{input layer: field name}}, got {inputs!r}")
    unknown = sorted(set(inputs.values()) - set(fields))
    if unknown:
        raise DatasetError(f"dataset {name!r}: inputs name field(s) {unknown} it does not have; its fields are "
                           f"{sorted(fields)}")
    return dict(inputs)


@dataclass(frozen=True, eq=False)
class ArrayDataset(Dataset):
    """numpy arrays, one per field (first dimension: the samples).  A trainer sends each field once
    to each device that reads it (cast to the trainer's dtype); a step's reads slice those copies."""

    arrays: dict
    name: str = "arrays"
    inputs: dict | None = None
    placed = True

    def __post_init__(self):
        _check_fields(self.name, self.arrays)
        arrays = {k: np.asarray(v) for k, v in self.arrays.items()}
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
        if None in lengths.values() or len(set(lengths.values())) != 1:
            raise DatasetError(f"dataset {self.name!r}: every field needs the same number of samples (first "
                               f"dimension), got {lengths}")
        for k, v in arrays.items():
            if v.dtype.kind not in "fiub":
                raise DatasetError(f"dataset {self.name!r}: field {k!r} holds dtype {v.dtype}; fields must hold "
                                   "numbers (float, int, unsigned or bool)")
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise DatasetError(f"dataset {self.name!r}: field {k!r} contains NaN or infinite values")
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "inputs", _check_inputs(self.name, self.inputs, arrays))

    def __len__(self):
        return next(iter(self.arrays.values())).shape[0]

    @property
    def fields(self):
        return {k: FieldSpec(v.shape[1:], v.dtype) for k, v in self.arrays.items()}

    def where(self, field):
        return f"array {field!r} of dataset {self.name!r}"

    def label_range(self, field):
        values = self.arrays[field]
        return int(values.min()), int(values.max())

    def read(self, field, indices, window):
        return self.arrays[field][(np.asarray(indices),) + tuple(window)]

    def array(self, field: str, dtype) -> np.ndarray:
        """The field as the devices hold it: in `dtype`, contiguous."""
        return np.ascontiguousarray(self.arrays[field], dtype=dtype)


def _read_header_any(f):  # format 3.0 (utf-8 field names): numpy has no public reader for it
    return np.lib.format._read_array_header(f, (3, 0))


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


@dataclass(frozen=True)
class NpyFile:
    """A .npy file's header, checked against the file's size: what a worker maps."""

    path: str
    shape: tuple
    dtype: np.dtype
    fortran_order: bool
    offset: int  # where the data begin

    @property
    def nbytes(self) -> int:
        return self.offset + prod(self.shape) * self.dtype.itemsize

    @classmethod
    def open(cls, path: str, where: str) -> NpyFile:
        """Read the header of the file at `path`; `where` names it in errors (DatasetError)."""
        try:
            with open(path, "rb") as f:
                try:
                    version = np.lib.format.read_magic(f)
                    shape, fortran, dtype = _HEADER_READERS.get(version, _read_header_any)(f)
                except ValueError as error:
                    raise DatasetError(f"{where} is not a .npy file ({error})") from None
                offset = f.tell()
        except FileNotFoundError:
            raise DatasetError(f"{where}: no such file") from None
        except IsADirectoryError:
            raise DatasetError(f"{where} is a directory, not a .npy file") from None
        if dtype.hasobject:
            raise DatasetError(f"{where} holds Python objects (dtype {dtype}); a dataset file must hold numbers")
        if not shape:
            raise DatasetError(f"{where} holds a scalar; a dataset file holds one sample per row")
        npy = cls(path, tuple(shape), dtype, bool(fortran), offset)
        npy.check_size(where)
        return npy

    def check_size(self, where: str, size: int | None = None):
        size = os.path.getsize(self.path) if size is None else size
        if size < self.nbytes:
            raise DatasetError(f"{where} is truncated: it holds {size:,} bytes, its header (shape {self.shape}, "
                               f"dtype {self.dtype}) needs {self.nbytes:,}")

    def map(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape,
                         order="F" if self.fortran_order else "C")


@dataclass(frozen=True)
class NpyDataset(Dataset):
    """One .npy file per field, e.g. {"images": "x.npy", "labels": "y.npy"}, memory-mapped by each
    worker: a read touches only the pages of its rows and window.  Headers and sizes are checked
    when the dataset is made, and again before every read (a file replaced, shrunk or gone while
    training raises DataReadError naming it)."""

    paths: dict
    name: str = ""
    inputs: dict | None = None
    files: dict = field(default=None, repr=False)  # field -> NpyFile, read from the headers

    def __post_init__(self):
        name = self.name or ", ".join(str(p) for p in (self.paths.values() if isinstance(self.paths, dict) else []))
        object.__setattr__(self, "name", name or "npy")
        _check_fields(self.name, self.paths)
        files = {}
        for k, p in self.paths.items():
            path = str(Path(p))
            files[k] = NpyFile.open(path, f"dataset {self.name!r}, field {k!r}: {path}")
        lengths = {k: f.shape[0] for k, f in files.items()}
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"dataset {self.name!r}: every file needs the same number of samples (first "
                               f"dimension), got " + ", ".join(f"{files[k].path}: {n}" for k, n in lengths.items()))
        object.__setattr__(self, "paths", {k: f.path for k, f in files.items()})
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "inputs", _check_inputs(self.name, self.inputs, files))

    def __len__(self):
        return next(iter(self.files.values())).shape[0]

    def __hash__(self):
        return hash((self.name, tuple(self.paths.items())))

    @property
    def fields(self):
        return {k: FieldSpec(f.shape[1:], f.dtype) for k, f in self.files.items()}

    def where(self, field):
        return f"file {self.files[field].path} (field {field!r} of dataset {self.name!r})"

    def label_range(self, field):
        values = mapped(self.files[field], self.where(field))
        return int(values.min()), int(values.max())

    def read(self, field, indices, window):
        values = mapped(self.files[field], self.where(field))
        return values[(np.asarray(indices),) + tuple(window)]


_MAPPED: dict = {}  # path -> ((device, inode, size, mtime), NpyFile, memmap): each process maps a file once


def mapped(npy: NpyFile, where: str) -> np.memmap:
    """`npy` mapped in this process, after checking that the file is still the one whose header was
    read: reading past the end of a mapped file that shrank would kill the process (SIGBUS)."""
    try:
        stat = os.stat(npy.path)
    except FileNotFoundError:
        raise DataReadError(f"{where} disappeared: no such file while training") from None
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    held = _MAPPED.get(npy.path)
    if held is not None and held[0] == identity and held[1] == npy:
        return held[2]
    try:
        npy.check_size(where, stat.st_size)
        if held is not None:  # changed since it was mapped: the header must still be the one checked
            now = NpyFile.open(npy.path, where)
            if (now.shape, now.dtype, now.fortran_order, now.offset) != (
                    npy.shape, npy.dtype, npy.fortran_order, npy.offset):
                raise DatasetError(f"{where} changed while training: its header says shape {now.shape}, dtype "
                                   f"{now.dtype}; it was shape {npy.shape}, dtype {npy.dtype}")
    except DatasetError as error:
        raise DataReadError(str(error)) from None
    values = npy.map()
    _MAPPED[npy.path] = (identity, npy, values)
    return values


@dataclass(frozen=True)
class Synthetic(Dataset):
    """`length` samples of `shape` with labels in [0, classes), never stored: each value is a pure
    function of (seed, sample, position) (`taskrt.data.synthetic`), so a device generates only the
    window it reads (on a GPU worker, on the device itself: `generated`).  Fields "images" (values
    in [-1, 1)) and "labels"."""

    generated = True  # read(..., xp=cupy) computes the values where they are needed

    length: int
    shape: tuple = (3, 224, 224)
    classes: int = 1000
    seed: int = 0
    name: str = "synthetic"
    inputs: dict | None = None

    def __post_init__(self):
        for what, value in (("length", self.length), ("classes", self.classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DatasetError(f"dataset {self.name!r}: {what} must be a positive int, got {value!r}")
        if self.length > synthetic.MAX_SAMPLES:
            raise DatasetError(f"dataset {self.name!r}: length {self.length} exceeds {synthetic.MAX_SAMPLES} "
                               "(indices are hashed as 32-bit integers)")
        try:
            shape = tuple(int(s) for s in self.shape)
        except TypeError:
            raise DatasetError(f"dataset {self.name!r}: shape must be a tuple of ints, got {self.shape!r}") from None
        if not shape or min(shape) < 1 or prod(shape) > synthetic.MAX_VALUES:
            raise DatasetError(f"dataset {self.name!r}: shape {shape} must have positive sizes and at most "
                               f"{synthetic.MAX_VALUES} values per sample")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise DatasetError(f"dataset {self.name!r}: seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "inputs", _check_inputs(self.name, self.inputs, (IMAGES, LABELS)))

    def __len__(self):
        return self.length

    @property
    def fields(self):
        return {IMAGES: FieldSpec(self.shape, np.dtype("float32")), LABELS: FieldSpec((), np.dtype("int64"))}

    def where(self, field):
        return f"synthetic field {field!r} of dataset {self.name!r} (seed {self.seed})"

    def label_range(self, field):
        return 0, self.classes - 1

    def read(self, field, indices, window, xp=np, dtype="float32"):
        if field == LABELS:
            return synthetic.labels(xp, self.seed, indices, self.classes)
        return synthetic.values(xp, self.seed, indices, self.shape, tuple(window), dtype)


def digits(image_size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's bundled digits (`taskrt.data.arrays.load_digits`) as (train, test) datasets."""
    x_train, y_train, x_test, y_test = load_digits(image_size, test_fraction, seed)
    return (ArrayDataset({IMAGES: x_train, LABELS: y_train}, name="digits-train"),
            ArrayDataset({IMAGES: x_test, LABELS: y_test}, name="digits-test"))


@dataclass(frozen=True)
class Binding:
    """A dataset checked against a graph: which field feeds each input layer, and in which dtype."""

    dataset: Dataset
    fields: tuple  # ((input layer, field, dtype name), ...) in the graph's input order

    def field_of(self, layer: str) -> str:
        return next(f for name, f, _ in self.fields if name == layer)


def bind_dataset(graph, dataset, dtype, with_labels: bool = True, min_length: int | None = None) -> Binding:
    """Check `dataset` against `graph`'s inputs (the float inputs, and the labels `with_labels`):
    per-sample shapes and dtypes, labels within the classes, at least `min_length` samples.
    Raises DatasetError naming the dataset (or file), the input layer and what would fit."""
    from taskrt.data.arrays import data_inputs, narrowed

    if not isinstance(dataset, Dataset):
        raise DatasetError(f"expected a taskrt dataset (ArrayDataset, NpyDataset, Synthetic, digits()), got "
                           f"{type(dataset).__name__}; wrap numpy arrays as ArrayDataset({{'images': x, 'labels': y}})")
    layers = data_inputs(graph, with_labels)
    mapping = dataset.inputs if dataset.inputs is not None else _default_mapping(graph, dataset, layers)
    unknown = sorted(set(mapping) - {l.name for l in graph.inputs})
    if unknown:
        raise DatasetError(f"dataset {dataset.name!r}: inputs names {unknown}, which graph {graph.name!r} does not "
                           f"have; its inputs are {[l.name for l in graph.inputs]}")
    fields = dataset.fields
    bound = []
    for layer in layers:
        if layer.name not in mapping:
            raise DatasetError(f"dataset {dataset.name!r} feeds no field to input {layer.name!r} of graph "
                               f"{graph.name!r}; name one with inputs={{{layer.name!r}: <field>}} (fields: "
                               f"{sorted(fields)})")
        name = mapping[layer.name]
        spec, where = fields[name], dataset.where(name)
        if tuple(spec.shape) != tuple(layer.shape[1:]):
            raise DatasetError(f"{where} has samples of shape {tuple(spec.shape)}; input {layer.name!r} of graph "
                               f"{graph.name!r} takes samples of shape {tuple(layer.shape[1:])}")
        if layer.op.dtype == "int64":
            if spec.dtype.kind not in "iu":
                raise DatasetError(f"{where} holds dtype {spec.dtype}; input {layer.name!r} holds class labels and "
                                   "needs integers")
            _check_label_range(graph, layer.name, dataset, name, where)
            bound.append((layer.name, name, "int64"))
        else:
            if spec.dtype.kind not in "fiub":
                raise DatasetError(f"{where} holds dtype {spec.dtype}; input {layer.name!r} needs numbers")
            narrowed(where, spec.dtype, dtype)
            bound.append((layer.name, name, np.dtype(dtype).name))
    if min_length is not None and len(dataset) < min_length:
        raise DatasetError(f"dataset {dataset.name!r} has {len(dataset)} samples, fewer than the batch of "
                           f"{min_length} that graph {graph.name!r} takes (input {layers[0].name!r}); use a "
                           "larger dataset or a graph with a smaller batch")
    return Binding(dataset, tuple(bound))


def _default_mapping(graph, dataset, layers) -> dict:
    floats = [l.name for l in graph.inputs if l.op.dtype != "int64"]
    ints = [l.name for l in graph.inputs if l.op.dtype == "int64"]
    mapping = {}
    for names, field_name, kind in ((floats, IMAGES, "float"), (ints, LABELS, "int64")):
        if not names or not any(l.name in names for l in layers):
            continue
        if len(names) > 1:
            raise DatasetError(f"graph {graph.name!r} has {len(names)} {kind} inputs {names}: give dataset "
                               f"{dataset.name!r} inputs={{layer: field}} to say which field feeds each")
        if field_name not in dataset.fields:
            raise DatasetError(f"dataset {dataset.name!r} has no field {field_name!r} for input {names[0]!r} of "
                               f"graph {graph.name!r}; its fields are {sorted(dataset.fields)}: name one with "
                               f"inputs={{{names[0]!r}: <field>}}")
        mapping[names[0]] = field_name
    return mapping


def _check_label_range(graph, layer, dataset, name, where):
    low, high = dataset.label_range(name)
    for loss_name, _ in graph.consumers(layer):
        classes = graph[graph[loss_name].inputs[0]].shape[1]
        if low < 0 or high >= classes:
            raise DatasetError(f"{where} holds labels from {low} to {high}; input {layer!r} (labels of "
                               f"{loss_name!r}) must lie in [0, {classes})")


@dataclass(frozen=True, eq=False)
class Batch:
    """One step's samples: a dataset bound to the graph and the indices of its samples, in batch
    order.  All a step read from a dataset sends to the workers, and all the elastic log keeps."""

    binding: Binding
    indices: np.ndarray


def batch_indices(dataset, indices, batch: int) -> np.ndarray:
    """`indices` as the int64 array of one batch of `dataset`, checked: `batch` of them, each a
    sample of the dataset."""
    try:
        values = np.asarray(indices)
    except Exception:  # noqa: BLE001  (anything numpy cannot read as an array: reported below)
        values = None
    if values is None or values.dtype.kind not in "iu" or values.shape != (batch,):
        what = f"shape {values.shape}, dtype {values.dtype}" if values is not None else repr(indices)
        raise DatasetError(f"dataset {dataset.name!r}: a batch is {batch} sample indices (integers, shape "
                           f"({batch},)), got {what}")
    if batch and (values.min() < 0 or values.max() >= len(dataset)):
        raise DatasetError(f"dataset {dataset.name!r} has samples 0..{len(dataset) - 1}; the batch asks for "
                           f"indices from {values.min()} to {values.max()}")
    return np.ascontiguousarray(values, dtype=np.int64)
