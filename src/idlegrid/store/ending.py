"""Ending what a job, a training round or a shard's decision closes: its open shards
and its live tasks, whose nodes the coordinator then tells to stop.

Building blocks over an open connection, shared by `store.jobs`, `store.rounds`,
the top-up (store/replenish.py) and the verifier's decisions.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Update, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, JobState, ShardState, TaskState
from idlegrid.store import rows
from idlegrid.store.base import HeldTask, NodeTask
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks

LIVE = tuple(state.value for state in LIVE_TASK_STATES)
OPEN_JOB = rows.states(JobState.QUEUED, JobState.RUNNING)
_CANCELLABLE = (TaskState.READY, TaskState.ASSIGNED)
# Expired tasks are told to stop too (their node may still run them), but stay expired:
# an error of their node, which only a result that still comes takes back.
_TO_STOP = rows.states(TaskState.READY, TaskState.ASSIGNED, TaskState.EXPIRED)


def complete(job_id: int, *, result_hash: str, result_size: int, now: float) -> Update:
    """The job completed with its result (a job still queued or running)."""
    return move(
        jobs,
        JobState.COMPLETED,
        jobs.c.id == job_id,
        result_hash=result_hash,
        result_size=result_size,
        finished_at=now,
    )


def end_open_shards(where: Any, to: ShardState, *, now: float) -> Update:
    """The update that ends the open shards matching `where` (those decided stay)."""
    return move(shards, to, where, sources=[ShardState.OPEN], finished_at=now)


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
