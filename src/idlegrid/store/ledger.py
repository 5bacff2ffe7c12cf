"""Verdicts, credit and suspicions: the store's side of `verification.ledger`.

The rules are `verification.ledger`'s (pure); these functions read the rows they need
inside the caller's transaction, call them, and write the delta they return. They run in
the same transaction as the decision they follow, so a verdict, the trust it changes and
the credit it grants commit together or not at all.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import JobState, ShardState, TaskState
from idlegrid.store import recheck, stats, totals
from idlegrid.store import trust as trust_rows
from idlegrid.store.schema import jobs, nodes, shards, tasks
from idlegrid.store.trust import load_trust as load_trust  # where tests have read it
from idlegrid.verification import ledger as rules
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import TrustSettings

log = logging.getLogger(__name__)


async def apply_verdicts(
    conn: AsyncConnection,
    verdicts: Iterable[tuple[int, ResultVerdict]],
    *,
    settings: TrustSettings,
    now: float,
    credit: bool = True,
    trust_counted: Collection[int] = (),
) -> None:
    """Write what these verdicts change: each node's trust, then the credit they grant.

    `verification.ledger` decides; this reads the rows it needs and writes its deltas.
    `credit` False: trust only (a result that came after its shard was decided and
    credited: the work is paid for once). `trust_counted`: results whose valid verdict
    the node's trust has counted already (a shard reopened for a check voted again).
    """
    verdict_of = dict(verdicts)
    if not verdict_of:
        return
    found = await _judged(
        conn,
        # One lock order for every transaction: by node (deadlocks are retried anyway).
        tasks.c.id.in_(list(verdict_of)),
        order_by=(tasks.c.node_id, tasks.c.id),
    )
    found = await _settle_suspicions(conn, found)
    for group in rules.trust_groups(found, verdict_of, trust_counted):
        await trust_rows.change_trust(conn, group, settings=settings, now=now)
    # After the trust changes: a node caught here had its lone shards replicated again
    # (store.recheck), and no check vouches for those any more.
    # Read after the trust rows are locked: a check of the same node decided at once by
    # another process has committed by now, and is seen (or sees this decision).
    on_record = await checks_on_record(conn, rules.accepted_alone(found, verdict_of))
    vouched = await _vouched(conn, rules.vouch_horizons(found, verdict_of, on_record))
    confirmed = await _confirmed(conn, found, verdict_of)
    delta = rules.credit_delta(
        found,
        verdict_of,
        vouched,
        credit=credit,
        checks_on_record=on_record,
        confirmed=confirmed,
    )
    await write_credit(conn, delta, now=now)


async def _confirmed(
    conn: AsyncConnection,
    found: Sequence[rules.JudgedResult],
    verdict_of: Mapping[int, ResultVerdict],
) -> list[rules.JudgedResult]:
    """The unpaid passes that a known-answer check answered right here confirms, of the
    answer's kind (`rules.confirmed_passes`; `pay_confirmed_passes` pays the rest when
    their job completes)."""
    answered = [r for r in found if verdict_of[r.task_id] == "answered"]
    confirmed: list[rules.JudgedResult] = []
    for node_id in rules.confirming(verdict_of, {r.task_id: r.node_id for r in found}):
        mine = [r for r in answered if r.node_id == node_id]
        until = max(r.finished_at or 0.0 for r in mine)
        passes = await _unpaid_passes(conn, tasks.c.node_id == node_id, jobs.c.kind == mine[0].kind)
        confirmed += rules.confirmed_passes(
            passes,
            last_lie=await _last_lies(conn, [node_id]),
            answered_until={node_id: until},
        )
    return confirmed


async def pay_confirmed_passes(conn: AsyncConnection, job_id: int, *, now: float) -> None:
    """A job completed: the passes of its outputs whose nodes answered a known-answer check
    right after them (and lied not since) are paid ("confirmed")."""
    passes = await _unpaid_passes(conn, tasks.c.job_id == job_id)
    if not passes:
        return
    node_ids = sorted({p.result.node_id for p in passes})
    confirmed = rules.confirmed_passes(
        passes,
        last_lie=await _last_lies(conn, node_ids),
        answered_until=await _last_right_answers(conn, node_ids),
    )
    if confirmed:
        await write_credit(conn, rules.credit_delta([], {}, confirmed=confirmed), now=now)


async def _unpaid_passes(conn: AsyncConnection, *where: Any) -> list[rules.CheckPass]:
    """The unpaid checks of other nodes' outputs (not known-answer probes) matching
    `where`, in node order, with what `rules.confirmed_passes` reads of each."""
    found = await conn.execute(
        _CHECKS.where(
            *where,
            tasks.c.checks_hash.is_not(None),
            tasks.c.known_answer.is_(None),
            tasks.c.credit.is_(None),
        ).order_by(tasks.c.node_id, tasks.c.id)
    )
    return [
        rules.CheckPass(
            result=_judged_of(row),
            outcome=row.outcome,
            job_completed=row.job_state == JobState.COMPLETED.value,
        )
        for row in found.all()
    ]


async def _last_lies(conn: AsyncConnection, node_ids: Sequence[int]) -> dict[int, float]:
    """Per node, when its latest result found invalid finished (absent: none)."""
    return await _latest(conn, node_ids, tasks.c.outcome == "invalid")


async def _last_right_answers(conn: AsyncConnection, node_ids: Sequence[int]) -> dict[int, float]:
    """Per node, when its latest known-answer check answered right finished (absent: none)."""
    return await _latest(
        conn, node_ids, tasks.c.known_answer.is_not(None), tasks.c.outcome == "valid"
    )


async def _latest(conn: AsyncConnection, node_ids: Sequence[int], *where: Any) -> dict[int, float]:
    """Per node, the latest `finished_at` of its tasks matching `where`."""
    found = await conn.execute(
        select(tasks.c.node_id, func.max(tasks.c.finished_at))
        .where(tasks.c.node_id.in_(list(node_ids)), *where)
        .group_by(tasks.c.node_id)
    )
    return {node_id: float(latest) for node_id, latest in found.all() if latest is not None}


async def _settle_suspicions(
    conn: AsyncConnection, found: list[rules.JudgedResult]
) -> list[rules.JudgedResult]:
    """The suspected among `found` are judged now: their mark is cleared, and only those
    this transaction cleared count as suspected (a suspicion is settled once)."""
    marked = [r.task_id for r in found if r.suspected]
    if not marked:
        return found
    cleared = set(
        (
            await conn.execute(
                update(tasks)
                .where(tasks.c.id.in_(marked), tasks.c.suspected.is_(True))
                .values(suspected=False)
                .returning(tasks.c.id)
            )
        )
        .scalars()
        .all()
    )
    return [dataclasses.replace(r, suspected=r.task_id in cleared) for r in found]


async def write_credit(conn: AsyncConnection, delta: rules.CreditDelta, *, now: float) -> None:
    """Take back, then grant, the credit of `delta`: one task update for all, one grant
    per node and per account, the dashboard's aggregates in the same transaction."""
    await _take_back(conn, delta.taken_back, now=now)
    if not delta.grants:
        return
    # Only the rows this transaction pays: another process vouching for the same lone
    # results at once waits on these row locks, then finds them paid.
    unpaid = set(
        (
            await conn.execute(
                update(tasks)
                .where(tasks.c.id.in_([g.task_id for g in delta.grants]), tasks.c.credit.is_(None))
                .values(credit=0.0)
                .returning(tasks.c.id)
            )
        )
        .scalars()
        .all()
    )
    granted = [g for g in delta.grants if g.task_id in unpaid]
    if not granted:
        return
    await conn.execute(
        update(tasks).where(tasks.c.id == bindparam("task")).values(credit=bindparam("amount")),
        [{"task": g.task_id, "amount": g.amount} for g in granted],
    )
    for node_id, amount in rules.per_node(granted).items():
        await totals.grant(conn, "nodes", node_id, amount, now=now)
    for account_id, amount in rules.per_account(granted).items():
        await totals.grant(conn, "accounts", account_id, amount, now=now)
    # The dashboard's aggregates, in the same transaction: no page reads the task table.
    work = [stats.Earned(g.node_id, g.account_id, g.cost_flops, g.amount) for g in granted]
    await totals.validated(conn, work, now=now)


_JUDGED = (
    select(
        tasks.c.id,
        tasks.c.node_id,
        tasks.c.backend,
        tasks.c.credit,
        tasks.c.finished_at,
        nodes.c.account_id,
        jobs.c.kind,
        shards.c.cost_flops,
        shards.c.mode,
        tasks.c.suspected,
    )
    .join(nodes, nodes.c.id == tasks.c.node_id)
    .join(jobs, jobs.c.id == tasks.c.job_id)
    .join(shards, shards.c.id == tasks.c.shard_id)
)


async def _judged(
    conn: AsyncConnection, *where: Any, order_by: Sequence[Any] = ()
) -> list[rules.JudgedResult]:
    """The results matching `where`, as the ledger's rules read them."""
    found = (await conn.execute(_JUDGED.where(*where).order_by(*order_by))).all()
    return [_judged_of(row) for row in found]


def _judged_of(row: Any) -> rules.JudgedResult:
    return rules.JudgedResult(
        task_id=row.id,
        node_id=row.node_id,
        account_id=row.account_id,
        kind=row.kind,
        backend=row.backend or "cpu",
        cost_flops=row.cost_flops,
        mode=row.mode,
        credit=row.credit,
        finished_at=row.finished_at,
        suspected=bool(row.suspected),
    )


# A check task's row as `rules.confirmed_passes` reads it.
_CHECKS = _JUDGED.add_columns(tasks.c.outcome, jobs.c.state.label("job_state"))


# Made once (see claims.OTHER): the results of a shard that agreed with each other.
_AGREEING = tasks.alias("agreeing")


async def checks_on_record(conn: AsyncConnection, since: Mapping[int, float]) -> dict[int, float]:
    """Per node, when its latest check on record (`rules.on_record`) at or after
    `since[node]` finished. Nodes without one are absent."""
    agreeing = (
        select(func.count())
        .where(_AGREEING.c.shard_id == tasks.c.shard_id, _AGREEING.c.outcome == "valid")
        .scalar_subquery()
    )
    found: dict[int, float] = {}
    for node_id, earliest in since.items():
        rows = await conn.execute(
            select(
                tasks.c.finished_at,
                tasks.c.outcome,
                tasks.c.checks_hash.is_not(None).label("checked_output"),
                tasks.c.credit.is_not(None).label("paid"),
                agreeing.label("agreeing"),
            ).where(
                tasks.c.node_id == node_id,
                tasks.c.state == TaskState.COMPLETED.value,
                tasks.c.finished_at >= earliest,
            )
        )
        latest = rules.latest_on_record(
            rules.FinishedResult(
                finished_at=float(row.finished_at),
                outcome=row.outcome,
                agreeing=row.agreeing,
                checked_output=bool(row.checked_output),
                paid=bool(row.paid),
            )
            for row in rows.all()
        )
        if latest is not None:
            found[node_id] = latest
    return found


async def _vouched(conn: AsyncConnection, horizons: dict[int, float]) -> list[rules.JudgedResult]:
    """The results these nodes decided alone up to their horizons (`rules.vouch_horizons`)
    that the rule of vouched results names (`rules.vouched_results`): the candidates
    `rules.credit_delta` pays (`rules.vouched_for`)."""
    found: list[rules.JudgedResult] = []
    for node_id, until in horizons.items():
        lone = await conn.execute(
            _LONE.where(
                tasks.c.node_id == node_id,
                tasks.c.credit.is_(None),
                shards.c.mode == "alone",
                tasks.c.finished_at <= until,
            )
        )
        found += rules.vouched_results(
            (rules.LoneResult(result=_judged_of(row), outcome=row.outcome) for row in lone.all()),
            {node_id: until},
        )
    return found


# A lone result's row as `rules.vouched_results` reads it.
_LONE = _JUDGED.add_columns(tasks.c.outcome)


async def _take_back(
    conn: AsyncConnection, taken_back: Sequence[rules.Grant], *, now: float
) -> None:
    """Credit granted to results found wrong since is taken back from their nodes and
    accounts; the task keeps credit 0 (granted once, never again)."""
    if not taken_back:
        return
    await conn.execute(
        update(tasks).where(tasks.c.id.in_([g.task_id for g in taken_back])).values(credit=0.0)
    )
    for g in taken_back:
        await totals.grant(conn, "nodes", g.node_id, g.amount, now=now)
        await totals.grant(conn, "accounts", g.account_id, g.amount, now=now)


async def hold_credit(conn: AsyncConnection, task_id: int, *, now: float) -> None:
    """Write `rules.held` for a result run alone and now disputed: the credit it was paid
    comes off its node and account, and the task is unpaid again (nothing vouches for it
    meanwhile: its shard is no longer run alone)."""
    for result in await _judged(conn, tasks.c.id == task_id):
        held = rules.held(result)
        if held is None:
            continue
        await conn.execute(update(tasks).where(tasks.c.id == task_id).values(credit=None))
        await totals.grant(conn, "nodes", held.node_id, held.amount, now=now)
        await totals.grant(conn, "accounts", held.account_id, held.amount, now=now)


async def suspect(
    conn: AsyncConnection, task_id: int, *, settings: TrustSettings, now: float
) -> recheck.Rechecked:
    """The spot check of a result run alone disagreed: its node stops running alone on
    that kind and backend, and what it ran or decided alone is replicated again."""
    row = (
        await conn.execute(
            select(tasks.c.node_id, tasks.c.backend, jobs.c.kind)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .where(tasks.c.id == task_id, tasks.c.node_id.is_not(None))
        )
    ).first()
    if row is None:
        return recheck.Rechecked()
    backend = row.backend or "cpu"
    marked = await conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.suspected.is_(False))
        .values(suspected=True)
    )
    if marked.rowcount == 1:  # a result is suspected once, until its verdict
        group = rules.TrustGroup(
            node_id=row.node_id, kind=row.kind, backend=backend, events=("suspected",)
        )
        await trust_rows.change_trust(conn, group, settings=settings, now=now)
    await hold_credit(conn, task_id, now=now)
    return await recheck.recheck_node(
        conn, row.node_id, row.kind, backend, window_s=settings.recheck_window_s, now=now
    )


_CLEARED: tuple[rules.TrustEvent] = ("cleared",)


async def drop_undecided_suspicions(
    conn: AsyncConnection, job_id: int, *, settings: TrustSettings, now: float
) -> int:
    """The job's suspected results whose shard ended without a verdict (the job was
    cancelled, or failed): nothing will judge them now, so each suspicion is dropped as
    if cleared (`trust.after_cleared`), and its node's held streak comes back once none
    is left. Returns how many were dropped."""
    ended = (ShardState.CANCELLED.value, ShardState.FAILED.value)
    of_ended_shard = select(shards.c.id).where(shards.c.job_id == job_id, shards.c.state.in_(ended))
    dropped = (
        await conn.execute(
            update(tasks)
            .where(
                tasks.c.job_id == job_id,
                tasks.c.suspected.is_(True),
                tasks.c.node_id.is_not(None),
                tasks.c.shard_id.in_(of_ended_shard.scalar_subquery()),
            )
            .values(suspected=False)
            .returning(tasks.c.node_id, tasks.c.backend)
        )
    ).all()
    if not dropped:
        return 0
    kind = (await conn.execute(select(jobs.c.kind).where(jobs.c.id == job_id))).scalar_one()
    # One trust read and write per node and backend, one event per suspicion dropped, in
    # one lock order.
    per_group = collections.Counter((row.node_id, row.backend or "cpu") for row in dropped)
    for (node_id, backend), count in sorted(per_group.items()):
        group = rules.TrustGroup(
            node_id=node_id, kind=kind, backend=backend, events=_CLEARED * count
        )
        await trust_rows.change_trust(conn, group, settings=settings, now=now)
    return len(dropped)
