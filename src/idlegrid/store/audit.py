"""SQL of audits: a job is released only when its lone results are vouched for.

A shard decided by one trusted node alone had no second opinion. Before a job
completes, each node that decided shards of it alone must have passed a check since its
latest one (its result is still unpaid); if it has not, that latest shard gets a spot
check by a trusted node first (`audit`). Which shards wait for one is
`verification.audit.to_audit`'s to say: `unvouched_alone` reads the job's decided lone
shards whose result is unpaid and returns what the rule names. The job completes when
the check agrees, and if it disagrees the node's lone shards are replicated again
(`store.recheck`). Functions over an open connection, in the caller's transaction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import rows
from idlegrid.store.base import ReadyTask
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks
from idlegrid.verification import audit as rules


async def unvouched_alone(conn: AsyncConnection, job_id: int) -> list[int]:
    """The job's shards decided alone to audit before it completes (`rules.to_audit`):
    per node, its latest such shard whose result is still unpaid, that no check of the
    node has vouched for yet."""
    found = await conn.execute(
        select(
            shards.c.id,
            tasks.c.node_id,
            tasks.c.finished_at,
            tasks.c.credit.is_not(None).label("paid"),
        )
        .join(tasks, tasks.c.id == shards.c.canonical_task_id)
        .where(
            shards.c.job_id == job_id,
            shards.c.mode == "alone",
            shards.c.state == ShardState.DONE.value,
            tasks.c.credit.is_(None),  # the rule's candidates: no paid one is audited
        )
    )
    return rules.to_audit(
        rules.DecidedAlone(
            shard_id=row.id,
            node_id=row.node_id,
            finished_at=row.finished_at,
            paid=bool(row.paid),
        )
        for row in found.all()
    )


async def audit(conn: AsyncConnection, shard_ids: Sequence[int], *, now: float) -> list[ReadyTask]:
    """Open decided lone shards again for one spot check each, by a trusted node.

    Their result votes again; a check that disagrees escalates the shard like any spot
    check (`escalate`). The new replicas go to the front of the queue.
    """
    if not shard_ids:
        return []
    ids = sorted(set(shard_ids))
    await conn.execute(
        move(
            shards,
            ShardState.OPEN,
            shards.c.id.in_(ids),
            sources=[ShardState.DONE],
            target=2,
            quorum=2,
            mode="spot",
            canonical_task_id=None,
            output_hash=None,
            output_size=None,
            finished_at=None,
            attempts=shards.c.attempts + 1,
        )
    )
    # Their results stay valid and vote again (the vote reads valid results too); the
    # decision judges only what it changes, so no node's trust counts a result twice.
    return await _spot_checks(conn, ids, now=now)


async def _spot_checks(conn: AsyncConnection, ids: Sequence[int], *, now: float) -> list[ReadyTask]:
    """One new replica per shard, for trusted nodes only, first in the queue."""
    values = [
        dict(shard_id=shard_id, job_id=job_id, state=TaskState.READY.value, created_at=now)
        for shard_id, job_id in (
            await conn.execute(
                select(shards.c.id, shards.c.job_id)
                .where(shards.c.id.in_(ids))
                .order_by(shards.c.id)
            )
        ).all()
    ]
    created = (
        (
            await conn.execute(
                insert(tasks)
                .values(trusted_only=True)
                .returning(tasks.c.id, sort_by_parameter_order=True),
                values,
            )
        )
        .scalars()
        .all()
    )
    found = await conn.execute(
        select(*rows.READY_COLUMNS)
        .join(jobs, jobs.c.id == tasks.c.job_id)
        .join(shards, shards.c.id == tasks.c.shard_id)
        .where(tasks.c.id.in_(list(created)))
        .order_by(tasks.c.id)
    )
    return [dataclasses.replace(rows.ready(row), urgent=True) for row in found]
