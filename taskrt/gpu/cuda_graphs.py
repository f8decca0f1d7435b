"""A device's fused run replayed as a CUDA graph: one launch for all of its kernels.  Runs on workers.

On a GPU worker the Python that launches a step's kernels costs more than the kernels: measured
on an H100, an Inception-v3 step (batch 64, one device, 1,286 tasks) spent 350 ms launching what
PyTorch's own step does in 112 ms.  A fused run (`taskrt.planning.fusion.FusedRun`) computes the same
function of its inputs at every step, so after `WARMUP_CALLS` ordinary calls (cuDNN's autotuner
times its algorithms during the first) its kernels are captured once into a CUDA graph that reads
static copies of its inputs.  Every later call copies its inputs in, replays the graph and copies
its outputs out: values the step returns are fresh arrays, as an ordinary call returns, so a value
Dask still holds (a snapshot's state, a loss not yet read) is never overwritten by a later replay.

The copies are part of the graph: a copy kernel at its start reads where this call's inputs lie
from a table of addresses, and one at its end writes the outputs into a fresh buffer named in the
same table, so a call costs the host one upload of the table, the graph's launch and a view per
output.  (Copying array by array through torch took 9.7 ms for Inception-v3's 286 inputs and 9.5
ms for its outputs on an H200, where their bytes take a fraction of a millisecond to move: the
host's time per array.)  The copy kernel checks itself once per process before the first capture;
a wrong result turns replay off in that process, saying why.

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
import threading
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy

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
    steps: tuple | None = None  # the steps `reads` last saw, and what they read
    paths: list = field(default_factory=list)
    literals: str = ""

    def reads(self, steps) -> tuple[list, str]:
        """`read_order(steps)` and `_literals(steps)`, worked out again only for other steps (a program
        hands its worker the same runs every step; Inception-v3's one run: 1 ms a call otherwise)."""
        if self.steps is not steps:
            self.steps, self.paths, self.literals = steps, read_order(steps), _literals(steps)
        return self.paths, self.literals


_programs: OrderedDict = OrderedDict()  # run name -> Program, most recently used last


def enabled() -> bool:
    """Replay on this worker: a GPU worker whose torch has CUDA, unless TASKRT_CUDA_GRAPHS=0."""
    if os.environ.get("TASKRT_CUDA_GRAPHS", "1") == "0":
        return False
    from taskrt.gpu.device import is_gpu

    if not is_gpu():
        return False
    from taskrt.ops.torch_kernels import torch_cuda_available

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
    """Per captured graph of this process (median of `repeats`): the GPU milliseconds of its replay,
    its copies in and out included (CUDA events), and the host milliseconds of a call that replays
    it (the table's upload, the launch and the output views, without waiting for the GPU).
    {run name: {...}}."""
    import time

    backend = _torch_backend()
    if backend is None:
        return {}
    torch = backend.torch

    def median(times):
        return sorted(times)[len(times) // 2]

    def gpu_ms(fn):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return median(times)

    def host_ms(fn):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
        return median(times)

    out = {}
    for name, program in _programs.items():
        for captured in program.graphs.values():
            def call(c=captured):
                return c.replay(c.static)  # its own inputs: the copy in leaves them as they are

            out[name] = {"replay_ms": gpu_ms(call), "host_ms": host_ms(call), "inputs": len(captured.static),
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
    paths, literals = program.reads(run.steps)
    values = [_at(inputs, path) for path in paths]
    leaves, structure = flatten(values, backend.is_array)
    arrays = [leaf for leaf in leaves if backend.is_array(leaf)]
    constants = [leaf for leaf in leaves if not backend.is_array(leaf)]
    if any(hasattr(c, "shape") for c in constants):  # e.g. a batch given as numpy, copied in the run
        return run.run(inputs)
    # Values that are not arrays (a program's hyper-parameters) are constants of the capture, as literals are
    signature = (structure, tuple((a.shape, a.dtype.str) for a in arrays), literals, repr(constants))
    captured = program.graphs.get(signature)
    if captured is None:
        program.calls[signature] += 1
        if program.calls[signature] <= WARMUP_CALLS:
            return run.run(inputs)
        try:
            captured = Captured(run, inputs, paths, leaves, structure, backend)
        except Exception as error:  # noqa: BLE001  (any failure to capture: run as before, say why once)
            notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))  # the step that failed
            return _fall_back(program, run, inputs, f"{type(error).__name__}: {error}{notes}")
        program.graphs[signature] = captured
    return captured.replay(arrays)


COPY_THREADS = 256  # threads of a block of the copy kernel
COPY_BLOCK_BYTES = 65536  # bytes one block of the copy kernel moves (16 per thread per pass)
UPLOAD_RING = 8  # pinned buffers a worker's table uploads take in turn


def copy_layout(nbytes) -> tuple:
    """The copy kernel's first block of each segment and the blocks in all (a segment of n bytes
    takes ceil(n / COPY_BLOCK_BYTES) blocks)."""
    first, blocks = [], 0
    for n in nbytes:
        first.append(blocks)
        blocks += -(-n // COPY_BLOCK_BYTES)
    return first, blocks


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class Captured:
    """A captured run: its graph, the static inputs it reads and the static outputs it writes, and the
    table of addresses its copy kernels read at every replay.

    The table (uint64) holds two copy tables, one for the inputs and one for the outputs, each of
    m rows: m source addresses, m destination addresses, m byte counts and m first blocks
    (`copy_layout`).  A replay fills in the inputs' sources (this call's arrays) and the outputs'
    destinations (a fresh buffer), uploads the table and launches the graph."""

    def __init__(self, run, inputs, paths, leaves, structure, backend):
        """`leaves`: the values the run reads, arrays (read from static copies) and constants."""
        self.backend = backend
        copied = [backend.copy(leaf) if backend.is_array(leaf) else leaf for leaf in leaves]
        self.static = [c for c, leaf in zip(copied, leaves) if backend.is_array(leaf)]  # contiguous copies
        static_inputs = substitute(inputs, paths, unflatten(structure, copied))

        def body(watch=None):  # outputs contiguous: the copy out moves bytes
            outputs = run.run(static_inputs, watch)
            out_leaves, out_structure = flatten(outputs, backend.is_array)
            if any(leaf is not None and not backend.is_array(leaf) for leaf in out_leaves):
                raise CaptureError("the run returns values that are not arrays on this device")
            return unflatten(out_structure, [None if leaf is None else backend.contiguous(leaf)
                                             for leaf in out_leaves])

        first_outputs = backend.ordinary_call(body)  # its outputs' number and sizes size the table
        first_leaves, _ = flatten(first_outputs, backend.is_array)
        in_bytes = [a.nbytes for a in self.static]
        out_bytes = [leaf.nbytes for leaf in first_leaves if leaf is not None]
        self.m_in, self.m_out = len(in_bytes), len(out_bytes)
        del first_outputs, first_leaves
        self.table = backend.device_table(4 * (self.m_in + self.m_out))
        tables = (self.table[:4 * self.m_in], self.table[4 * self.m_in:])
        first_in, self.blocks_in = copy_layout(in_bytes)
        first_out, self.blocks_out = copy_layout(out_bytes)

        def copy_in():
            backend.copy_segments(tables[0], self.m_in, self.blocks_in)

        def copy_out():
            backend.copy_segments(tables[1], self.m_out, self.blocks_out)

        self.replay_graph, outputs = backend.capture(body, copy_in, copy_out)
        self.out_leaves, self.out_structure = flatten(outputs, backend.is_array)
        arrays = [leaf for leaf in self.out_leaves if leaf is not None]
        if [a.nbytes for a in arrays] != out_bytes:
            raise CaptureError("the captured run returned other outputs than its ordinary call")
        self.offsets, self.out_bytes = [], 0  # where each output lies in the buffer of a call's outputs
        for a in arrays:
            self.offsets.append(self.out_bytes)
            self.out_bytes = aligned(self.out_bytes + a.nbytes)
        self.shapes = [(a.shape, a.dtype) for a in arrays]
        host = [0] * (4 * (self.m_in + self.m_out))
        m, o = self.m_in, 4 * self.m_in
        host[m:2 * m] = [backend.address(a) for a in self.static]  # inputs: sources filled per call
        host[2 * m:3 * m], host[3 * m:4 * m] = in_bytes, first_in
        n = self.m_out
        host[o:o + n] = [backend.address(a) for a in arrays]  # outputs: destinations filled per call
        host[o + 2 * n:o + 3 * n], host[o + 3 * n:o + 4 * n] = out_bytes, first_out
        self.host_table = host
        self._lock = threading.Lock()  # one call at a time fills the table (a worker with threads)
        self._held = []  # contiguous copies of the last call's strided inputs, until the next call

    def replay(self, arrays):
        backend, host = self.backend, self.host_table
        contiguous = [backend.contiguous(a) for a in arrays]
        buffer = backend.empty_bytes(self.out_bytes)
        base, o = backend.address(buffer), 4 * self.m_in + self.m_out
        with self._lock:
            self._held = [c for c, a in zip(contiguous, arrays) if c is not a]
            host[:self.m_in] = [backend.address(a) for a in contiguous]
            host[o:o + self.m_out] = [base + offset for offset in self.offsets]
            backend.upload(self.table, host)
            self.replay_graph()
        views = iter([backend.view(buffer, offset, shape, dtype)
                      for offset, (shape, dtype) in zip(self.offsets, self.shapes)])
        return unflatten(self.out_structure, [None if leaf is None else next(views) for leaf in self.out_leaves])


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
# Copies the segments of one copy table (see Captured): block b finds its segment by the first blocks,
# then moves its COPY_BLOCK_BYTES of it, 16 bytes a thread where both addresses allow, else bytes.
COPY_KERNEL = r"""
extern "C" __global__ void copy_segments(const unsigned long long* table, const int m) {
    const unsigned long long* src = table;
    const unsigned long long* dst = table + m;
    const unsigned long long* nbytes = table + 2 * (long long)m;
    const unsigned long long* first = table + 3 * (long long)m;
    const unsigned long long block = blockIdx.x;
    int lo = 0, hi = m - 1;  /* the last segment starting at or before this block */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= block) lo = mid; else hi = mid - 1;
    }
    const unsigned long long n = nbytes[lo];
    const unsigned long long start = (block - first[lo]) * BLOCK_BYTES;
    if (start >= n) return;
    const unsigned long long end = start + BLOCK_BYTES < n ? start + BLOCK_BYTES : n;
    const char* s = (const char*)src[lo];
    char* d = (char*)dst[lo];
    unsigned long long k = start;
    if ((((unsigned long long)s | (unsigned long long)d) & 15ULL) == 0) {
        const unsigned long long vend = start + ((end - start) & ~15ULL);
        for (unsigned long long v = start + 16ULL * threadIdx.x; v < vend; v += 16ULL * blockDim.x)
            *(uint4*)(d + v) = *(const uint4*)(s + v);
        k = vend;
    }
    for (k += threadIdx.x; k < end; k += blockDim.x) d[k] = s[k];
}
"""


def copy_kernel_source() -> str:
    return f"#define BLOCK_BYTES {COPY_BLOCK_BYTES}ULL\n" + COPY_KERNEL


class TorchBackend:
    """Captures with `torch.cuda.graph` (a private memory pool, shared by the worker's captures, holds
    the runs' intermediates), cupy launching on the capturing stream; cupy allocates from torch's
    caching allocator (`taskrt.gpu.device.share_torch_allocator`), so a capture's cupy arrays come from
    that pool."""

    def __init__(self):
        import cupy
        import cupyx
        import torch

        self.cupy, self.cupyx, self.torch = cupy, cupyx, torch
        self.kernel = cupy.RawKernel(copy_kernel_source(), "copy_segments")
        self._ring = [{"buffer": None, "event": None} for _ in range(UPLOAD_RING)]
        self.pool = None  # the captures' memory pool (torch.cuda.graph_pool_handle), made at the first capture
        self._next = 0
        self._ring_lock = threading.Lock()

    def is_array(self, x) -> bool:
        return isinstance(x, self.cupy.ndarray)

    def copy(self, x):
        return x.copy()

    def contiguous(self, x):
        return x if x._c_contiguous else self.cupy.ascontiguousarray(x)

    def address(self, x) -> int:
        return x.data.ptr

    def device_table(self, n: int):
        return self.cupy.zeros(n, dtype=self.cupy.uint64)

    def upload(self, table, host: list):
        """The host's table into `table`, in order on the stream the graph replays on, from one of a
        ring of pinned buffers (from pageable memory the driver may wait for the stream first: the
        host would stop running ahead of the GPU).  A buffer is filled again once its copy is done."""
        if not host:
            return
        runtime = self.cupy.cuda.runtime
        with self._ring_lock:
            slot = self._ring[self._next]
            self._next = (self._next + 1) % len(self._ring)
            if slot["event"] is None:
                slot["event"] = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            else:
                runtime.eventSynchronize(slot["event"])  # its last copy, UPLOAD_RING uploads ago
            if slot["buffer"] is None or slot["buffer"].size < len(host):
                slot["buffer"] = self.cupyx.empty_pinned(max(len(host), 1024), dtype=numpy.uint64)
            buffer = slot["buffer"]
            buffer[:len(host)] = host
            stream = self.torch.cuda.current_stream().cuda_stream
            runtime.memcpyAsync(table.data.ptr, buffer.ctypes.data, 8 * len(host), runtime.memcpyHostToDevice,
                                stream)
            runtime.eventRecord(slot["event"], stream)

    def copy_segments(self, table, m: int, blocks: int):
        if blocks:
            self.kernel((blocks,), (COPY_THREADS,), (table, numpy.int32(m)))

    def empty_bytes(self, n: int):
        return self.cupy.empty(max(n, 1), dtype=self.cupy.uint8)

    def view(self, buffer, offset: int, shape, dtype):
        return self.cupy.ndarray(shape, dtype, memptr=buffer.data + offset)

    def check_copies(self):
        """The copy kernel against cupy's own copies, on segments of odd sizes and alignments (run once
        before the first capture, which also loads the kernel outside any capture)."""
        cupy = self.cupy
        source = (cupy.arange(3 * COPY_BLOCK_BYTES, dtype=cupy.uint64) % 251).astype(cupy.uint8)
        target = cupy.zeros_like(source)
        pieces = [(0, 0, 2 * COPY_BLOCK_BYTES + 48), (3, 5, 1000), (16, 32, 0), (64, 2 * COPY_BLOCK_BYTES + 64, 17)]
        rows = [source.data.ptr + s for s, _, _ in pieces], [target.data.ptr + t for _, t, _ in pieces]
        nbytes = [n for _, _, n in pieces]
        first, blocks = copy_layout(nbytes)
        table = self.device_table(4 * len(pieces))
        self.upload(table, [*rows[0], *rows[1], *nbytes, *first])
        self.copy_segments(table, len(pieces), blocks)
        expected = cupy.zeros_like(source)
        for s, t, n in pieces:
            expected[t:t + n] = source[s:s + n]
        if not bool((target == expected).all()):
            raise CaptureError("the copy kernel copied wrongly on this GPU")

    def ordinary_call(self, body):
        """`body()` once on the static inputs, on a capturing stream, outside a capture: cuDNN's
        autotuner keys its choices by the arrays' alignment too, and a choice it has not made yet cannot
        be timed inside a capture ("FIND was unable to find an engine", seen on views of tiles)."""
        torch, cupy = self.torch, self.cupy
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream), cupy.cuda.ExternalStream(stream.cuda_stream):
            outputs = body()
        torch.cuda.synchronize()
        return outputs

    def capture(self, body, copy_in, copy_out):
        """`copy_in(); body(watch); copy_out()` captured: `watch(key)`, called after each of the body's
        steps, finds the first step that broke the capture (a host read, a synchronization, a copy on
        another stream), named in the CaptureError, where CUDA's own error would only say that an
        earlier operation failed.  Returns (replay, the body's outputs)."""
        torch, cupy = self.torch, self.cupy
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the ordinary calls' cached blocks: the capture's pool takes their place
        is_capturing = getattr(cupy.cuda.runtime, "streamIsCapturing", None)
        broken = []

        def watch(key):
            if broken or is_capturing is None:
                return
            try:
                status = is_capturing(stream.cuda_stream)
            except RuntimeError:  # cupy's answer where the capture was invalidated
                status = INVALIDATED
            if status == INVALIDATED:
                broken.append(key)

        # (As torch.cuda.graph, but the stream is restored even when the capture fails.)  thread_local:
        # the worker's event loop may touch the GPU (reading a loss) while this thread captures.  One
        # memory pool for every capture of the worker: nothing a graph leaves in it is read after its
        # replay (its static outputs are copied out inside it, its static inputs lie outside), and
        # replays queue on one stream, so a graph's intermediates may lie where another's did.
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                with cupy.cuda.ExternalStream(stream.cuda_stream):
                    copy_in()
                    outputs = body(watch)
                    copy_out()
            except BaseException as error:
                try:  # the step's own error says more than the capture's end
                    graph.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                if broken and isinstance(error, Exception):  # a later step failed for an earlier one's break
                    raise CaptureError(f"the capture broke at step {broken[0]}: {error}") from error
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
        from taskrt.gpu.device import share_torch_allocator

        if not share_torch_allocator():
            return None
        backend = TorchBackend()
        try:
            backend.check_copies()
        except Exception as error:  # noqa: BLE001  (replay off in this process, said once)
            os.environ["TASKRT_CUDA_GRAPHS"] = "0"
            warnings.warn(f"CUDA graphs are off on this worker: {type(error).__name__}: {error}", RuntimeWarning,
                          stacklevel=2)
            return None
        _backend = backend
    return _backend
