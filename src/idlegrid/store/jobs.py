"""Jobs and their shards: create, read, end (cancel, fail, complete).

The `store.jobs` role; each method is one transaction (store/database.py). Ending a job
cancels its live tasks (`ending.cancel_live`), whose nodes the coordinator then tells
to stop.
"""

from __future__ import annotations

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState
from idlegrid.store import ledger, rows
from idlegrid.store.base import CreatedJob, JobRecord, NewJob, NodeTask, ShardRecord, StateCounts
from idlegrid.store.blob_owners import add_job_blobs
from idlegrid.store.database import Role, read, write
from idlegrid.store.ending import LIVE, OPEN_JOB, cancel_live, complete, end_open_shards
from idlegrid.store.lifecycle import move
from idlegrid.store.replenish import replenish
from idlegrid.store.schema import jobs, shards, tasks


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
                target=job.first_target or job.replication,
                quorum=job.min_quorum,
            )
            for s in job.shards
        ],
    )
    return job_id


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


class Jobs(Role):
    """Jobs and their shards: create, read, end (`store.jobs`)."""

    @write
    async def create_job(self, conn: AsyncConnection, job: NewJob, *, now: float) -> CreatedJob:
        """Store the job and its shards, with their first tasks (for the ready queue)."""
        job_id = await insert_job(conn, job, now=now)
        first = await replenish(conn, now=now, job_id=job_id)
        record = await rows.job(conn, job_id)
        assert record is not None
        return CreatedJob(record, first.ready)

    @read
    async def get_job(self, conn: AsyncConnection, job_id: int) -> JobRecord | None:
        return await rows.job(conn, job_id)

    @write(retry_conflicts=True)
    async def cancel_job(self, conn: AsyncConnection, job_id: int, *, now: float) -> list[NodeTask]:
        return await end_job(conn, job_id, JobState.CANCELLED, error=None, now=now)

    @write(retry_conflicts=True)
    async def fail_job(
        self, conn: AsyncConnection, job_id: int, *, error: str, now: float
    ) -> list[NodeTask]:
        return await end_job(conn, job_id, JobState.FAILED, error=error, now=now)

    @read
    async def list_jobs(
        self, conn: AsyncConnection, account_id: int | None, *, limit: int, offset: int
    ) -> list[JobRecord]:
        query = select(jobs.c.id).order_by(jobs.c.id.desc()).limit(limit).offset(offset)
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        ids = (await conn.execute(query)).scalars().all()
        return [job for i in ids if (job := await rows.job(conn, i)) is not None]

    @read
    async def count_open_jobs(self, conn: AsyncConnection, account_id: int) -> int:
        """The account's jobs that are queued or running."""
        open_states = (JobState.QUEUED.value, JobState.RUNNING.value)
        query = select(func.count()).where(
            jobs.c.account_id == account_id, jobs.c.state.in_(open_states)
        )
        return int((await conn.execute(query)).scalar_one())

    @read
    async def list_shards(self, conn: AsyncConnection, job_id: int) -> list[ShardRecord]:
        live = (
            select(func.count())
            .where(tasks.c.shard_id == shards.c.id, tasks.c.state.in_(LIVE))
            .scalar_subquery()
        )
        query = select(shards, live.label("live")).where(shards.c.job_id == job_id)
        found = (await conn.execute(query.order_by(shards.c.idx))).all()
        return [rows.shard(row, live=row.live) for row in found]

    @read
    async def canonical_outputs(self, conn: AsyncConnection, job_id: int) -> list[str]:
        query = select(shards.c.output_hash, shards.c.state).where(shards.c.job_id == job_id)
        found = (await conn.execute(query.order_by(shards.c.idx))).all()
        if any(row.state != ShardState.DONE.value or row.output_hash is None for row in found):
            raise RuntimeError(f"job {job_id} has shards without a canonical result")
        return [row.output_hash for row in found]

    @write
    async def complete_job(
        self, conn: AsyncConnection, job_id: int, *, result_hash: str, result_size: int, now: float
    ) -> bool:
        changed = await conn.execute(
            complete(job_id, result_hash=result_hash, result_size=result_size, now=now)
        )
        if changed.rowcount != 1:
            return False
        # Its outputs' fate is settled: the passes its checkers' known answers confirmed
        # are paid now.
        await ledger.pay_confirmed_passes(conn, job_id, now=now)
        return True

    @read
    async def jobs_to_assemble(self, conn: AsyncConnection) -> list[int]:
        not_done = (
            select(shards.c.id)
            .where(shards.c.job_id == jobs.c.id, shards.c.state != ShardState.DONE.value)
            .exists()
        )
        query = select(jobs.c.id).where(jobs.c.state.in_(OPEN_JOB), ~not_done)
        return list((await conn.execute(query)).scalars().all())

    @read
    async def state_counts(self, conn: AsyncConnection) -> StateCounts:
        """How many tasks and how many jobs are in each state (for metrics)."""
        by_state = [
            {
                state: count
                for state, count in (
                    await conn.execute(select(table.c.state, func.count()).group_by(table.c.state))
                ).all()
            }
            for table in (tasks, jobs)
        ]
        return StateCounts(tasks=by_state[0], jobs=by_state[1])
