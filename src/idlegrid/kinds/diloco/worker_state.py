"""What a worker process keeps between training tasks: weights, residuals, AdamW moments.

Recent weights (by digest) let the next task rebuild its starting weights from the small
published updates instead of a full copy. Top-k's error-feedback residual belongs to the
sender, so each node keeps one per training run (not per shard: the coordinator sums all
updates, so what a node held back may join any later update of the same run). Both live
in memory only: a restarted worker has neither, gets a keyframe, and restarts its
residual at zero (what it had not sent yet is lost, a bounded error).

With `InnerSettings.keep_state` a node also keeps the AdamW moments of each shard it
trained (per training run and shard, as DiLoCo's replicas do), for the next round's task
of that shard; the coordinator prefers to give it that task (matching's affinity). A
node without them (new, restarted, or given another shard) starts the moments at zero.

Streaming DiLoCo (`training.fragments`) keeps each shard's local weights the same way:
the fragments not synced in a round go on training from them in the next; a node without
the previous round's local weights of a shard starts from the global ones.

Peer-to-peer rounds (`averaging: "p2p"`) keep the outer optimizer's state of each run
(its momentum and download residual, with the digest of the weights it goes with): each
member takes the outer step itself. A node without it gets it from the coordinator when
the coordinator holds it, or takes part in the round's averaging without stepping.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from idlegrid.kinds.diloco.tasks import OuterState


@dataclass(frozen=True)
class OptimizerState:
    """AdamW's moments over the flat parameter vector, and how many steps made them."""

    step: int
    exp_avg: np.ndarray  # float32, one per parameter
    exp_avg_sq: np.ndarray

    def fits(self, size: int) -> bool:
        return self.exp_avg.shape == self.exp_avg_sq.shape == (size,)


class WorkerState:
    """Thread-safe caches of one worker process (tasks may run in a thread pool)."""

    def __init__(self, *, weights_capacity: int = 2, optimizer_capacity: int = 2) -> None:
        self.weights_capacity = weights_capacity
        self.optimizer_capacity = optimizer_capacity
        self._weights: OrderedDict[str, np.ndarray] = OrderedDict()
        self._residuals: dict[str, np.ndarray] = {}
        # (stream, shard) -> (round that made it, state), least recently used first.
        self._optimizers: OrderedDict[tuple[str, int], tuple[int, OptimizerState]] = OrderedDict()
        # (stream, shard) -> (round that made them, local weights), least recently used first.
        self._locals: OrderedDict[tuple[str, int], tuple[int, np.ndarray]] = OrderedDict()
        # stream -> the outer optimizer's state of a peer-to-peer run (its newest).
        self._outer: dict[str, OuterState] = {}
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

    def optimizer_state(self, stream: str, shard: int, round_number: int) -> OptimizerState | None:
        """AdamW moments this node made for the shard in a round before `round_number`."""
        with self._lock:
            held = self._optimizers.get((stream, shard))
            if held is None or held[0] >= round_number:
                return None
            self._optimizers.move_to_end((stream, shard))
            return held[1]

    def set_optimizer_state(
        self, stream: str, shard: int, round_number: int, state: OptimizerState
    ) -> None:
        """Keep a task's AdamW moments, dropping the least recently used beyond capacity."""
        with self._lock:
            self._optimizers[(stream, shard)] = (round_number, state)
            self._optimizers.move_to_end((stream, shard))
            while len(self._optimizers) > self.optimizer_capacity:
                self._optimizers.popitem(last=False)

    def local_weights(self, stream: str, shard: int, round_number: int) -> np.ndarray | None:
        """The shard's local weights after this node's task of the round before, if held."""
        with self._lock:
            held = self._locals.get((stream, shard))
            if held is None or held[0] != round_number - 1:
                return None
            self._locals.move_to_end((stream, shard))
            return held[1]

    def set_local_weights(
        self, stream: str, shard: int, round_number: int, weights: np.ndarray
    ) -> None:
        """Keep a streaming task's local weights, dropping the least recently used."""
        frozen = np.array(weights, dtype=np.float32, copy=True)
        frozen.flags.writeable = False
        with self._lock:
            self._locals[(stream, shard)] = (round_number, frozen)
            self._locals.move_to_end((stream, shard))
            while len(self._locals) > self.optimizer_capacity:
                self._locals.popitem(last=False)

    def optimizer_shards(self, stream: str) -> list[int]:
        """The shards of a training run whose AdamW moments this node holds."""
        with self._lock:
            return sorted(shard for (held, shard) in self._optimizers if held == stream)

    def outer_state(self, stream: str, weights_digest: str) -> OuterState | None:
        """The run's outer state if it goes with these weights, else None."""
        with self._lock:
            held = self._outer.get(stream)
            return held if held is not None and held.weights_digest == weights_digest else None

    def set_outer_state(self, stream: str, state: OuterState | None) -> None:
        with self._lock:
            if state is None:
                self._outer.pop(stream, None)
            else:
                self._outer[stream] = state

    def clear(self) -> None:
        with self._lock:
            self._outer.clear()
            self._weights.clear()
            self._residuals.clear()
            self._optimizers.clear()
            self._locals.clear()
