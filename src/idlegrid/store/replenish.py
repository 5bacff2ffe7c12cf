"""SQL of top-up: tasks for open shards short of replicas, failure when out of attempts.

Functions over an open connection, run in the caller's transaction (a new job's, a new
training round's, or the monitor's pass). `verification.replication.shortfall` decides per
shard; this module reads the counts it needs and writes its answer.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState, TaskState
from idlegrid.store import dialect, ending, rows
from idlegrid.store.base import NodeTask, ReadyTask, Replenished
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks
from idlegrid.verification import replication


def _candidates_query() -> Any:
    # A known-answer check is no replica of its shard: the shard's own check still comes.
    live = (
        select(func.count())
        .where(
            tasks.c.shard_id == shards.c.id,
            tasks.c.state.in_(ending.LIVE),
            tasks.c.known_answer.is_(None),
        )
        .scalar_subquery()
    )
    results = (
        select(func.count())
        .where(tasks.c.shard_id == shards.c.id, *rows.counting_result(tasks))
        .scalar_subquery()
    )
    # Only narrows the shards to those `replication.shortfall` may give tasks or fail:
    # short of pending results, or `replication.undecided`.
    undecided = (
        (shards.c.quorum > 1)
        & (results >= shards.c.quorum)
        & (results >= shards.c.target)
        & (live == 0)
    )
    return (
        select(
            shards.c.id,
            shards.c.job_id,
            shards.c.attempts,
            live.label("live"),
            results.label("results"),
            shards.c.item_count,
            shards.c.cost_flops,
            shards.c.target,
            shards.c.quorum,
            shards.c.mode,
            jobs.c.max_attempts,
            jobs.c.kind,
            jobs.c.priority,
        )
        .join(jobs, jobs.c.id == shards.c.job_id)
        .where(
            shards.c.state == ShardState.OPEN.value,
            jobs.c.state.in_(ending.OPEN_JOB),
            (live + results < shards.c.target) | undecided,
        )
    )


_CANDIDATES = _candidates_query()


def _counts(row: Any) -> replication.ShardCounts:
    return replication.ShardCounts(
        target=row.target,
        quorum=row.quorum,
        live=row.live,
        results=row.results,
        attempts=row.attempts,
        max_attempts=row.max_attempts,
    )


async def replenish(
    conn: AsyncConnection, *, now: float, job_id: int | None, shard_id: int | None = None
) -> Replenished:
    """Create the tasks open shards need (of one job or shard, or of all); fail the
    exhausted."""
    query = _CANDIDATES if job_id is None else _CANDIDATES.where(shards.c.job_id == job_id)
    if shard_id is not None:
        query = query.where(shards.c.id == shard_id)
    found = (await conn.execute(query)).all()
    if found and dialect.row_locks(conn):
        found = await _lock_and_recount(conn, query, [row.id for row in found])
    new_tasks: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    exhausted: list[Any] = []
    for row in found:
        need = replication.shortfall(_counts(row))
        if need.exhausted:
            exhausted.append(row)
        if need.new_tasks <= 0:
            continue
        new_tasks += [
            dict(
                shard_id=row.id,
                job_id=row.job_id,
                state=TaskState.READY.value,
                created_at=now,
                trusted_only=False,
            )
        ] * need.new_tasks
        attempts.append({"b_shard": row.id, "b_more": need.new_tasks})
    if attempts:  # one statement for all the shards (a new job's are thousands)
        await conn.execute(
            update(shards)
            .where(shards.c.id == bindparam("b_shard"))
            .values(attempts=shards.c.attempts + bindparam("b_more")),
            attempts,
        )
    failed_jobs, to_cancel = await _fail_exhausted(conn, exhausted, now=now)
    ready = await _insert_tasks(conn, new_tasks, {row.id: row for row in found}, now=now)
    return Replenished(ready=ready, failed_jobs=failed_jobs, to_cancel=to_cancel)


async def _insert_tasks(
    conn: AsyncConnection, new_tasks: list[dict[str, Any]], meta: dict[int, Any], *, now: float
) -> list[ReadyTask]:
    if not new_tasks:
        return []
    # One multi-row insert; ids come back in the order of the rows.
    created = (
        await conn.execute(
            insert(tasks).returning(tasks.c.id, sort_by_parameter_order=True), new_tasks
        )
    ).all()
    ready = []
    for values, (task_id,) in zip(new_tasks, created, strict=True):
        row = meta[values["shard_id"]]
        ready.append(
            ReadyTask(
                task_id=task_id,
                shard_id=row.id,
                job_id=row.job_id,
                kind=row.kind,
                priority=row.priority,
                created_at=now,
                items=row.item_count,
                cost_flops=row.cost_flops,
                urgent=rows.is_urgent(row.mode, row.results > 0),
            )
        )
    return ready


async def _lock_and_recount(conn: AsyncConnection, query: Any, shard_ids: list[int]) -> list[Any]:
    """Lock the shards short of tasks and count again (PostgreSQL).

    Another process may be topping up the same shards: SKIP LOCKED leaves those to it,
    and the second count, a new statement under READ COMMITTED, sees every task a
    transaction that held a lock before us committed, so no shard gets tasks twice.
    """
    locked = (
        (
            await conn.execute(
                select(shards.c.id)
                .where(shards.c.id.in_(shard_ids))
                .order_by(shards.c.id)
                .with_for_update(skip_locked=True, key_share=True)
            )
        )
        .scalars()
        .all()
    )
    if not locked:
        return []
    return list((await conn.execute(query.where(shards.c.id.in_(locked)))).all())


async def _fail_exhausted(
    conn: AsyncConnection, exhausted: list[Any], *, now: float
) -> tuple[list[int], list[NodeTask]]:
    """Fail shards out of attempts and their jobs; return the jobs and tasks to cancel."""
    failed_jobs: list[int] = []
    to_cancel: list[NodeTask] = []
    for row in exhausted:
        reason = (
            f"shard {row.id} got no usable result in {row.attempts} attempts "
            f"(max_attempts={row.max_attempts})"
        )
        await conn.execute(
            move(
                shards,
                ShardState.FAILED,
                shards.c.id == row.id,
                sources=[ShardState.OPEN],
                error=reason,
                finished_at=now,
            )
        )
        changed = await conn.execute(
            move(jobs, JobState.FAILED, jobs.c.id == row.job_id, error=reason, finished_at=now)
        )
        if changed.rowcount == 1:
            failed_jobs.append(row.job_id)
            # Its other shards end with it, as in `jobs.end_job`.
            await conn.execute(
                ending.end_open_shards(shards.c.job_id == row.job_id, ShardState.FAILED, now=now)
            )
            to_cancel += await ending.cancel_live(conn, tasks.c.job_id == row.job_id, now=now)
    return failed_jobs, to_cancel
