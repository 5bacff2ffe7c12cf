"""Trust and credit rows: the store's side of the verifier's verdicts.

The policy (verification.trust, verification.credit) is pure; these functions read the rows it needs
inside the caller's transaction, apply it, and write the result back. They run in the
same transaction as the decision they follow, so a verdict, the trust it changes and the
credit it grants commit together or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, case, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store import recheck, stats, totals
from idlegrid.store.base import NodeTrust
from idlegrid.store.schema import accounts, jobs, node_quota, node_trust, nodes, shards, tasks
from idlegrid.verification import credit as credit_policy
from idlegrid.verification import trust as trust_policy
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import Trust, TrustSettings

log = logging.getLogger(__name__)
DAY_S = 86_400.0


def day_of(now: float) -> int:
    """Days since the epoch (UTC): the daily quota's day."""
    return int(now // DAY_S)


async def load_trust(
    conn: AsyncConnection,
    node_id: int,
    kind: str,
    backend: str,
    *,
    settings: TrustSettings,
    now: float,
    for_update: bool = False,
) -> NodeTrust:
    """A node's trust on a kind and backend, made (new) on first use."""
    where = (
        node_trust.c.node_id == node_id,
        node_trust.c.kind == kind,
        node_trust.c.backend == backend,
    )
    query = select(node_trust).where(*where)
    if for_update:
        query = query.with_for_update(key_share=True)
    row = (await conn.execute(query)).first()
    used = await _used_today(conn, node_id, kind, backend, now=now)
    if row is None:
        # ON CONFLICT: several claims of one new node may make its row at once.
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        await conn.execute(
            dialect.insert(node_trust)
            .values(
                node_id=node_id,
                kind=kind,
                backend=backend,
                **_trust_values(trust_policy.new_trust(settings)),
                updated_at=now,
            )
            .on_conflict_do_nothing()
        )
        row = (await conn.execute(query)).one()
    return NodeTrust(node_id, kind, backend, trust_of(row), used)


def used_today(day: int | None, used: int | None, now: float) -> int:
    """Tasks counted on `day` that count today (none if the count is of another day)."""
    return int(used or 0) if day == day_of(now) else 0


async def _used_today(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, now: float
) -> int:
    row = (
        await conn.execute(
            select(node_quota.c.day, node_quota.c.used).where(
                node_quota.c.node_id == node_id,
                node_quota.c.kind == kind,
                node_quota.c.backend == backend,
            )
        )
    ).first()
    return 0 if row is None else used_today(row.day, row.used, now)


async def use_quota(
    conn: AsyncConnection,
    node_id: int,
    kind: str,
    backend: str,
    *,
    used: int,
    now: float,
    count: int = 1,
) -> None:
    """Count claims against today's quota: `used` (read in the same transaction) + count."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(node_quota).values(
        node_id=node_id, kind=kind, backend=backend, day=day_of(now), used=used + count
    )
    await conn.execute(
        statement.on_conflict_do_update(
            index_elements=["node_id", "kind", "backend"],
            set_={"day": statement.excluded.day, "used": statement.excluded.used},
        )
    )


async def give_back_quota(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, *, count: int, now: float
) -> None:
    """Claims released unheard-of do not count against today's quota."""
    await conn.execute(
        update(node_quota)
        .where(
            node_quota.c.node_id == node_id,
            node_quota.c.kind == kind,
            node_quota.c.backend == backend,
            node_quota.c.day == day_of(now),
        )
        .values(used=case((node_quota.c.used > count, node_quota.c.used - count), else_=0))
    )


async def apply_verdicts(
    conn: AsyncConnection,
    verdicts: Iterable[tuple[int, ResultVerdict]],
    *,
    settings: TrustSettings,
    now: float,
    credit: bool = True,
    trust_counted: Collection[int] = (),
) -> None:
    """Update the trust of each task's node and grant credit for valid work.

    Credit comes from the shard's cost estimate (made by the coordinator when it split
    the job), never from anything the node said. A node whose trust becomes suspended
    is suspended, and its account flagged. `credit` False: trust only (a result that
    came after its shard was decided and credited: the work is paid for once).
    `trust_counted`: results whose valid verdict the node's trust has counted already (a
    shard reopened for a check voted again): credit only.
    """
    verdict_of = dict(verdicts)
    if not verdict_of:
        return
    rows = (
        await conn.execute(
            _VERDICT_ROWS.where(tasks.c.id.in_(list(verdict_of)))
            # One lock order for every transaction: by node (deadlocks are retried anyway).
            .order_by(tasks.c.node_id, tasks.c.id)
        )
    ).all()
    # One trust read and write per node, kind and backend, however many verdicts it
    # got (a batch of results from one node is the common case); the policy still steps
    # through them one by one, in task order.
    groups: dict[tuple[int, str, str], list[Any]] = {}
    for row in rows:
        if row.id in trust_counted and verdict_of[row.id] != "invalid":
            continue
        groups.setdefault((row.node_id, row.kind, row.backend or "cpu"), []).append(row)
    for (node_id, kind, backend), group in groups.items():
        await _judge_node(
            conn,
            node_id,
            kind,
            backend,
            group[0].account_id,
            [verdict_of[row.id] for row in group],
            settings=settings,
            now=now,
        )
    await _take_back(conn, [row for row in rows if verdict_of[row.id] == "invalid"], now=now)
    # A result a trusted node decided alone earns its credit once the node has passed a
    # check after it (it is vouched for); until then it is pending, as in BOINC. Results
    # judged without credit still vouch for the node's earlier ones.
    paying = {
        row.id: row
        for row in rows
        if credit
        and (
            verdict_of[row.id] == "valid"
            or (verdict_of[row.id] == "unchecked" and row.mode != "alone")
        )
    }
    for row in await _vouched(conn, [row for row in rows if verdict_of[row.id] == "valid"]):
        if credit or row.id not in verdict_of:
            paying[row.id] = row
    # Credit: one task update for all, one grant per node and per account.
    earned = [
        (row, credit_policy.credit_for(row.cost_flops))
        for row in paying.values()
        if row.credit is None
    ]
    if not earned:
        return
    # Only the rows this transaction pays: another process vouching for the same lone
    # results at once waits on these row locks, then finds them paid.
    unpaid = set(
        (
            await conn.execute(
                update(tasks)
                .where(tasks.c.id.in_([row.id for row, _ in earned]), tasks.c.credit.is_(None))
                .values(credit=0.0)
                .returning(tasks.c.id)
            )
        )
        .scalars()
        .all()
    )
    earned = [(row, amount) for row, amount in earned if row.id in unpaid]
    if not earned:
        return
    await conn.execute(
        update(tasks).where(tasks.c.id == bindparam("task")).values(credit=bindparam("amount")),
        [{"task": row.id, "amount": amount} for row, amount in earned],
    )
    per_node: dict[int, float] = {}
    per_account: dict[int, float] = {}
    for row, amount in earned:
        per_node[row.node_id] = per_node.get(row.node_id, 0.0) + amount
        per_account[row.account_id] = per_account.get(row.account_id, 0.0) + amount
    for node_id, amount in per_node.items():
        await totals.grant(conn, "nodes", node_id, amount, now=now)
    for account_id, amount in per_account.items():
        await totals.grant(conn, "accounts", account_id, amount, now=now)
    # The dashboard's aggregates, in the same transaction: no page reads the task table.
    work = [
        stats.Earned(row.node_id, row.account_id, row.cost_flops, amount) for row, amount in earned
    ]
    await totals.validated(conn, work, now=now)


_VERDICT_ROWS = (
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
    )
    .join(nodes, nodes.c.id == tasks.c.node_id)
    .join(jobs, jobs.c.id == tasks.c.job_id)
    .join(shards, shards.c.id == tasks.c.shard_id)
)


async def _vouched(conn: AsyncConnection, checked: list[Any]) -> list[Any]:
    """Results these nodes decided alone before the checks they just passed, and that
    earned no credit yet: the checks vouch for them."""
    last_check: dict[int, float] = {}
    for row in checked:
        last_check[row.node_id] = max(last_check.get(row.node_id, 0.0), row.finished_at or 0.0)
    found: list[Any] = []
    for node_id, until in sorted(last_check.items()):
        found += (
            await conn.execute(
                _VERDICT_ROWS.where(
                    tasks.c.node_id == node_id,
                    tasks.c.outcome == "valid",
                    tasks.c.credit.is_(None),
                    shards.c.mode == "alone",
                    tasks.c.finished_at <= until,
                )
            )
        ).all()
    return found


async def _take_back(conn: AsyncConnection, rows: list[Any], *, now: float) -> None:
    """Credit granted to results found wrong since (accepted alone, then rechecked) is
    taken back from their nodes and accounts; the task keeps credit 0 (granted once,
    never again)."""
    paid = [row for row in rows if row.credit]
    if not paid:
        return
    await conn.execute(
        update(tasks).where(tasks.c.id.in_([row.id for row in paid])).values(credit=0.0)
    )
    for row in paid:
        await totals.grant(conn, "nodes", row.node_id, -row.credit, now=now)
        await totals.grant(conn, "accounts", row.account_id, -row.credit, now=now)


async def withdraw_errors(
    conn: AsyncConnection, task_ids: Sequence[int], *, settings: TrustSettings, now: float
) -> None:
    """Take back the error charged to each task's node when the task expired (it
    delivered after all: verification.trust.after_error_withdrawn)."""
    if not task_ids:
        return
    found = (
        await conn.execute(
            select(tasks.c.node_id, tasks.c.backend, jobs.c.kind)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .where(tasks.c.id.in_(list(task_ids)), tasks.c.node_id.is_not(None))
            .order_by(tasks.c.node_id, tasks.c.id)  # the lock order of apply_verdicts
        )
    ).all()
    counts: dict[tuple[int, str, str], int] = {}
    for row in found:
        key = (row.node_id, row.kind, row.backend or "cpu")
        counts[key] = counts.get(key, 0) + 1
    for (node_id, kind, backend), count in counts.items():
        current = await load_trust(
            conn, node_id, kind, backend, settings=settings, now=now, for_update=True
        )
        after = current.trust
        for _ in range(count):
            after = trust_policy.after_error_withdrawn(after)
        await _save_trust(conn, node_id, kind, backend, after, now=now)


async def _save_trust(
    conn: AsyncConnection, node_id: int, kind: str, backend: str, trust: Trust, *, now: float
) -> None:
    """Write a node's trust for one kind and backend (its row locked by `load_trust`)."""
    await conn.execute(
        update(node_trust)
        .where(
            node_trust.c.node_id == node_id,
            node_trust.c.kind == kind,
            node_trust.c.backend == backend,
        )
        .values(**_trust_values(trust), updated_at=now)
    )


async def _judge_node(
    conn: AsyncConnection,
    node_id: int,
    kind: str,
    backend: str,
    account_id: int,
    verdicts: list[ResultVerdict],
    *,
    settings: TrustSettings,
    now: float,
) -> None:
    current = await load_trust(
        conn, node_id, kind, backend, settings=settings, now=now, for_update=True
    )
    before = after = current.trust
    for verdict in verdicts:
        match verdict:
            case "valid":
                after = trust_policy.after_valid(after, settings)
            case "unchecked":
                after = trust_policy.after_unchecked(after, settings)
            case "invalid":
                after = trust_policy.after_invalid(after, settings)
            case "error":
                after = trust_policy.after_error(after)
    await _save_trust(conn, node_id, kind, backend, after, now=now)
    if after.suspended and not before.suspended:  # suspension is for good (verification.trust)
        await suspend(conn, node_id, account_id, kind, now=now)
    if "invalid" in verdicts:
        # Caught once: whatever it ran or decided alone is replicated again, now.
        found = await recheck.recheck_node(
            conn, node_id, kind, backend, window_s=settings.recheck_window_s, now=now
        )
        if found.released:
            log.warning(
                "node %s was caught lying; %d shard(s) it decided alone belong to jobs "
                "that already ended: %s",
                node_id,
                len(found.released),
                found.released,
            )


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
    current = await load_trust(
        conn, row.node_id, row.kind, backend, settings=settings, now=now, for_update=True
    )
    suspected = trust_policy.after_suspected(current.trust)
    await _save_trust(conn, row.node_id, row.kind, backend, suspected, now=now)
    return await recheck.recheck_node(
        conn, row.node_id, row.kind, backend, window_s=settings.recheck_window_s, now=now
    )


async def suspend(
    conn: AsyncConnection, node_id: int, account_id: int, kind: str, *, now: float
) -> None:
    """Stop giving a node tasks and flag its account (it registers no new nodes)."""
    await conn.execute(
        update(nodes)
        .where(nodes.c.id == node_id, nodes.c.suspended_at.is_(None))
        .values(suspended_at=now)
    )
    await conn.execute(
        update(accounts)
        .where(accounts.c.id == account_id, accounts.c.flagged_at.is_(None))
        .values(
            flagged_at=now,
            flag_reason=f"node {node_id} was suspended for repeated invalid {kind} results",
        )
    )


def trust_of(row: Any) -> Trust:
    return Trust(
        consecutive_valid=row.consecutive_valid,
        valid_total=row.valid_total,
        invalid_total=row.invalid_total,
        error_total=row.error_total,
        recent_invalid=row.recent_invalid,
        daily_quota=row.daily_quota,
        suspended=row.suspended,
    )


def _trust_values(trust: Trust) -> dict[str, Any]:
    return dict(
        consecutive_valid=trust.consecutive_valid,
        valid_total=trust.valid_total,
        invalid_total=trust.invalid_total,
        error_total=trust.error_total,
        recent_invalid=trust.recent_invalid,
        daily_quota=trust.daily_quota,
        suspended=trust.suspended,
    )
