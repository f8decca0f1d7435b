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
  one-dimensional sums.  A receiver's range along a dimension is one of its blocks, and what a
  config looks like from a receiver along a dimension is one of few slot tuples (Grid), so the
  sums are tabulated per (dimension, block, tuple), gathered for every config once per
  (receiving device, dimension, block) that some part reads, and each receiving part multiplies
  one row of them per dimension (numba kernels).  This avoids the (producer parts x consumer parts)
  matrix; tests check it equals `general`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from taskrt.search.regions import PartTable, Slots, _grid_parts, _slots, overlap_volumes, part_slots


@dataclass
class Links:
    """Per device pair: seconds per byte and seconds per message (0 on the diagonal)."""

    inv_bandwidth: np.ndarray
    latency: np.ndarray
    node: np.ndarray  # node of each device
    nic_inv_bandwidth: float = 0.0  # seconds per byte through a node's shared network interface (0: none)

    def node_classes(self):
        """(intra, inter) inverse bandwidth and latency, if links depend only on same-node-or-not
        (worked out once: links do not change)."""
        if not hasattr(self, "_classes"):
            self._classes = self._node_classes()
        return self._classes

    def _node_classes(self):
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

    Per dimension, one slot per (degree, block index) with the block's interval (slots of a
    degree in block order, degrees ascending: `search.regions.block_slots`); `part_slot` is
    each part's slot along each dimension.  For a receiving device r, a dimension e and a
    config a, five slot positions say what the config looks like from r: the config's first
    slot, the bounds of the box of blocks its parts on r's node hold, the end of its blocks, and
    the block of its part on r itself (the slot count, a slot of zeros, if none).  Few of these
    tuples differ: `tuples[e]` lists the distinct ones and `tuple_of[r, e, a]` points into it."""

    def __init__(self, table: PartTable, shape, node: np.ndarray):
        slots = table.slots(shape)
        self._keep(table, slots, *_grid_tuples(table.block, table.device, table.starts, slots.first, table.degrees,
                                               node, slots.lo.shape[1]))

    @classmethod
    def of_blocks(cls, shape, degrees: np.ndarray, first: np.ndarray, node: np.ndarray) -> Grid:
        """The grid (and its part table, `table`) of configs given as (configs, rank) degrees, each
        on its block of devices from `first`: `search.regions.grid_parts`, the slots and the grid
        in one compiled call, as a search makes one per layer shape."""
        (starts, config, block, lo, hi, device, counts, slot_first, slot_lo, slot_hi, part_slot, ok, tuple_of,
         tuples) = _layout(np.asarray(shape, dtype=np.int64), degrees, first, node)
        table = PartTable(lo, hi, device, starts, block, degrees, config)
        table.keep_slots(Slots(slot_first, slot_lo, slot_hi, counts.tolist(), part_slot))
        grid = cls.__new__(cls)
        grid._keep(table, table.slots(shape), ok, tuple_of, tuples)
        return grid

    def _keep(self, table: PartTable, slots: Slots, ok: bool, tuple_of, tuples):
        self.table, self.degrees = table, table.degrees
        self.slots, self.part_slot = (slots.lo, slots.hi), slots.part
        self.ok = ok
        if ok:
            self.tuple_of, self.tuples = tuple_of, tuples


@numba.njit(cache=True, nogil=True)
def _layout(shape, degrees, first, node):
    """`Grid.of_blocks`: the part table's arrays, the slots' and the grid's."""
    starts, config, block, lo, hi, device = _grid_parts(shape, degrees, first)
    counts, slot_first, slot_lo, slot_hi = _slots(shape, degrees)
    part_slot = part_slots(slot_first, config, block)
    ok, tuple_of, tuples = _grid_tuples(block, device, starts, slot_first, degrees, node, slot_lo.shape[1])
    return (starts, config, block, lo, hi, device, counts, slot_first, slot_lo, slot_hi, part_slot, ok, tuple_of,
            tuples)


FIBONACCI = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / the golden ratio, as a signed 64-bit number


@numba.njit(cache=True, nogil=True)
def _grid_tuples(block, device, starts, first, degrees, node, none):
    """(ok, tuple_of, tuples): per dimension the distinct slot tuples (Grid) and which one each
    (receiver, config) has; ok False (and the arrays unfilled) if some config is not on a
    contiguous block of devices or the parts of some config on one node do not form a box of
    blocks.  A receiver holding no part of a config sees it as the others on its node do, so
    each (config, node) has one such tuple and each part one of its own: few to tell apart.
    Tuples are told apart by a hash table of their five slot positions (each below 2**12)
    packed into one number; tuple_of is unsigned, so numba indexes with it without checking for
    negative indices."""
    configs, rank = degrees.shape
    parts, devices = len(device), len(node)
    nodes = node.max() + 1
    box_lo = np.zeros((configs, nodes, rank), dtype=np.int64)
    box_hi = np.zeros((configs, nodes, rank), dtype=np.int64)
    count = np.empty(nodes, dtype=np.int64)
    tuple_of = np.empty((devices, rank, configs), dtype=np.uint32)
    most = configs * nodes + parts  # distinct tuples along a dimension at most
    tuples = np.empty((rank, most, 5), dtype=np.int64)  # rows past each dimension's count: zeroed at the end
    for a in range(configs):
        r0, r1 = starts[a], starts[a + 1] if a + 1 < configs else parts
        box_lo[a] = 1 << 62
        box_hi[a] = -1
        count[:] = 0
        for row in range(r0, r1):
            if device[row] != device[r0] + row - r0:
                return False, tuple_of, tuples
            k = node[device[row]]
            count[k] += 1
            for e in range(rank):
                box_lo[a, k, e] = min(box_lo[a, k, e], block[row, e])
                box_hi[a, k, e] = max(box_hi[a, k, e], block[row, e] + 1)
        for k in range(nodes):
            volume = 1
            for e in range(rank):
                volume *= box_hi[a, k, e] - box_lo[a, k, e]
            if count[k] == 0:
                box_lo[a, k, :] = 0
                box_hi[a, k, :] = 0
            elif volume != count[k]:
                return False, tuple_of, tuples
    mask = 1
    while mask < 2 * most:
        mask *= 2
    mask -= 1  # below 2**24: the hash keeps 24 bits
    table_key = np.empty(mask + 1, dtype=np.int64)
    table_id = np.empty(mask + 1, dtype=np.int64)
    on_node = np.empty(nodes, dtype=np.uint32)
    counted = np.zeros(rank, dtype=np.int64)  # distinct tuples along each dimension
    for e in range(rank):
        table_key[:] = -1
        distinct = 0
        for a in range(configs):
            f, top = first[a, e], first[a, e] + degrees[a, e]
            for k in range(nodes):  # the tuple of the node's devices that hold no part
                lo, hi = f + box_lo[a, k, e], f + box_hi[a, k, e]
                h = _probe(table_key, mask, f, lo, hi, top, none)
                if table_key[h] == -1:
                    distinct = _add(table_key, table_id, tuples[e], h, distinct, f, lo, hi, top, none)
                on_node[k] = table_id[h]
            for r in range(devices):
                tuple_of[r, e, a] = on_node[node[r]]
            for row in range(starts[a], starts[a + 1] if a + 1 < configs else parts):  # each part's own
                k = node[device[row]]
                lo, hi, mine = f + box_lo[a, k, e], f + box_hi[a, k, e], f + block[row, e]
                h = _probe(table_key, mask, f, lo, hi, top, mine)
                if table_key[h] == -1:
                    distinct = _add(table_key, table_id, tuples[e], h, distinct, f, lo, hi, top, mine)
                tuple_of[device[row], e, a] = table_id[h]
        counted[e] = distinct
    width = counted.max()
    for e in range(rank):  # dimensions with fewer tuples pad to the widest with zeros
        tuples[e, counted[e] : width] = 0
    return True, tuple_of, tuples[:, :width].copy()


@numba.njit(cache=True, nogil=True, inline="always")
def _key(p0, p1, p2, p3, p4):
    return p0 | (p1 << 12) | (p2 << 24) | (p3 << 36) | (p4 << 48)


@numba.njit(cache=True, nogil=True, inline="always")
def _probe(table_key, mask, p0, p1, p2, p3, p4):
    """The hash table's entry for the slot tuple (p0..p4): its own, or the free one to take."""
    key = _key(p0, p1, p2, p3, p4)
    h = (key * FIBONACCI >> 40) & mask  # Fibonacci hashing: the product wraps
    while table_key[h] != -1 and table_key[h] != key:
        h = (h + 1) & mask
    return h


@numba.njit(cache=True, nogil=True, inline="always")
def _add(table_key, table_id, tuples, h, distinct, p0, p1, p2, p3, p4):
    """Number the new slot tuple (p0..p4) `distinct` at entry h; the new count."""
    table_key[h], table_id[h] = _key(p0, p1, p2, p3, p4), distinct
    tuples[distinct, 0], tuples[distinct, 1], tuples[distinct, 2], tuples[distinct, 3], tuples[distinct, 4] = (
        p0, p1, p2, p3, p4)
    return distinct + 1


def separable(u: Grid, v: Grid, consumer: PartTable, needs, links: Links, itemsize: int,
              backward: bool) -> np.ndarray | None:
    """The same table as `general`, or None when the shortcut does not apply."""
    job = separable_job(u, v, consumer, needs, links, itemsize, backward)
    return None if job is None else job()


def separable_job(u: Grid, v: Grid, consumer: PartTable, needs, links: Links, itemsize: int, backward: bool):
    """`separable`'s kernel as a function to call, giving the activations' table plus
    (`backward`) the gradients'; None when the shortcut does not apply.
    The kernel releases the GIL: a search runs it on a helper thread (search.helper_thread.Kernels)."""
    classes = links.node_classes()
    if classes is None or not (u.ok and v.ok):
        return None
    need = needs.by_slot  # the consumer's needs per output dimension and block, in v's slot order
    drive = np.full(len(need.reads), -1, dtype=np.int64)  # the input dimension each output dimension drives
    for e, d in needs.driver.items():
        if drive[d] >= 0:
            return None  # one output dimension driving two input dimensions: no product of 1-D sums
        drive[d] = e
    (inv_intra, inv_inter), (lat_intra, lat_inter) = classes
    weights = (float(itemsize * inv_intra), float(itemsize * inv_inter), float(lat_intra), float(lat_inter))
    nic = links.nic_inv_bandwidth
    u_lo, u_hi = u.slots
    if int(u_hi.max(initial=0)) * len(links.node) >= FLOAT32_EXACT:
        return None  # box sums the kernels could not hold exactly (see _gathered)
    producer = u.table
    shape = (len(u.degrees), len(v.degrees))

    def table() -> np.ndarray:
        out = np.empty(shape)
        _table(u.tuple_of, u.tuples, u_lo, u_hi, v.part_slot, consumer.device, consumer.starts, needs.reads_nothing,
               needs.driven_by, v.tuple_of, v.tuples, need.reads, drive, need.lo, need.hi, need.constant_lo,
               need.constant_hi, need.has_constant, u.part_slot, producer.device, producer.starts, links.node, weights,
               itemsize, nic, backward, out)
        return out

    return table


@numba.njit(cache=True, nogil=True)
def _table(u_tuple_of, u_tuples, u_lo, u_hi, v_part_slot, v_device, v_starts, reads_nothing, driven_by, v_tuple_of,
           v_tuples, reads, drive, need_lo, need_hi, constant_lo, constant_hi, has_constant, u_part_slot, u_device,
           u_starts, node, weights, itemsize, nic, backward, out):
    """The activations' table into `out`, plus the gradients' when `backward`: one call, so a
    helper thread running it takes Python's lock back once per edge."""
    _forward(u_tuple_of, u_tuples, u_lo, u_hi, v_part_slot, v_device, v_starts, reads_nothing, driven_by, need_lo,
             need_hi, constant_lo, constant_hi, node, weights, itemsize, nic, out)
    if backward:
        back = np.empty_like(out)
        _backward(v_tuple_of, v_tuples, reads, drive, need_lo, need_hi, constant_lo, constant_hi, has_constant, u_lo,
                  u_hi, u_part_slot, u_device, u_starts, node, weights, itemsize, nic, back)
        out += back


@numba.njit(cache=True, nogil=True)
def _forward(tuple_of, tuples, slot_lo, slot_hi, part_slot, device, starts, empty, driver, need_lo, need_hi,
             constant_lo, constant_hi, node, weights, itemsize, nic, out):
    """out[a, b]: the time for consumer config b's parts to receive their needs from producer
    config a.  Per receiving part, the bytes and messages from the producer's parts on its node
    (a box of blocks: a product of 1-D sums), from all parts (its whole need), minus the part on
    its own device; its node's interface carries what comes from other nodes.  A config costs
    its slowest receiver or busiest interface.

    A part's need along input dimension e is the answer for its block along the output
    dimension driving e (`driver`, -1: the constant range), so the 1-D sums are computed once
    per (e, block) rather than per part."""
    rank, slots = slot_lo.shape
    width = need_lo.shape[1]
    parts = len(device)
    overlap = np.zeros((rank, width, slots + 1))  # the last slot: none (no part on the receiver)
    extent = np.zeros((rank, width))
    for e in range(rank):
        for i in range(width if driver[e] >= 0 else 1):
            lo = need_lo[driver[e], i, e] if driver[e] >= 0 else constant_lo[e]
            hi = need_hi[driver[e], i, e] if driver[e] >= 0 else constant_hi[e]
            extent[e, i] = max(hi - lo, 0)
            for s in range(slots):
                overlap[e, i, s] = max(min(slot_hi[e, s], hi) - max(slot_lo[e, s], lo), 0)
    rows = np.empty((parts, rank), dtype=np.int64)
    for q in range(parts):
        for e in range(rank):
            rows[q, e] = part_slot[q, driver[e]] if driver[e] >= 0 else 0
    which, gathered = _gathered(tuple_of, tuples, overlap, False, device, rows, empty)
    box, flat, entries, slowest, inter = _scratch(gathered, node)
    for b in range(len(starts)):  # consumer configs: independent columns
        slowest[:] = 0.0
        inter[:] = 0.0
        q1 = starts[b + 1] if b + 1 < len(starts) else parts
        for q in range(starts[b], q1):
            if empty[q]:
                continue  # it reads nothing
            need = 1.0
            for e in range(rank):
                need *= extent[e, rows[q, e]]
            _products(entries, which, q, flat)
            _receive(box, weights, 1.0, 1.0, need, slowest, inter, node[device[q]])
        _config_costs(slowest, inter, itemsize, nic, out[:, b])


@numba.njit(cache=True, nogil=True)
def _backward(tuple_of, tuples, reads, drive, need_lo, need_hi, constant_lo, constant_hi, has_constant, slot_lo,
              slot_hi, part_slot, device, starts, node, weights, itemsize, nic, out):
    """out[a, b]: the time for producer config a's parts to receive their output gradients
    from consumer config b: the same sums over the consumer's parts, whose contributions are
    products over its output dimensions.  A producer part's share of a consumer block along
    output dimension d depends on its own block along the input dimension d drives (`drive`),
    so these are computed once per (d, producer block)."""
    rank_out, width, rank_in = need_lo.shape
    slots = slot_lo.shape[1]
    parts = len(device)
    factor = np.zeros((rank_out, slots, width + 1))  # the last consumer slot: none
    for d in range(rank_out):
        e = drive[d]
        for i in range(slots if e >= 0 else 1):
            for s in range(width):
                g = reads[d, s]
                if e >= 0:
                    g *= max(min(slot_hi[e, i], need_hi[d, s, e]) - max(slot_lo[e, i], need_lo[d, s, e]), 0)
                factor[d, i, s] = g
    rows = np.empty((parts, rank_out), dtype=np.int64)
    for p in range(parts):
        for d in range(rank_out):
            rows[p, d] = part_slot[p, drive[d]] if drive[d] >= 0 else 0
    which, gathered = _gathered(tuple_of, tuples, factor, True, device, rows, np.zeros(parts, dtype=np.bool_))
    box, flat, entries, slowest, inter = _scratch(gathered, node)
    for a_u in range(len(starts)):  # producer configs: independent rows
        slowest[:] = 0.0
        inter[:] = 0.0
        p1 = starts[a_u + 1] if a_u + 1 < len(starts) else parts
        for p in range(starts[a_u], p1):
            scale = 1.0
            for e in range(rank_in):
                if has_constant[e]:
                    i = part_slot[p, e]
                    scale *= max(min(slot_hi[e, i], constant_hi[e]) - max(slot_lo[e, i], constant_lo[e]), 0)
            present = 1.0 if scale > 0 else 0.0
            _products(entries, which, p, flat)
            _receive(box, weights, scale, present, 0.0, slowest, inter, node[device[p]])
        _config_costs(slowest, inter, itemsize, nic, out[a_u])


LANES = 8  # the configs are padded to a multiple of this: the vector loops over them need no scalar tail
# The gathered box sums are integers: a sum of a dimension's overlaps with the blocks of one config
# (at most one block per device, each overlap at most the producer's size along it), or a count of
# blocks.  float32 holds integers below this exactly and halves the memory the kernels stream.
FLOAT32_EXACT = 2**24


@numba.njit(cache=True, nogil=True)
def _gathered(tuple_of, tuples, values, with_total, device, rows, skip):
    """What each receiving part multiplies, gathered once per distinct (device, dimension e, row
    i) rather than per part: parts on one device share most rows.

    `values[e, i]`: one receiver's values per slot along e (the last slot, the zero slot, left
    out of the sums); `rows[q, e]`: part q's row along e (parts `skip` says: none).  For each
    distinct slot tuple t along e (Grid.tuples) the box sums of row i are: the sum of the values
    over the box, the count of positive ones in it, the count over all blocks, the receiver's
    own value and, `with_total`, the sum over all blocks.  Returns each part's entry per
    dimension and the entries: (component, config), each config's box sums for the tuple it has
    along e as seen from the device (Grid.tuple_of), in float32 (exact: `separable` checks the
    sums stay below FLOAT32_EXACT), the configs padded with zeros to a multiple of LANES."""
    parts, rank = rows.shape
    devices, _, configs = tuple_of.shape
    width = values.shape[2]
    components = 5 if with_total else 4
    entry = np.full((rank, values.shape[1], devices), -1, dtype=np.int64)
    which = np.zeros((parts, rank), dtype=np.int64)
    count = 0
    for q in range(parts):
        if skip[q]:
            continue
        for e in range(rank):
            i, r = rows[q, e], device[q]
            if entry[e, i, r] < 0:
                entry[e, i, r] = count
                count += 1
            which[q, e] = entry[e, i, r]
    gathered = np.empty((count, components, (configs + LANES - 1) // LANES * LANES), dtype=np.float32)
    gathered[:, :, configs:] = 0
    sums = np.empty((components, tuples.shape[1]), dtype=np.float32)
    cum_vol = np.empty(width)
    cum_cnt = np.empty(width)
    for e in range(rank):
        for i in range(values.shape[1]):
            read = False
            for r in range(devices):
                read = read or entry[e, i, r] >= 0
            if not read:
                continue  # no part reads this row
            cum_vol[0], cum_cnt[0] = 0.0, 0.0
            for s in range(width - 1):
                cum_vol[s + 1] = cum_vol[s] + values[e, i, s]
                cum_cnt[s + 1] = cum_cnt[s] + (1.0 if values[e, i, s] > 0 else 0.0)
            for t in range(tuples.shape[1]):
                first, box_lo, box_hi, top, mine = (tuples[e, t, 0], tuples[e, t, 1], tuples[e, t, 2], tuples[e, t, 3],
                                                    tuples[e, t, 4])
                sums[0, t] = cum_vol[box_hi] - cum_vol[box_lo]
                sums[1, t] = cum_cnt[box_hi] - cum_cnt[box_lo]
                sums[2, t] = cum_cnt[top] - cum_cnt[first]
                sums[3, t] = values[e, i, mine]
                if with_total:
                    sums[4, t] = cum_vol[top] - cum_vol[first]
            for r in range(devices):
                g = entry[e, i, r]
                if g < 0:
                    continue
                view = tuple_of[r, e]
                for c in range(components):  # rows written in order: a gather along each
                    row, out = sums[c], gathered[g, c]
                    for a in range(configs):
                        out[a] = row[view[a]]
    return which, gathered


@numba.njit(cache=True, nogil=True)
def _scratch(gathered, node):
    """Per receiving part its box products (component, config) and the same as one flat row,
    the entries as flat rows (`_products`), and per config its slowest receiver and the bytes
    each node's interface carries, over the padded configs."""
    count, components, lanes = gathered.shape
    box = np.empty((components, lanes))
    return (box, box.reshape(components * lanes), gathered.reshape(count, components * lanes), np.empty(lanes),
            np.empty((node.max() + 1, lanes)))


@numba.njit(cache=True, nogil=True)
def _products(entries, which, q, out):
    """out: the products over dimensions e of part q's entries `entries[which[q, e]]` (`_gathered`,
    as flat rows), in float64 (exact: the products are integer volumes and counts, far below
    2**53).  Flat loops over contiguous rows, which the compiler vectorizes; 4 dimensions (the
    common case) in one pass."""
    if which.shape[1] == 4:
        g0, g1, g2, g3 = which[q, 0], which[q, 1], which[q, 2], which[q, 3]
        for j in range(len(out)):
            out[j] = (np.float64(entries[g0, j]) * np.float64(entries[g1, j]) * np.float64(entries[g2, j])
                      * np.float64(entries[g3, j]))
        return
    first = which[q, 0]
    for j in range(len(out)):
        out[j] = entries[first, j]
    for e in range(1, which.shape[1]):
        entry = which[q, e]
        for j in range(len(out)):
            out[j] *= np.float64(entries[entry, j])


@numba.njit(cache=True, nogil=True, inline="always")
def _receive(box, weights, scale, present, need, slowest, inter, k):
    """One receiving part's box products (`_products`) into its config's costs: per producer
    config, its time raises the slowest receiver's, and what it takes from other nodes adds to
    its node's interface.  What it takes from all parts: forward (4 components) its whole
    need, backward the fifth component.  Two loops that touch few arrays each, so both
    vectorize."""
    forward = box.shape[0] == 4
    for a in range(len(slowest)):
        total_vol = need if forward else box[4, a]
        t = _receiver_time(weights, scale, present, box[0, a], box[1, a], box[2, a], box[3, a], total_vol)
        slowest[a] = max(slowest[a], t)
    for a in range(len(slowest)):
        total_vol = need if forward else box[4, a]
        inter[k, a] += scale * (total_vol - box[0, a])


@numba.njit(cache=True, nogil=True, inline="always")
def _receiver_time(weights, scale, present, node_vol, node_cnt, total_cnt, local_vol, total_vol):
    """One receiving part's time for one config: volumes from its own node and from other nodes,
    messages from its node and from others (the local piece is neither), weighted by `weights`;
    `scale` weighs the volumes and `present` the messages (backward: the part's share, 1 forward)."""
    local_cnt = present if local_vol > 0 else 0.0
    return (weights[0] * scale * (node_vol - local_vol) + weights[1] * scale * (total_vol - node_vol)
            + weights[2] * present * (node_cnt - local_cnt) + weights[3] * present * (total_cnt - node_cnt))


@numba.njit(cache=True, nogil=True)
def _config_costs(slowest, inter, itemsize, nic, out):
    """out[a]: config a's time, its slowest receiver or its busiest node interface (the padding
    lanes past the configs left out)."""
    for a in range(len(out)):
        busiest = 0.0
        for k in range(inter.shape[0]):
            busiest = max(busiest, inter[k, a] * itemsize * nic)
        out[a] = max(slowest[a], busiest)
