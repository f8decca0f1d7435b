"""Winograd's minimal filtering F(2x2, 3x3) for 3x3 stride-1 convolutions of numpy tiles.

Each 2x2 block of outputs ("a tile") is computed from the 4x4 input patch under it with 16
multiplications per (input, output) channel pair instead of 36 (Lavin and Gray, "Fast Algorithms
for Convolutional Neural Networks", 2016):

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A        g: 3x3 kernel, d: 4x4 patch, (.): element-wise

Summed over input channels, the element-wise products become 16 GEMMs, one per position k of
the 4x4 transformed patch:  M[k] (T, Cout) = V[k] (T, C) @ U[k] (C, Cout)  over T tiles, with U
the transformed kernels and V the transformed patches.  The weight gradient is the same in
reverse:  dU[k] = V[k]^T @ dM[k]  with dM = A dY A^T, then dg = G^T dU G.  Backward-data needs
nothing of its own: for stride 1 it is a correlation of dY with the flipped, transposed kernel
(`ops.conv_kernels.data_grad_gather`), which runs here too.

Inputs are zero-padded NHWC copies (`ops.conv_kernels` makes them), padded one more row and
column where the output's height or width is odd, so every tile reads a whole 4x4 patch.  The
transforms are numba loops over channel vectors, contiguous in NHWC whatever the image size.
Tiles are processed in blocks of about BLOCK_TILES so V and M stay in cache.
"""

from __future__ import annotations

import numba
import numpy

BLOCK_TILES = 256


MIN_TILES = 64  # per call: below, the transformed kernels (16/9 the kernels' size, built every call) cost more
MIN_CHANNELS = 32  # the fewer of in and out: below, the transforms' channel vectors are too short


def applies(x, kernel, stride, channels: int, out_hw) -> bool:
    """3x3 stride-1 convolutions of numpy tiles (cupy tiles keep im2col, GPU tiles cuDNN) with at least
    MIN_TILES 2x2 output tiles and MIN_CHANNELS channels (the fewer of in and out).  Measured against
    im2col + GEMM, one thread, 64 to 512 channels, 4 to 4096 tiles: 0.5-0.85x the time from 64 tiles
    on (forward, backward-data, weight gradient); with 16 tiles 0.6-0.9x at 64 and 128 channels but up
    to 1.6x at 256 and 512; 1.8-3.2x with 3 input channels."""
    if type(x) is not numpy.ndarray or tuple(kernel) != (3, 3) or tuple(stride) != (1, 1):
        return False
    tiles = x.shape[0] * ((out_hw[0] + 1) // 2) * ((out_hw[1] + 1) // 2)
    return tiles >= MIN_TILES and channels >= MIN_CHANNELS


# ---- transforms ---------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _kernel_transform(w, flipped, out):
    """out[k, a, b] <- (G g G^T)[k // 4, k % 4] of the 3x3 kernel g from input channel a to output
    channel b of the correlation: g = w[b, a], or, flipped, w[a, b] rotated by 180 degrees."""
    rows, cols = out.shape[1], out.shape[2]
    g = numpy.empty((9, cols), dtype=w.dtype)  # the taps of a's kernels, one vector per tap
    t = numpy.empty((12, cols), dtype=w.dtype)
    for a in range(rows):
        for b in range(cols):
            for tap in range(9):
                g[tap, b] = w[a, b, 2 - tap // 3, 2 - tap % 3] if flipped else w[b, a, tap // 3, tap % 3]
        for j in range(3):  # t = G g, vectors over b
            g0, g1, g2 = g[j], g[3 + j], g[6 + j]
            t0, t1, t2, t3 = t[j], t[3 + j], t[6 + j], t[9 + j]
            for b in range(cols):
                t0[b] = g0[b]
                t1[b] = 0.5 * (g0[b] + g1[b] + g2[b])
                t2[b] = 0.5 * (g0[b] - g1[b] + g2[b])
                t3[b] = g2[b]
        for i in range(4):  # (G g) G^T
            r0, r1, r2 = t[3 * i], t[3 * i + 1], t[3 * i + 2]
            o0, o1, o2, o3 = out[4 * i, a], out[4 * i + 1, a], out[4 * i + 2, a], out[4 * i + 3, a]
            for b in range(cols):
                o0[b] = r0[b]
                o1[b] = 0.5 * (r0[b] + r1[b] + r2[b])
                o2[b] = 0.5 * (r0[b] - r1[b] + r2[b])
                o3[b] = r2[b]


@numba.njit(cache=True, nogil=True)
def kernel_gradient(du, out):
    """out[o, c] <- G^T dU[:, c, o] G: the 3x3 kernel gradient (Cout, C, 3, 3) from its transformed
    form (16, C, Cout)."""
    _, c_in, c_out = du.shape
    t = numpy.empty((12, c_out), dtype=du.dtype)
    g = numpy.empty((9, c_out), dtype=du.dtype)
    for c in range(c_in):
        for i in range(4):  # t = dU G, vectors over o
            u0, u1, u2, u3 = du[4 * i, c], du[4 * i + 1, c], du[4 * i + 2, c], du[4 * i + 3, c]
            t0, t1, t2 = t[3 * i], t[3 * i + 1], t[3 * i + 2]
            for o in range(c_out):
                t0[o] = u0[o] + 0.5 * (u1[o] + u2[o])
                t1[o] = 0.5 * (u1[o] - u2[o])
                t2[o] = 0.5 * (u1[o] + u2[o]) + u3[o]
        for j in range(3):  # G^T t
            r0, r1, r2, r3 = t[j], t[3 + j], t[6 + j], t[9 + j]
            g0, g1, g2 = g[j], g[3 + j], g[6 + j]
            for o in range(c_out):
                g0[o] = r0[o] + 0.5 * (r1[o] + r2[o])
                g1[o] = 0.5 * (r1[o] - r2[o])
                g2[o] = 0.5 * (r1[o] + r2[o]) + r3[o]
        for o in range(c_out):
            for tap in range(9):
                out[o, c, tap // 3, tap % 3] = g[tap, o]


@numba.njit(cache=True, nogil=True)
def input_transform(xp, v, n0, n1, th0, th1):
    """v[k, t, :] <- (B^T d B)[k // 4, k % 4] of the 4x4 patch d under each tile t of the block
    (samples [n0, n1), tile rows [th0, th1), all tile columns) of a padded NHWC tile xp."""
    width, c_in = xp.shape[2], xp.shape[3]
    tiles_w = (width - 2) // 2
    s = numpy.empty((4, width, c_in), dtype=xp.dtype)
    t = 0
    for n in range(n0, n1):
        for th in range(th0, th1):
            x0, x1, x2, x3 = xp[n, 2 * th], xp[n, 2 * th + 1], xp[n, 2 * th + 2], xp[n, 2 * th + 3]
            for w in range(width):  # B^T d: down the columns, channel vectors
                a, b, e, f = x0[w], x1[w], x2[w], x3[w]
                s0, s1, s2, s3 = s[0, w], s[1, w], s[2, w], s[3, w]
                for c in range(c_in):
                    s0[c] = a[c] - e[c]
                    s1[c] = b[c] + e[c]
                    s2[c] = e[c] - b[c]
                    s3[c] = b[c] - f[c]
            for tw in range(tiles_w):  # (B^T d) B: along the rows
                for i in range(4):
                    a, b, e, f = s[i, 2 * tw], s[i, 2 * tw + 1], s[i, 2 * tw + 2], s[i, 2 * tw + 3]
                    v0, v1, v2, v3 = v[4 * i, t], v[4 * i + 1, t], v[4 * i + 2, t], v[4 * i + 3, t]
                    for c in range(c_in):
                        v0[c] = a[c] - e[c]
                        v1[c] = b[c] + e[c]
                        v2[c] = e[c] - b[c]
                        v3[c] = b[c] - f[c]
                t += 1


@numba.njit(cache=True, nogil=True)
def output_transform(m, y, bias, relu, n0, n1, th0, th1):
    """y[n, o, 2 th + i, 2 tw + j] <- (A^T M A)[i, j] + bias[o], through relu if asked, for the block's
    tiles of an NCHW y (the last row and column are cropped where its height or width is odd)."""
    c_out, height, width = y.shape[1], y.shape[2], y.shape[3]
    tiles_w = (width + 1) // 2
    q = numpy.empty((8, c_out), dtype=y.dtype)  # M A: row i, column j at 2 i + j
    out = numpy.empty((4, c_out), dtype=y.dtype)  # A^T M A: output (i, j) at 2 i + j
    t = 0
    for n in range(n0, n1):
        for th in range(th0, th1):
            for tw in range(tiles_w):
                for i in range(4):
                    m0, m1, m2, m3 = m[4 * i, t], m[4 * i + 1, t], m[4 * i + 2, t], m[4 * i + 3, t]
                    qa, qb = q[2 * i], q[2 * i + 1]
                    for o in range(c_out):
                        qa[o] = m0[o] + m1[o] + m2[o]
                        qb[o] = m1[o] - m2[o] - m3[o]
                for j in range(2):
                    q0, q1, q2, q3 = q[j], q[2 + j], q[4 + j], q[6 + j]
                    top, bottom = out[j], out[2 + j]
                    for o in range(c_out):
                        top[o] = q0[o] + q1[o] + q2[o] + bias[o]
                        bottom[o] = q1[o] - q2[o] - q3[o] + bias[o]
                        if relu:
                            top[o] = max(top[o], 0)
                            bottom[o] = max(bottom[o], 0)
                for i in range(2):
                    h = 2 * th + i
                    for j in range(2):
                        w = 2 * tw + j
                        if h < height and w < width:
                            vals = out[2 * i + j]
                            for o in range(c_out):
                                y[n, o, h, w] = vals[o]
                t += 1


@numba.njit(cache=True, nogil=True)
def output_gradient_transform(dp, dm, n0, n1, th0, th1):
    """dm[k, t, :] <- (A dY A^T)[k // 4, k % 4] of each tile's 2x2 output gradient dY, from an NHWC
    gradient dp zero-padded to even height and width: the adjoint of `output_transform`."""
    width, c_out = dp.shape[2], dp.shape[3]
    tiles_w = width // 2
    r = numpy.empty((8, c_out), dtype=dp.dtype)  # A dY: row i, column j at 2 i + j
    t = 0
    for n in range(n0, n1):
        for th in range(th0, th1):
            for tw in range(tiles_w):
                for j in range(2):  # rows (y0, y0 + y1, y0 - y1, -y1) of each column j
                    y0, y1 = dp[n, 2 * th, 2 * tw + j], dp[n, 2 * th + 1, 2 * tw + j]
                    r0, r1, r2, r3 = r[j], r[2 + j], r[4 + j], r[6 + j]
                    for o in range(c_out):
                        r0[o] = y0[o]
                        r1[o] = y0[o] + y1[o]
                        r2[o] = y0[o] - y1[o]
                        r3[o] = -y1[o]
                for i in range(4):  # the same along the rows
                    a, b = r[2 * i], r[2 * i + 1]
                    m0, m1, m2, m3 = dm[4 * i, t], dm[4 * i + 1, t], dm[4 * i + 2, t], dm[4 * i + 3, t]
                    for o in range(c_out):
                        m0[o] = a[o]
                        m1[o] = a[o] + b[o]
                        m2[o] = a[o] - b[o]
                        m3[o] = -b[o]
                t += 1


# ---- the kernels --------------------------------------------------------------------------------
def _tile_blocks(n, tiles_h, tiles_w):
    """(n0, n1, th0, th1) blocks of about BLOCK_TILES tiles: whole tile rows, whole samples when small."""
    per_sample = tiles_h * tiles_w
    if per_sample >= BLOCK_TILES:
        step = max(1, BLOCK_TILES // tiles_w)
        for i in range(n):
            for h in range(0, tiles_h, step):
                yield i, i + 1, h, min(tiles_h, h + step)
    else:
        step = max(1, BLOCK_TILES // per_sample)
        for i in range(0, n, step):
            yield i, min(n, i + step), 0, tiles_h


def padding(pads, out_hw):
    """The padding of an NCHW tile's NHWC copy for F(2x2, 3x3): its own, plus one more row (column)
    at the bottom (right) where the output's height (width) is odd."""
    (pt, pb), (pl, pr) = pads
    return (pt, pb + out_hw[0] % 2), (pl, pr + out_hw[1] % 2)


def kernels(w, flipped):
    """U (16, C, Cout) of the correlation by w (Cout, C, 3, 3), or by w flipped and transposed."""
    w = numpy.ascontiguousarray(w)
    c_in, c_out = (w.shape[0], w.shape[1]) if flipped else (w.shape[1], w.shape[0])
    u = numpy.empty((16, c_in, c_out), dtype=w.dtype)
    _kernel_transform(w, flipped, u)
    return u


def _transformed_blocks(xp, c_out, out_hw):
    """Each block of tiles (n0, n1, th0, th1) of a padded NHWC tile, with its transformed patches
    V (16, tiles, C) and scratch of shape (16, tiles, c_out) for M or dM; buffers reused."""
    n, c_in = xp.shape[0], xp.shape[3]
    tiles_w = (out_hw[1] + 1) // 2
    blocks = list(_tile_blocks(n, (out_hw[0] + 1) // 2, tiles_w))
    most = max((n1 - n0) * (h1 - h0) * tiles_w for n0, n1, h0, h1 in blocks)
    v_buf = numpy.empty(16 * c_in * most, dtype=xp.dtype)
    m_buf = numpy.empty(16 * c_out * most, dtype=xp.dtype)
    for block in blocks:
        n0, n1, h0, h1 = block
        tiles = (n1 - n0) * (h1 - h0) * tiles_w
        v = v_buf[: 16 * tiles * c_in].reshape(16, tiles, c_in)
        input_transform(xp, v, *block)
        yield block, v, m_buf[: 16 * tiles * c_out].reshape(16, tiles, c_out)


def correlate(xp, u, bias, relu, out_hw):
    """relu?(the correlation by U (`kernels`) + bias) of a padded NHWC tile xp (`padding`), in NCHW."""
    c_out = u.shape[2]
    bias = numpy.zeros(c_out, xp.dtype) if bias is None else numpy.ascontiguousarray(bias, dtype=xp.dtype)
    y = numpy.empty((xp.shape[0], c_out, *out_hw), dtype=xp.dtype)
    for block, v, m in _transformed_blocks(xp, c_out, out_hw):
        numpy.matmul(v, u, out=m)
        output_transform(m, y, bias, relu, *block)
    return y


def weight_grad(xp, dp):
    """dL/dw (Cout, C, 3, 3) of one tile from its padded NHWC input xp (`padding`) and the NHWC output
    gradient dp zero-padded to even height and width (any relu already applied)."""
    c_in, c_out = xp.shape[3], dp.shape[3]
    du = numpy.zeros((16, c_in, c_out), dtype=xp.dtype)
    for block, v, dm in _transformed_blocks(xp, c_out, (xp.shape[1] - 2, xp.shape[2] - 2)):
        output_gradient_transform(dp, dm, *block)
        du += v.transpose(0, 2, 1) @ dm
    dw = numpy.empty((c_out, c_in, 3, 3), dtype=xp.dtype)
    kernel_gradient(du, dw)
    return dw
