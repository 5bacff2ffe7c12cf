"""Accounts and their API and node tokens: the `store.accounts` role.

Each method is one transaction (`@read`, `@write`, store/database.py). Tokens are
stored as hashes only: `find_token` looks a presented token up by its hash. A token is
never deleted: revoking stamps `revoked_at`, so a revoked token keeps failing
`find_token` and the list still shows when it was made and when it was revoked.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store import rows
from idlegrid.store.base import AccountExists, AccountRecord, TokenInfo, TokenRecord
from idlegrid.store.database import Role, read, write
from idlegrid.store.schema import accounts, teams, tokens


def _listing() -> Any:
    return select(*rows.TOKEN_COLUMNS).join(accounts, accounts.c.id == tokens.c.account_id)


class Accounts(Role):
    """Accounts and their API and node tokens (`store.accounts`)."""

    @write
    async def create_account(
        self,
        conn: AsyncConnection,
        name: str,
        *,
        is_admin: bool,
        now: float,
        role: str = "researcher",
    ) -> AccountRecord:
        """A new account; `AccountExists` when the name is taken. `role`: its dashboard
        role (a volunteer's account, made for a node token, uploads and submits nothing)."""
        try:
            result = await conn.execute(
                insert(accounts).values(name=name, is_admin=is_admin, created_at=now, role=role)
            )
        except IntegrityError as exc:
            raise AccountExists(f"an account named {name!r} exists") from exc
        return AccountRecord(id=rows.pk(result), name=name, is_admin=is_admin)

    @read
    async def get_account(self, conn: AsyncConnection, name: str) -> AccountRecord | None:
        row = (await conn.execute(select(accounts).where(accounts.c.name == name))).first()
        return rows.account(row) if row else None

    @read
    async def account_by_id(self, conn: AsyncConnection, account_id: int) -> AccountRecord | None:
        row = (await conn.execute(select(accounts).where(accounts.c.id == account_id))).first()
        return rows.account(row) if row else None

    @read
    async def team_account_ids(self, conn: AsyncConnection, team: str) -> list[int] | None:
        """The ids of a team's member accounts now; None if no team has that name."""
        team_id = (await conn.execute(select(teams.c.id).where(teams.c.name == team))).scalar()
        if team_id is None:
            return None
        query = select(accounts.c.id).where(accounts.c.team_id == team_id).order_by(accounts.c.id)
        return [int(i) for i in (await conn.execute(query)).scalars().all()]

    @read
    async def count_accounts(self, conn: AsyncConnection) -> int:
        return int((await conn.execute(select(func.count()).select_from(accounts))).scalar_one())

    @write
    async def add_token(
        self,
        conn: AsyncConnection,
        account_id: int,
        *,
        kind: str,
        token_hash: str,
        prefix: str,
        label: str,
        now: float,
    ) -> int:
        result = await conn.execute(
            insert(tokens).values(
                account_id=account_id,
                kind=kind,
                token_hash=token_hash,
                prefix=prefix,
                label=label,
                created_at=now,
            )
        )
        return rows.pk(result)

    @read
    async def find_token(self, conn: AsyncConnection, token_hash: str) -> TokenInfo | None:
        query = (
            select(
                tokens.c.id,
                tokens.c.kind,
                accounts.c.id.label("account_id"),
                accounts.c.name,
                accounts.c.is_admin,
            )
            .join(accounts, accounts.c.id == tokens.c.account_id)
            .where(tokens.c.token_hash == token_hash, tokens.c.revoked_at.is_(None))
        )
        row = (await conn.execute(query)).first()
        if row is None:
            return None
        return TokenInfo(
            token_id=row.id,
            account_id=row.account_id,
            account_name=row.name,
            kind=row.kind,
            is_admin=row.is_admin,
        )

    @read
    async def live_token_hashes(
        self, conn: AsyncConnection, *, after_id: int, limit: int
    ) -> list[tuple[int, str]]:
        """(id, hash) of live tokens with ids above `after_id`, in id order, at most `limit`:
        how a coordinator process learns, in pages, the tokens that exist."""
        query = (
            select(tokens.c.id, tokens.c.token_hash)
            .where(tokens.c.id > after_id, tokens.c.revoked_at.is_(None))
            .order_by(tokens.c.id)
            .limit(limit)
        )
        return [(row.id, row.token_hash) for row in (await conn.execute(query)).all()]

    @read
    async def list_tokens(
        self, conn: AsyncConnection, account_id: int | None, *, include_revoked: bool = False
    ) -> list[TokenRecord]:
        """Tokens of one account (None: every account), oldest first."""
        query = _listing()
        if account_id is not None:
            query = query.where(tokens.c.account_id == account_id)
        if not include_revoked:
            query = query.where(tokens.c.revoked_at.is_(None))
        return [rows.token(row) for row in (await conn.execute(query.order_by(tokens.c.id))).all()]

    @write
    async def revoke_token(
        self, conn: AsyncConnection, token_id: int, *, account_id: int | None, now: float
    ) -> TokenRecord | None:
        """Revoke a live token of `account_id` (None: of any account); None if no such."""
        where = [tokens.c.id == token_id, tokens.c.revoked_at.is_(None)]
        if account_id is not None:
            where.append(tokens.c.account_id == account_id)
        changed = await conn.execute(update(tokens).where(*where).values(revoked_at=now))
        if changed.rowcount != 1:
            return None
        return rows.token((await conn.execute(_listing().where(tokens.c.id == token_id))).one())
