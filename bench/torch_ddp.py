"""PyTorch DistributedDataParallel on one-thread CPU processes: what a user would run instead of
taskrt's strategies, the comparison row of bench peer and bench scaling_measured.

Each of `processes` spawned processes (one intra-op thread) holds a TorchPeer of the graph (the
same layers, initial parameters, loss and SGD update as the runtime's) whose parameters belong to
an nn.Module wrapped in torch.nn.parallel.DistributedDataParallel on a gloo process group over
127.0.0.1: DDP's own reducer all-reduces the gradients in buckets during the backward pass and
averages them over the ranks, as any DDP program does.  The global batch is the graph's; each
rank steps on its `batch / processes` samples, so the average of the ranks' batch-mean gradients
is the whole batch's (batch norm aside: each rank normalizes by its own samples, as DDP without
SyncBatchNorm does).

    with DDPRunner(graph, processes=2) as ddp:
        loss = ddp.step(x, y)             # every rank steps on its shard; the ranks' mean loss
        ddp.rank0_times[-1]               # rank 0's seconds for it, from a barrier to its update
    times = ddp_step_times(graph, 2, rounds=7)

The client sends each rank its shard with each step (as a Trainer's client sends its batch);
rank 0's times start at a barrier every rank reaches with its shard in hand.
"""

from __future__ import annotations

import datetime
import time
import traceback

import numpy as np

from taskrt.data.arrays import bind_inputs
from taskrt.search.measured import random_batch

TIMEOUT_S = 300.0  # starting a rank (importing torch), or one step, longer than this is a failure


class DDPUnavailable(RuntimeError):
    """torch, torch.distributed or its gloo backend is missing: callers report the row as skipped."""


def unavailable() -> str | None:
    """Why DDP on gloo cannot run here, or None where it can."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "PyTorch is not installed (pip install '.[torch]')"
    if not dist.is_available():
        return "this PyTorch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this PyTorch build has no gloo backend"
    return None


def _peer_module(peer):
    """An nn.Module owning `peer`'s parameters (the peer's tensors replaced by its nn.Parameters and
    its optimizer rebuilt on them, same hyper-parameters), whose forward is the peer's loss."""
    import torch

    class PeerModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = torch.nn.ParameterList()
            for layer in peer.params.values():
                for k, tensor in layer.items():
                    layer[k] = torch.nn.Parameter(tensor.detach())
                    self.flat.append(layer[k])
            hyper = {k: peer.optimizer.defaults[k] for k in ("lr", "momentum", "weight_decay")}
            peer.optimizer = torch.optim.SGD(list(self.flat), **hyper)

        def forward(self, inputs):
            return peer._loss(peer.activations(inputs, mode="train"))

    return PeerModule()


def _rank(rank, world, port, graph, seed, dtype, hyper, conn, timeout):
    """One rank: a TorchPeer under DDP, stepping on the shards its pipe brings until told to stop
    (or until the client is gone: the pipe's end-of-file)."""
    import torch
    import torch.distributed as dist

    from taskrt.bench.torch_peer import TorchPeer
    from taskrt.planning.params import init_parameters

    try:
        torch.set_num_threads(1)
        limit = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=limit)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
        peer = TorchPeer(graph, init_parameters(graph, seed, dtype), device="cpu", **hyper)
        model = torch.nn.parallel.DistributedDataParallel(_peer_module(peer))
        conn.send(("ready", None))
        while True:
            command, payload = conn.recv()
            if command == "stop":
                break
            if command == "parameters":
                conn.send(("parameters", peer.parameters()))
                continue
            inputs = {name: torch.from_numpy(a) for name, a in payload.items()}
            dist.barrier()  # every rank holds its shard: the ranks step together
            start = time.perf_counter()
            peer.optimizer.zero_grad(set_to_none=True)
            loss = model(inputs)
            loss.backward()  # DDP's reducer all-reduces and averages the gradient buckets here
            peer.optimizer.step()
            conn.send(("step", (float(loss.detach()), time.perf_counter() - start)))
    except EOFError:  # the client is gone
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DDPRunner:
    """`processes` ranks of DDP on the graph's global batch; a context manager (closing stops and,
    where needed, kills them).  `step(x, y)` is a runner as bench.measure.interleaved takes."""

    def __init__(self, graph, processes: int, seed: int = 0, dtype: str = "float32", lr: float = 1e-4,
                 momentum: float = 0.9, weight_decay: float = 0.0, timeout: float = TIMEOUT_S):
        batch = graph.inputs[0].shape[0]
        if processes < 1 or batch % processes:
            raise ValueError(f"DDP on {processes} processes needs a global batch divisible by {processes}; "
                             f"graph {graph.name!r} has batch {batch}")
        reason = unavailable()
        if reason:
            raise DDPUnavailable(reason)
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.graph, self.processes, self.timeout = graph, processes, timeout
        self.np_dtype = np.dtype(dtype)
        self.rank0_times: list[float] = []
        self.ranks, self.conns = [], []
        # the store's server lives here, on a port the system chose: no race for a free port
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        hyper = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        context = mp.get_context("spawn")
        try:
            for rank in range(processes):
                mine, theirs = context.Pipe()
                process = context.Process(target=_rank, daemon=True, name=f"ddp-rank{rank}",
                                          args=(rank, processes, self.store.port, graph, seed, dtype, hyper,
                                                theirs, timeout))
                process.start()
                theirs.close()
                self.ranks.append(process)
                self.conns.append(mine)
            self._replies("ready")
        except BaseException:
            self.close()
            raise

    def _replies(self, expected: str, ranks: int | None = None) -> list:
        """The first `ranks` ranks' replies (all by default), in rank order; a rank that fails, exits
        or takes past the timeout raises (the caller's `with` then stops the rest)."""
        deadline = time.monotonic() + self.timeout
        out = []
        for rank, (conn, process) in enumerate(zip(self.conns[:ranks], self.ranks)):
            while not conn.poll(0.2):
                if not process.is_alive() and not conn.poll():
                    raise RuntimeError(f"DDP rank {rank} exited (code {process.exitcode}) before replying")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"DDP rank {rank}: no reply to {expected!r} in {self.timeout:.0f} s")
            kind, payload = conn.recv()
            if kind == "error":
                exited = [r for r, p in enumerate(self.ranks) if not p.is_alive()]
                raise RuntimeError(f"DDP rank {rank} failed" + (f" (ranks {exited} had exited)" if exited else "")
                                   + f":\n{payload}")
            out.append(payload)
        return out

    def step(self, *data) -> float:
        """One step of every rank on its contiguous shard of the batch; the ranks' mean loss (the
        batch's)."""
        bound = bind_inputs(self.graph, data, self.np_dtype)
        shards = {name: np.split(a, self.processes) for name, a in bound.items()}
        for rank, conn in enumerate(self.conns):
            conn.send(("step", {name: np.ascontiguousarray(s[rank]) for name, s in shards.items()}))
        replies = self._replies("step")
        self.rank0_times.append(replies[0][1])
        return float(np.mean([loss for loss, _ in replies]))

    def parameters(self) -> dict:
        """Rank 0's parameters, {layer: {"weight": ndarray, "bias": ndarray}} (every rank's are equal)."""
        self.conns[0].send(("parameters", None))
        return self._replies("parameters", ranks=1)[0]

    def close(self) -> None:
        """Stop every rank: asked first, then terminated, then killed; none is left behind."""
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for process in self.ranks:
            process.join(10)
        for stop in ("terminate", "kill"):
            for process in self.ranks:
                if process.is_alive():
                    getattr(process, stop)()
                    process.join(5)
        for conn in self.conns:
            conn.close()
        self.ranks, self.conns = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def ddp_step_times(graph, processes: int, rounds: int, warmup: int = 2, seed: int = 0, **options) -> list[float]:
    """Rank 0's seconds for each of `rounds` steps after `warmup` untimed ones, on random data
    (`random_batch`), every step following one of its own; `options` as DDPRunner takes them.
    Raises DDPUnavailable where DDP cannot run, ValueError where the batch does not divide."""
    batch = random_batch(graph, seed)
    with DDPRunner(graph, processes, seed=seed, **options) as ddp:
        for _ in range(warmup + rounds):
            ddp.step(*batch)
        return ddp.rank0_times[warmup:]
