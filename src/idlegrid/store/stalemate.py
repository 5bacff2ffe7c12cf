"""SQL of stalled shards: open shards with results whose ready replica nobody holds.

Whether a node can still run that replica is `verification.stalemate`'s question; this
reads what it needs: each shard's replicas, with the node, account and network of each,
and whether its ready replicas are spot checks only (`trust_on` reads the trust that says
whether a node may take one; `open_checks` lets anyone take them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Exists, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import ending, rows
from idlegrid.store import trust as trust_rows
from idlegrid.store.base import ShardReplica, StalledShard
from idlegrid.store.schema import jobs, node_trust, shards, tasks
from idlegrid.verification.stalemate import late_until
from idlegrid.verification.trust import Trust

_RAN = (TaskState.ASSIGNED.value, TaskState.EXPIRED.value, TaskState.COMPLETED.value)


def _has(*where: Any) -> Exists:
    return select(tasks.c.id).where(tasks.c.shard_id == shards.c.id, *where).exists()


async def _replicas(
    conn: AsyncConnection, shard_ids: Sequence[int]
) -> dict[int, list[ShardReplica]]:
    """The replicas of these shards that a node holds or held, in task order."""
    replicas: dict[int, list[ShardReplica]] = {shard_id: [] for shard_id in shard_ids}
    held = await conn.execute(
        select(
            tasks.c.shard_id,
            tasks.c.node_id,
            tasks.c.account_id,
            tasks.c.network,
            tasks.c.state,
            tasks.c.assigned_at,
            tasks.c.lease_deadline,
            rows.bars_nobody(tasks).label("bars_nobody"),
        )
        .where(
            tasks.c.shard_id.in_(list(replicas)),
            tasks.c.node_id.is_not(None),
            tasks.c.state != TaskState.CANCELLED.value,
        )
        .order_by(tasks.c.id)
    )
    for r in held:
        late = r.state == TaskState.EXPIRED.value
        replicas[r.shard_id].append(
            ShardReplica(
                r.node_id,
                r.account_id,
                r.network,
                ran=r.state in _RAN,
                late_until=late_until(r.assigned_at, r.lease_deadline) if late else None,
                bars=not r.bars_nobody,
            )
        )
    return replicas


async def stalled_shards(
    conn: AsyncConnection, *, limit: int, job_ids: Sequence[int] | None = None
) -> list[StalledShard]:
    """Open shards of open jobs with a result, a ready replica, and no replica held."""
    query = (
        select(shards.c.id, shards.c.job_id, shards.c.idx, jobs.c.kind)
        .join(jobs, jobs.c.id == shards.c.job_id)
        .where(
            shards.c.state == ShardState.OPEN.value,
            jobs.c.state.in_(ending.OPEN_JOB),
            _has(tasks.c.state == TaskState.READY.value),
            ~_has(tasks.c.state == TaskState.ASSIGNED.value),
            _has(*rows.counting_result(tasks)),
        )
        .order_by(shards.c.id)
        .limit(limit)
    )
    if job_ids is not None:
        query = query.where(shards.c.job_id.in_(list(job_ids)))
    found = (await conn.execute(query)).all()
    if not found:
        return []
    replicas = await _replicas(conn, [row.id for row in found])
    open_to_any = set(
        (
            await conn.execute(
                select(tasks.c.shard_id).where(
                    tasks.c.shard_id.in_(list(replicas)),
                    tasks.c.state == TaskState.READY.value,
                    tasks.c.trusted_only.is_(False),
                )
            )
        )
        .scalars()
        .all()
    )
    return [
        StalledShard(
            row.id,
            row.job_id,
            row.idx,
            row.kind,
            replicas[row.id],
            checks_only=row.id not in open_to_any,
        )
        for row in found
    ]


async def trust_on(conn: AsyncConnection, node_ids: Sequence[int], kind: str) -> list[Trust]:
    """These nodes' trust on `kind`, on every backend they have one for (whether one of
    them may take a spot check is `verification.trust.is_trusted`'s to say)."""
    if not node_ids:
        return []
    found = await conn.execute(
        select(node_trust)
        .where(node_trust.c.node_id.in_(list(node_ids)), node_trust.c.kind == kind)
        .order_by(node_trust.c.node_id, node_trust.c.backend)
    )
    return [trust_rows.trust_of(row) for row in found.all()]


async def open_checks(conn: AsyncConnection, shard_id: int) -> int:
    """Let anyone take the shard's ready spot checks; how many there were."""
    changed = await conn.execute(
        update(tasks)
        .where(
            tasks.c.shard_id == shard_id,
            tasks.c.state == TaskState.READY.value,
            tasks.c.trusted_only.is_(True),
        )
        .values(trusted_only=False)
    )
    return changed.rowcount
