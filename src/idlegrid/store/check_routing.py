"""Which output a check task checks, and which nodes may take it (kinds verified by checks).

A shard's check goes to the earliest output not found invalid. For kinds whose outputs
name the build that made them (`TaskKind.names_builds`: llm-generate's llama.cpp), a
check on the output's own build is exact and one from another build holds it to the
cross-build margins (`verification.checking`), so the check waits for a node of the
output's build first: for `wait_s` after the output was made, a node of another build
cannot claim the shard's task while that output awaits its check. After that any node
may.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, exists, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState
from idlegrid.store import rows
from idlegrid.store.base import BuildWait
from idlegrid.store.schema import shards, tasks

GENERATION = tasks.alias("generation")


def awaiting(generation: Any, shard_id: Any) -> list[Any]:
    """Conditions for "an output of this shard that its next check would be about"."""
    return [
        generation.c.shard_id == shard_id,
        *rows.counting_result(generation),
        generation.c.checks_hash.is_(None),
        generation.c.output_hash.is_not(None),
    ]


def waits_for_its_build(claimer_build: str, *, wait_s: float, now: float) -> Any:
    """A condition on a claimed task: false while its shard's check waits for a node of
    another build than `claimer_build` (see the module)."""
    other_build = GENERATION.c.build.is_(None) | (GENERATION.c.build != claimer_build)
    recent = GENERATION.c.finished_at > now - wait_s
    return ~exists().where(*awaiting(GENERATION, tasks.c.shard_id), other_build, recent)


def check_target(shard_id: int, task_id: int) -> Select[Any]:
    """The output (hash, size) a task just claimed of `shard_id` is to check, if any."""
    return (
        select(GENERATION.c.output_hash, GENERATION.c.output_size)
        .where(
            *awaiting(GENERATION, shard_id),
            GENERATION.c.id != task_id,
        )
        .order_by(GENERATION.c.finished_at, GENERATION.c.id)
        .limit(1)
    )


async def build_waits(
    conn: AsyncConnection, job_id: int, *, since: float, limit: int
) -> list[BuildWait]:
    """The outputs of the job's open shards whose check still waits for a node of the
    build they name: they were made after `since`."""
    latest = GENERATION.c.finished_at
    query = (
        select(shards.c.idx, GENERATION.c.node_id, GENERATION.c.build, latest.label("since"))
        .join(shards, shards.c.id == GENERATION.c.shard_id)
        .where(
            shards.c.job_id == job_id,
            shards.c.state == ShardState.OPEN.value,
            GENERATION.c.build.is_not(None),
            GENERATION.c.node_id.is_not(None),
            *awaiting(GENERATION, GENERATION.c.shard_id),
            latest > since,
        )
        .order_by(shards.c.idx, GENERATION.c.id)
        .limit(limit)
    )
    return [
        BuildWait(row.idx, row.node_id, row.build, row.since) for row in await conn.execute(query)
    ]
