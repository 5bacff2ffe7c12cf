"""A node's trust and daily quota rows: the store's side of `verification.trust`.

Reads a node's trust on a kind and backend (made on first use) and the claims its daily
quota counted today; writes what the rules decide of them (`verification.ledger`'s trust
changes, an admin's lift of a suspension, an error withdrawn), inside the caller's
transaction. Suspends a node whose trust says so, and has what a caught liar decided
alone checked again (store/recheck.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store import dialect, recheck
from idlegrid.store.base import NodeTrust
from idlegrid.store.schema import accounts, jobs, node_quota, node_trust, nodes, tasks
from idlegrid.verification import ledger as rules
from idlegrid.verification import trust as trust_rules
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
        await conn.execute(
            dialect.insert(conn, node_trust)
            .values(
                node_id=node_id,
                kind=kind,
                backend=backend,
                **trust_values(trust_rules.new_trust(settings)),
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
    now: float,
    count: int = 1,
) -> None:
    """Count `count` claims against today's quota, as one atomic increment.

    Not "the count read earlier, plus one": two claims of one node in transactions that
    overlap (PostgreSQL's READ COMMITTED; a node's claims can run concurrently) would
    both read the same count and one claim would be lost from it. The row is reset when
    its day is past.
    """
    today = day_of(now)
    statement = dialect.insert(conn, node_quota).values(
        node_id=node_id, kind=kind, backend=backend, day=today, used=count
    )
    await conn.execute(
        statement.on_conflict_do_update(
            index_elements=["node_id", "kind", "backend"],
            set_={
                "day": statement.excluded.day,
                "used": case(
                    (node_quota.c.day == statement.excluded.day, node_quota.c.used + count),
                    else_=statement.excluded.used,
                ),
            },
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


async def lift_suspension(conn: AsyncConnection, node_id: int, *, now: float) -> None:
    """Write `rules.lifted` to every trust row of a node whose suspension an admin lifted."""
    query = (
        select(node_trust)
        .where(node_trust.c.node_id == node_id)
        .order_by(node_trust.c.kind, node_trust.c.backend)
    )
    if dialect.row_locks(conn):
        query = query.with_for_update(key_share=True)
    for row in (await conn.execute(query)).all():
        after = rules.lifted(trust_of(row))
        await save_trust(conn, node_id, row.kind, row.backend, after, now=now)


async def withdraw_errors(
    conn: AsyncConnection, task_ids: Sequence[int], *, settings: TrustSettings, now: float
) -> None:
    """Take back the error charged to each task's node when the task expired (it
    delivered after all)."""
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
    withdrawn: rules.TrustEvent = "error withdrawn"
    for (node_id, kind, backend), count in counts.items():
        group = rules.TrustGroup(
            node_id=node_id, kind=kind, backend=backend, events=(withdrawn,) * count
        )
        await change_trust(conn, group, settings=settings, now=now)


async def save_trust(
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
        .values(**trust_values(trust), updated_at=now)
    )


async def change_trust(
    conn: AsyncConnection, group: rules.TrustGroup, *, settings: TrustSettings, now: float
) -> recheck.Rechecked:
    """Read a node's trust (locked), and write what the group's events make of it:
    the trust, a suspension, the recheck of a node caught lying."""
    current = await load_trust(
        conn, group.node_id, group.kind, group.backend, settings=settings, now=now, for_update=True
    )
    change = rules.trust_change(group, current.trust, settings)
    await save_trust(conn, change.node_id, change.kind, change.backend, change.after, now=now)
    if change.suspended_now and change.account_id is not None:
        await suspend(conn, change.node_id, change.account_id, change.kind, now=now)
    if not change.caught:
        return recheck.Rechecked()
    found = await recheck.recheck_node(
        conn,
        change.node_id,
        change.kind,
        change.backend,
        window_s=settings.recheck_window_s,
        now=now,
    )
    if found.released:
        log.warning(
            "node %s was caught lying; %d shard(s) it decided alone belong to jobs "
            "that already ended: %s",
            change.node_id,
            len(found.released),
            found.released,
        )
    return found


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
        suspicions=row.suspicions,
        held_streak=row.held_streak,
        probes_passed=row.probes_passed,
    )


def trust_values(trust: Trust) -> dict[str, Any]:
    return dict(
        consecutive_valid=trust.consecutive_valid,
        valid_total=trust.valid_total,
        invalid_total=trust.invalid_total,
        error_total=trust.error_total,
        recent_invalid=trust.recent_invalid,
        daily_quota=trust.daily_quota,
        suspended=trust.suspended,
        suspicions=trust.suspicions,
        held_streak=trust.held_streak,
        probes_passed=trust.probes_passed,
    )
