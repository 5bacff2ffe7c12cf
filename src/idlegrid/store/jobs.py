"""SQL of jobs and their shards: create, read, end (cancel, fail, complete).

Functions over an open connection; `SqlStore` wraps each in a transaction. Ending a job
cancels its live tasks (`cancel_live`), whose nodes the coordinator then tells to stop.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Update, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, JobState, ShardState, TaskState
from idlegrid.store import rows
from idlegrid.store.base import HeldTask, JobRecord, NewJob, NodeTask, ShardRecord
from idlegrid.store.blob_owners import add_job_blobs
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks

LIVE = tuple(state.value for state in LIVE_TASK_STATES)
OPEN_JOB = rows.states(JobState.QUEUED, JobState.RUNNING)
_CANCELLABLE = (TaskState.READY, TaskState.ASSIGNED)
# Expired tasks are told to stop too (their node may still run them), but stay expired:
# an error of their node, which only a result that still comes takes back.
_TO_STOP = rows.states(TaskState.READY, TaskState.ASSIGNED, TaskState.EXPIRED)


async def insert_job(conn: AsyncConnection, job: NewJob, *, now: float) -> int:
    """Store the job and its shards (open, none with a task yet); return the job's id."""
    job_id = rows.pk(
        await conn.execute(
            insert(jobs).values(
                account_id=job.account_id,
                kind=job.kind,
                params=job.params,
                inputs=job.inputs,
                state=JobState.QUEUED.value,
                replication=job.replication,
                min_quorum=job.min_quorum,
                max_attempts=job.max_attempts,
                priority=job.priority,
                shards_total=len(job.shards),
                items_total=sum(s.items for s in job.shards),
                created_at=now,
            )
        )
    )
    await add_job_blobs(conn, job_id, job.inputs.values())
    await conn.execute(
        insert(shards),
        [
            dict(
                job_id=job_id,
                idx=s.index,
                state=ShardState.OPEN.value,
                input_hash=s.input_hash,
                input_size=s.input_size,
                item_count=s.items,
                cost_flops=s.cost_flops,
                attempts=0,
                target=job.replication,
                quorum=job.min_quorum,
            )
            for s in job.shards
        ],
    )
    return job_id


async def list_jobs(
    conn: AsyncConnection, account_id: int | None, *, limit: int, offset: int
) -> list[JobRecord]:
    query = select(jobs.c.id).order_by(jobs.c.id.desc()).limit(limit).offset(offset)
    if account_id is not None:
        query = query.where(jobs.c.account_id == account_id)
    ids = (await conn.execute(query)).scalars().all()
    return [job for i in ids if (job := await rows.job(conn, i)) is not None]


async def count_open_jobs(conn: AsyncConnection, account_id: int) -> int:
    open_states = (JobState.QUEUED.value, JobState.RUNNING.value)
    query = select(func.count()).where(
        jobs.c.account_id == account_id, jobs.c.state.in_(open_states)
    )
    return int((await conn.execute(query)).scalar_one())


async def list_shards(conn: AsyncConnection, job_id: int) -> list[ShardRecord]:
    live = (
        select(func.count())
        .where(tasks.c.shard_id == shards.c.id, tasks.c.state.in_(LIVE))
        .scalar_subquery()
    )
    query = select(shards, live.label("live")).where(shards.c.job_id == job_id)
    found = (await conn.execute(query.order_by(shards.c.idx))).all()
    return [rows.shard(row, live=row.live) for row in found]


async def end_job(
    conn: AsyncConnection, job_id: int, target: JobState, *, error: str | None, now: float
) -> list[NodeTask]:
    """Cancel or fail a job that has not ended, with its open shards and live tasks."""
    # A job that ended meanwhile (completed, or ended by another process) stays as it is.
    changed = await conn.execute(
        move(jobs, target, jobs.c.id == job_id, error=error, finished_at=now)
    )
    if changed.rowcount != 1:
        return []
    shard_target = ShardState.CANCELLED if target == JobState.CANCELLED else ShardState.FAILED
    await conn.execute(end_open_shards(shards.c.job_id == job_id, shard_target, now=now))
    return await cancel_live(conn, tasks.c.job_id == job_id, now=now)


async def canonical_outputs(conn: AsyncConnection, job_id: int) -> list[str]:
    query = select(shards.c.output_hash, shards.c.state).where(shards.c.job_id == job_id)
    found = (await conn.execute(query.order_by(shards.c.idx))).all()
    if any(row.state != ShardState.DONE.value or row.output_hash is None for row in found):
        raise RuntimeError(f"job {job_id} has shards without a canonical result")
    return [row.output_hash for row in found]


async def complete_job(
    conn: AsyncConnection, job_id: int, *, result_hash: str, result_size: int, now: float
) -> bool:
    changed = await conn.execute(
        move(
            jobs,
            JobState.COMPLETED,
            jobs.c.id == job_id,
            result_hash=result_hash,
            result_size=result_size,
            finished_at=now,
        )
    )
    return changed.rowcount == 1


def end_open_shards(where: Any, to: ShardState, *, now: float) -> Update:
    """The update that ends the open shards matching `where` (those decided stay)."""
    return move(shards, to, where, sources=[ShardState.OPEN], finished_at=now)


async def jobs_to_assemble(conn: AsyncConnection) -> list[int]:
    not_done = (
        select(shards.c.id)
        .where(shards.c.job_id == jobs.c.id, shards.c.state != ShardState.DONE.value)
        .exists()
    )
    query = select(jobs.c.id).where(jobs.c.state.in_(OPEN_JOB), ~not_done)
    return list((await conn.execute(query)).scalars().all())


async def cancel_live(conn: AsyncConnection, where: Any, *, now: float) -> list[NodeTask]:
    """Cancel ready and held tasks matching `where`; return those a node holds."""
    return [held.task for held in await cancel_live_by_shard(conn, where, now=now)]


async def cancel_live_by_shard(conn: AsyncConnection, where: Any, *, now: float) -> list[HeldTask]:
    """`cancel_live`, each held task with its shard id (expired ones too, to be told to
    stop, though they stay expired)."""
    found = (
        await conn.execute(
            select(tasks.c.id, tasks.c.node_id, tasks.c.state, tasks.c.shard_id).where(
                where, tasks.c.state.in_(_TO_STOP)
            )
        )
    ).all()
    if not found:
        return []
    # Still conditional: a result committed meanwhile by another process stays.
    await conn.execute(
        move(
            tasks,
            TaskState.CANCELLED,
            tasks.c.id.in_([r.id for r in found]),
            sources=_CANCELLABLE,
            finished_at=now,
        )
    )
    return [
        HeldTask(r.shard_id, NodeTask(task_id=r.id, node_id=r.node_id, state=TaskState(r.state)))
        for r in found
        if r.node_id is not None
    ]
