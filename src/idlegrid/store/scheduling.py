"""Scheduling: ready tasks of every job, straggling shards, speculative backups, top-up.

The `store.scheduling` role; each method is one transaction (store/database.py). The
top-up itself (store/replenish.py) also runs inside the transactions that make shards
(a new job, a training round). A backup
task follows the same rules as any claim: its insert is conditional on the shard being
open, short of `max_attempts`, without a backup yet and without a task on the node, with
the shard's row locked on PostgreSQL so two processes cannot both add one.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, JobState, ShardState, TaskState
from idlegrid.store import dialect, rows
from idlegrid.store.base import (
    Assignment,
    Claimer,
    ClaimMiss,
    NodeTrust,
    ReadyTask,
    Replenished,
    RunningTask,
)
from idlegrid.store.claims import claim, held_by
from idlegrid.store.database import Role, read, write
from idlegrid.store.replenish import replenish as top_up
from idlegrid.store.schema import jobs, nodes, shards, tasks

_LIVE = tuple(state.value for state in LIVE_TASK_STATES)
_OPEN_JOB = (JobState.QUEUED.value, JobState.RUNNING.value)


# Made once, not per query: an alias copies the table's columns and foreign keys into
# reference cycles that only the garbage collector frees (this runs every second).
_LIVE_TASKS = tasks.alias("live")
_READY_TASKS = tasks.alias("ready")


def _live_count(shard_id: Any) -> Any:
    live = _LIVE_TASKS
    return (
        select(func.count())
        .where(live.c.shard_id == shard_id, live.c.state.in_(_LIVE))
        .correlate_except(live)
        .scalar_subquery()
    )


@functools.lru_cache(maxsize=8)
def _running_shards_query(limit: int) -> Any:
    """The statement of `running_shards`, built once per limit: it runs every second for
    idle nodes, and building it anew leaves reference cycles for the collector."""
    ready = _READY_TASKS
    return (
        select(
            tasks.c.id,
            tasks.c.shard_id,
            tasks.c.job_id,
            tasks.c.node_id,
            tasks.c.assigned_at,
            jobs.c.kind,
            shards.c.item_count,
            shards.c.cost_flops,
            nodes.c.benchmark,
        )
        .join(shards, shards.c.id == tasks.c.shard_id)
        .join(jobs, jobs.c.id == tasks.c.job_id)
        .join(nodes, nodes.c.id == tasks.c.node_id)
        .where(
            tasks.c.state == TaskState.ASSIGNED.value,
            shards.c.state == ShardState.OPEN.value,
            jobs.c.state.in_(_OPEN_JOB),
            shards.c.attempts < jobs.c.max_attempts,
            _live_count(shards.c.id) <= jobs.c.replication,
            # Uncorrelated: one pass over the ready tasks (a hashed subplan), not one per row.
            tasks.c.job_id.not_in(
                select(ready.c.job_id).where(ready.c.state == TaskState.READY.value)
            ),
        )
        .order_by(tasks.c.assigned_at)
        .limit(limit)
    )


async def _straggling(conn: AsyncConnection, shard_id: int, node_id: int) -> tuple[Any, Any] | None:
    """The shard (locked on PostgreSQL) and its job, if the node may get a backup of it:
    open, in an open job of replication 1, under `max_attempts`, without a ready task or
    a backup yet, and with no task of it ever on this node."""
    shard_query = select(shards).where(shards.c.id == shard_id)
    if dialect.row_locks(conn):
        shard_query = shard_query.with_for_update(key_share=True)
    shard = (await conn.execute(shard_query)).first()
    if shard is None or shard.state != ShardState.OPEN.value:
        return None
    job = (await conn.execute(select(jobs).where(jobs.c.id == shard.job_id))).one()
    # Replicated shards are not backed up: their replicas race to a quorum already, and a
    # backup would spend the shard's max_total_results budget that a dispute needs.
    if job.state not in _OPEN_JOB or shard.attempts >= job.max_attempts or job.replication > 1:
        return None
    live, ready = (
        await conn.execute(
            select(
                func.count(),
                func.count().filter(tasks.c.state == TaskState.READY.value),
            ).where(tasks.c.shard_id == shard_id, tasks.c.state.in_(_LIVE))
        )
    ).one()
    on_node = (
        await conn.execute(
            select(func.count()).where(tasks.c.shard_id == shard_id, tasks.c.node_id == node_id)
        )
    ).scalar_one()
    # One backup at most: a shard's live tasks never exceed its target plus one. A
    # shard with a task still waiting in the queue is not straggling.
    if live > shard.target or ready or on_node:
        return None
    return shard, job


async def _insert_backup(
    conn: AsyncConnection, shard: Any, claimer: Claimer, lease_deadline: float, *, now: float
) -> int:
    """A backup task of the shard, inserted already claimed by `claimer`: an attempt."""
    inserted = await conn.execute(
        insert(tasks).values(
            shard_id=shard.id,
            job_id=shard.job_id,
            state=TaskState.ASSIGNED.value,
            created_at=now,
            lease_deadline=lease_deadline,
            **held_by(claimer, now),
        )
    )
    await conn.execute(
        update(shards).where(shards.c.id == shard.id).values(attempts=shards.c.attempts + 1)
    )
    return rows.pk(inserted)


class Scheduling(Role):
    """The ready queue's heads, stragglers and their backups, the top-up (`store.scheduling`)."""

    @read
    async def ready_heads(self, conn: AsyncConnection, *, per_job: int) -> list[ReadyTask]:
        """The oldest `per_job` ready tasks of every job, so no job hides behind another."""
        position = (
            func.row_number()
            .over(partition_by=tasks.c.job_id, order_by=tasks.c.id)
            .label("position")
        )
        ranked = (
            select(*rows.READY_COLUMNS, position)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.state == TaskState.READY.value)
            .subquery()
        )
        query = select(ranked).where(ranked.c.position <= per_job).order_by(ranked.c.id)
        return [rows.ready(row) for row in await conn.execute(query)]

    @read
    async def running_shards(self, conn: AsyncConnection, *, limit: int) -> list[RunningTask]:
        """Held tasks of open shards in jobs with no ready task left and no backup yet."""
        query = _running_shards_query(limit)
        return [
            RunningTask(
                task_id=row.id,
                shard_id=row.shard_id,
                job_id=row.job_id,
                node_id=row.node_id,
                kind=row.kind,
                items=row.item_count,
                cost_flops=row.cost_flops,
                assigned_at=row.assigned_at,
                node_benchmark=dict(row.benchmark or {}),
            )
            for row in await conn.execute(query)
        ]

    @write(retry_conflicts=True)
    async def add_backup_task(
        self,
        conn: AsyncConnection,
        shard_id: int,
        node_id: int,
        *,
        lease_deadline: float,
        now: float,
        backend: str = "cpu",
    ) -> Assignment | None:
        """Give `node_id` one extra (speculative) task of an open shard, already claimed,
        on `backend`: a claim like any other, in the node's daily quota of the kind.

        None when the shard is decided, already has a backup or a ready task, is out of
        attempts (`max_attempts`), the node already holds or held a task of it, or it
        may claim nothing now (suspended, or its quota used up).
        """
        found = await _straggling(conn, shard_id, node_id)
        if found is None:
            return None
        shard, job = found
        node = (
            await conn.execute(
                select(nodes.c.account_id, nodes.c.network).where(nodes.c.id == node_id)
            )
        ).one()
        claimer = Claimer(
            node_id=node_id, account_id=node.account_id, network=node.network, backend=backend
        )

        async def take(found: NodeTrust) -> list[int]:
            return [await _insert_backup(conn, shard, claimer, lease_deadline, now=now)]

        # A claim like any other: never for a suspended node or past its quota.
        outcome = await claim(conn, claimer, job.kind, take, trust=self.trust, now=now)
        if isinstance(outcome, ClaimMiss):
            return None
        [task_id] = outcome[1]
        return Assignment(
            task_id=task_id,
            shard_id=shard_id,
            job_id=job.id,
            shard_index=shard.idx,
            kind=job.kind,
            params=job.params,
            input_hash=shard.input_hash,
            input_size=shard.input_size,
            lease_deadline=lease_deadline,
        )

    @write(retry_conflicts=True)
    async def replenish(self, conn: AsyncConnection, *, now: float) -> Replenished:
        """Create tasks for open shards short of replicas; fail shards out of attempts."""
        return await top_up(conn, now=now, job_id=None)
