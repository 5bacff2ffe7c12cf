"""SQL of rechecks: a caught node's lone shards read, and replicated again.

Which of them go back to full replication is `verification.recheck`'s rule; here the
shards it needs are read and its answer written, in the caller's transaction (the
verdict's: see `store.ledger`). Their new replicas go to the front of the ready queue
(mode "escalated", `rows.ready`). An ended job's outputs that rested on a liar's word
are `verification.recheck.rested_on_liars`'s to name; here the checks of the job's
outputs and their nodes' latest lies are read for it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState, TaskState
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import jobs, shards, tasks
from idlegrid.verification import recheck as rules
from idlegrid.verification.recheck import UNREPLICATED, LoneShard, Rechecked, recheck, rested

_OPEN_JOB = (JobState.QUEUED.value, JobState.RUNNING.value)


async def recheck_node(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, window_s: float, now: float
) -> Rechecked:
    """Send back to full replication what this node ran or decided without replicas."""
    found = await _lone_shards(conn, node_id, kind, backend, since=now - window_s)
    out = recheck((_lone(row) for row in found), now=now, window_s=window_s)
    by_id = {row.id: row for row in found}
    for shard_id in out.to_replicate:
        row = by_id[shard_id]
        await _replicate(conn, shard_id, target=row.replication, quorum=row.min_quorum)
    word = await _rested_on(conn, node_id, kind, backend, since=now - window_s)
    on_word = rested((_lone(row) for row in word), now=now, window_s=window_s)
    by_id = {row.id: row for row in word}
    for shard_id in on_word.reopened:
        row = by_id[shard_id]
        # One more result than it has: the check its caught checker's pass stood for.
        await _replicate(conn, shard_id, target=row.results + 1, quorum=row.min_quorum)
    out.reopened += on_word.reopened
    out.released += on_word.released
    # Their results stay valid and vote again, with what their nodes' trust is now (the
    # vote reads valid results too); the decision judges only what it changes, so no
    # node's trust counts a result twice.
    return out


def _lone(row: Any) -> LoneShard:
    """A shard row of `_lone_shards` or `_rested_on` as the rules read it."""
    return LoneShard(
        shard_id=row.id,
        open=row.state == ShardState.OPEN.value,
        task_id=row.task_id,
        canonical_task_id=row.canonical_task_id,
        finished_at=row.finished_at,
        job_open=row.job_state in _OPEN_JOB,
    )


async def _lone_shards(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, since: float
) -> list[Any]:
    """The node's shards of this kind and backend run without full replication: open,
    or decided since `since`, in shard order."""
    query = (
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
            | ((shards.c.state == ShardState.DONE.value) & (shards.c.finished_at >= since)),
        )
        .order_by(shards.c.id)
    )
    return list((await conn.execute(query)).all())


_CHECK = tasks.alias("pass_of_output")


async def _rested_on(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, since: float
) -> list[Any]:
    """The shards decided since `since` whose canonical output this node's check passed,
    and no other check did (the rule: `rules.rested_alone`; kinds verified by checks),
    in shard order."""
    results = (
        select(func.count())
        .where(
            _CHECK.c.shard_id == shards.c.id,
            _CHECK.c.outcome == "valid",
            _CHECK.c.known_answer.is_(None),
        )
        .scalar_subquery()
    )
    query = (
        select(
            shards.c.id,
            shards.c.state,
            shards.c.canonical_task_id,
            tasks.c.id.label("task_id"),
            shards.c.finished_at,
            jobs.c.state.label("job_state"),
            jobs.c.min_quorum,
            results.label("results"),
        )
        .join(tasks, tasks.c.shard_id == shards.c.id)
        .join(jobs, jobs.c.id == shards.c.job_id)
        .where(
            tasks.c.node_id == node_id,
            jobs.c.kind == kind,
            func.coalesce(tasks.c.backend, "cpu") == backend,
            tasks.c.checks_hash == shards.c.output_hash,
            tasks.c.known_answer.is_(None),
            tasks.c.outcome == "valid",
            shards.c.state == ShardState.DONE.value,
            shards.c.finished_at >= since,
        )
        .order_by(shards.c.id)
    )
    passed = list((await conn.execute(query)).all())
    if not passed:
        return []
    ids = sorted({row.id for row in passed})
    checks = await _output_checks(conn, shards.c.id.in_(ids), key=shards.c.id)
    alone = {check.task_id for check in rules.rested_alone(checks)}
    return [row for row in passed if row.task_id in alone]


async def _output_checks(conn: AsyncConnection, *where: Any, key: Any) -> list[rules.OutputCheck]:
    """The checks of the canonical outputs of the decided shards `where` selects, each
    under its shard's `key` (a `shards` column: the rules only group by it), in key
    order, then task order."""
    query = (
        select(
            key.label("key"),
            tasks.c.id,
            tasks.c.node_id,
            tasks.c.finished_at,
            tasks.c.outcome,
            tasks.c.known_answer.is_not(None).label("known_answer"),
        )
        .join(tasks, tasks.c.shard_id == shards.c.id)
        .where(*where, shards.c.state == ShardState.DONE.value)
        .where(tasks.c.checks_hash == shards.c.output_hash)
        .order_by(key, tasks.c.id)
    )
    return [
        rules.OutputCheck(
            shard_index=row.key,
            task_id=row.id,
            node_id=row.node_id,
            finished_at=row.finished_at,
            outcome=row.outcome,
            known_answer=bool(row.known_answer),
        )
        for row in await conn.execute(query)
    ]


async def _replicate(conn: AsyncConnection, shard_id: int, *, target: int, quorum: int) -> None:
    # Open ones get the new target too; a done one reopens. Never a failed or cancelled one.
    await conn.execute(
        move(
            shards,
            ShardState.OPEN,
            shards.c.id == shard_id,
            sources=[ShardState.DONE],
            or_already=True,
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


async def rested_on_liars(conn: AsyncConnection, job_id: int) -> list[tuple[int, int]]:
    """(shard index, node) of the job's decided shards whose output one check alone
    passed, by a node caught lying since (`rules.rested_on_liars`; kinds verified by
    checks), in shard order."""
    checks = await _output_checks(conn, shards.c.job_id == job_id, key=shards.c.idx)
    alone = rules.rested_alone(checks)
    last_lie = await _last_lies(conn, sorted({c.node_id for c in alone if c.node_id is not None}))
    return rules.rested_on_liars(alone, last_lie)


async def _last_lies(conn: AsyncConnection, node_ids: list[int]) -> dict[int, tuple[float, int]]:
    """Per node, when its latest result found invalid finished, and its task (the latest
    task of those that finished then); absent: none."""
    found: dict[int, tuple[float, int]] = {}
    for node_id in node_ids:
        row = (
            await conn.execute(
                select(tasks.c.finished_at, tasks.c.id)
                .where(
                    tasks.c.node_id == node_id,
                    tasks.c.outcome == "invalid",
                    tasks.c.finished_at.is_not(None),
                )
                .order_by(tasks.c.finished_at.desc(), tasks.c.id.desc())
                .limit(1)
            )
        ).first()
        if row is not None:
            found[node_id] = (float(row.finished_at), int(row.id))
    return found
