"""SQL of audits: a job is released only when its lone results are vouched for.

A shard decided by one trusted node alone had no second opinion. Before a job
completes, each node that decided shards of it alone must have passed a check since its
latest one (`unvouched_alone`: its result is still unpaid). If it has not, that shard
gets a spot check by a trusted node first (`audit`); the job completes when the check
agrees, and if it disagrees the node's lone shards are replicated again
(`store.recheck`). Functions over an open connection, in the caller's transaction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import rows
from idlegrid.store.base import ReadyTask
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks

# A shard decided alone whose result no check has paid for yet.
_UNPAID_ALONE = (
    shards.c.mode == "alone",
    shards.c.state == ShardState.DONE.value,
    tasks.c.credit.is_(None),
)


async def unvouched_alone(conn: AsyncConnection, job_id: int) -> list[int]:
    """Per node that decided shards of this job alone, its latest such shard whose
    result is still unpaid: no check of the node has vouched for it yet.

    A lone result is paid once its node passes a check that finished after it
    (`verification.ledger.vouch_horizons`): the node cannot tell which of its shards run
    alone, nor which result will be checked. So an unpaid one is exactly one no check
    has vouched for, and the job waits for its audit; the check that passes it vouches
    for the node's earlier lone results too.
    """
    latest = (
        await conn.execute(
            select(
                tasks.c.node_id,
                func.max(tasks.c.finished_at).label("finished_at"),
            )
            .join(shards, shards.c.canonical_task_id == tasks.c.id)
            .where(*_UNPAID_ALONE, shards.c.job_id == job_id)
            .group_by(tasks.c.node_id)
        )
    ).all()
    found = []
    for node_id, finished_at in latest:
        shard_id = (
            await conn.execute(
                select(shards.c.id)
                .join(tasks, tasks.c.id == shards.c.canonical_task_id)
                .where(
                    *_UNPAID_ALONE,
                    shards.c.job_id == job_id,
                    tasks.c.node_id == node_id,
                    tasks.c.finished_at == finished_at,
                )
                .order_by(shards.c.id)
                .limit(1)
            )
        ).scalar_one()
        found.append(shard_id)
    return sorted(found)


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
