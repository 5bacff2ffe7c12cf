"""The training rounds of `diloco-train` jobs: the `store.rounds` role.

A round row is opened and the previous one closed in one transaction with the shards of
the new round, so a round is closed exactly once even when two monitor passes (or two
coordinator processes) try at the same moment: the loser's conditional update changes
no row and it creates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState, TaskState, TrainingRoundState
from idlegrid.store.base import (
    DueRound,
    NewRound,
    NewShard,
    NodeTask,
    ReadyTask,
    RoundAdvance,
    RoundRecord,
    RoundTraffic,
    TrainingFinish,
)
from idlegrid.store.blob_owners import add_job_blobs
from idlegrid.store.database import Role, read, write
from idlegrid.store.ending import cancel_live, complete, end_open_shards
from idlegrid.store.lifecycle import move
from idlegrid.store.replenish import replenish
from idlegrid.store.schema import jobs, shards, tasks, training_rounds

_OPEN = TrainingRoundState.OPEN.value
_LIVE_JOB = (JobState.QUEUED.value, JobState.RUNNING.value)


class TrainingRounds(Role):
    """The training rounds of `diloco-train` jobs (`store.rounds`)."""

    @write
    async def start_training(
        self,
        conn: AsyncConnection,
        job_id: int,
        first: NewRound,
        extra_shards: Sequence[NewShard],
        *,
        now: float,
    ) -> list[ReadyTask]:
        await conn.execute(insert(training_rounds).values(**_round_values(job_id, first, now)))
        await _name_round_blobs(conn, job_id, first)
        await _add_shards(conn, job_id, extra_shards)
        topped_up = await replenish(conn, now=now, job_id=job_id)
        return topped_up.ready

    @read
    async def training_rounds(self, conn: AsyncConnection, job_id: int) -> list[RoundRecord]:
        query = (
            select(training_rounds)
            .where(training_rounds.c.job_id == job_id)
            .order_by(training_rounds.c.round)
        )
        return [_record(row) for row in (await conn.execute(query)).all()]

    @write
    async def advance_round(
        self,
        conn: AsyncConnection,
        job_id: int,
        closing: int,
        *,
        metrics: dict[str, Any],
        cancel_shards: Sequence[int],
        next_round: NewRound,
        shards: Sequence[NewShard],
        now: float,
    ) -> RoundAdvance:
        if not await _close(conn, job_id, closing, metrics, now):
            return RoundAdvance(won=False, ready=[], to_cancel=[])
        to_cancel = await _cancel_shards(conn, job_id, cancel_shards, now=now)
        await conn.execute(insert(training_rounds).values(**_round_values(job_id, next_round, now)))
        await _name_round_blobs(conn, job_id, next_round)
        await _add_shards(conn, job_id, shards)
        more = await replenish(conn, now=now, job_id=job_id)
        return RoundAdvance(won=True, ready=more.ready, to_cancel=to_cancel + more.to_cancel)

    @write
    async def finish_training(
        self,
        conn: AsyncConnection,
        job_id: int,
        final: int,
        *,
        metrics: dict[str, Any],
        result_hash: str,
        result_size: int,
        now: float,
    ) -> TrainingFinish:
        """Close the last round and complete the job; its remaining tasks are cancelled."""
        if not await _close(conn, job_id, final, metrics, now):
            return TrainingFinish(won=False, to_cancel=[])
        await conn.execute(
            end_open_shards(shards.c.job_id == job_id, ShardState.CANCELLED, now=now)
        )
        to_cancel = await cancel_live(conn, tasks.c.job_id == job_id, now=now)
        completed = await conn.execute(
            complete(job_id, result_hash=result_hash, result_size=result_size, now=now)
        )
        return TrainingFinish(won=completed.rowcount == 1, to_cancel=to_cancel)

    @write
    async def update_round_metrics(
        self, conn: AsyncConnection, job_id: int, round_number: int, values: dict[str, Any]
    ) -> None:
        await _merge_metrics(conn, job_id, round_number, values)

    @write
    async def extend_round(
        self, conn: AsyncConnection, job_id: int, round_number: int, *, deadline: float
    ) -> None:
        await conn.execute(
            update(training_rounds)
            .where(_round_is(job_id, round_number), training_rounds.c.state == _OPEN)
            .values(deadline=deadline)
        )

    @read
    async def due_rounds(self, conn: AsyncConnection, *, now: float) -> list[DueRound]:
        query = (
            select(training_rounds.c.job_id, training_rounds.c.round)
            .join(jobs, jobs.c.id == training_rounds.c.job_id)
            .where(
                training_rounds.c.state == _OPEN,
                training_rounds.c.deadline <= now,
                jobs.c.state.in_(_LIVE_JOB),
            )
        )
        return [DueRound(row.job_id, row.round) for row in (await conn.execute(query)).all()]

    @read
    async def round_traffic(
        self, conn: AsyncConnection, job_id: int, shard_indexes: Sequence[int]
    ) -> RoundTraffic:
        of_round = and_(shards.c.job_id == job_id, shards.c.idx.in_(list(shard_indexes)))
        assigned = (
            select(func.coalesce(func.sum(shards.c.input_size), 0))
            .select_from(tasks.join(shards, shards.c.id == tasks.c.shard_id))
            .where(of_round, tasks.c.assigned_at.is_not(None))
        )
        uploaded = (
            select(func.coalesce(func.sum(tasks.c.output_size), 0), tasks.c.node_id)
            .select_from(tasks.join(shards, shards.c.id == tasks.c.shard_id))
            .where(of_round, tasks.c.state == TaskState.COMPLETED.value)
            .group_by(tasks.c.node_id)
        )
        payload_bytes = (await conn.execute(assigned)).scalar_one()
        per_node = (await conn.execute(uploaded)).all()
        return RoundTraffic(
            payload_bytes=int(payload_bytes),
            output_bytes=int(sum(row[0] for row in per_node)),
            nodes=tuple(sorted(row.node_id for row in per_node if row.node_id is not None)),
        )


async def _cancel_shards(
    conn: AsyncConnection, job_id: int, indexes: Sequence[int], *, now: float
) -> list[NodeTask]:
    if not indexes:
        return []
    of_round = and_(shards.c.job_id == job_id, shards.c.idx.in_(list(indexes)))
    ids = (await conn.execute(select(shards.c.id).where(of_round))).scalars().all()
    await conn.execute(end_open_shards(of_round, ShardState.CANCELLED, now=now))
    return await cancel_live(conn, tasks.c.shard_id.in_(list(ids)), now=now)


def _round_is(job_id: int, round_number: int) -> Any:
    return and_(training_rounds.c.job_id == job_id, training_rounds.c.round == round_number)


async def _name_round_blobs(conn: AsyncConnection, job_id: int, new: NewRound) -> None:
    """The round's weights, update and optimizer state: its tasks' nodes fetch them
    (`blob_access`; peer-to-peer members fetch the optimizer state when they lack it)."""
    blobs = [new.checkpoint_hash, new.update_hash or "", new.momentum_hash]
    await add_job_blobs(conn, job_id, blobs)


async def _close(
    conn: AsyncConnection, job_id: int, round_number: int, metrics: dict[str, Any], now: float
) -> bool:
    # The loser of two passes closing one round changes nothing here.
    changed = await conn.execute(
        move(
            training_rounds,
            TrainingRoundState.CLOSED,
            _round_is(job_id, round_number),
            closed_at=now,
        )
    )
    if changed.rowcount != 1:
        return False
    await _merge_metrics(conn, job_id, round_number, metrics)
    return True


async def _merge_metrics(
    conn: AsyncConnection, job_id: int, round_number: int, values: dict[str, Any]
) -> None:
    query = select(training_rounds.c.metrics).where(_round_is(job_id, round_number))
    current = (await conn.execute(query)).scalar_one_or_none()
    if current is None:
        return
    await conn.execute(
        update(training_rounds)
        .where(_round_is(job_id, round_number))
        .values(metrics={**current, **values})
    )


async def _add_shards(conn: AsyncConnection, job_id: int, new: Sequence[NewShard]) -> None:
    if not new:
        return
    job = (
        await conn.execute(select(jobs.c.replication, jobs.c.min_quorum).where(jobs.c.id == job_id))
    ).one()
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
            for s in new
        ],
    )
    await conn.execute(
        update(jobs)
        .where(jobs.c.id == job_id)
        .values(
            shards_total=jobs.c.shards_total + len(new),
            items_total=jobs.c.items_total + sum(s.items for s in new),
        )
    )


def _round_values(job_id: int, new: NewRound, now: float) -> dict[str, Any]:
    return dict(
        job_id=job_id,
        round=new.round,
        state=_OPEN,
        final=new.final,
        weights_digest=new.weights_digest,
        checkpoint_hash=new.checkpoint_hash,
        momentum_hash=new.momentum_hash,
        update_hash=new.update_hash,
        first_shard=new.first_shard,
        train_shards=new.train_shards,
        eval_shard=new.eval_shard,
        opened_at=now,
        deadline=new.deadline,
        metrics={},
    )


def _record(row: Any) -> RoundRecord:
    return RoundRecord(
        job_id=row.job_id,
        round=row.round,
        state=TrainingRoundState(row.state),
        final=bool(row.final),
        weights_digest=row.weights_digest,
        checkpoint_hash=row.checkpoint_hash,
        momentum_hash=row.momentum_hash,
        update_hash=row.update_hash,
        first_shard=row.first_shard,
        train_shards=row.train_shards,
        eval_shard=row.eval_shard,
        opened_at=row.opened_at,
        deadline=row.deadline,
        closed_at=row.closed_at,
        metrics=dict(row.metrics or {}),
    )
