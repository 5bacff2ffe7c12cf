"""SQL of rechecks: what a node decided alone is replicated again once it is caught lying.

A node that runs shards alone was trusted on its record; one wrong result shows the
record was no guarantee. In the transaction of the verdict that caught it, every shard
of that kind and backend it runs alone now goes back to full replication, and every
shard it decided alone within `TrustSettings.recheck_window_s` is opened again, with
its result back in the vote, unless its job already ended (those are logged: the audit
before a job completes, `store.audit`, is what keeps them few). Their new
replicas go to the front of the ready queue (mode "escalated", `rows.ready`). Functions
over an open connection, in the caller's transaction (the verdict's: see `ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState, TaskState
from idlegrid.store.schema import jobs, shards, tasks

# Modes of a shard whose result no full set of replicas checked.
UNREPLICATED = ("alone", "spot")
_OPEN_JOB = (JobState.QUEUED.value, JobState.RUNNING.value)


@dataclass
class Rechecked:
    """Shards sent back to full replication by a caught node."""

    escalated: list[int] = field(default_factory=list)  # were still open
    reopened: list[int] = field(default_factory=list)  # were decided, job still open
    released: list[int] = field(default_factory=list)  # decided, job ended: too late


async def recheck_node(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, window_s: float, now: float
) -> Rechecked:
    """Send back to full replication what this node ran or decided without replicas."""
    found = (
        await conn.execute(
            select(
                shards.c.id,
                shards.c.state,
                shards.c.canonical_task_id,
                tasks.c.id.label("task_id"),
                shards.c.finished_at,
                jobs.c.state.label("job_state"),
                jobs.c.replication,
                jobs.c.min_quorum,
            )
            .join(tasks, tasks.c.shard_id == shards.c.id)
            .join(jobs, jobs.c.id == shards.c.job_id)
            .where(
                tasks.c.node_id == node_id,
                jobs.c.kind == kind,
                func.coalesce(tasks.c.backend, "cpu") == backend,
                shards.c.mode.in_(UNREPLICATED),
                (shards.c.state == ShardState.OPEN.value)
                | (
                    (shards.c.state == ShardState.DONE.value)
                    & (shards.c.finished_at >= now - window_s)
                ),
            )
            .order_by(shards.c.id)
        )
    ).all()
    out = Rechecked()
    for row in {row.id: row for row in found}.values():
        if row.state == ShardState.OPEN.value:
            out.escalated.append(row.id)
        elif row.canonical_task_id != row.task_id or row.finished_at < now - window_s:
            continue  # another node's result, or long ago
        elif row.job_state in _OPEN_JOB:
            out.reopened.append(row.id)
        else:
            out.released.append(row.id)
    by_id = {row.id: row for row in found}
    for shard_id in out.escalated + out.reopened:
        row = by_id[shard_id]
        await _replicate(conn, shard_id, target=row.replication, quorum=row.min_quorum)
    # Their results stay valid and vote again, with what their nodes' trust is now (the
    # vote reads valid results too); the decision judges only what it changes, so no
    # node's trust counts a result twice.
    return out


async def _replicate(conn: AsyncConnection, shard_id: int, *, target: int, quorum: int) -> None:
    await conn.execute(
        update(shards)
        .where(shards.c.id == shard_id)
        .values(
            state=ShardState.OPEN.value,
            target=target,
            quorum=quorum,
            mode="escalated",
            canonical_task_id=None,
            output_hash=None,
            output_size=None,
            finished_at=None,
        )
    )
    # A spot check still waiting for a trusted node may go to anyone now.
    await conn.execute(
        update(tasks)
        .where(tasks.c.shard_id == shard_id, tasks.c.state == TaskState.READY.value)
        .values(trusted_only=False)
    )
