"""Credit totals and work aggregates, written once at the end of a transaction.

Every validated result adds to a few rows that many transactions share: the grid's row
of the hour, the account that owns a fleet of nodes, its team. Written where the credit
is decided, each of them stays locked from that statement to the commit, and every other
transaction that pays credit waits behind it (on PostgreSQL, the result batches of all
coordinator processes). Instead the ledger adds what it grants to the transaction's
`Totals`, and the store writes them just before the commit, in one fixed order: the
shared rows are then held for a few statements and the commit, not for the whole batch.

Still one transaction: the credit, the verdict and the aggregates commit together or
not at all, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store import stats
from idlegrid.store.schema import accounts, nodes, teams
from idlegrid.verification import credit as credit_rules

# Tables whose credit a grant changes, in the order their rows are locked.
_TABLES = {"nodes": nodes, "accounts": accounts, "teams": teams}


@dataclass
class Totals:
    """What a transaction adds to the shared totals, until it writes them."""

    grants: dict[tuple[str, int], float] = field(default_factory=dict)  # (table, id) -> credit
    work: list[stats.Earned] = field(default_factory=list)
    now: float = 0.0

    def grant(self, table: str, row_id: int, amount: float, *, now: float) -> None:
        key = (table, row_id)
        self.grants[key] = self.grants.get(key, 0.0) + amount
        self.now = max(self.now, now)

    def validated(self, work: list[stats.Earned], *, now: float) -> None:
        self.work += work
        self.now = max(self.now, now)

    def __bool__(self) -> bool:
        return bool(self.grants or self.work)


_OPEN: ContextVar[Totals | None] = ContextVar("idlegrid_store_totals", default=None)


def current() -> Totals | None:
    """The running transaction's totals, or None where the caller writes them at once."""
    return _OPEN.get()


@contextlib.asynccontextmanager
async def deferred() -> AsyncIterator[Totals]:
    """Collect the totals of the transaction run inside; the caller writes them
    (`write`) before it commits. Nested: the outer transaction's totals."""
    running = _OPEN.get()
    if running is not None:
        yield running
        return
    collected = Totals()
    token = _OPEN.set(collected)
    try:
        yield collected
    finally:
        _OPEN.reset(token)


async def grant(
    conn: AsyncConnection, table: str, row_id: int, amount: float, *, now: float
) -> None:
    """Add credit to a node's, an account's or a team's totals: at the end of the
    running transaction where one collects them (`deferred`), else now."""
    running = _OPEN.get()
    if running is not None:
        running.grant(table, row_id, amount, now=now)
    else:
        await grant_now(conn, _TABLES[table], row_id, amount, now=now)


async def validated(conn: AsyncConnection, work: list[stats.Earned], *, now: float) -> None:
    """Validated work for the aggregates (and its credit for the owners' teams)."""
    running = _OPEN.get()
    if running is not None:
        running.validated(work, now=now)
        return
    for team_id, amount in sorted((await stats.record_validated(conn, work, now=now)).items()):
        await grant_now(conn, teams, team_id, amount, now=now)


async def write(conn: AsyncConnection, totals: Totals) -> None:
    """Write the collected totals: credit of nodes, then of accounts, then the
    aggregates (the hour's row, the nodes' days, validated counts, teams), each in id
    order, so two transactions take the shared rows in one order."""
    if not totals:
        return
    grants, work, now = dict(totals.grants), list(totals.work), totals.now
    totals.grants.clear()
    totals.work.clear()
    for name in ("nodes", "accounts", "teams"):
        for (table, row_id), amount in sorted(grants.items()):
            if table == name and amount:
                await grant_now(conn, _TABLES[name], row_id, amount, now=now)
    if work:
        for team_id, amount in sorted((await stats.record_validated(conn, work, now=now)).items()):
            await grant_now(conn, teams, team_id, amount, now=now)


async def grant_now(
    conn: AsyncConnection, table: Any, row_id: int, amount: float, *, now: float
) -> None:
    """Add credit to a node's or an account's totals (decayed sum: verification.credit)."""
    row = (
        await conn.execute(
            select(table.c.credit_total, table.c.credit_decayed, table.c.credit_updated_at)
            .where(table.c.id == row_id)
            .with_for_update(key_share=True)
        )
    ).one()
    totals = credit_rules.grant(credit_of(row), amount, now=now)
    await conn.execute(
        update(table)
        .where(table.c.id == row_id)
        .values(
            credit_total=totals.total,
            credit_decayed=totals.decayed,
            credit_updated_at=totals.updated_at,
            credit_rank=credit_rules.rank_key(totals),
        )
    )


def credit_of(row: Any) -> credit_rules.CreditTotals:
    return credit_rules.CreditTotals(row.credit_total, row.credit_decayed, row.credit_updated_at)
