"""t_s: the time to synchronize a layer's replicated weights under each config, by a parameter
server per shard or by all-reduce among the replicas (see CostModel.sync_methods)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def sync_times(starts, device, c_lo, c_hi, per_channel, inv_bandwidth, latency, node, nodes, nic, itemsize, hop):
    """Per config: the parameter server's time and the all-reduce's, each with its dependent tasks
    (`hop` seconds each; see CostModel.sync_methods).  A config's parts with the same channel block
    form a shard, served by its first part's device."""
    configs, parts = len(starts), len(device)
    ps, allreduce = np.zeros(configs), np.zeros(configs)
    replicated = np.zeros(configs, dtype=np.bool_)
    shard_of = np.empty(parts, dtype=np.int64)
    first = np.empty(parts, dtype=np.int64)
    members = np.empty(parts, dtype=np.int64)
    chunk = np.empty(parts)
    ps_nic, allreduce_nic = np.zeros(nodes), np.zeros(nodes)
    for a in range(configs):
        r0, r1 = starts[a], starts[a + 1] if a + 1 < configs else parts
        shards = 0
        for r in range(r0, r1):
            s = 0
            while s < shards and not (c_lo[first[s]] == c_lo[r] and c_hi[first[s]] == c_hi[r]):
                s += 1
            if s == shards:
                first[s] = r
                shards += 1
            shard_of[r] = s
        ps_nic[:] = 0.0
        allreduce_nic[:] = 0.0
        for s in range(shards):
            server = device[first[s]]
            volume = per_channel * (c_hi[first[s]] - c_lo[first[s]])
            nbytes = volume * itemsize
            gradients_in, weights_out, replicas = 0.0, 0.0, 0
            for r in range(first[s], r1):
                if shard_of[r] != s:
                    continue
                d = device[r]
                gradients_in += nbytes * inv_bandwidth[d, server] + latency[d, server]
                weights_out += nbytes * inv_bandwidth[server, d] + latency[server, d]
                if node[d] != node[server]:  # gradients to the server, weights back
                    ps_nic[node[server]] += nbytes
                    ps_nic[node[d]] += nbytes
                members[replicas] = d
                replicas += 1
            ps[a] = max(ps[a], max(gradients_in, weights_out))
            if replicas == 1:
                continue
            replicated[a] = True
            # all-reduce: replica i owns chunk i of the flat shard (taskrt.planning.plan.chunk_bounds)
            owners = min(replicas, volume)
            for i in range(replicas):
                chunk[i] = volume // owners + (1 if i < volume % owners else 0) if i < owners else 0.0
            for k in range(replicas):
                dk = members[k]
                has_k = 1.0 if chunk[k] > 0 else 0.0
                in_seconds, in_chunks, in_latency, in_has = 0.0, 0.0, 0.0, 0.0
                out_seconds, out_chunks, out_latency, out_has = 0.0, 0.0, 0.0, 0.0
                received = 0.0
                for i in range(replicas):
                    di = members[i]
                    has_i = 1.0 if chunk[i] > 0 else 0.0
                    in_seconds += inv_bandwidth[di, dk] * itemsize
                    in_chunks += inv_bandwidth[di, dk] * itemsize * chunk[i]
                    in_latency += latency[di, dk]
                    in_has += latency[di, dk] * has_i
                    out_seconds += inv_bandwidth[dk, di] * itemsize
                    out_chunks += inv_bandwidth[dk, di] * itemsize * chunk[i]
                    out_latency += latency[dk, di]
                    out_has += latency[dk, di] * has_i
                    if node[di] != node[dk]:  # its chunk of their gradients, their chunks of the weights
                        received += chunk[i] + chunk[k]
                incoming = chunk[k] * in_seconds + in_chunks + has_k * in_latency + in_has
                outgoing = chunk[k] * out_seconds + out_chunks + has_k * out_latency + out_has
                allreduce[a] = max(allreduce[a], max(incoming, outgoing))
                allreduce_nic[node[dk]] += received * itemsize
        ps[a] = max(ps[a], ps_nic.max() * nic)
        allreduce[a] = max(allreduce[a], allreduce_nic.max() * nic)
    with_ps, with_allreduce = np.empty(configs), np.empty(configs)
    for a in range(configs):  # tasks: (grad, update, wfetch) and (rslice, update, wfetch, wgather) when replicated
        with_ps[a] = ps[a] + (3 if replicated[a] else 1) * hop
        with_allreduce[a] = allreduce[a] + 4 * hop if replicated[a] else ps[a] + hop
    return with_ps, with_allreduce
