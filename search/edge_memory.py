"""The compiled kernels of search.memory_tables' edge tables: for each (producer config, consumer
config) of an edge, the most forward moves for it onto one device (the values a consumer part
reads from producer parts on other devices, and the slices cut for them on the producers'
devices), counted four ways from the most general to the fastest (see MemoryTables._fast_path)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def edges_general(lo, hi, device, starts, need_lo, need_hi, to, need_starts, size, devices, rows, cols, asked, out):
    """Into `out` (producer configs x consumer configs; -1: not yet known), for the pairs of `rows`
    and `cols` not known yet: the most forward moves for the edge onto one device: pieces its
    consumer parts read from producer parts elsewhere (once per value and reading device) and
    slices cut on it for others (once per value; not a tile read whole)."""
    producers, consumers, rank = len(starts), len(need_starts), lo.shape[1]
    parts, readers = len(device), len(to)
    memory = np.zeros(devices, dtype=np.int64)
    pieces = np.empty((readers, 2 * rank), dtype=np.int64)  # of one producer part: value bounds
    reader = np.empty(readers, dtype=np.int64)
    for i in range(len(rows)):
        a = rows[i]
        p0, p1 = starts[a], starts[a + 1] if a + 1 < producers else parts
        for k in range(len(cols)):
            b = cols[k]
            if out[a, b] >= 0 or not asked[i, k]:
                continue
            q0, q1 = need_starts[b], need_starts[b + 1] if b + 1 < consumers else readers
            memory[:] = 0
            for p in range(p0, p1):
                count = 0
                for q in range(q0, q1):
                    if to[q] == device[p]:
                        continue
                    volume, whole = 1, True
                    for e in range(rank):
                        x0, x1 = max(lo[p, e], need_lo[q, e]), min(hi[p, e], need_hi[q, e])
                        volume *= max(x1 - x0, 0)
                        pieces[count, e], pieces[count, rank + e] = x0, x1
                        whole = whole and x0 == lo[p, e] and x1 == hi[p, e]
                    if volume == 0:
                        continue
                    cut, travels = not whole, True
                    for k in range(count):  # a value seen before: cut already; travelled if the same reader
                        same = True
                        for e in range(2 * rank):
                            same = same and pieces[k, e] == pieces[count, e]
                        if same:
                            cut = False
                            travels = travels and reader[k] != to[q]
                    if travels:
                        memory[to[q]] += volume * size
                    if cut:
                        memory[device[p]] += volume * size
                    reader[count] = to[q]
                    count += 1
            out[a, b] = memory.max()


@numba.njit(cache=True, nogil=True)
def distinct_devices(device, starts) -> bool:
    """Whether every config puts each of its parts on a device of its own (the search space's do)."""
    configs, parts = len(starts), len(device)
    for a in range(configs):
        stop = starts[a + 1] if a + 1 < configs else parts
        for p in range(starts[a], stop):
            for q in range(starts[a], p):
                if device[q] == device[p]:
                    return False
    return True


@numba.njit(cache=True, nogil=True)
def need_classes(need_lo, need_hi, need_starts):
    """Per consumer part, the first part of its config reading the same box (its value's class)."""
    readers, configs, rank = len(need_lo), len(need_starts), need_lo.shape[1]
    out = np.arange(readers)
    for b in range(configs):
        stop = need_starts[b + 1] if b + 1 < configs else readers
        for q in range(need_starts[b], stop):
            for r in range(need_starts[b], q):
                same = True
                for e in range(rank):
                    same = same and need_lo[q, e] == need_lo[r, e] and need_hi[q, e] == need_hi[r, e]
                if same:
                    out[q] = out[r]
                    break
    return out


@numba.njit(cache=True, nogil=True)
def edges_distinct(lo, hi, device, starts, need_lo, need_hi, to, need_starts, classes, size, devices, rows, cols,
                    asked, out):
    """`edges_general` where each config has one part per device: a piece travels once to its reader as it
    is, and a slice is cut once per producer part and class of equal needs (pieces of one part
    that two classes cut alike count twice: more, never less, than the plan)."""
    producers, consumers, rank = len(starts), len(need_starts), lo.shape[1]
    parts, readers = len(device), len(to)
    memory = np.zeros(devices, dtype=np.int64)
    stamp = np.full(readers, -1, dtype=np.int64)
    for i in range(len(rows)):
        a = rows[i]
        p0, p1 = starts[a], starts[a + 1] if a + 1 < producers else parts
        for k in range(len(cols)):
            b = cols[k]
            if out[a, b] >= 0 or not asked[i, k]:
                continue
            q0, q1 = need_starts[b], need_starts[b + 1] if b + 1 < consumers else readers
            for p in range(p0, p1):
                memory[device[p]] = 0
            for q in range(q0, q1):
                memory[to[q]] = 0
            for p in range(p0, p1):
                for q in range(q0, q1):
                    if to[q] == device[p]:
                        continue
                    volume, whole = 1, True
                    for e in range(rank):
                        x0, x1 = max(lo[p, e], need_lo[q, e]), min(hi[p, e], need_hi[q, e])
                        if x1 <= x0:
                            volume = 0
                            break
                        volume *= x1 - x0
                        whole = whole and x0 == lo[p, e] and x1 == hi[p, e]
                    if volume == 0:
                        continue
                    memory[to[q]] += volume * size
                    if not whole and stamp[classes[q]] != p:
                        stamp[classes[q]] = p
                        memory[device[p]] += volume * size
            most = 0
            for p in range(p0, p1):
                most = max(most, memory[device[p]])
            for q in range(q0, q1):
                most = max(most, memory[to[q]])
            out[a, b] = most
            for q in range(q0, q1):
                stamp[classes[q]] = -1


@numba.njit(cache=True, nogil=True)
def is_grid(lo, hi, block, degrees, starts, shape) -> bool:
    """Whether each config's parts are its grid's blocks, row-major, as equal as possible with the
    first ones one larger (search.regions.grid_parts): together they tile the tensor."""
    configs, parts, rank = len(starts), len(lo), lo.shape[1]
    for a in range(configs):
        stop = starts[a + 1] if a + 1 < configs else parts
        count = 1
        for e in range(rank):
            count *= degrees[a, e]
        if stop - starts[a] != count:
            return False
        for p in range(starts[a], stop):
            index = 0
            for e in range(rank):
                q, r = shape[e] // degrees[a, e], shape[e] % degrees[a, e]
                b = block[p, e]
                index = index * degrees[a, e] + b
                if lo[p, e] != b * q + min(b, r) or hi[p, e] != lo[p, e] + q + (1 if b < r else 0):
                    return False
            if index != p - starts[a]:
                return False
    return True


@numba.njit(cache=True, nogil=True)
def follows_blocks(need_lo, need_hi, block, degrees, starts, driven_by) -> bool:
    """Whether each config's parts are numbered row-major over its blocks and each input dimension
    of every part's need is that of the part with the same block along its driving output
    dimension (and block 0 along the others; the first part's where nothing drives it)."""
    configs, parts, rank = len(starts), len(need_lo), block.shape[1]
    for a in range(configs):
        stop = starts[a + 1] if a + 1 < configs else parts
        count = 1
        for o in range(rank):
            count *= degrees[a, o]
        if stop - starts[a] != count:
            return False
        for q in range(starts[a], stop):
            index = 0
            for o in range(rank):
                index = index * degrees[a, o] + block[q, o]
            if index != q - starts[a]:
                return False
            for e in range(len(driven_by)):
                o = driven_by[e]
                r = starts[a] if o < 0 else starts[a] + block[q, o] * _stride(degrees, a, o)
                if need_lo[q, e] != need_lo[r, e] or need_hi[q, e] != need_hi[r, e]:
                    return False
    return True


@numba.njit(cache=True, nogil=True)
def _stride(degrees, a, o):
    """Parts between two blocks along output dimension o of config a (row-major)."""
    stride = 1
    for k in range(o + 1, degrees.shape[1]):
        stride *= degrees[a, k]
    return stride


@numba.njit(cache=True, nogil=True)
def local_parts(device, starts, devices):
    """(configs, devices): each config's part on each device, -1 where it has none."""
    configs, parts = len(starts), len(device)
    out = np.full((configs, devices), -1, dtype=np.int64)
    for a in range(configs):
        for p in range(starts[a], starts[a + 1] if a + 1 < configs else parts):
            out[a, device[p]] = p
    return out


@numba.njit(cache=True, nogil=True)
def edges_separable(lo, hi, device, starts, shape, local, need_lo, need_hi, to, need_starts, degrees, local_reader,
                     lonely, driven_by, size, devices, rows, cols, asked, out):
    """`edges_general` without visiting every (producer part, consumer part) pair.

    What a consumer part receives is its need less what the producer part on its own device holds
    of it (the producer's parts tile the tensor).  What is cut on a producer part's device is the
    sum over the distinct needs of their overlap with it, less the needs holding it whole and
    the need only a part on its own device reads: the distinct needs are the products over
    driving output dimensions of their blocks' intervals, so the sum is a product of sums.  Two
    blocks needing the same interval count twice (more, never less, than the plan)."""
    producers, consumers, rank = len(starts), len(need_starts), lo.shape[1]
    parts, readers, out_rank = len(device), len(to), degrees.shape[1]
    memory = np.zeros(devices, dtype=np.int64)
    for i in range(len(rows)):
        a = rows[i]
        p0, p1 = starts[a], starts[a + 1] if a + 1 < producers else parts
        for k in range(len(cols)):
            b = cols[k]
            if out[a, b] >= 0 or not asked[i, k]:
                continue
            q0, q1 = need_starts[b], need_starts[b + 1] if b + 1 < consumers else readers
            for p in range(p0, p1):
                memory[device[p]] = 0
            for q in range(q0, q1):
                memory[to[q]] = 0
            for q in range(q0, q1):  # received: the need less the local part's share of it
                volume, held = 1, 1
                mine = local[a, to[q]]
                for e in range(rank):
                    x0, x1 = max(need_lo[q, e], 0), min(need_hi[q, e], shape[e])
                    volume *= max(x1 - x0, 0)
                    if mine >= 0:
                        held *= max(min(x1, hi[mine, e]) - max(x0, lo[mine, e]), 0)
                if mine < 0:
                    held = 0
                memory[to[q]] += (volume - held) * size
            for p in range(p0, p1):  # cut: distinct needs meeting the part, not holding it whole
                total, whole, volume = 1, 1, 1
                for e in range(rank):
                    volume *= hi[p, e] - lo[p, e]
                    if driven_by[e] < 0:
                        x0, x1 = max(need_lo[q0, e], lo[p, e]), min(need_hi[q0, e], hi[p, e])
                        total *= max(x1 - x0, 0)
                        whole *= 1 if need_lo[q0, e] <= lo[p, e] and hi[p, e] <= need_hi[q0, e] else 0
                for o in range(out_rank):
                    drives = False
                    for e in range(rank):
                        drives = drives or driven_by[e] == o
                    if not drives:
                        continue
                    stride = _stride(degrees, b, o)
                    meets, holds = 0, 0
                    for k in range(degrees[b, o]):
                        q = q0 + k * stride
                        overlap, inside = 1, True
                        for e in range(rank):
                            if driven_by[e] == o:
                                overlap *= max(min(need_hi[q, e], hi[p, e]) - max(need_lo[q, e], lo[p, e]), 0)
                                inside = inside and need_lo[q, e] <= lo[p, e] and hi[p, e] <= need_hi[q, e]
                        meets += overlap
                        holds += 1 if inside else 0
                    total *= meets
                    whole *= holds
                cut = total - volume * whole
                mine = local_reader[b, device[p]]
                if mine >= 0 and lonely[mine]:  # a need only a part on this device reads is not cut
                    overlap, inside = 1, True
                    for e in range(rank):
                        overlap *= max(min(need_hi[mine, e], hi[p, e]) - max(need_lo[mine, e], lo[p, e]), 0)
                        inside = inside and need_lo[mine, e] <= lo[p, e] and hi[p, e] <= need_hi[mine, e]
                    if not inside:
                        cut -= overlap
                memory[device[p]] += cut * size
            most = 0
            for p in range(p0, p1):
                most = max(most, memory[device[p]])
            for q in range(q0, q1):
                most = max(most, memory[to[q]])
            out[a, b] = most


@numba.njit(cache=True, nogil=True)
def producer_intervals(lo, hi, shape):
    """Per dimension e, the distinct intervals [lo, hi) of the parts (sorted; those of dimension e
    at first[e]:first[e + 1]), and each part's interval's index among them."""
    parts, rank = lo.shape
    ids = np.empty((parts, rank), dtype=np.int64)
    out_lo = np.empty(parts * rank, dtype=np.int64)
    out_hi = np.empty(parts * rank, dtype=np.int64)
    first = np.zeros(rank + 1, dtype=np.int64)
    n = 0
    for e in range(rank):
        span = shape[e] + 1
        keys = lo[:, e] * span + hi[:, e]
        order = np.argsort(keys)
        first[e] = n
        for k in range(parts):
            p = order[k]
            if k == 0 or keys[p] != keys[order[k - 1]]:
                out_lo[n], out_hi[n] = lo[p, e], hi[p, e]
                n += 1
            ids[p, e] = n - 1 - first[e]
    first[rank] = n
    return out_lo[:n].copy(), out_hi[:n].copy(), first, ids


@numba.njit(cache=True, nogil=True)
def interval_tables(lo, hi, first, need_lo, need_hi, need_starts, degrees, driven_by):
    """For the producer intervals of each input dimension e (producer_intervals) and each consumer
    config: the sum of their overlaps with the config's distinct needs along e (one per block of
    the output dimension driving e; the first part's where nothing drives it) and how many hold
    them whole: (dimensions, most intervals, consumer configs) each."""
    rank, consumers = len(first) - 1, len(need_starts)
    widest = 0
    for e in range(rank):
        widest = max(widest, first[e + 1] - first[e])
    total = np.zeros((rank, widest, consumers), dtype=np.int64)
    whole = np.zeros((rank, widest, consumers), dtype=np.int64)
    for e in range(rank):
        driver = driven_by[e]
        for b in range(consumers):
            blocks = 1 if driver < 0 else degrees[b, driver]
            stride = 0 if driver < 0 else _stride(degrees, b, driver)
            for k in range(blocks):
                q = need_starts[b] + k * stride
                for i in range(first[e + 1] - first[e]):
                    x0, x1 = lo[first[e] + i], hi[first[e] + i]
                    total[e, i, b] += max(min(need_hi[q, e], x1) - max(need_lo[q, e], x0), 0)
                    whole[e, i, b] += 1 if need_lo[q, e] <= x0 and x1 <= need_hi[q, e] else 0
    return total, whole


@numba.njit(cache=True, nogil=True)
def edges_tabulated(lo, hi, device, starts, local, need_lo, need_hi, to, need_starts, local_reader, lonely, ids,
                     sums, counts, volumes, shape, size, devices, rows, cols, asked, out):
    """`edges_separable` with each output dimension driving at most one input dimension: a producer
    part's sum over the distinct needs is the product over input dimensions of a table entry
    (its interval's, for the consumer config), and so is the count of needs holding it whole."""
    producers, consumers, rank = len(starts), len(need_starts), lo.shape[1]
    parts, readers = len(device), len(to)
    memory = np.zeros(devices, dtype=np.int64)
    for i in range(len(rows)):
        a = rows[i]
        p0, p1 = starts[a], starts[a + 1] if a + 1 < producers else parts
        for k in range(len(cols)):
            b = cols[k]
            if out[a, b] >= 0 or not asked[i, k]:
                continue
            q0, q1 = need_starts[b], need_starts[b + 1] if b + 1 < consumers else readers
            for p in range(p0, p1):
                memory[device[p]] = 0
            for q in range(q0, q1):
                memory[to[q]] = 0
            for q in range(q0, q1):  # received: the need less the local part's share of it
                volume, held = 1, 1
                mine = local[a, to[q]]
                for e in range(rank):
                    x0, x1 = max(need_lo[q, e], 0), min(need_hi[q, e], shape[e])
                    volume *= max(x1 - x0, 0)
                    if mine >= 0:
                        held *= max(min(x1, hi[mine, e]) - max(x0, lo[mine, e]), 0)
                if mine < 0:
                    held = 0
                memory[to[q]] += (volume - held) * size
            for p in range(p0, p1):  # cut
                total, whole = 1, 1
                for e in range(rank):
                    total *= sums[e, ids[p, e], b]
                    whole *= counts[e, ids[p, e], b]
                cut = total - volumes[p] * whole
                mine = local_reader[b, device[p]]
                if mine >= 0 and lonely[mine]:  # a need only a part on this device reads is not cut
                    overlap, inside = 1, True
                    for e in range(rank):
                        overlap *= max(min(need_hi[mine, e], hi[p, e]) - max(need_lo[mine, e], lo[p, e]), 0)
                        inside = inside and need_lo[mine, e] <= lo[p, e] and hi[p, e] <= need_hi[mine, e]
                    if not inside:
                        cut -= overlap
                memory[device[p]] += cut * size
            most = 0
            for p in range(p0, p1):
                most = max(most, memory[device[p]])
            for q in range(q0, q1):
                most = max(most, memory[to[q]])
            out[a, b] = most
