"""Accounts: the one module of their SQL, for the API and the dashboard alike.

The `store.accounts` role: accounts and their API and node tokens, each method one
transaction (`@read`, `@write`, store/database.py). Tokens are stored as hashes only:
`find_token` looks a presented token up by its hash. A token is never deleted: revoking
stamps `revoked_at`, so a revoked token keeps failing `find_token` and the list still
shows when it was made and when it was revoked.

Below the role, the dashboard's side of the same rows as module functions over an
`AsyncConnection`, which the dashboard runs through `store.web` (`web_read`,
`web_write`): password accounts (`sign_up`), who signs in (`account_by_login`), the
account as its pages show it (`WebAccount`), roles, disabling and flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store import rows
from idlegrid.store.base import AccountExists, AccountRecord, TokenInfo, TokenRecord
from idlegrid.store.database import Role, read, write
from idlegrid.store.schema import accounts, teams, tokens, web_sessions
from idlegrid.verification.credit import CreditTotals

# What an account may do on the dashboard.
AccountRole = Literal["volunteer", "researcher", "admin"]
ROLES: tuple[AccountRole, ...] = ("volunteer", "researcher", "admin")


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
        self,
        conn: AsyncConnection,
        account_id: int | None,
        *,
        include_revoked: bool = False,
        for_page: bool = False,
    ) -> list[TokenRecord]:
        """Tokens of one account (None: every account), oldest first; `for_page`: as the
        account's page lists them, live ones first, newest first, at most 200."""
        query = _listing()
        if account_id is not None:
            query = query.where(tokens.c.account_id == account_id)
        if not include_revoked:
            query = query.where(tokens.c.revoked_at.is_(None))
        if for_page:
            query = query.order_by(tokens.c.revoked_at.is_not(None), tokens.c.id.desc()).limit(200)
        else:
            query = query.order_by(tokens.c.id)
        return [rows.token(row) for row in (await conn.execute(query)).all()]

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


# -- accounts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WebAccount:
    id: int
    name: str
    email: str | None
    role: AccountRole
    password_hash: str | None
    created_at: float
    disabled_at: float | None
    team_id: int | None
    flagged_at: float | None
    flag_reason: str | None
    credit: CreditTotals
    validated: int

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def is_researcher(self) -> bool:
        """Researchers (and admins) upload data and submit jobs from the browser."""
        return self.role in ("researcher", "admin")


def web_account_of(row: Any) -> WebAccount:
    """An `accounts` row as the dashboard shows it."""
    return WebAccount(
        id=row.id,
        name=row.name,
        email=row.email,
        role="admin" if row.is_admin else row.role,
        password_hash=row.password_hash,
        created_at=row.created_at,
        disabled_at=row.disabled_at,
        team_id=row.team_id,
        flagged_at=row.flagged_at,
        flag_reason=row.flag_reason,
        credit=CreditTotals(row.credit_total, row.credit_decayed, row.credit_updated_at),
        validated=row.validated_total,
    )


async def sign_up(
    conn: AsyncConnection,
    name: str,
    *,
    email: str,
    password_hash: str,
    role: AccountRole,
    now: float,
) -> int:
    """A new password account (a sign-up on the dashboard); `AccountExists` names what is
    taken (name or email)."""
    taken = await conn.execute(
        select(accounts.c.name, accounts.c.email).where(
            or_(func.lower(accounts.c.name) == name.lower(), accounts.c.email == email)
        )
    )
    for row in taken.all():
        what = "username" if row.name.lower() == name.lower() else "email address"
        raise AccountExists(f"that {what} is taken")
    # A concurrent sign-up that took it a moment ago: `web_write` raises `Conflict`.
    result = await conn.execute(
        insert(accounts).values(
            name=name,
            email=email,
            password_hash=password_hash,
            role=role,
            is_admin=role == "admin",
            created_at=now,
        )
    )
    return int(result.inserted_primary_key[0])  # type: ignore[index]


async def account_by_login(conn: AsyncConnection, login: str) -> WebAccount | None:
    """The account a sign-in names, by username (any case) or email address."""
    login = login.strip()
    column = accounts.c.email if "@" in login else func.lower(accounts.c.name)
    row = (await conn.execute(select(accounts).where(column == login.lower()))).first()
    return web_account_of(row) if row else None


async def web_account(conn: AsyncConnection, account_id: int) -> WebAccount | None:
    """An account as the dashboard shows it."""
    row = (await conn.execute(select(accounts).where(accounts.c.id == account_id))).first()
    return web_account_of(row) if row else None


async def account_by_name(conn: AsyncConnection, name: str) -> WebAccount | None:
    row = (await conn.execute(select(accounts).where(accounts.c.name == name))).first()
    return web_account_of(row) if row else None


async def set_password(
    conn: AsyncConnection, account_id: int, password_hash: str, *, keep_session: str | None
) -> None:
    """Change a password and end every other browser session of the account."""
    await conn.execute(
        update(accounts).where(accounts.c.id == account_id).values(password_hash=password_hash)
    )
    query = delete(web_sessions).where(web_sessions.c.account_id == account_id)
    if keep_session is not None:
        query = query.where(web_sessions.c.id != keep_session)
    await conn.execute(query)


async def set_login(
    conn: AsyncConnection,
    name: str,
    *,
    email: str | None,
    password_hash: str,
    role: AccountRole,
    now: float,
) -> int:
    """Give an account (made if missing) a password and a role: the operator's way in."""
    row = (await conn.execute(select(accounts.c.id).where(accounts.c.name == name))).first()
    values = {"password_hash": password_hash, "role": role, "is_admin": role == "admin"}
    if email is not None:
        values["email"] = email.lower()
    if row is None:
        result = await conn.execute(insert(accounts).values(name=name, created_at=now, **values))
        return int(result.inserted_primary_key[0])  # type: ignore[index]
    await conn.execute(update(accounts).where(accounts.c.id == row.id).values(**values))
    return int(row.id)


async def set_role(conn: AsyncConnection, account_id: int, role: AccountRole) -> bool:
    result = await conn.execute(
        update(accounts)
        .where(accounts.c.id == account_id)
        .values(role=role, is_admin=role == "admin")
    )
    return bool(result.rowcount)


async def set_disabled(
    conn: AsyncConnection, account_id: int, *, disabled: bool, now: float
) -> bool:
    """Disable an account (its sessions end, its tokens are revoked), or enable it again."""
    result = await conn.execute(
        update(accounts)
        .where(accounts.c.id == account_id)
        .values(disabled_at=now if disabled else None)
    )
    if disabled:
        await conn.execute(delete(web_sessions).where(web_sessions.c.account_id == account_id))
        await conn.execute(
            update(tokens)
            .where(tokens.c.account_id == account_id, tokens.c.revoked_at.is_(None))
            .values(revoked_at=now)
        )
    return bool(result.rowcount)


async def clear_flag(conn: AsyncConnection, account_id: int) -> bool:
    result = await conn.execute(
        update(accounts)
        .where(accounts.c.id == account_id)
        .values(flagged_at=None, flag_reason=None)
    )
    return bool(result.rowcount)


async def list_accounts(
    conn: AsyncConnection, *, search: str, flagged: bool, limit: int, offset: int
) -> list[WebAccount]:
    """Accounts for the admin page, newest first; `search` matches a name's start."""
    query = select(accounts).order_by(accounts.c.id.desc()).limit(limit).offset(offset)
    if search:
        query = query.where(accounts.c.name.startswith(search, autoescape=True))
    if flagged:
        query = query.where(accounts.c.flagged_at.is_not(None))
    return [web_account_of(row) for row in (await conn.execute(query)).all()]
