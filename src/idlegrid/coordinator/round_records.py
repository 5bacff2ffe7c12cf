"""What a training job's stored rounds say, as pure functions of the store's records: a
round's shard indexes, the published updates that lead to its weights, which updates are
late, too stale or hopeless (asynchronous mode), and each round's metrics row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from idlegrid.kinds.base import Published, RoundJob
from idlegrid.states import ShardState, TrainingRoundState
from idlegrid.store.base import RoundRecord, ShardRecord


def train_indexes(record: RoundRecord) -> range:
    return range(record.first_shard, record.first_shard + record.train_shards)


def round_indexes(record: RoundRecord) -> list[int]:
    extra = [] if record.eval_shard is None else [record.eval_shard]
    return [*train_indexes(record), *extra]


def done_shard(shards: dict[int, ShardRecord], index: int | None) -> ShardRecord | None:
    shard = None if index is None else shards.get(index)
    return shard if shard is not None and shard.state == ShardState.DONE else None


def is_open(shards: dict[int, ShardRecord], index: int) -> bool:
    shard = shards.get(index)
    return shard is not None and shard.state == ShardState.OPEN


def published_chain(records: Sequence[RoundRecord], update_hash: str) -> list[Published]:
    """Every update published, oldest first, ending at the one to the new weights."""
    published = [
        Published(before.round, before.weights_digest, after.update_hash)
        for before, after in zip(records, records[1:], strict=False)
        if after.update_hash is not None
    ]
    current = records[-1]
    return [*published, Published(current.round, current.weights_digest, update_hash)]


def consumed(records: Sequence[RoundRecord]) -> set[int]:
    """Training shards some close already aggregated or dropped."""
    taken: set[int] = set()
    for record in records:
        taken.update(record.metrics.get("applied", []))
        taken.update(record.metrics.get("dropped", []))
    return taken


def unapplied(records: Sequence[RoundRecord], shards: dict[int, ShardRecord]) -> list[int]:
    """Training shards of closed rounds that are done or still open, yet in no close."""
    taken = consumed(records)
    return [
        i
        for record in records[:-1]
        for i in train_indexes(record)
        if i not in taken and (done_shard(shards, i) is not None or is_open(shards, i))
    ]


def late_updates(
    records: Sequence[RoundRecord], shards: dict[int, ShardRecord], max_staleness: int
) -> tuple[list[ShardRecord], list[ShardRecord]]:
    """Decided updates of earlier rounds that no close took yet: (usable, too stale).

    An update of round r is usable in the round open now (t) if t - r <= max_staleness.
    """
    current, taken = records[-1], consumed(records)
    usable: list[ShardRecord] = []
    too_stale: list[ShardRecord] = []
    for record in records[:-1]:
        for i in train_indexes(record):
            shard = done_shard(shards, i)
            if shard is None or i in taken:
                continue
            fresh_enough = current.round - record.round <= max_staleness
            (usable if fresh_enough else too_stale).append(shard)
    return usable, too_stale


def hopeless(
    records: Sequence[RoundRecord],
    shards: dict[int, ShardRecord],
    next_round: int,
    max_staleness: int,
) -> list[int]:
    """Open training shards that could only arrive past max_staleness: cancel them."""
    return [
        i
        for record in records
        if next_round - record.round > max_staleness
        for i in train_indexes(record)
        if is_open(shards, i)
    ]


def finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def round_row(
    record: RoundRecord, shards: dict[int, ShardRecord], training: RoundJob
) -> dict[str, Any]:
    metrics = record.metrics
    row: dict[str, Any] = {
        "round": record.round,
        "state": record.state.value,
        "final": record.final,
        "train_loss": metrics.get("train_loss"),
        "eval_loss": metrics.get("eval_loss"),
        "updates": metrics.get("updates"),
        "bytes_up": metrics.get("bytes_up"),
        "bytes_down": metrics.get("bytes_down"),
        "round_time_s": metrics.get("round_time_s"),
        "nodes": len(metrics.get("nodes", [])),
        "closed_by": metrics.get("closed_by"),
        # The largest distance of an update to the round's aggregate (poisoning shows here).
        "max_suspicion": metrics.get("max_suspicion"),
        "stale_applied": metrics.get("stale_applied"),
        "stale_dropped": metrics.get("stale_dropped"),
        # Peer-to-peer jobs: how the round was averaged and, if it fell back, why.
        "averaging": metrics.get("averaging"),
        "agreeing": metrics.get("agreeing"),
        "fallback_reason": metrics.get("fallback_reason"),
        # Members (shards) that averaged in Hivemind's client mode (behind NAT).
        "client_members": metrics.get("client_members"),
        # Bytes each member (shard) sent and received in its all-reduce, on the wire;
        # members its group could not do without (dead, unreachable, a part that did not
        # decode) and members left out of the agreeing group.
        "wire_bytes": metrics.get("wire_bytes"),
        "blamed": metrics.get("blamed"),
        "left_out": metrics.get("left_out"),
        "weights_digest": record.weights_digest,
        "checkpoint": record.checkpoint_hash,
    }
    if record.state == TrainingRoundState.OPEN:
        row["updates"] = sum(1 for i in train_indexes(record) if done_shard(shards, i) is not None)
        row["updates_needed"] = 0 if record.final else training.plan.min_updates
    return row
