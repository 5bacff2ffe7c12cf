"""One DiLoCo round, closed: updates in, new global weights and the published update out.

Pure numpy, no I/O, no torch: the coordinator's round driver stores a `RoundState`,
feeds `close_round` the decoded updates that arrived (on quorum or when the timer ran
out), stores the returned state and publishes the returned message. The simulation and
the kind's `assemble` use the same function, so there is one definition of a round.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from idlegrid.training import aggregate as aggregation
from idlegrid.training.compression import Compression, Message
from idlegrid.training.flat import digest
from idlegrid.training.fragments import Span
from idlegrid.training.outer import OuterSettings, nesterov_step, publish_update


@dataclass(frozen=True)
class RoundState:
    """The coordinator's training state at the start of round `round`."""

    round: int
    weights: np.ndarray
    momentum: np.ndarray
    download_residual: np.ndarray | None = None

    @property
    def digest(self) -> str:
        return digest(self.weights)


@dataclass(frozen=True)
class Update:
    """One task's decoded pseudo-gradient, with what the round needs to weigh it."""

    delta: np.ndarray
    base_round: int  # the round whose weights the task started from
    loss: float = float("nan")


@dataclass(frozen=True)
class ClosedRound:
    state: RoundState  # the next round's state
    message: Message  # the published update: state.weights = apply_update(old, message)
    suspicion: tuple[float, ...] = field(default=())  # per update: distance to the aggregate
    train_loss: float = float("nan")
    stale_applied: int = 0  # updates from older rounds that counted (asynchronous)
    stale_dropped: int = 0  # updates from older rounds left out: too stale, or synchronous


def initial_state(weights: np.ndarray) -> RoundState:
    """Round 0: the initial weights, zero momentum."""
    weights = np.asarray(weights, dtype=np.float32)
    return RoundState(0, weights, np.zeros_like(weights))


def close_round(
    state: RoundState,
    updates: Sequence[Update],
    *,
    rule: aggregation.Aggregation,
    outer: OuterSettings,
    download: Compression,
    asynchronous: bool = False,
    max_staleness: int | None = None,
    fragment: Span | None = None,
) -> ClosedRound:
    """Aggregate a round's updates, take the outer step, compress it for download.

    Updates from older rounds are dropped unless `asynchronous`, where they count with
    their staleness weight, up to `max_staleness` rounds old (None: any age). Updates
    for a later round are ignored. A round without updates keeps its momentum untouched
    and publishes only what download error feedback still owes the workers (often nothing).

    `fragment` (streaming DiLoCo, `training.fragments`): the updates are pseudo-gradients
    of this span of the weights alone; the outer step moves only it (with its slice of the
    momentum and of the download residual), and the message covers only it. Synchronous
    only: a late update would be of another fragment.
    """
    if fragment is not None:
        if asynchronous:
            raise ValueError("streaming fragments need synchronous rounds")
        return _close_fragment(state, updates, fragment, rule=rule, outer=outer, download=download)
    if not asynchronous:
        oldest = state.round
    else:
        oldest = 0 if max_staleness is None else state.round - max_staleness
    usable = [u for u in updates if oldest <= u.base_round <= state.round]
    dropped = sum(1 for u in updates if u.base_round < oldest)
    if not usable:
        return dataclasses.replace(_empty_round(state, download), stale_dropped=dropped)
    deltas = [u.delta for u in usable]
    staleness = [state.round - u.base_round for u in usable] if asynchronous else None
    outer_gradient = aggregation.aggregate(deltas, rule, staleness=staleness)
    update, momentum = nesterov_step(outer_gradient, state.momentum, outer)
    published = publish_update(state.weights, update, state.download_residual, download)
    suspicion = aggregation.distances(deltas, outer_gradient)
    losses = [u.loss for u in usable if np.isfinite(u.loss)]
    return ClosedRound(
        state=RoundState(state.round + 1, published.weights, momentum, published.residual),
        message=published.message,
        suspicion=tuple(float(s) for s in suspicion),
        train_loss=float(np.mean(losses)) if losses else float("nan"),
        stale_applied=sum(1 for u in usable if u.base_round < state.round),
        stale_dropped=dropped,
    )


def _close_fragment(
    state: RoundState,
    updates: Sequence[Update],
    fragment: Span,
    *,
    rule: aggregation.Aggregation,
    outer: OuterSettings,
    download: Compression,
) -> ClosedRound:
    """`close_round` of one streaming fragment: the rest of the state stays as it was."""
    if not 0 <= fragment.start < fragment.stop <= state.weights.size:
        raise ValueError(f"fragment {fragment} does not fit weights of {state.weights.size}")
    part = fragment.slice
    usable = [u for u in updates if u.base_round == state.round]
    dropped = sum(1 for u in updates if u.base_round < state.round)
    for u in usable:
        if u.delta.shape != (fragment.size,):
            raise ValueError(f"an update of {u.delta.shape} for a fragment of {fragment.size}")
    residual = state.download_residual
    weights, momentum = state.weights, state.momentum
    if usable:
        deltas = [u.delta for u in usable]
        outer_gradient = aggregation.aggregate(deltas, rule)
        step, momentum_part = nesterov_step(outer_gradient, state.momentum[part], outer)
        momentum = state.momentum.copy()
        momentum[part] = momentum_part
        suspicion = aggregation.distances(deltas, outer_gradient)
    else:
        step, suspicion = np.zeros(fragment.size, np.float32), np.zeros(0)
    owed = None if residual is None else residual[part]
    published = publish_update(weights[part], step, owed, download)
    weights = weights.copy()
    weights[part] = published.weights
    if published.residual is not None:
        residual = np.zeros_like(weights) if residual is None else residual.copy()
        residual[part] = published.residual
    losses = [u.loss for u in usable if np.isfinite(u.loss)]
    return ClosedRound(
        state=RoundState(state.round + 1, weights, momentum, residual),
        message=published.message,
        suspicion=tuple(float(s) for s in suspicion),
        train_loss=float(np.mean(losses)) if losses else float("nan"),
        stale_dropped=dropped,
    )


def _empty_round(state: RoundState, download: Compression) -> ClosedRound:
    zero = np.zeros_like(state.weights)
    published = publish_update(state.weights, zero, state.download_residual, download)
    next_state = RoundState(state.round + 1, published.weights, state.momentum, published.residual)
    return ClosedRound(state=next_state, message=published.message)


def task_seed(job_seed: int, round_number: int, shard: int) -> int:
    """The seed of one shard's task in one round: the same for every replica of it."""
    text = f"idlegrid/diloco:{job_seed}:{round_number}:{shard}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
