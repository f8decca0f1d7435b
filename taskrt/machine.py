"""Machine: the device graph.  Devices, the node of each, bandwidth and latency of every pair.

    Machine.local(2)              an embedded LocalCluster: one single-threaded worker process per device
    Machine.from_client(client)   any running Dask cluster, one device per worker (dask-cuda GPUs too)
    Machine.simulated(4, 4, ...)  hardware that is not here, for search and simulation only

Each device is pinned by a Dask resource tag `dev<i>` rather than by worker address, so a
worker that a nanny restarts on a new port still receives its device's tasks.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from operator import getitem

import numpy as np

# Peak float32 FLOP/s, memory bandwidth (bytes/s) and memory (bytes) of device kinds used in
# simulation.  Data-sheet figures; the cost model says so wherever it uses them.
DEVICE_KINDS = {
    "P100": {"flops": 9.3e12, "memory_bandwidth": 732e9, "memory": 16e9},
    "V100": {"flops": 14.0e12, "memory_bandwidth": 900e9, "memory": 16e9},
    "A100": {"flops": 19.5e12, "memory_bandwidth": 1555e9, "memory": 40e9},
    # SplitBrain's nodes (seed 000): one 8-core 2.2 GHz Ivy Bridge Xeon, AVX (8-wide fp32 add and
    # multiply each cycle: 16 FLOP/cycle/core), four DDR3-1600 channels, 64 GB
    "IvyBridge-8c": {"flops": 8 * 2.2e9 * 16, "memory_bandwidth": 4 * 12.8e9, "memory": 64e9},
    # Cori's KNL nodes (seed 001): Xeon Phi 7250, 68 cores x 1.4 GHz x 64 fp32 FLOP/cycle, 16 GB MCDRAM
    "KNL-7250": {"flops": 68 * 1.4e9 * 64, "memory_bandwidth": 400e9, "memory": 16e9},
    # The nodes of seed 003: two 28-core 2.5 GHz Xeon Platinum 8180 (Skylake, 112 threads), AVX-512
    # with two FMA units (64 fp32 FLOP/cycle/core), six DDR4-2666 channels per socket
    "SKL-8180x2": {"flops": 2 * 28 * 2.5e9 * 64, "memory_bandwidth": 2 * 6 * 21.33e9, "memory": 192e9},
}
NVLINK = 20e9  # bytes/s, one P100 NVLink direction
INFINIBAND_100G = 12.5e9  # bytes/s, 100 Gb/s EDR


class MachineError(RuntimeError):
    """A cluster that cannot serve as a machine, or a device that was lost."""


@dataclass(frozen=True)
class Device:
    id: int
    node: int
    kind: str
    memory: float | None  # bytes available to tasks, if known


def resource_tag(device: int) -> str:
    return f"dev{device}"


class Machine:
    def __init__(self, devices, bandwidth, latency, client=None, cluster=None, description="", nic_bandwidth=None):
        self.devices: list[Device] = list(devices)
        # bytes/s of the one network interface each node's devices share for traffic between nodes
        # (None: links between nodes are independent)
        self.nic_bandwidth = nic_bandwidth
        self.bandwidth = np.asarray(bandwidth, dtype=float)  # bytes/s from row device to column device
        self.latency = np.asarray(latency, dtype=float)  # seconds
        self.client = client
        self.cluster = cluster  # set only when this machine started it, and so must stop it
        self.description = description
        self._owns_client = False
        self.closed = False
        self.tags: list[str] | None = None  # each device's resource tag, when not dev<i> (see subset)

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def local(cls, n: int = 2, memory_limit="auto", probe=True, quiet=True, gpu: bool = False) -> Machine:
        """Start `n` single-threaded worker processes on 127.0.0.1, dashboard on a free port.

        `gpu=True`: GPU workers, each computing with cupy on one GPU: through dask-cuda's
        LocalCUDACluster (one worker per GPU) when it is installed and `n` equals the GPU count,
        otherwise worker i sees GPU i % count, so several workers may share one GPU (the only way
        to run multi-device plans on a one-GPU machine; their timings are not those of separate
        GPUs)."""
        import dask
        from distributed import Client, Nanny, Scheduler, SpecCluster

        import taskrt.dashboard  # noqa: F401  (registers the dashboard's taskrt page before the scheduler starts)
        from taskrt.batching import shorten_batching

        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Machine.local needs a positive number of devices, got {n!r}")
        gpus = _local_gpu_count() if gpu else 0
        if not gpu and n > (os.cpu_count() or 1):
            logging.getLogger("taskrt").warning(
                "Machine.local(%d) on %d cores: timings are not meaningful, bytes and results are",
                n, os.cpu_count())
        dask.config.set(_DASK_SETTINGS)
        level = logging.WARNING if quiet else logging.INFO
        scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}
        if gpu and n == gpus and _has_dask_cuda():
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(n_workers=n, threads_per_worker=1, host="127.0.0.1",
                                       dashboard_address="127.0.0.1:0", silence_logs=level, memory_limit=memory_limit)
        else:
            def env(i):
                if gpu:
                    return {"TASKRT_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": str(i % gpus)}
                return {"TASKRT_DEVICE": "cpu"}

            workers = {
                i: {"cls": Nanny, "options": {"nthreads": 1, "resources": {resource_tag(i): 1}, "host": "127.0.0.1",
                                              "memory_limit": memory_limit, "silence_logs": level, "env": env(i)}}
                for i in range(n)
            }
            cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=level, name="taskrt")
        client = Client(cluster, set_as_default=False)
        client.wait_for_workers(n)
        shorten_batching(client)  # this cluster is ours: steps wait on its messages (taskrt.batching)
        machine = cls._adopt(client, cluster=cluster, probe=probe)
        machine._owns_client = True
        what = "local devices" if not gpu else (
            f"GPU workers on {gpus} GPU(s)" + (" (workers share GPUs: timings are not those of separate GPUs)"
                                               if n > gpus else ""))
        print(f"taskrt: {n} {what}, dashboard at {client.dashboard_link}")
        return machine

    @classmethod
    def from_client(cls, client, probe=True) -> Machine:
        """Use a running cluster: each worker is one device, in the order of their `dev<i>` resource
        tags if they have them, otherwise sorted by address (tags are then added; a worker
        restarted later loses them unless started with `--resources dev<i>=1`)."""
        return cls._adopt(client, cluster=None, probe=probe)

    @classmethod
    def _adopt(cls, client, cluster, probe) -> Machine:
        workers = worker_info(client)
        if not workers:
            raise MachineError("the Dask cluster has no workers")
        tagged = {}
        for address, info in workers.items():
            tags = [r for r in info.get("resources", {}) if r.startswith("dev") and r[3:].isdigit()]
            if tags:
                tagged[int(tags[0][3:])] = address
        if sorted(tagged) != list(range(len(workers))):
            tagged = dict(enumerate(sorted(workers)))
            for i, address in tagged.items():
                client.run(_set_resource, resource_tag(i), workers=[address])
        hosts = sorted({workers[a]["host"] for a in tagged.values()})
        described = client.run(_describe_device)
        # workers sharing one GPU share its memory
        sharing = Counter((workers[a]["host"], described[a].get("gpu")) for a in tagged.values())
        devices = []
        for i in range(len(tagged)):
            info, found = workers[tagged[i]], described[tagged[i]]
            if found["kind"].startswith("gpu:"):
                memory = found["memory"] / sharing[(info["host"], found["gpu"])]
            else:
                memory = info.get("memory_limit") or None
            devices.append(Device(i, hosts.index(info["host"]), found["kind"], memory))
        # No Active Memory Manager: it may drop a replica a pinned task still reads.
        client.run_on_scheduler(_stop_amm)
        from taskrt.mailbox import Mailbox
        from taskrt.worker_reads import StepWatch
        from taskrt.worker_setup import WorkerSetup, freeze_heap

        client.register_plugin(WorkerSetup())
        client.register_plugin(StepWatch())
        client.register_plugin(Mailbox())  # values sent between devices' programs (taskrt.program_executor)
        # The scheduler's process once, now (with Machine.local it is this process): its modules and
        # Dask's state, not the trainers to come, which must stay collectable when dropped
        client.run_on_scheduler(freeze_heap)
        n = len(devices)
        machine = cls(devices, np.full((n, n), np.inf), np.zeros((n, n)), client=client, cluster=cluster,
                      description=f"{n} Dask workers")
        if probe and n > 1:
            machine.bandwidth, machine.latency = probe_links(machine)
        return machine

    @classmethod
    def simulated(cls, nodes=4, devices_per_node=4, intra_bandwidth=NVLINK, inter_bandwidth=INFINIBAND_100G,
                  latency=5e-6, device_kind="P100") -> Machine:
        """Hardware that is not present: only for search and simulation (no cluster)."""
        if device_kind not in DEVICE_KINDS:
            raise ValueError(f"unknown device kind {device_kind!r}; known: {sorted(DEVICE_KINDS)}")
        if nodes < 1 or devices_per_node < 1:
            raise ValueError(f"need at least one node and one device per node, got {nodes}x{devices_per_node}")
        n = nodes * devices_per_node
        memory = DEVICE_KINDS[device_kind]["memory"]
        devices = [Device(i, i // devices_per_node, device_kind, memory) for i in range(n)]
        node = np.array([d.node for d in devices])
        same = node[:, None] == node[None, :]
        bandwidth = np.where(same, intra_bandwidth, inter_bandwidth).astype(float)
        np.fill_diagonal(bandwidth, np.inf)
        lat = np.full((n, n), float(latency))
        np.fill_diagonal(lat, 0.0)
        return cls(devices, bandwidth, lat, description=f"simulated {nodes}x{devices_per_node} {device_kind}",
                   nic_bandwidth=float(inter_bandwidth) if nodes > 1 else None)

    def subset(self, ids) -> Machine:
        """The devices `ids` of this machine as a machine of their own, renumbered 0..k-1 in the
        order given, on the same cluster (each keeps its resource tag).  Closing it stops nothing."""
        ids = list(ids)
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < self.num_devices for i in ids):
            raise ValueError(f"subset needs distinct device ids in 0..{self.num_devices - 1}, got {ids}")
        devices = [Device(k, self.devices[i].node, self.devices[i].kind, self.devices[i].memory)
                   for k, i in enumerate(ids)]
        grid = np.ix_(ids, ids)
        view = Machine(devices, self.bandwidth[grid], self.latency[grid], client=self.client,
                       description=f"devices {ids} of {self.description}", nic_bandwidth=self.nic_bandwidth)
        view.tags = [self.tag(i) for i in ids]
        return view

    # ---- reading ----------------------------------------------------------------------------
    def tag(self, device: int) -> str:
        """The Dask resource tag that pins tasks to `device`."""
        return resource_tag(device) if self.tags is None else self.tags[device]

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def is_simulated(self) -> bool:
        return self.client is None and not self.closed

    def addresses(self) -> dict[int, str]:
        """Current worker address of each device (it changes when a worker restarts)."""
        out = self.live_devices()
        missing = [d.id for d in self.devices if d.id not in out]
        if missing:
            raise MachineError(f"device(s) {missing} have no worker: the worker was lost or is restarting")
        return out

    def freeze_worker_heaps(self) -> None:
        """Move what the workers hold now out of the reach of Python's garbage collector
        (`taskrt.worker_setup`).  A Trainer calls it after its first step: its kernels compiled."""
        from taskrt.worker_setup import freeze_heap

        self.client.run(freeze_heap, on_error="ignore")  # a worker being lost just now is not an error here

    def live_devices(self) -> dict[int, str]:
        """{device: worker address} of the devices that have a worker now."""
        device_of = {self.tag(d.id): d.id for d in self.devices}
        out = {}
        for address, info in worker_info(self.client).items():
            for tag in info.get("resources", {}):
                if tag in device_of:
                    out[device_of[tag]] = address
        return out

    def calibrate(self) -> dict:
        """What the runtime costs on this cluster, measured: Dask's time per task and per dependent
        hop (`task_overhead`), graph submission per task, from sending a one-task graph to its task
        starting (`first_start_s`), asking the scheduler for the workers (`check_s`, as every step
        does first), one scatter call, the client's
        bandwidth to a worker, directly and carried in a graph through the scheduler, the end of
        a run to the client, and a device's memory bandwidth (an array copy)."""

        import dask

        out = self.task_overhead()
        client, tag = self.client, uuid.uuid4().hex[:8]
        address = self.addresses()
        submit = []
        for r in range(3):
            dsk = {(f"taskrt-submit-{tag}-{r}", i): (_noop,) for i in range(200)}
            with dask.annotate(resources={self.tag(0): 1}):
                start = time.perf_counter()
                futures = client.get(dsk, list(dsk), sync=False)
                submit.append((time.perf_counter() - start) / len(dsk))
            client.gather(futures)
            del futures
        small, large = np.zeros(8), np.zeros(4 * 2**20 // 8)
        scatter, big = [], []
        for _ in range(5):
            start = time.perf_counter()
            [f] = client.scatter([small], workers=[address[0]], hash=False, direct=True)
            scatter.append(time.perf_counter() - start)
            start = time.perf_counter()
            [g] = client.scatter([large], workers=[address[0]], hash=False, direct=True)
            big.append(time.perf_counter() - start)
            del f, g
        inline, first = {8: [], INLINE_PROBE_BYTES: []}, []
        for r in range(7):  # a graph carrying a step's data (taskrt.executor.INLINE_DATA_BYTES), small and not
            for nbytes in inline:
                key = (f"taskrt-inline-{tag}-{r}-{nbytes}", 0)
                with dask.annotate(resources={self.tag(0): 1}):
                    sent, start = time.time(), time.perf_counter()
                    [future] = client.get({key: (_started, np.zeros(nbytes // 8))}, [key], sync=False)
                    started = future.result()
                inline[nbytes].append(time.perf_counter() - start)
                if nbytes == 8:  # the least a step waits for its first task (the hosts' clocks agree)
                    first.append(started - sent)
                del future
        from taskrt.worker_reads import ask

        answer = []
        for r in range(5):  # a step's reads on its workers (taskrt.worker_reads): end of a run to the client
            key = (f"taskrt-answer-{tag}-{r}", 0)
            with dask.annotate(resources={self.tag(0): 1}):
                [future] = client.get({key: (_sleep_until_done, 0.02)}, [key], sync=False)
            ended = client.sync(ask, client, address[0], [(key, None, key, 0)], 5.0)
            if ended is not None:
                answer.append(time.time() - ended[0])
            del future
        check = []
        for _ in range(7):  # a step first asks which devices have a worker (Trainer._check_state)
            start = time.perf_counter()
            self.live_devices()
            check.append(time.perf_counter() - start)
        copy = client.run(_copy_rate, workers=[address[0]])[address[0]]
        fresh = client.run(_copy_rate, fresh=True, workers=[address[0]])[address[0]]
        out.update(self._cpu_costs())
        out.update({
            "submit_per_task_s": statistics.median(submit),
            "scatter_s": statistics.median(scatter),
            "client_bandwidth": large.nbytes / max(statistics.median(big) - statistics.median(scatter), 1e-9),
            "memory_bandwidth": copy,
            "fresh_copy_bandwidth": fresh,
            "answer_s": statistics.median(answer) if answer else out["per_hop_s"],
            "first_start_s": max(statistics.median(first), 0.0),  # a one-task graph sent: its task starts
            "check_s": statistics.median(check),  # one question to the scheduler: the workers now
            # what carrying a byte in a graph adds (on a quiet local host: below the noise, 0)
            "inline_per_byte_s": max(statistics.median(inline[INLINE_PROBE_BYTES]) - statistics.median(inline[8]),
                                     0.0) / INLINE_PROBE_BYTES,
        })
        return out

    def _cpu_costs(self, tasks: int = 300, nbytes: int = 16 * 2**20, messages: int = 4, small: int = 50) -> dict:
        """Processor time the runtime itself spends (workers, and this process where the local
        scheduler runs): per task, per message between two devices (beyond the task reading it;
        `small` messages of 1 KiB) and per byte moved between them (`messages` of `nbytes`).  On
        a machine whose devices share few cores this time competes with the kernels."""

        import dask

        client, tag = self.client, uuid.uuid4().hex[:8]
        address = self.addresses()

        def total():
            return sum(client.run(_process_cpu).values()) + _process_cpu()

        with dask.annotate(resources={self.tag(0): 1}):
            dsk = {(f"taskrt-cpu-{tag}", i): (_noop,) for i in range(tasks)}
            before = total()
            client.gather(client.get(dsk, list(dsk), sync=False))
            per_task = (total() - before) / tasks
        per_byte = per_message = 0.0
        if self.num_devices > 1:
            per_message = self._cpu_per_message(total, small)
            rounds = []
            for r in range(3):  # the first round's receiver takes its first large messages: the median counts
                # the payloads are made first: filling them is a kernel's work, not moving bytes
                payloads = [client.submit(_payload, nbytes, key=f"taskrt-cpu-bytes-{tag}-{r}-{i}",
                                          workers=[address[0]], allow_other_workers=False, pure=False)
                            for i in range(messages)]
                client.gather([client.submit(_touch, p, workers=[address[0]], allow_other_workers=False, pure=False)
                               for p in payloads])
                time.sleep(0.05)
                before = total()
                for payload in payloads:
                    client.submit(_touch, payload, workers=[address[1]], allow_other_workers=False,
                                  pure=False).result()
                time.sleep(0.05)
                # the touch tasks are tasks, and each brings one message: both are counted apart
                rounds.append(max((total() - before) - messages * (per_task + per_message), 0.0) / (messages * nbytes))
                del payloads, payload
            per_byte = statistics.median(rounds)
        return {"cpu_per_task_s": per_task, "cpu_per_message_s": per_message, "cpu_per_byte_s": per_byte,
                "cores": self._effective_cores()}

    def _cpu_per_message(self, total, count: int, rounds: int = 3) -> float:
        """Processor time of one small message between devices 0 and 1: tasks reading small values
        made on device 0, run on device 1 against the same tasks run on device 0 (median of rounds)."""
        client, address = self.client, self.addresses()

        def touch_all(values, device):
            before = total()
            client.gather([client.submit(_touch, v, workers=[address[device]], allow_other_workers=False,
                                         pure=False) for v in values])
            time.sleep(0.05)
            return total() - before

        estimates = []
        for _ in range(rounds):
            values = [client.submit(_payload, 1024, workers=[address[0]], allow_other_workers=False, pure=False)
                      for _ in range(count)]
            client.gather(values)
            local = touch_all(values, 0)
            remote = touch_all(values, 1)
            estimates.append(max(remote - local, 0.0) / count)
            del values
        return statistics.median(estimates)

    def _effective_cores(self, repeats: int = 5, rounds: int = 3) -> float:
        """How many kernels the host really runs at once: the same convolution timed alone on one
        device, then on min(devices, cores) devices at once; the sum of the speeds relative to
        alone (two virtual cores may not give two cores' worth of work).  Alone and together
        alternate for a few rounds and the median counts, as the machine's speed drifts."""

        cores = os.cpu_count() or 1
        k = min(self.num_devices, cores)
        if k < 2:
            return float(cores)
        client = self.client
        address = self.addresses()

        def timed(devices):
            return client.gather([client.submit(_conv_seconds, repeats, workers=[address[i]],
                                                allow_other_workers=False, pure=False) for i in devices])

        estimates = []
        for _ in range(rounds):
            [alone] = timed([0])
            together = timed(range(k))
            estimates.append(cores - k + sum(alone / t for t in together))
        return float(min(cores, statistics.median(estimates)))

    def task_overhead(self, independent: int = 200, chain: int = 50, repeats: int = 3) -> dict:
        """Dask's own cost on this cluster, measured with trivial tasks pinned to device 0: seconds
        per independent no-op task (throughput), per dependent hop (a task waiting on the one
        before; between tasks that compute for HOP_WORK_S, the work not counted),
        and per export (taking a value out of a tuple, as after a fused run); with two devices or
        more, per dependent hop that alternates between devices 0 and 1 (`per_cross_hop_s`)."""

        import dask

        from taskrt.worker_setup import INLINE

        client, tag = self.client, uuid.uuid4().hex[:8]
        per_task, per_hop, per_export = [], [], []
        with dask.annotate(resources={self.tag(0): 1}):
            for r in range(repeats):
                dsk = {(f"taskrt-noop-{tag}-{r}", i): (_noop,) for i in range(independent)}
                start = time.perf_counter()
                client.gather(client.get(dsk, list(dsk), sync=False))
                per_task.append((time.perf_counter() - start) / independent)
                per_hop.append(self._hop_s(f"taskrt-chain-{tag}-{r}", chain, lambda i: 0))
                # a fused run's exports: values taken out of one result, on the workers' event loop
                name = f"taskrt-export-{tag}-{r}"
                dsk = {(name, -1): (_numbers, independent), **{(name, i): (getitem, (name, -1), i)
                                                                 for i in range(independent)}}
                with dask.annotate(executor=lambda key: INLINE if key[1] >= 0 else "default"):
                    start = time.perf_counter()
                    client.gather(client.get(dsk, [(name, i) for i in range(independent)], sync=False))
                per_export.append((time.perf_counter() - start) / independent)
        out = {"per_task_s": statistics.median(per_task), "per_hop_s": statistics.median(per_hop),
               "export_s": statistics.median(per_export)}
        if self.num_devices > 1:  # a hop to another device: its worker also fetches the value
            out["per_cross_hop_s"] = statistics.median(
                self._hop_s(f"taskrt-cross-{tag}-{r}", chain, lambda i: i % 2) for r in range(repeats))
        return out

    def _hop_s(self, name: str, chain: int, device_of) -> float:
        """Seconds per hop of a chain of `chain` tasks, task i on device `device_of(i)`, each
        computing HOP_WORK_S (not counted)."""
        import dask

        dsk = {(name, 0): (_compute, HOP_WORK_S),
               **{(name, i): (_compute, HOP_WORK_S, (name, i - 1)) for i in range(1, chain)}}
        tags = {key: {self.tag(device_of(key[1])): 1} for key in dsk}
        with dask.annotate(resources=lambda key: tags[key]):
            start = time.perf_counter()
            self.client.gather(self.client.get(dsk, [(name, chain - 1)], sync=False))
        return (time.perf_counter() - start) / chain - HOP_WORK_S

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst or nbytes == 0:
            return 0.0
        return float(self.latency[src, dst] + nbytes / self.bandwidth[src, dst])

    def describe(self) -> dict:
        return {
            "description": self.description,
            "devices": [d.__dict__ for d in self.devices],
            "bandwidth_bytes_per_s": np.where(np.isinf(self.bandwidth), -1, self.bandwidth).tolist(),
            "latency_s": self.latency.tolist(),
            "nic_bandwidth_bytes_per_s": self.nic_bandwidth,
        }

    def __repr__(self):
        return f"Machine({self.description})"

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self):
        """Stop what this machine started (the local cluster and its client), and only that."""
        if self._owns_client and self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.client = self.cluster = None
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


INLINE_PROBE_BYTES = 2**20  # the most a graph carries (taskrt.executor.INLINE_DATA_BYTES)
# Hops are timed between tasks that compute this long (a short kernel): a worker's event loop then
# shares the processor with the task, as in a step.  Between no-op tasks a hop cost 0.1-0.8 ms
# less on local(2), on one device and between two (three rounds of chains of 50).
HOP_WORK_S = 0.002

_DASK_SETTINGS = {
    "distributed.scheduler.active-memory-manager.start": False,
    # Dask's debugging logs (transitions, events, each message stream's recent messages with their
    # task specs) 100 entries long, not 1000: fewer objects for Python's full garbage collections
    # to walk in the scheduler (taskrt.worker_setup); the workers' transfer logs stay long
    "distributed.admin.low-level-log-length": 100,
    "distributed.worker.daemon": False,
    # A step's temporaries must land on memory the worker already has.  Dask's nanny gives its workers
    # MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's dynamic mmap threshold: every large
    # temporary became a fresh mmap that page-faulted again (kernels 1.6x slower than in-process).
    # glibc's defaults are not enough either: tasks run on a worker thread, whose malloc arena gives
    # whole 64 MiB heaps back to the system as soon as they are empty, so the next step faults them in
    # again (VGG-16-32: 14,000 page faults and 80 ms of system time per step, against 80 faults
    # in-process).  One arena, allocations up to 32 MiB (glibc's largest threshold) from it, and up to
    # 1 GiB of free memory kept: 150 faults and 2 ms.  Larger arrays come from ops.reuse.
    "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 1,
    "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 32 << 20,
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 1 << 30,
}


def worker_info(client) -> dict:
    """The scheduler's current view of the workers, fetched now.  (`client.scheduler_info()` returns
    a cache that the client's periodic refresh may overwrite with a copy without workers.)"""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def _stop_amm(dask_scheduler=None):
    amm = getattr(dask_scheduler.extensions.get("amm"), "stop", None)
    if amm is not None:
        amm()


async def _set_resource(tag, dask_worker=None):
    await dask_worker.set_resources(**{**dask_worker.state.total_resources, tag: 1})


def _describe_device(dask_worker=None) -> dict:
    """This worker's device kind and memory (taskrt.device), and which GPU it is (PCI bus id)."""
    from taskrt import device

    out = device.describe()
    if device.is_gpu():
        import cupy

        out["gpu"] = cupy.cuda.Device().pci_bus_id
    return out


def _local_gpu_count() -> int:
    """GPUs this host's processes can use; a clear error when there are none."""
    try:
        import cupy
    except ImportError:
        raise MachineError("Machine.local(gpu=True) needs cupy, which is not installed: pip install "
                           "'taskrt[gpu]' (cupy-cuda12x) or cupy-cuda13x, to match the CUDA driver") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (a CUDA runtime error: no driver, no device)
        raise MachineError(f"Machine.local(gpu=True): cupy finds no CUDA device ({e})") from None
    if count < 1:
        raise MachineError("Machine.local(gpu=True): no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    return count


def _has_dask_cuda() -> bool:
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None


def _noop(*args):
    return None


def _compute(seconds, *args):
    """Keep the processor busy for `seconds` (small matrix products, as kernels do)."""
    a = np.full((64, 64), 0.01, dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.tanh(a @ a)


def _started(*args):
    """The time the task starts."""
    return time.time()


def _numbers(count):
    return tuple(range(count))


def _sleep_until_done(seconds):
    """Sleep, then return the time the task ends."""
    time.sleep(seconds)
    return time.time()


def _conv_seconds(repeats):
    """Median seconds of a mid-sized convolution's forward and backward (a typical kernel)."""

    from ops import Conv2d
    from ops.rect import Rect

    op = Conv2d(((8, 64, 28, 28),), 64, (3, 3), (1, 1), (1, 1), "relu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(op.in_shapes[0]).astype(np.float32)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in op.param_shapes().items()}
    out = Rect.full(op.out_shape)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = op.forward([x], params, out)
        op.backward(y, [x], y, params, out, [True])
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _process_cpu(dask_worker=None, dask_scheduler=None) -> float:
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def _copy_rate(dask_worker=None, fresh=False, nbytes=32 * 2**20, repeats=5):
    """Bytes per second of an array copy on this worker's device: into a reused buffer (read and
    write counted once each), or with `fresh` the bytes copied into newly allocated memory (what a
    slice task does: its output is fresh, so the copy pays the page faults too)."""
    from taskrt import device

    xp = device.array_module()
    src = xp.ones(nbytes // 8)
    dst = None if fresh else xp.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        device.synchronize()
        start = time.perf_counter()
        if fresh:
            copied = src.copy()
        else:
            xp.copyto(dst, src)
        device.synchronize()
        times.append(time.perf_counter() - start)
        if fresh:
            del copied
    return (1 if fresh else 2) * nbytes / float(np.median(times[1:]))  # the first run warms up


# ---- link probe -----------------------------------------------------------------------------
def _payload(nbytes):
    """An array on the worker's device: GPU workers' links are probed with what they send (cupy)."""
    from taskrt import device

    return device.array_module().ones(nbytes // 8, dtype=np.float64)


def _touch(x):
    return x.nbytes


def probe_links(machine, small=1024, large=8 * 2**20, repeats=3):
    """Bandwidth and latency of every ordered device pair, from the durations Dask records for
    real worker-to-worker transfers of a small and a large array (medians of `repeats`, after
    one transfer that opens the connection)."""
    client, n = machine.client, machine.num_devices
    address = machine.addresses()
    tag = uuid.uuid4().hex[:8]
    keys = {}
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            for r, size in enumerate([small] + [small, large] * repeats):
                key = f"taskrt-probe-{tag}-{src}-{dst}-{r}"
                payload = client.submit(_payload, size, key=key, workers=[address[src]],
                                        allow_other_workers=False, pure=False)
                client.submit(_touch, payload, workers=[address[dst]], allow_other_workers=False,
                              pure=False).result()
                if r > 0:
                    keys[key] = (src, dst, size)
                del payload
    durations: dict[tuple, list[float]] = {}
    for entries in client.run(_probe_log, f"taskrt-probe-{tag}").values():
        for key, seconds in entries:
            if key in keys:
                durations.setdefault(keys[key], []).append(seconds)
    bandwidth, latency = np.full((n, n), np.inf), np.zeros((n, n))
    for src in range(n):
        for dst in range(n):
            if src != dst:
                t_small = float(np.median(durations[(src, dst, small)]))
                t_large = float(np.median(durations[(src, dst, large)]))
                latency[src, dst] = t_small
                bandwidth[src, dst] = (large - small) / max(t_large - t_small, 1e-9)
    return bandwidth, latency


def _probe_log(prefix, dask_worker=None):
    out = []
    for entry in dask_worker.transfer_incoming_log:
        for key in entry["keys"]:
            if isinstance(key, str) and key.startswith(prefix):
                out.append((key, entry["duration"]))
    return out
