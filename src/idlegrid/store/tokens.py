"""SQL of token listing and revocation, mixed into `SqlStore` (the `TokenStore` protocol).

A token is never deleted: revoking stamps `revoked_at`, so a revoked token keeps failing
`find_token` and the list still shows when it was made and when it was revoked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store.schema import accounts, tokens


@dataclass(frozen=True)
class TokenRecord:
    """A token as listed: never its secret or hash, only the prefix it is shown by."""

    id: int
    account: str
    kind: str
    prefix: str
    label: str
    created_at: float
    revoked_at: float | None


class TokenStore(Protocol):
    """Listing and revoking API and node tokens."""

    async def list_tokens(
        self, account_id: int | None, *, include_revoked: bool = False
    ) -> list[TokenRecord]:
        """Tokens of one account (None: every account), oldest first."""
        ...

    async def revoke_token(
        self, token_id: int, *, account_id: int | None, now: float
    ) -> TokenRecord | None:
        """Revoke a live token of `account_id` (None: of any account); None if no such."""
        ...


async def list_tokens(
    conn: AsyncConnection, account_id: int | None, *, include_revoked: bool
) -> list[TokenRecord]:
    query = _listing()
    if account_id is not None:
        query = query.where(tokens.c.account_id == account_id)
    if not include_revoked:
        query = query.where(tokens.c.revoked_at.is_(None))
    rows = (await conn.execute(query.order_by(tokens.c.id))).all()
    return [_record(row) for row in rows]


async def revoke_token(
    conn: AsyncConnection, token_id: int, *, account_id: int | None, now: float
) -> TokenRecord | None:
    where = [tokens.c.id == token_id, tokens.c.revoked_at.is_(None)]
    if account_id is not None:
        where.append(tokens.c.account_id == account_id)
    changed = await conn.execute(update(tokens).where(*where).values(revoked_at=now))
    if changed.rowcount != 1:
        return None
    row = (await conn.execute(_listing().where(tokens.c.id == token_id))).one()
    return _record(row)


def _listing() -> Any:
    return select(
        tokens.c.id,
        accounts.c.name.label("account"),
        tokens.c.kind,
        tokens.c.prefix,
        tokens.c.label,
        tokens.c.created_at,
        tokens.c.revoked_at,
    ).join(accounts, accounts.c.id == tokens.c.account_id)


def _record(row: Any) -> TokenRecord:
    return TokenRecord(
        id=row.id,
        account=row.account,
        kind=row.kind,
        prefix=row.prefix,
        label=row.label,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


class TokensSql:
    """The token listing and revocation methods of `SqlStore`."""

    if TYPE_CHECKING:  # provided by SqlStore

        def _tx(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]: ...
        def _read(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]: ...

    async def list_tokens(
        self, account_id: int | None, *, include_revoked: bool = False
    ) -> list[TokenRecord]:
        async with self._read() as conn:
            return await list_tokens(conn, account_id, include_revoked=include_revoked)

    async def revoke_token(
        self, token_id: int, *, account_id: int | None, now: float
    ) -> TokenRecord | None:
        async with self._tx() as conn:
            return await revoke_token(conn, token_id, account_id=account_id, now=now)
