"""What a worker process keeps between training tasks: recent global weights, residuals.

Recent weights (by digest) let the next task rebuild its starting weights from the small
published updates instead of a full copy. Top-k's error-feedback residual belongs to the
sender, so each node keeps one per training run (not per shard: the coordinator sums all
updates, so what a node held back may join any later update of the same run). Both live
in memory only: a restarted worker has neither, gets a keyframe, and restarts its
residual at zero (what it had not sent yet is lost, a bounded error).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class WorkerState:
    """Thread-safe caches of one worker process (tasks may run in a thread pool)."""

    def __init__(self, *, weights_capacity: int = 2) -> None:
        self.weights_capacity = weights_capacity
        self._weights: OrderedDict[str, np.ndarray] = OrderedDict()
        self._residuals: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def weights(self, weights_digest: str) -> np.ndarray | None:
        """Weights with this digest if held (a read-only array), else None."""
        with self._lock:
            found = self._weights.get(weights_digest)
            if found is not None:
                self._weights.move_to_end(weights_digest)
            return found

    def remember_weights(self, weights_digest: str, weights: np.ndarray) -> None:
        """Keep these weights, dropping the least recently used beyond capacity."""
        frozen = weights.copy()
        frozen.flags.writeable = False
        with self._lock:
            self._weights[weights_digest] = frozen
            self._weights.move_to_end(weights_digest)
            while len(self._weights) > self.weights_capacity:
                self._weights.popitem(last=False)

    def residual(self, stream: str) -> np.ndarray | None:
        """The error-feedback residual this node holds for a training run, if any."""
        with self._lock:
            return self._residuals.get(stream)

    def set_residual(self, stream: str, residual: np.ndarray | None) -> None:
        with self._lock:
            if residual is None:
                self._residuals.pop(stream, None)
            else:
                self._residuals[stream] = residual

    def clear(self) -> None:
        with self._lock:
            self._weights.clear()
            self._residuals.clear()
