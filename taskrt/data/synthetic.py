"""Seeded synthetic samples: each value a pure function of (seed, sample index, flat position in
the sample), computed with 32-bit integer operations and one exact conversion to float, so numpy
and cupy give the same bits, and a device can generate any window of any sample by itself.

    values(np, seed=0, indices=[3, 7], shape=(3, 224, 224), window=(slice(0, 3), slice(0, 8), slice(0, 8)))
    labels(np, seed=0, indices=[3, 7], classes=1000)

`xp` is the array module (numpy or cupy).  Only the window asked for is computed.
"""

from __future__ import annotations

from math import prod

import numpy as np

MAX_SAMPLES = 2**32  # sample indices and flat positions are hashed as 32-bit integers
MAX_VALUES = 2**32
_SEED_SALT, _LABEL_SALT, _POSITION_MUL = 0x3C6EF372, 0x5BD1E995, 0x9E3779B9


def _mix(xp, x):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that spreads every input bit."""
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(0x85EBCA6B)
    x = x ^ (x >> xp.uint32(13))
    x = x * xp.uint32(0xC2B2AE35)
    return x ^ (x >> xp.uint32(16))


def sample_keys(xp, seed: int, indices):
    """One uint32 per sample: the hash of (seed, index).  The seed's hash is computed on the host and
    enters the device's kernels as an argument: a device array made from host values would be a
    copy that can wait for the device's queued work."""
    seed_key = _mix(np, np.asarray([seed % 2**32], dtype=np.uint32) ^ np.uint32(_SEED_SALT))[0]
    return _mix(xp, xp.asarray(indices).astype(xp.uint32) ^ seed_key)


def values(xp, seed: int, indices, shape: tuple, window: tuple, dtype="float32"):
    """Samples `indices` of shape `shape`, only `window` (one slice per dimension of `shape`, steps
    of 1), as `dtype` values in [-1, 1): the top 24 bits of the hash of (seed, index, position),
    times 2**-23, minus 1 (exact in float32 and float64)."""
    strides = [prod(shape[d + 1:]) for d in range(len(shape))]
    position = xp.zeros((1,) * len(shape), dtype=xp.uint32)
    for d, (cut, size, stride) in enumerate(zip(window, shape, strides)):
        lo, hi, _ = cut.indices(size)
        axis = xp.arange(lo, hi, dtype=xp.uint32) * xp.uint32(stride)
        position = position + axis.reshape((1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
    keys = sample_keys(xp, seed, indices).reshape((-1,) + (1,) * len(shape))
    bits = _mix(xp, (position[None] * xp.uint32(_POSITION_MUL)) ^ keys) >> xp.uint32(8)
    scalar = np.dtype(dtype).type
    return bits.astype(dtype) * scalar(2.0**-23) - scalar(1.0)


def labels(xp, seed: int, indices, classes: int):
    """Class labels of samples `indices` in [0, classes), int64: the hash of (seed, index) modulo `classes`."""
    return (_mix(xp, sample_keys(xp, seed, indices) ^ xp.uint32(_LABEL_SALT)) % xp.uint32(classes)).astype(xp.int64)
