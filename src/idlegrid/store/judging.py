"""A shard's decision written: the store's side of `verification.judging`.

The rules (`verification.judging`) decide a shard from what `shards_for_verify` reads;
`decide` records the decisions with a conditional update, so a decision that lost a race
to another process changes nothing; `verification.replication.decision_verdicts` says
what each result earns, and `store.ledger` writes what that changes in trust and credit.
The `store.verification` role (store/verification.py) runs these in its transactions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import (
    dialect,
    ending,
    ledger,
)
from idlegrid.store.base import (
    DecisionOutcome,
    NodeTask,
    ShardDecision,
)
from idlegrid.store.lifecycle import check_moved, move
from idlegrid.store.schema import jobs, shards, tasks
from idlegrid.verification import replication
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import TrustSettings

log = logging.getLogger(__name__)

# A result not judged yet, or judged late (stored after its shard was decided).
UNJUDGED_OR_LATE = tasks.c.outcome.is_(None) | (tasks.c.outcome == "late")


@dataclass
class Decided:
    """What `decide` changed: the shards it decided, their jobs, their tasks to cancel."""

    won: set[int] = field(default_factory=set)
    job_of: dict[int, int] = field(default_factory=dict)
    to_cancel: dict[int, list[NodeTask]] = field(default_factory=dict)


async def decide(
    conn: AsyncConnection,
    decisions: Sequence[ShardDecision],
    *,
    trust: TrustSettings,
    now: float,
) -> Decided:
    """Record the verifier's decisions and the verdicts they give their results."""
    # Undecided shards: only their invalid results are marked.
    pending_invalid = [
        t
        for d in decisions
        if d.canonical_task_id is None and d.fail_reason is None
        for t in d.invalid
    ]
    await mark(conn, pending_invalid, "invalid")
    await mark(
        conn,
        [t for d in decisions if d.canonical_task_id is None and d.fail_reason is None
         for t in d.moot],
        "moot",
    )  # fmt: skip
    verdicts: list[tuple[int, ResultVerdict]] = [(t, "invalid") for t in pending_invalid]
    final = [d for d in decisions if d.canonical_task_id is not None or d.fail_reason is not None]
    decided = Decided()
    judged: set[int] = set()
    if final:
        decided = await _take_final(conn, final, now=now)
        taking = [d for d in final if d.shard_id in decided.won]
        taking = list({d.shard_id: d for d in taking}.values())  # one per shard
        # Only the decision that won marks results: a lost race leaves them to it.
        # A shard reopened for a check votes again with its earlier valid results; their
        # nodes' trust counted them already, and counts them again only if they changed.
        judged |= await _valid_already(conn, [t for d in taking for t in d.valid])
        await mark(conn, [t for d in taking for t in d.valid], "valid")
        await mark(conn, [t for d in taking for t in d.invalid], "invalid")
        for d in taking:
            held = set(d.held)
            verdicts += [
                (task, "held" if task in held else verdict)
                for task, verdict in replication.decision_verdicts(d.valid, d.invalid)
            ]
    await ledger.apply_verdicts(conn, verdicts, settings=trust, now=now, trust_counted=judged)
    return decided


async def _outputs(conn: AsyncConnection, task_ids: Sequence[int]) -> dict[int, Any]:
    """The outputs (hash, size, and the output it checks, if a check) of these tasks."""
    if not task_ids:
        return {}
    query = select(tasks.c.id, tasks.c.output_hash, tasks.c.output_size, tasks.c.checks_hash).where(
        tasks.c.id.in_(task_ids)
    )
    return {row.id: row for row in (await conn.execute(query)).all()}


def _without_check_verdicts(
    decisions: Sequence[ShardDecision], outputs: dict[int, Any]
) -> list[ShardDecision]:
    """A check's verdict is never a shard's result: a decision that names one is refused
    (the shard stays open), whatever rule made it."""
    verdicts = {t for t, row in outputs.items() if row.checks_hash is not None}
    for d in decisions:
        if d.canonical_task_id in verdicts:
            log.error(
                "shard %s: refused a decision that makes check task %s's verdict its result",
                d.shard_id,
                d.canonical_task_id,
            )
    return [d for d in decisions if d.canonical_task_id not in verdicts]


async def _take_final(
    conn: AsyncConnection, final: Sequence[ShardDecision], *, now: float
) -> Decided:
    """Close the shards of final decisions that are still open; cancel their live tasks."""
    # Shards still open take their decision (locked on PostgreSQL, in id order):
    # a decision that lost a race to another process changes nothing.
    query = (
        select(shards.c.id, shards.c.job_id)
        .where(
            shards.c.id.in_(sorted({d.shard_id for d in final})),
            shards.c.state == ShardState.OPEN.value,
        )
        .order_by(shards.c.id)
    )
    if dialect.row_locks(conn):
        query = query.with_for_update(key_share=True)
    job_of = {row.id: row.job_id for row in (await conn.execute(query)).all()}
    taking = list({d.shard_id: d for d in final if d.shard_id in job_of}.values())
    if not taking:
        return Decided(job_of=job_of)
    outputs = await _outputs(conn, [d.canonical_task_id for d in taking if d.canonical_task_id])
    taking = _without_check_verdicts(taking, outputs)
    if not taking:
        return Decided(job_of=job_of)
    for state, statement in _DECIDE_SHARD.items():
        closing = [d for d in taking if _decided_state(d) == state]
        if closing:
            # Open and locked since they were read: each must move (logged if one cannot).
            moved = await conn.execute(
                statement,
                [
                    _decided_shard(d, outputs.get(d.canonical_task_id or -1), now=now)
                    for d in closing
                ],
            )
            await check_moved(conn, moved, shards, [d.shard_id for d in closing], state)
    won = {d.shard_id for d in taking}
    to_cancel: dict[int, list[NodeTask]] = {}
    where = tasks.c.shard_id.in_(sorted(won))
    for held in await ending.cancel_live_by_shard(conn, where, now=now):
        to_cancel.setdefault(held.shard_id, []).append(held.task)
    return Decided(won=won, job_of=job_of, to_cancel=to_cancel)


# An open shard decided: done with its canonical result, or failed with its reason.
_DECIDE_SHARD = {
    state: move(
        shards,
        state,
        shards.c.id == bindparam("b_shard"),
        sources=[ShardState.OPEN],
        canonical_task_id=bindparam("b_canonical"),
        output_hash=bindparam("b_output_hash"),
        output_size=bindparam("b_output_size"),
        error=bindparam("b_error"),
        finished_at=bindparam("b_now"),
    )
    for state in (ShardState.DONE, ShardState.FAILED)
}


def _decided_state(decision: ShardDecision) -> ShardState:
    return ShardState.DONE if decision.canonical_task_id is not None else ShardState.FAILED


def _decided_shard(decision: ShardDecision, output: Any | None, *, now: float) -> dict[str, Any]:
    """The bound values of one shard's decision in `_DECIDE_SHARD`."""
    done = decision.canonical_task_id is not None
    return {
        "b_shard": decision.shard_id,
        "b_canonical": decision.canonical_task_id,
        "b_output_hash": output.output_hash if done and output is not None else None,
        "b_output_size": output.output_size if done and output is not None else None,
        "b_error": decision.fail_reason,
        "b_now": now,
    }


# A job with at most this many shards open (as one transaction sees it) has its row
# locked before they are counted again; see `open_shards_left`.
LOCK_JOB_BELOW = 32


async def open_shards_left(conn: AsyncConnection, job_ids: Sequence[int]) -> dict[int, int]:
    """Per job, its shards not done (jobs with none are absent).

    Two transactions deciding a job's last shards at once would each count the other's
    shard as open, and neither would end the job. So a job near its end (at most
    `LOCK_JOB_BELOW` open shards in this transaction's view) has its row locked
    (PostgreSQL) and is counted again: the second transaction counts after the first
    committed, and sees its shard done. Far from its end no lock is taken, so result
    batches of one job from several coordinators do not queue on its row; should more
    than `LOCK_JOB_BELOW` transactions decide its last shards at once, the monitor's
    pass (`jobs_to_assemble`) ends the job.
    """
    if not job_ids:
        return {}
    wanted = sorted(set(job_ids))
    counted = await _open_shards(conn, wanted)
    if dialect.row_locks(conn):
        near_end = [job_id for job_id in wanted if counted.get(job_id, 0) <= LOCK_JOB_BELOW]
        if near_end:
            await conn.execute(
                select(jobs.c.id)
                .where(jobs.c.id.in_(near_end))
                .order_by(jobs.c.id)
                .with_for_update(key_share=True)
            )
            far = {j: n for j, n in counted.items() if n > LOCK_JOB_BELOW}
            counted = far | await _open_shards(conn, near_end)
    return counted


async def _open_shards(conn: AsyncConnection, job_ids: Sequence[int]) -> dict[int, int]:
    query = (
        select(shards.c.job_id, func.count().label("n"))
        .where(shards.c.job_id.in_(job_ids), shards.c.state != ShardState.DONE.value)
        .group_by(shards.c.job_id)
    )
    return {row.job_id: row.n for row in (await conn.execute(query)).all()}


def outcomes(
    decisions: Sequence[ShardDecision], decided: Decided, open_left: dict[int, int]
) -> list[DecisionOutcome]:
    """One outcome per decision, in order; a shard decided twice in one call counts once."""
    result = []
    reported: set[int] = set()
    for d in decisions:
        if d.shard_id not in decided.won or d.shard_id in reported:
            result.append(DecisionOutcome(decided=False, to_cancel=[], job_done=False))
            continue
        reported.add(d.shard_id)
        result.append(
            DecisionOutcome(
                decided=True,
                to_cancel=decided.to_cancel.get(d.shard_id, []),
                job_done=open_left.get(decided.job_of[d.shard_id], 0) == 0,
            )
        )
    return result


async def _valid_already(conn: AsyncConnection, task_ids: Sequence[int]) -> set[int]:
    """Those of these tasks judged valid before (their shard was reopened for a check)."""
    if not task_ids:
        return set()
    found = await conn.execute(
        select(tasks.c.id).where(tasks.c.id.in_(list(task_ids)), tasks.c.outcome == "valid")
    )
    return set(found.scalars().all())


async def judge_once(conn: AsyncConnection, task_id: int, outcome: str, *where: Any) -> bool:
    """Give a completed result not judged yet (or late) its outcome; False if another
    judgement came first."""
    changed = await conn.execute(
        update(tasks)
        .where(
            tasks.c.id == task_id,
            UNJUDGED_OR_LATE,
            tasks.c.state == TaskState.COMPLETED.value,
            *where,
        )
        .values(outcome=outcome)
    )
    return changed.rowcount == 1


async def mark(conn: AsyncConnection, task_ids: Sequence[int], outcome: str) -> None:
    if task_ids:
        await conn.execute(
            update(tasks).where(tasks.c.id.in_(list(task_ids))).values(outcome=outcome)
        )
