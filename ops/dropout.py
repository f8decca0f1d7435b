"""Dropout (PyTorch's inverted dropout): in training y = x * mask / (1 - p), each element kept with
probability 1 - p; in prediction y = x.

The mask is not drawn from a generator's stream but is a pure function of (seed, step, layer, the
element's flat index in the whole tensor), so every tile of every split draws exactly the mask one
device draws for the same elements, on numpy and on cupy alike, and backward recomputes it instead
of keeping it.  The hash (32-bit unsigned operations only, as taskrt.data.synthetic's values):

    key1 = chain of MurmurHash3's fmix32 over the words (seed mod 2**64 as two words, step mod 2**64
           as two words, crc32 of the layer name), each xored in before a round; key2 = fmix32(key1 ^ salt)
    h    = fmix32((index_lo * 0x9E3779B9) ^ key1)                 (index_lo: index mod 2**32)
    h    = fmix32(h ^ index_hi ^ key2)                            (index_hi: index // 2**32, 0 below 2**32)
    keep = h >= round(p * 2**32)

Why it is good enough: fmix32 is a bijection of uint32 with full avalanche (every input bit flips
each output bit with probability close to 1/2), so for a fixed key distinct indices below 2**32 give
distinct first-round values; the multiply by the odd golden-ratio constant spreads consecutive
indices over the high bits first, as synthetic.values does.  The second round carries the high word
of indices past 2**32 and adds margin: with one round, the masks of two keys would be one function
of inputs that differ by a fixed xor (key1 ^ key1'), leaning on fmix32's differentials alone.  The
keep rate is 1 - p to within 2**-33.  It is not a cryptographic generator, which dropout does not
need; tests/test_dropout.py checks the keep rate, each of the 32 bits, neighbouring elements, the
independence of other steps, seeds and layers (to 5 sigma over 1e6 elements), and the bits against
a pure-Python computation.
"""

from __future__ import annotations

import math
import operator
import zlib
from dataclasses import dataclass
from math import prod

from taskrt.ops.base import Op, array_module
from taskrt.ops.errors import ShapeError
from taskrt.ops.rect import Rect

_MASK32 = 0xFFFFFFFF
_KEY_SALT, _SECOND_SALT, _INDEX_MUL = 0x3C6EF372, 0xA54FF53A, 0x9E3779B9
_FMIX_MUL1, _FMIX_MUL2 = 0x85EBCA6B, 0xC2B2AE35


def _fmix_host(v: int) -> int:
    """MurmurHash3's fmix32 on a Python int (the key is made on the host, outside any device queue)."""
    v ^= v >> 16
    v = (v * _FMIX_MUL1) & _MASK32
    v ^= v >> 13
    v = (v * _FMIX_MUL2) & _MASK32
    return v ^ (v >> 16)


def _fmix(xp, h):
    """fmix32 of a uint32 array, in place (wrapping multiplies, as uint32 arrays do on numpy and cupy)."""
    h ^= h >> xp.uint32(16)
    h *= xp.uint32(_FMIX_MUL1)
    h ^= h >> xp.uint32(13)
    h *= xp.uint32(_FMIX_MUL2)
    h ^= h >> xp.uint32(16)
    return h


def dropout_keys(seed: int, step: int, layer: str) -> tuple[int, int]:
    """The two 32-bit keys of (seed, step, layer): one fmix32 round per word."""
    seed, step = operator.index(seed) % 2**64, operator.index(step) % 2**64
    key = _KEY_SALT
    for word in (seed & _MASK32, seed >> 32, step & _MASK32, step >> 32, zlib.crc32(layer.encode())):
        key = _fmix_host(key ^ word)
    return key, _fmix_host(key ^ _SECOND_SALT)


def _flat_index(xp, shape, rect, dtype):
    """The flat (row-major) index in `shape` of every element of `rect`, as `dtype`, from one
    arange per dimension broadcast together: the whole tensor is never materialized."""
    strides = [prod(shape[d + 1:]) for d in range(len(shape))]
    index = xp.zeros((1,) * len(shape), dtype=dtype)
    for d, (lo, hi, stride) in enumerate(zip(rect.lo, rect.hi, strides)):
        axis = xp.arange(lo, hi, dtype=dtype) * dtype(stride)
        index = index + axis.reshape((1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
    return index


def dropout_bits(xp, seed: int, step: int, layer: str, shape: tuple, rect: Rect):
    """The uint32 hash of every element of `rect` (a Rect inside a tensor of `shape`)."""
    shape = tuple(int(s) for s in shape)
    if rect.rank != len(shape) or not Rect.full(shape).contains(rect):
        raise ValueError(f"dropout: rect {rect} is not inside a tensor of shape {shape}")
    key1, key2 = dropout_keys(seed, step, layer)
    if prod(shape) <= 2**32:  # every index fits 32 bits: its high word is 0 (decided by the shape, not the tile)
        h = _flat_index(xp, shape, rect, xp.uint32)
        high = None
    else:
        index = _flat_index(xp, shape, rect, xp.uint64)
        h = (index & xp.uint64(_MASK32)).astype(xp.uint32)
        high = (index >> xp.uint64(32)).astype(xp.uint32)
    h = h * xp.uint32(_INDEX_MUL)  # a fresh array: the index may be a broadcast view
    h ^= xp.uint32(key1)
    h = _fmix(xp, h)
    if high is not None:
        h ^= high
    h ^= xp.uint32(key2)
    return _fmix(xp, h)


def keep_threshold(p: float) -> int:
    """Elements whose hash is at least this are kept: a fraction 1 - p of the 2**32 values (to 2**-33)."""
    return min(round(p * 2**32), _MASK32)


def dropout_keep(xp, seed: int, step: int, layer: str, shape: tuple, rect: Rect, p: float):
    """Which elements of `rect` (inside a tensor of `shape`) dropout keeps at (seed, step) in `layer`:
    a bool array of rect.shape, the same for that element whatever tile it is computed in."""
    return dropout_bits(xp, seed, step, layer, shape, rect) >= xp.uint32(keep_threshold(p))


@dataclass(frozen=True)
class Dropout(Op):
    """`layer` is the name whose hash keys the mask (the graph sets it to the layer's own name), so
    two dropout layers of one graph draw independent masks and a rebuilt graph draws the same ones."""

    p: float = 0.5
    layer: str = ""

    kind = "dropout"
    #: its training output depends on a draw: forward and backward take `draw=(seed, step)`
    random = True

    def __post_init__(self):
        if len(self.in_shapes) != 1:
            raise ShapeError(f"dropout takes one input, got {len(self.in_shapes)}")
        p = self.p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and 0 <= p < 1):
            raise ShapeError(f"dropout p must be a number with 0 <= p < 1, got {p!r}")
        if not isinstance(self.layer, str):
            raise ShapeError(f"dropout layer must be a layer name (str), got {self.layer!r}")

    @property
    def out_shape(self):
        return tuple(self.in_shapes[0])

    # The training cost: the two hash rounds (about 17 integer operations), the compare and scale.
    def flops(self, out):
        return 20 * out.volume

    def backward_flops(self, out):
        return 20 * out.volume

    def _mask(self, xp, draw, out, dtype):
        """The tile's mask / (1 - p) in `dtype` (torch's noise: bernoulli(1 - p) divided by 1 - p)."""
        if not (isinstance(draw, (tuple, list)) and len(draw) == 2):  # a list: a tuple after msgpack
            raise ValueError(f"dropout draw must be None (prediction) or (seed, step), got {draw!r}")
        seed, step = draw
        keep = dropout_keep(xp, seed, step, self.layer, self.out_shape, out, self.p)
        return keep.astype(dtype) / (1 - self.p)

    def forward(self, xs, params, out, draw=None):
        x = xs[0]
        xp = array_module(x)
        if draw is None or self.p == 0:
            return xp.ascontiguousarray(x)  # as Identity: nothing writes into an op's output
        return x * self._mask(xp, draw, out, x.dtype)

    def backward(self, dy, xs, y, params, out, need_dx, draw=None):
        if not need_dx[0]:
            return [None], {}
        if draw is None or self.p == 0:
            return [dy], {}
        return [dy * self._mask(array_module(dy), draw, out, dy.dtype)], {}

    def attrs(self):
        return {"p": self.p, "layer": self.layer}


@dataclass(frozen=True)
class DropPath(Dropout):
    """Stochastic depth (torchvision's `stochastic_depth(mode="row")`): in training each sample's
    whole tensor is kept with probability 1 - p and scaled by 1 / (1 - p), the mask a hash of
    (seed, step, layer, sample index), so every split draws what one device draws."""

    kind = "drop_path"

    def _mask(self, xp, draw, out, dtype):
        if not (isinstance(draw, (tuple, list)) and len(draw) == 2):
            raise ValueError(f"drop_path draw must be None (prediction) or (seed, step), got {draw!r}")
        seed, step = draw
        rows = Rect((out.lo[0],), (out.hi[0],))
        keep = dropout_keep(xp, seed, step, self.layer, (self.out_shape[0],), rows, self.p)
        return (keep.astype(dtype) / (1 - self.p)).reshape((-1,) + (1,) * (len(self.out_shape) - 1))

    def flops(self, out):
        return out.volume

    def backward_flops(self, out):
        return out.volume
