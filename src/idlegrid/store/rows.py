"""Rows to records: the column lists and mappers the store's modules share, written once.

A query that returns records selects one of the column lists here and maps each row with
the matching function, so a record's fields and the columns behind them change in one
place.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, NodeState, ShardState, TaskState
from idlegrid.store import totals
from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    JobRecord,
    NodeRecord,
    ReadyTask,
    ShardRecord,
    TokenRecord,
)
from idlegrid.store.schema import accounts, jobs, shards, tasks, tokens
from idlegrid.verification.trust import Trust


def counting_result(task: Any) -> list[Any]:
    """Conditions on a row of `task` (the tasks table or an alias) for a result that still
    counts: completed, and valid or not yet judged."""
    return [
        task.c.state == TaskState.COMPLETED.value,
        task.c.outcome.is_(None) | (task.c.outcome == "valid"),
        task.c.known_answer.is_(None),  # a known-answer check is never a shard's result
    ]


_LIE = tasks.alias("lie_of_shard")


def bars_nobody(task: Any) -> Any:
    """A condition on a row of `task`, a check that does not bar its node from its shard
    (kinds verified by checks): a check of an output found invalid or set aside (its node
    may check the output made again, which in a small pool no other node can), or a known-answer
    check no longer held (its node answered it; while it holds it, it must not see the
    real claim beside the planted one)."""
    caught_a_lie = exists().where(
        _LIE.c.shard_id == task.c.shard_id,
        _LIE.c.output_hash == task.c.checks_hash,
        _LIE.c.checks_hash.is_(None),
        _LIE.c.outcome.in_(["invalid", "moot"]),
    )
    answered = task.c.known_answer.is_not(None) & task.c.state.not_in(
        [TaskState.READY.value, TaskState.ASSIGNED.value]
    )
    return task.c.checks_hash.is_not(None) & (caught_a_lie | answered)


_RESULT = tasks.alias("result_of_shard")
# The shard has a result that still counts: a task of it now finishes a begun shard (a
# dispute's next replica, a check of an output, an output made again, a stand-in for a
# lost replica), so it is urgent (`is_urgent`).
HAS_RESULT = exists().where(_RESULT.c.shard_id == shards.c.id, *counting_result(_RESULT))


def is_urgent(mode: str | None, has_result: bool) -> bool:
    """Whether a ready task goes ahead of every other (`ReadyTask.urgent`): its shard went
    back to full replication (a node was caught lying), or already has a result."""
    return mode == "escalated" or has_result


# What a ready-queue entry needs: the task joined to its job and its shard.
READY_COLUMNS = (
    tasks.c.id,
    tasks.c.shard_id,
    tasks.c.job_id,
    tasks.c.created_at,
    jobs.c.kind,
    jobs.c.priority,
    shards.c.item_count,
    shards.c.cost_flops,
    shards.c.mode,
    HAS_RESULT.label("has_result"),
)

# What a node needs to hear of a task it claimed (`assignment`).
ASSIGNED_COLUMNS = (
    tasks.c.id,
    tasks.c.shard_id,
    tasks.c.job_id,
    shards.c.idx,
    shards.c.input_hash,
    shards.c.input_size,
    shards.c.mode,
    jobs.c.kind,
    jobs.c.params,
)


# A token as listed (`token`), with its account's name.
TOKEN_COLUMNS = (
    tokens.c.id,
    accounts.c.name.label("account"),
    tokens.c.kind,
    tokens.c.prefix,
    tokens.c.label,
    tokens.c.created_at,
    tokens.c.revoked_at,
)


def pk(result: Any) -> int:
    """The primary key of the row an INSERT made."""
    return int(result.inserted_primary_key[0])


def node(row: Any) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        account_id=row.account_id,
        node_key=row.node_key,
        name=row.name,
        state=NodeState(row.state),
        hardware=row.hardware,
        benchmark=row.benchmark,
        kinds=row.kinds,
        slots=row.slots,
        worker_version=row.worker_version,
        created_at=row.created_at,
        last_seen_at=row.last_seen_at,
        connected_seconds=row.connected_seconds,
        network=row.network,
        suspended_at=row.suspended_at,
        credit=totals.credit_of(row),
    )


def account(row: Any) -> AccountRecord:
    return AccountRecord(
        id=row.id,
        name=row.name,
        is_admin=row.is_admin,
        flagged_at=row.flagged_at,
        flag_reason=row.flag_reason,
        credit=totals.credit_of(row),
    )


def token(row: Any) -> TokenRecord:
    """A row of `TOKEN_COLUMNS`."""
    return TokenRecord(
        id=row.id,
        account=row.account,
        kind=row.kind,
        prefix=row.prefix,
        label=row.label,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


def shard(row: Any, *, live: int = 0) -> ShardRecord:
    return ShardRecord(
        id=row.id,
        job_id=row.job_id,
        index=row.idx,
        state=ShardState(row.state),
        items=row.item_count,
        attempts=row.attempts,
        input_hash=row.input_hash,
        output_hash=row.output_hash,
        error=row.error,
        live_tasks=live,
        target=row.target,
        quorum=row.quorum,
        mode=row.mode,
        cost_flops=row.cost_flops,
    )


def ready(row: Any) -> ReadyTask:
    """A row of `READY_COLUMNS`."""
    return ReadyTask(
        task_id=row.id,
        shard_id=row.shard_id,
        job_id=row.job_id,
        kind=row.kind,
        priority=row.priority,
        created_at=row.created_at,
        items=row.item_count,
        cost_flops=row.cost_flops,
        urgent=is_urgent(row.mode, bool(row.has_result)),
    )


def assignment(
    row: Any, lease_deadline: float, trust: Trust, *, first_replica: bool = False
) -> Assignment:
    """A row of `ASSIGNED_COLUMNS`."""
    return Assignment(
        task_id=row.id,
        shard_id=row.shard_id,
        job_id=row.job_id,
        shard_index=row.idx,
        kind=row.kind,
        params=row.params,
        input_hash=row.input_hash,
        input_size=row.input_size,
        lease_deadline=lease_deadline,
        trust=trust,
        first_replica=first_replica,
    )


async def job(conn: AsyncConnection, job_id: int, *, with_counts: bool = True) -> JobRecord | None:
    """One job; with its shards counted by state and its completed tasks, unless not asked."""
    row = (await conn.execute(select(jobs).where(jobs.c.id == job_id))).first()
    if row is None:
        return None
    counts: dict[str, int] = {}
    tasks_run = 0
    if with_counts:
        counts = {
            state: n
            for state, n in (
                await conn.execute(
                    select(shards.c.state, func.count())
                    .where(shards.c.job_id == job_id)
                    .group_by(shards.c.state)
                )
            ).all()
        }
        tasks_run = (
            await conn.execute(
                select(func.count()).where(
                    tasks.c.job_id == job_id, tasks.c.state == TaskState.COMPLETED.value
                )
            )
        ).scalar_one()
    return JobRecord(
        id=row.id,
        account_id=row.account_id,
        kind=row.kind,
        params=row.params,
        inputs=row.inputs,
        state=JobState(row.state),
        replication=row.replication,
        min_quorum=row.min_quorum,
        max_attempts=row.max_attempts,
        priority=row.priority,
        shards_total=row.shards_total,
        items_total=row.items_total,
        result_hash=row.result_hash,
        result_size=row.result_size,
        error=row.error,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        shard_counts=counts,
        tasks_run=tasks_run,
    )


def states(*values: Any) -> list[str]:
    """The stored values of some state enums' members."""
    return [state.value for state in values]
