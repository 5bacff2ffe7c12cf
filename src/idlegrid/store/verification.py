"""SQL of verification (`store.verification`): shards with results to judge, their
decisions, late results, spot checks and the flags that follow a caught lie.

The role's operations each run in one transaction; `decide` and the functions beside it
are the building blocks they share. The rules
(`verification.judging`) decide from what `shards_for_verify` returns; `decide` records
their decisions with a conditional update, so a decision that lost a race to another
process changes nothing, `verification.replication.decision_verdicts` says what each
result earns, and `store.ledger` writes what that changes in trust and credit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, ShardState, TaskState
from idlegrid.store import (
    audit,
    check_routing,
    collusion,
    dialect,
    ending,
    ledger,
    recheck,
    rows,
    stalemate,
    starts,
)
from idlegrid.store.base import (
    BuildWait,
    DecisionOutcome,
    JobRecord,
    KnownAnswer,
    LateResult,
    NodeTask,
    ReadyTask,
    ShardDecision,
    ShardForVerify,
    ShardResult,
    StalledShard,
)
from idlegrid.store.database import Role, read, retry_conflicts, write
from idlegrid.store.lifecycle import check_moved, move
from idlegrid.store.schema import jobs, node_trust, shards, tasks
from idlegrid.verification import ledger as ledger_rules
from idlegrid.verification import replication
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import Trust, TrustSettings

log = logging.getLogger(__name__)

_UNJUDGED_OR_LATE = tasks.c.outcome.is_(None) | (tasks.c.outcome == "late")


_RESULTS_WITH_TRUST = (
    select(
        tasks.c.id,
        tasks.c.shard_id,
        tasks.c.node_id,
        tasks.c.output_hash,
        tasks.c.output_size,
        tasks.c.outcome,
        tasks.c.checks_hash,
        tasks.c.build,
        tasks.c.finished_at,
        node_trust.c.consecutive_valid,
        node_trust.c.valid_total,
        node_trust.c.invalid_total,
        node_trust.c.error_total,
        node_trust.c.recent_invalid,
        node_trust.c.daily_quota,
        node_trust.c.suspended,
        node_trust.c.suspicions,
        node_trust.c.held_streak,
        node_trust.c.probes_passed,
    )
    .join(jobs, jobs.c.id == tasks.c.job_id)
    .outerjoin(
        node_trust,
        and_(
            node_trust.c.node_id == tasks.c.node_id,
            node_trust.c.kind == jobs.c.kind,
            node_trust.c.backend == func.coalesce(tasks.c.backend, "cpu"),
        ),
    )
    .where(*rows.counting_result(tasks))
    .order_by(tasks.c.shard_id, tasks.c.finished_at, tasks.c.id)
)


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
    canonical = [d.canonical_task_id for d in taking if d.canonical_task_id]
    outputs = {}
    if canonical:
        outputs = {
            row.id: row
            for row in (
                await conn.execute(
                    select(
                        tasks.c.id, tasks.c.output_hash, tasks.c.output_size, tasks.c.checks_hash
                    ).where(tasks.c.id.in_(canonical))
                )
            ).all()
        }
    # A check's verdict is never a shard's result: a decision that names one is refused
    # (the shard stays open), whatever rule made it.
    verdicts = {t for t, row in outputs.items() if row.checks_hash is not None}
    for d in taking:
        if d.canonical_task_id in verdicts:
            log.error(
                "shard %s: refused a decision that makes check task %s's verdict its result",
                d.shard_id,
                d.canonical_task_id,
            )
    taking = [d for d in taking if d.canonical_task_id not in verdicts]
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


async def _judge_once(conn: AsyncConnection, task_id: int, outcome: str, *where: Any) -> bool:
    """Give a completed result not judged yet (or late) its outcome; False if another
    judgement came first."""
    changed = await conn.execute(
        update(tasks)
        .where(
            tasks.c.id == task_id,
            _UNJUDGED_OR_LATE,
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


class Verification(Role):
    """What the verifier reads and decides: shards with results to judge, their decisions,
    late results, and the checks that follow a caught lie (`store.verification`)."""

    @read
    async def shards_to_verify(self, conn: AsyncConnection, *, limit: int) -> list[int]:
        query = (
            select(tasks.c.shard_id)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(
                shards.c.state == ShardState.OPEN.value,
                tasks.c.state == TaskState.COMPLETED.value,
                tasks.c.outcome.is_(None),
                tasks.c.known_answer.is_(None),  # judged on their own: `known_answers`
            )
            .distinct()
            .limit(limit)
        )
        return list((await conn.execute(query)).scalars().all())

    @read
    async def shards_for_verify(
        self, conn: AsyncConnection, shard_ids: Sequence[int]
    ) -> dict[int, ShardForVerify]:
        """Each shard with its job and its results not found invalid, with their nodes' trust."""
        trust = self.trust
        ids = sorted(set(shard_ids))
        if not ids:
            return {}
        shard_rows = (await conn.execute(select(shards).where(shards.c.id.in_(ids)))).all()
        if not shard_rows:
            return {}
        job_of: dict[int, JobRecord] = {}
        for job_id in sorted({row.job_id for row in shard_rows}):
            job = await rows.job(conn, job_id, with_counts=False)
            assert job is not None
            job_of[job_id] = job
        found = (await conn.execute(_RESULTS_WITH_TRUST.where(tasks.c.shard_id.in_(ids)))).all()
        live_query = (
            select(tasks.c.shard_id, func.count().label("n"))
            .where(
                tasks.c.shard_id.in_(ids),
                tasks.c.state.in_(rows.states(*LIVE_TASK_STATES)),
                tasks.c.known_answer.is_(None),
            )
            .group_by(tasks.c.shard_id)
        )
        live = {row.shard_id: row.n for row in (await conn.execute(live_query)).all()}
        by_shard: dict[int, list[ShardResult]] = {row.id: [] for row in shard_rows}
        for r in found:
            by_shard[r.shard_id].append(
                ShardResult(
                    task_id=r.id,
                    node_id=r.node_id,
                    output_hash=r.output_hash,
                    output_size=r.output_size,
                    outcome=r.outcome,
                    checks_hash=r.checks_hash,
                    build=r.build,
                    finished_at=r.finished_at,
                    trust=(
                        ledger.trust_of(r)
                        if r.valid_total is not None
                        else trust_rules.new_trust(trust)
                    ),
                )
            )
        return {
            row.id: ShardForVerify(
                shard=rows.shard(row, live=live.get(row.id, 0)),
                job=job_of[row.job_id],
                results=by_shard[row.id],
            )
            for row in shard_rows
        }

    @read
    async def stalled_shards(
        self, conn: AsyncConnection, *, limit: int, job_ids: Sequence[int] | None = None
    ) -> list[StalledShard]:
        """Open shards with results whose ready replica nobody holds (`store/stalemate.py`)."""
        return await stalemate.stalled_shards(conn, limit=limit, job_ids=job_ids)

    @read
    async def build_waits(
        self, conn: AsyncConnection, job_id: int, *, since: float, limit: int
    ) -> list[BuildWait]:
        """Outputs whose check waits for a node of their build (`store.check_routing`)."""
        return await check_routing.build_waits(conn, job_id, since=since, limit=limit)

    @read
    async def trust_on(
        self, conn: AsyncConnection, node_ids: Sequence[int], kind: str
    ) -> list[Trust]:
        """These nodes' trust on `kind`, on every backend they have one for."""
        return await stalemate.trust_on(conn, node_ids, kind)

    @write
    async def open_checks(self, conn: AsyncConnection, shard_id: int) -> int:
        """Let any node take a stalled shard's spot checks (`store/stalemate.py`)."""
        return await stalemate.open_checks(conn, shard_id)

    @read
    async def late_results(
        self, conn: AsyncConnection, *, limit: int, task_ids: Sequence[int] | None = None
    ) -> list[LateResult]:
        """Results stored after their shard was decided, not yet judged (of `task_ids` only,
        if given), oldest first."""
        query = (
            select(
                tasks.c.id,
                tasks.c.node_id,
                tasks.c.output_hash,
                tasks.c.job_id,
                shards.c.output_hash.label("canonical_hash"),
            )
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(
                # Late, or taken while open by a verification that lost the race to decide.
                _UNJUDGED_OR_LATE,
                tasks.c.state == TaskState.COMPLETED.value,
                shards.c.state == ShardState.DONE.value,
                tasks.c.known_answer.is_(None),
            )
            .order_by(tasks.c.id)
            .limit(limit)
        )
        if task_ids is not None:
            query = query.where(tasks.c.id.in_(list(task_ids)))
        found = (await conn.execute(query)).all()
        return [
            LateResult(r.id, r.node_id, r.output_hash, r.canonical_hash, r.job_id) for r in found
        ]

    @read
    async def known_answers(
        self, conn: AsyncConnection, *, limit: int, shard_ids: Sequence[int] | None = None
    ) -> list[KnownAnswer]:
        """Known-answer checks answered and not yet judged (of these shards only, if
        given), oldest first."""
        query = (
            select(
                tasks.c.id,
                tasks.c.node_id,
                tasks.c.output_hash,
                tasks.c.checks_hash,
                tasks.c.known_answer,
                tasks.c.job_id,
            )
            .where(
                _UNJUDGED_OR_LATE,
                tasks.c.state == TaskState.COMPLETED.value,
                tasks.c.known_answer.is_not(None),
            )
            .order_by(tasks.c.id)
            .limit(limit)
        )
        if shard_ids is not None:
            query = query.where(tasks.c.shard_id.in_(sorted(set(shard_ids))))
        return [
            KnownAnswer(r.id, r.node_id, r.output_hash, r.checks_hash, r.known_answer, r.job_id)
            for r in await conn.execute(query)
        ]

    @write(retry_conflicts=True)
    async def judge_known_answer(
        self, conn: AsyncConnection, task_id: int, *, right: bool, now: float
    ) -> bool:
        """A known-answer check judged: answered right, a valid result that confirms its
        node's earlier passes; wrong, a lie (`verification.probes`). False if it was
        judged already."""
        where = tasks.c.known_answer.is_not(None)
        if not await _judge_once(conn, task_id, "valid" if right else "invalid", where):
            return False
        verdict: ResultVerdict = "answered" if right else "invalid"
        await ledger.apply_verdicts(conn, [(task_id, verdict)], settings=self.trust, now=now)
        return True

    @write(retry_conflicts=True)
    async def judge_late(
        self, conn: AsyncConnection, task_id: int, *, agrees: bool | None, now: float
    ) -> None:
        """A late result judged against its shard's canonical one; `agrees` None: nothing
        to judge it by ("moot": no trust change, no credit)."""
        # Whether a coordinator start made it late matters to a result that agrees only.
        made_late = bool(agrees) and await starts.made_late(conn, task_id)
        judgement = ledger_rules.late_judgement(agrees, made_late=made_late)
        if await _judge_once(conn, task_id, judgement.outcome) and judgement.verdict:
            await ledger.apply_verdicts(
                conn,
                [(task_id, judgement.verdict)],
                settings=self.trust,
                now=now,
                credit=judgement.paid,
            )

    @write
    async def record_start(
        self, conn: AsyncConnection, process_id: str, *, now: float, grace_s: float
    ) -> None:
        """A coordinator process started, with this restart grace (the late rule's)."""
        await starts.record_start(conn, process_id, started_at=now, grace_s=grace_s)

    async def shard_for_verify(self, shard_id: int) -> ShardForVerify | None:
        """`shards_for_verify` of one shard."""
        return (await self.shards_for_verify([shard_id])).get(shard_id)

    async def decide_shard(
        self,
        shard_id: int,
        *,
        canonical_task_id: int | None,
        valid: Sequence[int],
        invalid: Sequence[int],
        fail_reason: str | None,
        now: float,
    ) -> DecisionOutcome:
        """`decide_shards` of one decision."""
        decision = ShardDecision(shard_id, canonical_task_id, valid, invalid, fail_reason)
        return (await self.decide_shards([decision], now=now))[0]

    @retry_conflicts
    async def decide_shards(
        self, decisions: Sequence[ShardDecision], *, now: float
    ) -> list[DecisionOutcome]:
        """Record the verifier's decisions in one transaction: shards still open take them,
        their results get their verdicts, trust and credit their delta (`decide`)."""
        if not decisions:
            return []
        async with self.db.tx() as conn:
            decided = await decide(conn, decisions, trust=self.trust, now=now)
        # Counted after the commit: when two processes decide a job's last two shards at
        # once, the later commit then sees both (inside the transactions neither would).
        open_left: dict[int, int] = {}
        if decided.won:
            async with self.db.read() as conn:
                job_ids = [decided.job_of[shard_id] for shard_id in decided.won]
                open_left = await open_shards_left(conn, job_ids)
        return outcomes(decisions, decided, open_left)

    @write(retry_conflicts=True)
    async def suspect(self, conn: AsyncConnection, task_ids: Sequence[int], *, now: float) -> None:
        """Results run alone and disputed: their nodes lose their standing until judged."""
        for task_id in sorted(set(task_ids)):  # one lock order (by task, not node)
            await ledger.suspect(conn, task_id, settings=self.trust, now=now)

    @write(retry_conflicts=True)
    async def drop_undecided_suspicions(
        self, conn: AsyncConnection, job_id: int, *, now: float
    ) -> int:
        """The ended job's suspicions that no verdict will settle now are dropped
        (`ledger.drop_undecided_suspicions`)."""
        return await ledger.drop_undecided_suspicions(conn, job_id, settings=self.trust, now=now)

    @write(retry_conflicts=True)
    async def flag_colluders(
        self, conn: AsyncConnection, groups: Sequence[Sequence[int]], *, now: float
    ) -> list[int]:
        """Flag the accounts whose nodes agreed on wrong results (`store/collusion.py`)."""
        return await collusion.flag_colluders(
            conn, groups, flag_after=self.trust.collusion_flag_after, now=now
        )

    @read
    async def rested_on_liars(self, conn: AsyncConnection, job_id: int) -> list[tuple[int, int]]:
        """The job's shards whose output rested on one check by a node caught lying since
        (`store.recheck.rested_on_liars`): (shard index, node)."""
        return await recheck.rested_on_liars(conn, job_id)

    @read
    async def unvouched_alone(self, conn: AsyncConnection, job_id: int) -> list[int]:
        """The job's shards decided by one node that no check has vouched for yet."""
        return await audit.unvouched_alone(conn, job_id)

    @write(retry_conflicts=True)
    async def audit(
        self, conn: AsyncConnection, shard_ids: Sequence[int], *, now: float
    ) -> list[ReadyTask]:
        """Reopen shards decided alone for a spot check (`store/audit.py`)."""
        return await audit.audit(conn, shard_ids, now=now)
