"""Probing the links of a cluster: bandwidth and latency of every ordered device pair, from
Dask's own record of real transfers between the workers."""

from __future__ import annotations

import uuid

import numpy as np


def _payload(nbytes):
    """An array on the worker's device: GPU workers' links are probed with what they send (cupy)."""
    from taskrt.gpu import device

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
