"""Outputs that no honest computation of a float kind returns. Pure numpy."""

from __future__ import annotations

import numpy as np


def degenerate(rows: np.ndarray) -> str | None:
    """Why a 2-D float output cannot be an honest one, or None.

    NaN or infinities, a row of zeros, or a row that is one value repeated: an embedding
    or a network's output vector is none of these, and a node that returns one skipped
    the work (or broke it) rather than computed it differently.
    """
    if not np.all(np.isfinite(rows)):
        return "output contains NaN or infinite values"
    if rows.ndim != 2 or rows.shape[1] < 2:
        return None
    if np.any(np.all(rows == 0, axis=1)):
        return "output has a row of zeros"
    if np.any(np.all(rows == rows[:, :1], axis=1)):
        return "output has a row that is one value repeated"
    return None
