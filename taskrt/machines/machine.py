"""Machine: the device graph.  Devices, the node of each, bandwidth and latency of every pair.

    Machine.local(2)              an embedded LocalCluster: one single-threaded worker process per device
    Machine.from_client(client)   any running Dask cluster, one device per worker (dask-cuda GPUs too)
    Machine.simulated(4, 4, ...)  hardware that is not here, for search and simulation only

Each device is pinned by a Dask resource tag `dev<i>` rather than by worker address, so a
worker that a nanny restarts on a new port still receives its device's tasks.

Its other jobs have rooms of their own: starting a local cluster (`taskrt.machines.local_cluster`),
probing links (`taskrt.machines.link_probe`), measuring the runtime's costs (`taskrt.machines.calibration`) and
the data sheets of simulated device kinds (`taskrt.machines.device_kinds`).
"""

from __future__ import annotations

import atexit
import weakref
from collections import Counter

import numpy as np
import psutil

from taskrt.machines import calibration
from taskrt.machines.calibration import HOP_WORK_S, INLINE_PROBE_BYTES
from taskrt.machines.device_kinds import DEVICE_KINDS, INFINIBAND_100G, NVLINK
from taskrt.machines.devices import Device, MachineError, resource_tag
from taskrt.machines.link_probe import probe_links
from taskrt.machines.worker_setup import KEEP_FREE_SHARE, KEEP_HEAP_SHARE

__all__ = ["DEVICE_KINDS", "HOP_WORK_S", "INFINIBAND_100G", "INLINE_PROBE_BYTES", "NVLINK", "Device", "Machine",
           "MachineError", "probe_links", "resource_tag", "worker_info"]


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
        from taskrt.machines import local_cluster

        client, cluster, gpus = local_cluster.start(n, memory_limit, quiet, gpu)
        machine = cls._adopt(client, cluster=cluster, probe=probe)
        machine._owns_client = True
        # A script that never closes its machine: closed in order at exit, before Python tears the
        # cluster down under the scheduler (which then reports its workers' values lost, as errors)
        atexit.register(_close_at_exit, weakref.ref(machine))
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
                memory = usable_memory(info.get("memory_limit"), found.get("rss", 0))
            devices.append(Device(i, hosts.index(info["host"]), found["kind"], memory))
        # No Active Memory Manager: it may drop a replica a pinned task still reads.
        client.run_on_scheduler(_stop_amm)
        from taskrt.machines.worker_setup import WorkerSetup, freeze_heap
        from taskrt.transport.mailbox import Mailbox
        from taskrt.transport.worker_reads import StepWatch

        client.register_plugin(WorkerSetup())
        client.register_plugin(StepWatch())
        client.register_plugin(Mailbox())  # values sent between devices' programs (taskrt.execution.program_executor)
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
        (`taskrt.machines.worker_setup`).  A Trainer calls it after its first step: its kernels compiled."""
        from taskrt.machines.worker_setup import freeze_heap

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
        """What the runtime costs on this cluster, measured (`taskrt.machines.calibration.calibrate`)."""
        return calibration.calibrate(self)

    def task_overhead(self, independent: int = 200, chain: int = 50, repeats: int = 3) -> dict:
        """Dask's own cost on this cluster per task, hop and export (`taskrt.machines.calibration.task_overhead`)."""
        return calibration.task_overhead(self, independent, chain, repeats)

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


def _close_at_exit(machine_ref) -> None:
    machine = machine_ref()
    if machine is not None and not machine.closed:
        machine.close()


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


def usable_memory(limit, resident: int) -> float | None:
    """Bytes a step's arrays may take on a CPU worker with Dask memory limit `limit` (None or 0:
    unknown): the share below which Dask's worker keeps running tasks (it pauses at
    `distributed.worker.memory.pause` of its limit, 0.8 by default, off on Machine.local's workers;
    its nanny ends it at `...terminate`, 0.95), less what the process holds before any step
    (`resident`: the interpreter, its libraries, Dask), the freed arrays it may keep for reuse
    (taskrt.machines.worker_setup.keep_free_memory) and the free heap glibc may keep
    (taskrt.machines.local_cluster.kept_heap)."""
    if not limit:
        return None
    import dask

    share = (dask.config.get("distributed.worker.memory.pause", 0.8)
             or dask.config.get("distributed.worker.memory.terminate", 0.95) or 1.0)
    return max(float(limit) * share - resident - limit // KEEP_FREE_SHARE - limit // KEEP_HEAP_SHARE, 0.0)


def _describe_device(dask_worker=None) -> dict:
    """This worker's device kind and memory (taskrt.gpu.device), and which GPU it is (PCI bus id)."""
    from taskrt.gpu import device

    out = device.describe()
    out["rss"] = psutil.Process().memory_info().rss  # the worker process before any step
    if device.is_gpu():
        import cupy

        out["gpu"] = cupy.cuda.Device().pci_bus_id
    return out
