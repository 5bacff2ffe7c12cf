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


def sketch(vector: np.ndarray, size: int = SKETCH_SIZE) -> np.ndarray:
    """The count sketch of a flat vector: float32, `size` buckets (same map everywhere)."""
    buckets, signs = _sketch_map(vector.size, size)
    summed = np.bincount(buckets, weights=signs * vector.astype(np.float64), minlength=size)
    return summed.astype(np.float32)


@functools.lru_cache(maxsize=4)
def _sketch_map(length: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([_SKETCH_SEED, length, size])
    buckets = rng.integers(0, size, size=length)
    signs = rng.integers(0, 2, size=length).astype(np.float64) * 2 - 1
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
