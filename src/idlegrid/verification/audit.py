"""Audits: a job is released only when its lone results are vouched for.

A shard decided by one trusted node alone had no second opinion. A lone result is paid
once its node passes a check that finished after it (`verification.ledger.vouch_horizons`):
the node cannot tell which of its shards run alone, nor which result will be checked. So
an unpaid one is exactly one no check has vouched for, and before its job completes the
latest such shard of each node gets a spot check by a trusted node (`to_audit`); the
check that passes it vouches for the node's earlier lone results too. Pure: the store
reads the job's decided lone shards (`DecidedAlone`) and audits what `to_audit` names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DecidedAlone:
    """A shard of the job decided alone, with its canonical result, as the audit reads it."""

    shard_id: int
    node_id: int | None  # the node of its canonical result
    finished_at: float | None  # when that result finished
    paid: bool  # that result was paid (vouched for), or its credit taken back


def to_audit(shards: Iterable[DecidedAlone]) -> list[int]:
    """The shards to spot-check before the job completes, sorted: per node, its latest
    shard whose result is unpaid (the earliest shard of those finished at once; of a
    node whose results never finished, its earliest)."""
    unpaid: dict[int | None, list[DecidedAlone]] = {}
    for shard in shards:
        if not shard.paid:
            unpaid.setdefault(shard.node_id, []).append(shard)
    return sorted(_latest(found).shard_id for found in unpaid.values())


def _latest(shards: list[DecidedAlone]) -> DecidedAlone:
    finished = [s.finished_at for s in shards if s.finished_at is not None]
    latest = max(finished, default=None)
    return min((s for s in shards if s.finished_at == latest), key=lambda s: s.shard_id)
