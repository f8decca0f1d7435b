"""A device's fused run replayed as a CUDA graph: one launch for all of its kernels.  Runs on workers.

On a GPU worker the Python that launches a step's kernels costs more than the kernels: measured
on an H100, an Inception-v3 step (batch 64, one device, 1,286 tasks) spent 350 ms launching what
PyTorch's own step does in 112 ms.  A fused run (`taskrt.fusion.FusedRun`) computes the same
function of its inputs at every step, so after `WARMUP_CALLS` ordinary calls (cuDNN's autotuner
times its algorithms during the first) its kernels are captured once into a CUDA graph that reads
static copies of its inputs.  Every later call copies its inputs in, replays the graph and copies
its outputs out: values the step returns are fresh arrays, as an ordinary call returns, so a value
Dask still holds (a snapshot's state, a loss not yet read) is never overwritten by a later replay.

A capture is preceded by one ordinary call on the static copies (cuDNN's autotuner then times
its choices for them outside the capture).  A run is captured per input signature (the shapes and
dtypes of the arrays it reads, in the order its steps first read them, and the literal values and
other non-array inputs it was given, such as a program's hyper-parameters), so a changed learning
rate captures again.  Where the values come from does not matter: a step whose
state arrives as futures (the first step, or after `Executor.cut_lineage`) replays the graph that
steps reading the state out of the previous run captured.  A call given values that are not
device arrays (a batch of numpy arrays, which the run copies to the device) runs as before; a run
that cannot be captured (it reads a value to the host) warns once and runs as before from then on.
Captures are kept per run name (`FusedRun.program`), the `MAX_PROGRAMS` most recently used per worker.
TASKRT_CUDA_GRAPHS=0 turns replay off in a process.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

WARMUP_CALLS = 2  # ordinary calls of a run before it is captured
ALIGN = 256  # bytes: where each output copy starts in the buffer the copies share
MAX_PROGRAMS = 256  # runs kept per worker: more than one step of a device runs (each capture holds its memory)
INVALIDATED = 2  # cudaStreamCaptureStatusInvalidated


class CaptureError(RuntimeError):
    """A run that cannot be replayed as a graph."""


@dataclass
class Program:
    """What a worker keeps of one named run: its calls per signature and its captured graphs."""

    calls: Counter = field(default_factory=Counter)
    graphs: dict = field(default_factory=dict)  # signature -> Captured
    failed: str | None = None  # why this run is not replayed


_programs: OrderedDict = OrderedDict()  # run name -> Program, most recently used last


def enabled() -> bool:
    """Replay on this worker: a GPU worker whose torch has CUDA, unless TASKRT_CUDA_GRAPHS=0."""
    if os.environ.get("TASKRT_CUDA_GRAPHS", "1") == "0":
        return False
    from taskrt.device import is_gpu

    if not is_gpu():
        return False
    from ops.torch_kernels import torch_cuda_available

    return torch_cuda_available()


def clear() -> None:
    """Drop every captured graph of this process (their memory goes back to torch's cache)."""
    _programs.clear()


def stats() -> dict:
    """Runs, captured graphs and runs that fell back to ordinary calls in this process."""
    return {"programs": len(_programs), "graphs": sum(len(p.graphs) for p in _programs.values()),
            "failed": {name: p.failed for name, p in _programs.items() if p.failed}}


def memory() -> dict:
    """Bytes the captured graphs of this process hold outside their private pools: the static copies
    of their inputs and the static outputs (those in the pools too), and the most graphs one run
    has (more than one: captured again for another signature, each with a pool of its own)."""
    graphs = [c for p in _programs.values() for c in p.graphs.values()]
    return {"graphs": len(graphs), "most_per_run": max((len(p.graphs) for p in _programs.values()), default=0),
            "static_inputs": sum(a.nbytes for c in graphs for a in c.static),
            "static_outputs": sum(a.nbytes for c in graphs for a in c.out_leaves if a is not None)}


def timings(repeats: int = 5) -> dict:
    """GPU milliseconds of each captured graph of this process (median of `repeats`, CUDA events):
    its replay alone, copying its inputs in and copying its outputs out.  {run name: {...}}."""
    backend = _torch_backend()
    if backend is None:
        return {}
    torch = backend.torch

    def gpu_ms(fn):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    out = {}
    for name, program in _programs.items():
        for captured in program.graphs.values():
            sources = [backend.copy(target) for target in captured.static]

            def copy_in(c=captured, sources=sources):
                backend.copy_all(c.static, sources)

            out[name] = {"replay_ms": gpu_ms(captured.replay_graph), "copy_in_ms": gpu_ms(copy_in),
                         "copy_out_ms": gpu_ms(captured.outputs_copied), "inputs": len(captured.static),
                         "outputs": sum(leaf is not None for leaf in captured.out_leaves)}
    return out


def call(run, inputs, backend=None):
    """`run(*inputs)` (a FusedRun with a program name), replayed from its graph when it can be."""
    backend = backend or _torch_backend()
    if backend is None:
        return run.run(inputs)
    program = _program(run.program)
    if program.failed:
        return run.run(inputs)
    paths = read_order(run.steps)
    values = [_at(inputs, path) for path in paths]
    leaves, structure = flatten(values, backend.is_array)
    arrays = [leaf for leaf in leaves if backend.is_array(leaf)]
    constants = [leaf for leaf in leaves if not backend.is_array(leaf)]
    if any(hasattr(c, "shape") for c in constants):  # e.g. a batch given as numpy, copied in the run
        return run.run(inputs)
    # Values that are not arrays (a program's hyper-parameters) are constants of the capture, as literals are
    signature = (structure, tuple((a.shape, a.dtype.str) for a in arrays), _literals(run.steps), repr(constants))
    captured = program.graphs.get(signature)
    if captured is None:
        program.calls[signature] += 1
        if program.calls[signature] <= WARMUP_CALLS:
            return run.run(inputs)
        try:
            captured = Captured.of(run, inputs, paths, leaves, structure, backend)
        except Exception as error:  # noqa: BLE001  (any failure to capture: run as before, say why once)
            notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))  # the step that failed
            return _fall_back(program, run, inputs, f"{type(error).__name__}: {error}{notes}")
        program.graphs[signature] = captured
        return captured.outputs_copied()
    return captured.replay(arrays)


@dataclass
class Captured:
    """A captured run: its graph, the static inputs it reads and the static outputs it writes."""

    replay_graph: object  # callable: launches the graph
    static: list  # arrays the graph reads, in leaf order
    out_leaves: list
    out_structure: tuple
    backend: object

    @classmethod
    def of(cls, run, inputs, paths, leaves, structure, backend) -> Captured:
        """`leaves`: the values the run reads, arrays (read from static copies) and constants."""
        copied = [backend.copy(leaf) if backend.is_array(leaf) else leaf for leaf in leaves]
        static = [c for c, leaf in zip(copied, leaves) if backend.is_array(leaf)]
        static_inputs = substitute(inputs, paths, unflatten(structure, copied))
        graph, outputs = backend.capture(lambda watch=None: run.run(static_inputs, watch))
        out_leaves, out_structure = flatten(outputs, backend.is_array)
        if any(leaf is not None and not backend.is_array(leaf) for leaf in out_leaves):
            raise CaptureError("the run returns values that are not arrays on this device")
        captured = cls(graph, static, out_leaves, out_structure, backend)
        graph()  # a capture records the kernels without running them
        return captured

    def replay(self, arrays):
        self.backend.copy_all(self.static, arrays)
        self.replay_graph()
        return self.outputs_copied()

    def outputs_copied(self):
        arrays = [leaf for leaf in self.out_leaves if leaf is not None]
        copies = iter(self.backend.copies(arrays))
        return unflatten(self.out_structure, [None if leaf is None else next(copies) for leaf in self.out_leaves])


def _program(name) -> Program:
    program = _programs.pop(name, None) or Program()
    _programs[name] = program
    while len(_programs) > MAX_PROGRAMS:
        _programs.popitem(last=False)
    return program


def _fall_back(program: Program, run, inputs, why: str):
    program.failed = why
    warnings.warn(f"fused run {run.program!r} runs without a CUDA graph: {why}", RuntimeWarning, stacklevel=3)
    return run.run(inputs)


# ---- the values a run reads -------------------------------------------------------------------------
def read_order(steps) -> list[tuple]:
    """Where the run's steps read its inputs, in the order they first do: (slot,) for a whole input,
    (slot, j) for item j of one (another run's result).  The same values come in the same order
    whichever way the run is given them."""
    order = {}
    for _, _, args in steps:
        for kind, ref in args:
            if kind == "in":
                order.setdefault((ref,), None)
            elif kind == "item":
                order.setdefault(tuple(ref), None)
    return [p for p in order if len(p) == 1 or (p[0],) not in order]


def _at(inputs, path):
    value = inputs[path[0]]
    return value if len(path) == 1 else value[path[1]]


def substitute(inputs, paths, values) -> list:
    """`inputs` with the value at each path replaced (a run's result read item by item becomes a list
    holding the replaced items; the items no step reads become None)."""
    out = list(inputs)
    for path, value in zip(paths, values):
        if len(path) == 1:
            out[path[0]] = value
        else:
            slot, j = path
            if not isinstance(out[slot], list):
                out[slot] = [None] * len(inputs[slot])
            out[slot][j] = value
    return out


def _literals(steps) -> str:
    """The literal arguments of a run's steps (hyper-parameters): a capture holds them as constants."""
    return repr([ref for _, _, args in steps for kind, ref in args if kind == "lit"])


def flatten(value, is_array) -> tuple[list, tuple]:
    """(array leaves in order, structure): tuples and lists are walked, None kept in the structure, an
    array (or anything else) is a leaf."""
    leaves = []

    def walk(v):
        if isinstance(v, (tuple, list)):
            return ("tuple" if isinstance(v, tuple) else "list", tuple(walk(x) for x in v))
        if v is None:
            return None
        leaves.append(v)
        return "leaf"

    return leaves, walk(value)


def unflatten(structure, leaves: list):
    it = iter(leaves)

    def build(s):
        if s is None:
            return None
        if s == "leaf":
            return next(it)
        kind, children = s
        built = [build(c) for c in children]
        return tuple(built) if kind == "tuple" else built

    return build(structure)


# ---- the device ---------------------------------------------------------------------------------------
class TorchBackend:
    """Captures with `torch.cuda.graph` (its private memory pool holds the run's intermediates), cupy
    launching on the capturing stream; cupy allocates from torch's caching allocator
    (`taskrt.device.share_torch_allocator`), so a capture's cupy arrays come from the same pool."""

    def __init__(self):
        import cupy
        import torch

        self.cupy, self.torch = cupy, torch

    def is_array(self, x) -> bool:
        return isinstance(x, self.cupy.ndarray)

    def copy(self, x):
        return x.copy()

    def copy_all(self, targets, sources):
        """Each source into its target, in a few batched kernels (torch's multi-tensor copy): a run
        reads hundreds of arrays (Inception-v3: a kernel launch each would cost milliseconds)."""
        pairs = [(t, s) for t, s in zip(targets, sources) if t.data.ptr != s.data.ptr]
        if pairs:
            self.torch._foreach_copy_([self.tensor(t) for t, _ in pairs], [self.tensor(s) for _, s in pairs])

    def copies(self, arrays) -> list:
        """Fresh contiguous copies of `arrays`: views of one new buffer (one allocation), filled by one
        batched copy.  They share that buffer's lifetime, as a run's outputs mostly do anyway."""
        cupy = self.cupy
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        flat = cupy.empty(max(total, 1), dtype=cupy.uint8)
        out = [flat[o:o + a.nbytes].view(a.dtype).reshape(a.shape) for o, a in zip(offsets, arrays)]
        self.copy_all(out, arrays)
        return out

    def tensor(self, x):
        return self.torch.from_dlpack(x)

    def capture(self, fn):
        """`fn(watch)` captured: `watch(key)`, called after each of its steps, finds the first step
        that broke the capture (a host read, a synchronization, a copy on another stream), named in
        the CaptureError, where CUDA's own error would only say that an earlier operation failed."""
        torch, cupy = self.torch, self.cupy
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        torch.cuda.synchronize()
        # One ordinary call on the static inputs, on the capturing stream, first: cuDNN's autotuner
        # keys its choices by the arrays' alignment too, and a choice it has not made yet cannot be
        # timed inside a capture ("FIND was unable to find an engine", seen on views of tiles)
        with torch.cuda.stream(stream), cupy.cuda.ExternalStream(stream.cuda_stream):
            fn(None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the ordinary calls' cached blocks: the capture's pool takes their place
        is_capturing = getattr(cupy.cuda.runtime, "streamIsCapturing", None)
        broken = []

        def watch(key):
            if not broken and is_capturing is not None and is_capturing(stream.cuda_stream) == INVALIDATED:
                broken.append(key)

        # (As torch.cuda.graph, but the stream is restored even when the capture fails.)  thread_local:
        # the worker's event loop may touch the GPU (reading a loss) while this thread captures.
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                with cupy.cuda.ExternalStream(stream.cuda_stream):
                    outputs = fn(watch)
            except BaseException:
                try:  # the step's own error says more than the capture's end
                    graph.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            try:
                graph.capture_end()
            except Exception as error:
                if broken:
                    raise CaptureError(f"the capture broke at step {broken[0]}: {error}") from error
                raise
        torch.cuda.synchronize()
        return graph.replay, outputs


_backend = None


def _torch_backend():
    global _backend
    if _backend is None:
        if "cupy" not in sys.modules or not enabled():
            return None
        from taskrt.device import share_torch_allocator

        if not share_torch_allocator():
            return None
        _backend = TorchBackend()
    return _backend
