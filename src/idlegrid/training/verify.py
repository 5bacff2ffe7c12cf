"""Comparing two replicas' pseudo-gradients of one shard and seed. Pure numpy.

Honest replicas differ a little: thread counts and hardware round float sums differently,
and H AdamW steps carry those differences along. They differ by orders of magnitude less
than a replica that skipped steps, used other data or another seed.

Every result carries a count sketch of its uncompressed pseudo-gradient: each value is
added, with a seeded random sign, into one of `SKETCH_SIZE` buckets. The sketch is linear
and keeps L2 distances in expectation, so two sketches' relative distance estimates the
relative distance of the full vectors, for 1 kB instead of 4 bytes a parameter. It also
compares results whose messages differ for a legitimate reason: top-k's error feedback
adds each node's own residual before sending.
"""

from __future__ import annotations

import functools

import numpy as np

SKETCH_SIZE = 256
_SKETCH_SEED = 0x1D1E
# Relative L2 distance under which two pseudo-gradients of one shard and seed agree.
# Measured on CPU, same seed, 1 vs 2 torch threads, the 117k-parameter character LM:
# 2e-6 after H=20 steps, 3e-5 after H=100 (tests/training/test_training_verify.py re-measures it).
# Another seed on the same shard gives 0.55-0.6. 0.05 leaves room for H in the hundreds
# and other hardware (provisional until measured on GPUs) while staying 10x below that.
DELTA_TOLERANCE = 0.05
# Relative difference under which two replicas' mean training losses agree.
LOSS_TOLERANCE = 0.01


# Values a part when a sketch is drawn and summed: its float64 temporaries stay at a few
# MB, not 16 bytes a parameter (2 GB for a 135M-parameter model).
_SKETCH_PART = 1 << 20


def sketch(vector: np.ndarray, size: int = SKETCH_SIZE) -> np.ndarray:
    """The count sketch of a flat vector: float32, `size` buckets (same map everywhere)."""
    buckets, signs = _sketch_map(vector.size, size)
    summed = np.zeros(size, dtype=np.float64)
    for start in range(0, vector.size, _SKETCH_PART):
        part = slice(start, start + _SKETCH_PART)
        weights = signs[part] * vector[part].astype(np.float64)
        summed += np.bincount(buckets[part], weights=weights, minlength=size)
    return summed.astype(np.float32)


@functools.lru_cache(maxsize=4)
def _sketch_map(length: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each value's bucket (int32) and sign (int8, +1 or -1): 5 bytes a value, kept.

    Drawn in parts as int32: the same stream as one int64 draw of all of them (numpy draws
    bounded integers below 2**32 from 32-bit outputs either way).
    """
    if size > np.iinfo(np.int32).max:
        raise ValueError(f"a sketch of {size} buckets is too large")
    rng = np.random.default_rng([_SKETCH_SEED, length, size])
    buckets = np.empty(length, dtype=np.int32)
    signs = np.empty(length, dtype=np.int8)
    for start in range(0, length, _SKETCH_PART):
        count = min(_SKETCH_PART, length - start)
        buckets[start : start + count] = rng.integers(0, size, size=count, dtype=np.int32)
    for start in range(0, length, _SKETCH_PART):
        count = min(_SKETCH_PART, length - start)
        drawn = rng.integers(0, 2, size=count, dtype=np.int32)
        signs[start : start + count] = drawn * 2 - 1
    return buckets, signs


def relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / max(||a||, ||b||) in float64; 0 for two zero vectors, inf for NaN."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if not (np.all(np.isfinite(a64)) and np.all(np.isfinite(b64))):
        return float("inf")
    scale = max(float(np.linalg.norm(a64)), float(np.linalg.norm(b64)))
    if scale == 0.0:
        return 0.0
    return float(np.linalg.norm(a64 - b64)) / scale


def deltas_agree(a: np.ndarray, b: np.ndarray, tolerance: float = DELTA_TOLERANCE) -> bool:
    """Whether two vectors (or their sketches) agree within `tolerance`; NaN disagrees."""
    distance = relative_distance(a, b)
    return bool(distance <= tolerance)


def losses_agree(a: float, b: float, tolerance: float = LOSS_TOLERANCE) -> bool:
    """Whether two replicas' training losses agree (relative, floor 1); NaN disagrees."""
    return bool(abs(a - b) <= tolerance * max(1.0, abs(a), abs(b)))
