"""Aggregation of pseudo-gradients into one outer gradient: plain and robust rules.

Pure numpy on flat float32 vectors, no I/O; accumulation is in float32 (the sums of a
round's few updates lose nothing that matters next to int8 quantization).

- `mean`: the DiLoCo default; one update scaled by 1000 moves it by 1000 / n.
- `trimmed_mean`: per coordinate, drop the `trim` largest and smallest values, average the
  rest (Yin et al., 2018). Absorbs up to `trim` arbitrary updates.
- `centered_clip`: start at a center (the coordinate-wise median unless given) and move it
  by the mean of the updates' differences to it, each clipped to norm `tau`
  (Karimireddy et al., 2021). One update moves the result by at most tau / n per pass.
- `staleness_weight`: in asynchronous mode an update computed from weights `s` rounds old
  is scaled by (1 + s) ** -alpha (FedAsync's polynomial rule) before any rule runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Rule = Literal["mean", "trimmed-mean", "centered-clip"]


class Aggregation(BaseModel):
    """How a round's updates become one outer gradient."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: Rule = "mean"
    trim_fraction: float = Field(
        default=0.2, ge=0.0, lt=0.5, description="share dropped at each end (trimmed-mean)"
    )
    clip_tau: float | None = Field(
        default=None,
        gt=0.0,
        description="clip radius (centered-clip); default: the median distance to the center",
    )
    clip_iterations: int = Field(default=3, ge=1, le=100)
    staleness_alpha: float = Field(
        default=0.5, ge=0.0, le=10.0, description="asynchronous mode: weight (1+s)^-alpha"
    )


def _stack(updates: Sequence[np.ndarray]) -> np.ndarray:
    if not updates:
        raise ValueError("no updates to aggregate")
    stacked = np.stack([np.asarray(u, dtype=np.float32) for u in updates])
    if stacked.ndim != 2:
        raise ValueError("updates must be flat vectors of one length")
    return stacked


def mean(updates: Sequence[np.ndarray], weights: Sequence[float] | None = None) -> np.ndarray:
    """The (weighted) mean of the updates."""
    stacked = _stack(updates)
    if weights is None:
        return stacked.mean(axis=0, dtype=np.float32)
    w = np.asarray(weights, dtype=np.float32)
    if w.shape != (len(stacked),) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError("weights must be one non-negative value per update, not all zero")
    return ((w[:, None] * stacked).sum(axis=0) / w.sum()).astype(np.float32)


def trim_count(updates: int, fraction: float) -> int:
    """How many values trimmed mean drops at each end: ceil(fraction * updates), capped.

    Rounding up means any positive fraction trims at least one of four or more updates;
    the cap keeps at least one value per coordinate.
    """
    # The epsilon stops 0.3 * 10 = 3.0000000000000004 from rounding up to 4.
    return min(math.ceil(fraction * updates - 1e-9), (updates - 1) // 2)


def trimmed_mean(updates: Sequence[np.ndarray], trim: int) -> np.ndarray:
    """Coordinate-wise mean after dropping the `trim` smallest and largest values."""
    stacked = _stack(updates)
    if trim < 0 or 2 * trim >= len(stacked):
        raise ValueError(f"cannot trim {trim} from each end of {len(stacked)} updates")
    ordered = np.sort(stacked, axis=0)
    return ordered[trim : len(stacked) - trim].mean(axis=0, dtype=np.float32)


def centered_clip(
    updates: Sequence[np.ndarray],
    *,
    tau: float | None = None,
    center: np.ndarray | None = None,
    iterations: int = 3,
) -> np.ndarray:
    """Centered clipping: v <- v + mean_i clip(x_i - v, tau), from the median or `center`."""
    stacked = _stack(updates)
    result = np.median(stacked, axis=0).astype(np.float32) if center is None else center.copy()
    for _ in range(iterations):
        differences = stacked - result
        norms = np.linalg.norm(differences, axis=1)
        radius = float(np.median(norms)) if tau is None else tau
        if radius <= 0:
            break
        factors = np.minimum(1.0, radius / np.maximum(norms, 1e-30)).astype(np.float32)
        result = result + (factors[:, None] * differences).mean(axis=0, dtype=np.float32)
    return result.astype(np.float32)


def staleness_weight(staleness: int, alpha: float) -> float:
    """Weight of an update computed `staleness` rounds ago: (1 + s) ** -alpha."""
    if staleness < 0:
        raise ValueError("staleness cannot be negative")
    return float((1.0 + staleness) ** -alpha)


def aggregate(
    updates: Sequence[np.ndarray],
    settings: Aggregation,
    *,
    staleness: Sequence[int] | None = None,
) -> np.ndarray:
    """One outer gradient from a round's updates under `settings`.

    With `staleness` (asynchronous mode), each update is first scaled by its staleness
    weight, so a stale update pulls less whatever the rule.
    """
    if staleness is not None:
        if len(staleness) != len(updates):
            raise ValueError("one staleness per update")
        updates = [
            np.float32(staleness_weight(s, settings.staleness_alpha)) * np.asarray(u)
            for u, s in zip(updates, staleness, strict=True)
        ]
    if settings.rule == "trimmed-mean":
        return trimmed_mean(updates, trim_count(len(updates), settings.trim_fraction))
    if settings.rule == "centered-clip":
        return centered_clip(updates, tau=settings.clip_tau, iterations=settings.clip_iterations)
    return mean(updates)


def distances(updates: Sequence[np.ndarray], reference: np.ndarray) -> np.ndarray:
    """Relative L2 distance of each update to `reference`: a suspicion score per update."""
    stacked = _stack(updates)
    scale = max(float(np.linalg.norm(reference)), 1e-30)
    return (np.linalg.norm(stacked - reference, axis=1) / scale).astype(np.float64)
