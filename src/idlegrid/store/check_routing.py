"""Which output a check task checks, and which nodes may take it (kinds verified by checks).

A shard's check goes to the earliest output not found invalid. For kinds whose outputs
name the build that made them (`TaskKind.names_builds`: llm-generate's llama.cpp), only a
check on the build the output's node reported counts as a pass (`verification.checking`),
so the check waits for such a node: for `wait_s` after the shard's latest result, a node
of another build cannot claim the shard's task while an output of another build awaits
its check. After that any node may, and its check can fail the output but not pass it.
An output that `checking.OTHER_BUILDS_BEFORE_REMAKE` checks of other builds checked, and
none of its own, is set aside: no more checks go to it, and the shard's next task makes
the output again (its node gets nothing for it, and loses nothing).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import rows
from idlegrid.store.base import BuildWait
from idlegrid.store.schema import shards, tasks
from idlegrid.verification.checking import OTHER_BUILDS_BEFORE_REMAKE

GENERATION = tasks.alias("generation")
CHECK = tasks.alias("check_of_generation")
LATEST = tasks.alias("latest_of_shard")
_COMPLETED = TaskState.COMPLETED.value


def _checks_of(generation: Any) -> list[Any]:
    return [
        CHECK.c.shard_id == generation.c.shard_id,
        CHECK.c.state == _COMPLETED,
        CHECK.c.checks_hash == generation.c.output_hash,
    ]


def _same_build(generation: Any) -> Any:
    # Never NULL (a check by a node that reported no build is of another build), so
    # that its negation counts it.
    return generation.c.build.is_not(None) & (
        func.coalesce(CHECK.c.build, "") == generation.c.build
    )


def set_aside(generation: Any) -> Any:
    """The output was checked by other builds only, `OTHER_BUILDS_BEFORE_REMAKE` times."""
    others = (
        select(func.count())
        .where(*_checks_of(generation), ~_same_build(generation))
        .scalar_subquery()
    )
    own = exists().where(*_checks_of(generation), _same_build(generation))
    return (others >= OTHER_BUILDS_BEFORE_REMAKE) & ~own


def awaiting(generation: Any, shard_id: Any, *, by_build: bool) -> list[Any]:
    """Conditions for "an output of this shard that its next check would be about"."""
    found = [
        generation.c.shard_id == shard_id,
        *rows.counting_result(generation),
        generation.c.checks_hash.is_(None),
        generation.c.output_hash.is_not(None),
    ]
    return [*found, ~set_aside(generation)] if by_build else found


def waits_for_its_build(claimer_build: str, *, wait_s: float, now: float) -> Any:
    """A condition on a claimed task: false while its shard's check waits for a node of
    another build than `claimer_build` (see the module)."""
    recent = exists().where(
        LATEST.c.shard_id == tasks.c.shard_id,
        LATEST.c.state == _COMPLETED,
        LATEST.c.finished_at > now - wait_s,
    )
    other_build = GENERATION.c.build.is_(None) | (GENERATION.c.build != claimer_build)
    return ~exists().where(
        *awaiting(GENERATION, tasks.c.shard_id, by_build=True), other_build, recent
    )


def check_target(shard_id: int, task_id: int, *, by_build: bool) -> Select[Any]:
    """The output (hash, size) a task just claimed of `shard_id` is to check, if any."""
    return (
        select(GENERATION.c.output_hash, GENERATION.c.output_size)
        .where(
            *awaiting(GENERATION, shard_id, by_build=by_build),
            GENERATION.c.id != task_id,
        )
        .order_by(GENERATION.c.finished_at, GENERATION.c.id)
        .limit(1)
    )


async def build_waits(
    conn: AsyncConnection, job_id: int, *, since: float, limit: int
) -> list[BuildWait]:
    """The outputs of the job's open shards whose check still waits for a node of the
    build they name: their shard's latest result came after `since`."""
    latest = (
        select(func.max(LATEST.c.finished_at))
        .where(LATEST.c.shard_id == GENERATION.c.shard_id, LATEST.c.state == _COMPLETED)
        .scalar_subquery()
    )
    query = (
        select(shards.c.idx, GENERATION.c.node_id, GENERATION.c.build, latest.label("since"))
        .join(shards, shards.c.id == GENERATION.c.shard_id)
        .where(
            shards.c.job_id == job_id,
            shards.c.state == ShardState.OPEN.value,
            GENERATION.c.build.is_not(None),
            GENERATION.c.node_id.is_not(None),
            *awaiting(GENERATION, GENERATION.c.shard_id, by_build=True),
            latest > since,
        )
        .order_by(shards.c.idx, GENERATION.c.id)
        .limit(limit)
    )
    return [
        BuildWait(row.idx, row.node_id, row.build, row.since) for row in await conn.execute(query)
    ]
