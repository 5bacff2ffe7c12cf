"""The `store.verification` role: the verifier's way into the store.

Shards with results to judge, their decisions (written by store/judging.py), late
results, known-answer checks, spot checks and the flags that follow a caught lie; each
operation one transaction. The rules (`verification.judging`) decide from what
`shards_for_verify` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, ShardState, TaskState
from idlegrid.store import (
    audit,
    check_routing,
    collusion,
    judging,
    ledger,
    recheck,
    rows,
    stalemate,
    starts,
)
from idlegrid.store import trust as trust_rows
from idlegrid.store.base import (
    BuildWait,
    DecisionOutcome,
    JobRecord,
    KnownAnswer,
    LateResult,
    ReadyTask,
    ShardDecision,
    ShardForVerify,
    ShardResult,
    StalledShard,
)
from idlegrid.store.database import Role, read, retry_conflicts, write
from idlegrid.store.schema import jobs, node_trust, shards, tasks
from idlegrid.verification import ledger as ledger_rules
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import Trust, TrustSettings

log = logging.getLogger(__name__)


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


async def _live_tasks(conn: AsyncConnection, shard_ids: Sequence[int]) -> dict[int, int]:
    """Per shard, its live tasks (known-answer checks aside)."""
    query = (
        select(tasks.c.shard_id, func.count().label("n"))
        .where(
            tasks.c.shard_id.in_(shard_ids),
            tasks.c.state.in_(rows.states(*LIVE_TASK_STATES)),
            tasks.c.known_answer.is_(None),
        )
        .group_by(tasks.c.shard_id)
    )
    return {row.shard_id: row.n for row in (await conn.execute(query)).all()}


async def _results_with_trust(
    conn: AsyncConnection, shard_ids: Sequence[int], *, settings: TrustSettings
) -> dict[int, list[ShardResult]]:
    """Per shard, its results that still count, each with its node's trust on the kind
    (a new node's trust where it has none yet)."""
    by_shard: dict[int, list[ShardResult]] = {}
    found = await conn.execute(_RESULTS_WITH_TRUST.where(tasks.c.shard_id.in_(shard_ids)))
    for r in found.all():
        by_shard.setdefault(r.shard_id, []).append(
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
                    trust_rows.trust_of(r)
                    if r.valid_total is not None
                    else trust_rules.new_trust(settings)
                ),
            )
        )
    return by_shard


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
        live = await _live_tasks(conn, ids)
        by_shard = await _results_with_trust(conn, ids, settings=self.trust)
        return {
            row.id: ShardForVerify(
                shard=rows.shard(row, live=live.get(row.id, 0)),
                job=job_of[row.job_id],
                results=by_shard.get(row.id, []),
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
                judging.UNJUDGED_OR_LATE,
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
                judging.UNJUDGED_OR_LATE,
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
        if not await judging.judge_once(conn, task_id, "valid" if right else "invalid", where):
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
        if await judging.judge_once(conn, task_id, judgement.outcome) and judgement.verdict:
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
            decided = await judging.decide(conn, decisions, trust=self.trust, now=now)
        # Counted after the commit: when two processes decide a job's last two shards at
        # once, the later commit then sees both (inside the transactions neither would).
        open_left: dict[int, int] = {}
        if decided.won:
            async with self.db.read() as conn:
                job_ids = [decided.job_of[shard_id] for shard_id in decided.won]
                open_left = await judging.open_shards_left(conn, job_ids)
        return judging.outcomes(decisions, decided, open_left)

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
