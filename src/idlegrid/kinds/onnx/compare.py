"""When two onnx-infer results of one shard are the same answer: per-output tolerances.

Honest nodes differ: thread counts change the order of float sums, graph optimisations
fuse operators, GPUs use other kernels. Cheats differ more: a model with fewer layers,
float16 arithmetic where float32 was asked for, noise, zeros, another shard's answer.
The rules, per output and per row (the first axis):

- same names, shapes and dtypes; integer and boolean outputs (class ids, masks) exactly;
- NaN and infinities in the same places;
- the largest difference in a row within `atol + rtol * m`, where m is the row's largest
  magnitude: relative to the row's scale, so values near zero do not need their own
  tolerance (elementwise rtol fails on them whatever the backend);
- rows of `cosine_min_size` values or more (embedding-like) also need cosine >= `cosine`;
- a float32 output whose every value is exactly a float16 or bfloat16 number, where most
  of the other side's values are not, was computed (or rounded) in 16 bits.

The defaults were calibrated by benchmarks/calibrate_onnx.py; docs/verification.md has the
table of honest and dishonest distances they separate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.kinds.base import Verdict

# Honest float32 runs measured up to ~2e-6 (row-relative) and 1 - cos ~1e-12 on CPU
# (docs/verification.md); cheats started at 5e-4. These leave room for GPUs.
DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6
DEFAULT_COSINE = 1.0 - 1e-6
COSINE_MIN_SIZE = 16
# Fewer values than this cannot show whether they were made in 16 bits.
LOW_PRECISION_MIN_VALUES = 64


class Tolerance(BaseModel):
    """How far two results of one output may be apart and still agree."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rtol: float = Field(default=DEFAULT_RTOL, ge=0.0, le=1.0)
    atol: float = Field(default=DEFAULT_ATOL, ge=0.0)
    # Minimum per-row cosine for rows of `cosine_min_size` values or more; None: no rule.
    cosine: float | None = Field(default=DEFAULT_COSINE, ge=-1.0, le=1.0)
    cosine_min_size: int = Field(default=COSINE_MIN_SIZE, ge=1)


def compare_outputs(
    first: Mapping[str, np.ndarray],
    second: Mapping[str, np.ndarray],
    tolerances: Mapping[str, Tolerance],
) -> Verdict:
    """AGREE when every output of `first` matches `second` under its tolerance."""
    if set(first) != set(second):
        return Verdict.DISAGREE
    for name, a in first.items():
        if not arrays_agree(a, second[name], tolerances.get(name, Tolerance())):
            return Verdict.DISAGREE
    return Verdict.AGREE


def arrays_agree(a: np.ndarray, b: np.ndarray, tolerance: Tolerance) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind != "f":
        return bool(np.array_equal(a, b))
    if a.dtype == np.float32 and _one_side_16_bit(a, b):
        return False
    if not _same_non_finite(a, b):
        return False
    errors, scales = row_errors(a, b)
    if np.any(errors > tolerance.atol + tolerance.rtol * scales):
        return False
    if tolerance.cosine is not None and a.ndim and a[0].size >= tolerance.cosine_min_size:
        return bool(np.all(row_cosines(a, b) >= tolerance.cosine))
    return True


def row_errors(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the largest absolute difference, and the largest magnitude of either side
    (non-finite values left out: `_same_non_finite` judges them)."""
    rows = a.shape[0] if a.ndim else 1
    a64 = np.where(np.isfinite(a), a, 0).astype(np.float64).reshape(rows, -1)
    b64 = np.where(np.isfinite(b), b, 0).astype(np.float64).reshape(rows, -1)
    if a64.shape[1] == 0:
        return np.zeros(rows), np.zeros(rows)
    errors = np.max(np.abs(a64 - b64), axis=1)
    scales = np.maximum(np.max(np.abs(a64), axis=1), np.max(np.abs(b64), axis=1))
    return errors, scales


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each pair of rows; 1 where both are zero, 0 where only one is."""
    rows = a.shape[0] if a.ndim else 1
    a64 = np.where(np.isfinite(a), a, 0).astype(np.float64).reshape(rows, -1)
    b64 = np.where(np.isfinite(b), b, 0).astype(np.float64).reshape(rows, -1)
    dots = np.einsum("ij,ij->i", a64, b64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    both_zero = (np.linalg.norm(a64, axis=1) == 0) & (np.linalg.norm(b64, axis=1) == 0)
    cosines = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
    return np.where(both_zero, 1.0, cosines)


def _same_non_finite(a: np.ndarray, b: np.ndarray) -> bool:
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(finite_a, finite_b):
        return False
    if finite_a.all():
        return True
    # Same places; +inf, -inf and NaN must also match.
    return bool(np.array_equal(a[~finite_a], b[~finite_b], equal_nan=True))


def _one_side_16_bit(a: np.ndarray, b: np.ndarray) -> bool:
    """One result is all 16-bit numbers while most of the other's are not.

    "Most" keeps saturated outputs honest: a near one-hot softmax is mostly exact 0s and
    1s on any backend, and one backend's 0.99999994 against another's 1.0 is no cheat.
    """
    if not (low_precision(a) or low_precision(b)):
        return False
    return max(wide_fraction(a), wide_fraction(b)) > 0.5


def wide_fraction(values: np.ndarray) -> float:
    """The fraction of finite values that neither float16 nor bfloat16 represents exactly."""
    finite = values[np.isfinite(values)].astype(np.float32)
    if finite.size == 0:
        return 0.0
    with np.errstate(over="ignore"):
        half = finite.astype(np.float16).astype(np.float32) == finite
    brain = (finite.view(np.uint32) & np.uint32(0xFFFF)) == 0
    return float(np.mean(~(half | brain)))


def low_precision(values: np.ndarray) -> bool:
    """Whether every finite value is exactly a float16 or a bfloat16 number.

    Honest float32 arithmetic leaves low mantissa bits set in almost every value; a
    result that survives rounding to 16 bits unchanged was made in 16 bits.
    """
    finite = values[np.isfinite(values)]
    if finite.size < LOW_PRECISION_MIN_VALUES or not np.any(finite):
        return False
    with np.errstate(over="ignore"):
        if np.array_equal(finite.astype(np.float16).astype(np.float32), finite):
            return True
    return not np.any(finite.view(np.uint32) & np.uint32(0xFFFF))


def distances(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(largest row-relative difference, largest 1 - cosine): the calibration's figures."""
    errors, scales = row_errors(a, b)
    relative = np.divide(errors, scales, out=np.zeros_like(errors), where=scales > 0)
    cosine_gap = 1.0 - row_cosines(a, b) if a.ndim and a[0].size > 1 else np.zeros(1)
    return float(relative.max(initial=0.0)), float(cosine_gap.max(initial=0.0))
