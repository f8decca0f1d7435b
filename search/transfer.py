"""t_x tables: for every (producer config, consumer config), the time to move the consumer's
input into place (and the gradient back).

Model: each receiving part takes its pieces one after another, each costing its bytes over the
link plus the link's latency; parts receive in parallel, so a config pair costs its slowest
receiver.  Volumes are overlaps of producer tiles with consumer needs (search.regions), the
numbers the lowering moves.

Two ways to compute the same table:
- `general`: per-part overlap volumes, summed per receiving device with one matrix product per
  device; any bandwidth matrix, any device lists.
- `separable`: when links only depend on "same node or not" and every config sits on a
  contiguous block of devices (the search space), the parts on one node form a box in
  block-index space, and the volume a receiver gets from a box is a product over dimensions of
  one-dimensional sums.  This avoids the (producer parts x consumer parts) matrix; tests check
  it equals `general`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from search.regions import PartTable, overlap_volumes
from taskrt.config import blocks


@dataclass
class Links:
    """Per device pair: seconds per byte and seconds per message (0 on the diagonal)."""

    inv_bandwidth: np.ndarray
    latency: np.ndarray
    node: np.ndarray  # node of each device
    nic_inv_bandwidth: float = 0.0  # seconds per byte through a node's shared network interface (0: none)

    def node_classes(self):
        """(intra, inter) inverse bandwidth and latency, if links depend only on same-node-or-not."""
        same = self.node[:, None] == self.node[None, :]
        off = ~np.eye(len(self.node), dtype=bool)
        out = []
        for matrix in (self.inv_bandwidth, self.latency):
            intra, inter = matrix[same & off], matrix[~same]
            if (intra.size and np.ptp(intra) > 0) or (inter.size and np.ptp(inter) > 0):
                return None
            out.append((intra[0] if intra.size else 0.0, inter[0] if inter.size else 0.0))
        return out


def general(producer: PartTable, consumer: PartTable, links: Links, itemsize: int, backward: bool) -> np.ndarray:
    volume = overlap_volumes(producer, consumer)
    remote = (volume > 0).astype(np.float64)
    seg_u, seg_v = _segments(producer), _segments(consumer)
    node_u, node_v = links.node[producer.device], links.node[consumer.device]
    forward = np.empty((len(producer.starts), len(consumer.device)))
    inter = np.empty_like(forward)
    for r in np.unique(consumer.device):
        cols = consumer.device == r
        weights = seg_u * (itemsize * links.inv_bandwidth[producer.device, r])[None, :]
        delays = seg_u * links.latency[producer.device, r][None, :]
        forward[:, cols] = weights @ volume[:, cols] + delays @ remote[:, cols]
        inter[:, cols] = (seg_u * (node_u != links.node[r])[None, :]) @ volume[:, cols]
    cost = np.maximum(np.maximum.reduceat(forward, consumer.starts, axis=1),
                      _nic_time(inter.T, consumer, links, itemsize).T)
    if backward:
        back = np.empty((len(producer.device), len(consumer.starts)))
        inter = np.empty_like(back)
        for r in np.unique(producer.device):
            rows = producer.device == r
            weights = seg_v * (itemsize * links.inv_bandwidth[consumer.device, r])[None, :]
            delays = seg_v * links.latency[consumer.device, r][None, :]
            back[rows, :] = volume[rows, :] @ weights.T + remote[rows, :] @ delays.T
            inter[rows, :] = volume[rows, :] @ (seg_v * (node_v != links.node[r])[None, :]).T
        cost = cost + np.maximum(np.maximum.reduceat(back, producer.starts, axis=0),
                                 _nic_time(inter, producer, links, itemsize))
    return cost


def _nic_time(inter, receivers: PartTable, links: Links, itemsize: int) -> np.ndarray:
    """Time for the bytes arriving from other nodes to pass each receiving node's shared network
    interface: (receiver parts, sender configs) bytes -> (receiver configs, sender configs), the
    busiest node of each receiver config."""
    if not links.nic_inv_bandwidth:
        return np.zeros((len(receivers.starts), inter.shape[1]))
    key = receivers.config * (links.node.max() + 1) + links.node[receivers.device]
    cuts = np.flatnonzero(np.diff(key)) + 1
    segments = np.concatenate([[0], cuts])  # runs of one config on one node
    per_node = np.add.reduceat(inter, segments, axis=0) * itemsize * links.nic_inv_bandwidth
    config_of_segment = receivers.config[segments]
    first = np.concatenate([[0], np.flatnonzero(np.diff(config_of_segment)) + 1])
    return np.maximum.reduceat(per_node, first, axis=0)


def _segments(table: PartTable) -> np.ndarray:
    """(configs, parts) indicator of which config each part belongs to."""
    seg = np.zeros((len(table.starts), len(table.device)))
    seg[table.config, np.arange(len(table.device))] = 1.0
    return seg


# ---- separable path -----------------------------------------------------------------------------
class Grid:
    """The configs of one layer as block grids, built once per layer for every edge it is on.

    Per dimension, one slot per (degree, block index) with the block's interval.  Per receiving
    device r, config a and dimension e, `index[r, a, e]` holds five slot positions: the config's
    first slot, the bounds of the box of blocks its parts on r's node hold, the end of its
    blocks, and the block of its part on r itself (-1: none)."""

    def __init__(self, table: PartTable, shape, node: np.ndarray, num_devices: int):
        self.table = table
        rank, configs = table.block.shape[1], len(table.starts)
        config = table.config
        self.degrees = np.maximum.reduceat(table.block, table.starts, axis=0) + 1
        expected = table.device[table.starts][config] + np.arange(len(config)) - table.starts[config]
        self.ok = bool(np.array_equal(expected, table.device))  # every config on a contiguous block of devices
        if not self.ok:
            return
        nodes = int(node.max()) + 1
        group = config * nodes + node[table.device]
        lo = np.full((configs * nodes, rank), np.iinfo(np.int64).max)
        hi = np.full((configs * nodes, rank), -1)
        np.minimum.at(lo, group, table.block)
        np.maximum.at(hi, group, table.block + 1)
        count = np.bincount(group, minlength=configs * nodes)
        lo[count == 0], hi[count == 0] = 0, 0
        if not np.array_equal(np.prod(hi - lo, axis=1), count):
            self.ok = False  # some node's parts do not form a box
            return
        box_lo, box_hi = lo.reshape(configs, nodes, rank), hi.reshape(configs, nodes, rank)
        local = np.full((configs, num_devices, rank), -1, dtype=np.int64)
        local[config, table.device] = table.block
        self.first_slot = np.zeros((configs, rank), dtype=np.int64)
        self.groups, slot_lo, slot_hi = [], [], []
        for d in range(rank):
            lo_d, hi_d, groups = [], [], []
            for degree in np.unique(self.degrees[:, d]).tolist():
                self.first_slot[self.degrees[:, d] == degree, d] = len(lo_d)
                groups.append((len(lo_d), degree))
                for a, b in blocks(shape[d], degree):
                    lo_d.append(a)
                    hi_d.append(b)
            self.groups.append(groups)
            slot_lo.append(lo_d)
            slot_hi.append(hi_d)
        self.slots = _slot_arrays(slot_lo, slot_hi)
        k = node[np.arange(num_devices)]  # node of each receiving device
        first = np.broadcast_to(self.first_slot[None], (num_devices, configs, rank))
        self.index = np.ascontiguousarray(np.stack([
            first,
            first + box_lo[:, k, :].transpose(1, 0, 2),
            first + box_hi[:, k, :].transpose(1, 0, 2),
            first + self.degrees[None],
            np.where(local >= 0, self.first_slot[:, None, :] + local, -1).transpose(1, 0, 2),
        ], axis=-1), dtype=np.int64)  # (devices, configs, rank, 5)


def _slot_arrays(slot_lo, slot_hi):
    """Per dimension the slot intervals, padded to one (rank, slots) array each for lo and hi."""
    rows = max(len(x) for x in slot_lo)
    lo = np.zeros((len(slot_lo), rows), dtype=np.int64)
    hi = np.zeros_like(lo)
    for e, (a, b) in enumerate(zip(slot_lo, slot_hi)):
        lo[e, : len(a)], hi[e, : len(b)] = a, b
    return lo, hi


def separable(u: Grid, v: Grid, consumer: PartTable, needs, links: Links, itemsize: int,
              backward: bool) -> np.ndarray | None:
    """The same table as `general`, or None when the shortcut does not apply."""
    classes = links.node_classes()
    if classes is None or not (u.ok and v.ok):
        return None
    (inv_intra, inv_inter), (lat_intra, lat_inter) = classes
    weights = np.array([itemsize * inv_intra, itemsize * inv_inter, lat_intra, lat_inter])
    slot_lo, slot_hi = u.slots
    receive = np.zeros((len(consumer.device), len(u.degrees)))
    inter = np.zeros_like(receive)
    _forward(u.index, slot_lo, slot_hi, consumer.lo, consumer.hi, consumer.device, weights, receive, inter)
    forward = np.maximum(np.maximum.reduceat(receive, consumer.starts, axis=0),
                         _nic_time(inter, consumer, links, itemsize)).T
    if not backward:
        return forward
    # the consumer's needs per output dimension and block (slot), over the input dimensions
    rank_in, rank_out = consumer.lo.shape[1], v.degrees.shape[1]
    slots = max(sum(g for _, g in groups) for groups in v.groups)
    reads = np.zeros((rank_out, slots))
    need_lo = np.zeros((rank_out, slots, rank_in), dtype=np.int64)
    need_hi = np.zeros_like(need_lo)
    drives = np.zeros((rank_out, rank_in), dtype=np.bool_)
    for d in range(rank_out):
        r, ranges = needs.block_ranges(d, v.groups[d])
        reads[d, : len(r)] = r
        for e, (a, b) in ranges.items():
            drives[d, e] = True
            need_lo[d, : len(a), e], need_hi[d, : len(b), e] = a, b
    constant_lo = np.zeros(rank_in, dtype=np.int64)
    constant_hi = np.zeros(rank_in, dtype=np.int64)
    has_constant = np.zeros(rank_in, dtype=np.bool_)
    for e, (a, b) in needs.constant.items():
        constant_lo[e], constant_hi[e], has_constant[e] = a, b, True
    producer = u.table
    back = np.zeros((len(producer.device), len(v.degrees)))
    inter = np.zeros_like(back)
    _backward(v.index, reads, need_lo, need_hi, drives, constant_lo, constant_hi, has_constant, producer.lo,
              producer.hi, producer.device, weights, back, inter)
    return forward + np.maximum(np.maximum.reduceat(back, producer.starts, axis=0),
                                _nic_time(inter, producer, links, itemsize))


def _forward_py(index, slot_lo, slot_hi, need_lo, need_hi, device, weights, out, inter):
    """For each consumer part (receiver) and producer config: bytes and messages from the
    producer's parts on the receiver's node (a box of blocks: a product of 1-D sums), from all
    parts (the receiver's whole need), minus the part on the receiver's own device.  `out` is
    (consumer parts, producer configs)."""
    rank, slots = slot_lo.shape
    configs = index.shape[1]
    cum_vol = np.zeros((rank, slots + 1))
    cum_cnt = np.zeros((rank, slots + 1))
    overlap = np.zeros((rank, slots))
    for q in range(len(device)):
        r = device[q]
        need = 1.0
        for e in range(rank):
            need *= max(need_hi[q, e] - need_lo[q, e], 0)
            for s in range(slots):
                o = max(min(slot_hi[e, s], need_hi[q, e]) - max(slot_lo[e, s], need_lo[q, e]), 0)
                overlap[e, s] = o
                cum_vol[e, s + 1] = cum_vol[e, s] + o
                cum_cnt[e, s + 1] = cum_cnt[e, s] + (1.0 if o > 0 else 0.0)
        for a in range(configs):
            node_vol = node_cnt = total_cnt = local_vol = 1.0
            for e in range(rank):
                f, b0, b1, top, mine = index[r, a, e, 0], index[r, a, e, 1], index[r, a, e, 2], index[r, a, e, 3], \
                    index[r, a, e, 4]
                node_vol *= cum_vol[e, b1] - cum_vol[e, b0]
                node_cnt *= cum_cnt[e, b1] - cum_cnt[e, b0]
                total_cnt *= cum_cnt[e, top] - cum_cnt[e, f]
                local_vol = local_vol * overlap[e, mine] if mine >= 0 else 0.0
            local_cnt = 1.0 if local_vol > 0 else 0.0
            out[q, a] = (weights[0] * (node_vol - local_vol) + weights[1] * (need - node_vol)
                         + weights[2] * (node_cnt - local_cnt) + weights[3] * (total_cnt - node_cnt))
            inter[q, a] = need - node_vol


def _backward_py(index, reads, need_lo, need_hi, drives, constant_lo, constant_hi, has_constant, part_lo, part_hi,
                 device, weights, out, inter):
    """For each producer part (receiving gradients) and consumer config: the same sums over the
    consumer's parts, whose contributions are products over its output dimensions.  `out` is
    (producer parts, consumer configs)."""
    rank_out, slots, rank_in = need_lo.shape
    configs = index.shape[1]
    cum_vol = np.zeros((rank_out, slots + 1))
    cum_cnt = np.zeros((rank_out, slots + 1))
    factor = np.zeros((rank_out, slots))
    for p in range(len(device)):
        r = device[p]
        scale = 1.0
        for e in range(rank_in):
            if has_constant[e]:
                scale *= max(min(part_hi[p, e], constant_hi[e]) - max(part_lo[p, e], constant_lo[e]), 0)
        present = 1.0 if scale > 0 else 0.0
        for d in range(rank_out):
            for s in range(slots):
                g = reads[d, s]
                for e in range(rank_in):
                    if drives[d, e]:
                        g *= max(min(part_hi[p, e], need_hi[d, s, e]) - max(part_lo[p, e], need_lo[d, s, e]), 0)
                factor[d, s] = g
                cum_vol[d, s + 1] = cum_vol[d, s] + g
                cum_cnt[d, s + 1] = cum_cnt[d, s] + (1.0 if g > 0 else 0.0)
        for a in range(configs):
            node_vol = node_cnt = total_vol = total_cnt = local_vol = 1.0
            for d in range(rank_out):
                f, b0, b1, top, mine = index[r, a, d, 0], index[r, a, d, 1], index[r, a, d, 2], index[r, a, d, 3], \
                    index[r, a, d, 4]
                node_vol *= cum_vol[d, b1] - cum_vol[d, b0]
                node_cnt *= cum_cnt[d, b1] - cum_cnt[d, b0]
                total_vol *= cum_vol[d, top] - cum_vol[d, f]
                total_cnt *= cum_cnt[d, top] - cum_cnt[d, f]
                local_vol = local_vol * factor[d, mine] if mine >= 0 else 0.0
            local_cnt = present if local_vol > 0 else 0.0
            out[p, a] = (weights[0] * scale * (node_vol - local_vol) + weights[1] * scale * (total_vol - node_vol)
                         + weights[2] * present * (node_cnt - local_cnt)
                         + weights[3] * present * (total_cnt - node_cnt))
            inter[p, a] = scale * (total_vol - node_vol)


_forward = numba.njit(cache=True)(_forward_py)
_backward = numba.njit(cache=True)(_backward_py)
