"""SQL of collusion: the accounts of agreeing wrong results counted, and flagged.

Whether two accounts are colluders is `verification.collusion`'s rule; here each pair
of accounts it names is counted over every shard where both were found wrong, and the
flags it decides are written. Functions over an open connection, in the caller's
transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store.schema import accounts, tasks
from idlegrid.verification import collusion

# Made once (see claims.OTHER): the other account's task of the same shard.
_PARTNER = tasks.alias("partner")


async def flag_colluders(
    conn: AsyncConnection, groups: Sequence[Sequence[int]], *, flag_after: int, now: float
) -> list[int]:
    """Flag the accounts of these agreeing wrong results that were wrong together often
    enough; the accounts flagged now."""
    task_ids = sorted({task for group in groups for task in group})
    if not task_ids:
        return []
    account_of = dict(
        (
            await conn.execute(
                select(tasks.c.id, tasks.c.account_id).where(tasks.c.id.in_(task_ids))
            )
        ).all()
    )
    flagged: list[int] = []
    for first, second in collusion.account_pairs(groups, account_of):
        together = await _wrong_together(conn, first, second)
        if not collusion.colluding(together, flag_after=flag_after):
            continue
        for account, partner in ((first, second), (second, first)):
            changed = await conn.execute(
                update(accounts)
                .where(accounts.c.id == account, accounts.c.flagged_at.is_(None))
                .values(
                    flagged_at=now,
                    flag_reason=collusion.flag_reason(partner, together),
                )
            )
            if changed.rowcount:
                flagged.append(account)
    return flagged


async def _wrong_together(conn: AsyncConnection, first: int, second: int) -> int:
    """Shards where results of both accounts were found wrong."""
    query = (
        select(func.count(func.distinct(tasks.c.shard_id)))
        .join(
            _PARTNER,
            and_(
                _PARTNER.c.shard_id == tasks.c.shard_id,
                _PARTNER.c.account_id == second,
                _PARTNER.c.outcome == "invalid",
            ),
        )
        .where(tasks.c.account_id == first, tasks.c.outcome == "invalid")
    )
    return int((await conn.execute(query)).scalar_one())
