"""SQL of the web dashboard: browser sessions, teams, the admin's node and job lists.

Module functions over an `AsyncConnection`, like store/ledger.py. The `store.web` role
runs any of them, or of store/accounts.py (password accounts, roles, flags: accounts have
one module), store/stats.py and store/uploads.py, in a read or a write
transaction: `await store.web.web_read(stats.leaderboard, "accounts", ...)`, so
the dashboard names what it wants without holding a connection or writing SQL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import LIVE_TASK_STATES, ShardState
from idlegrid.store import database
from idlegrid.store import trust as trust_rows
from idlegrid.store.accounts import WebAccount, web_account_of

# The dashboard reads an account by name through `store.web` too.
from idlegrid.store.accounts import account_by_name as account_by_name
from idlegrid.store.base import NodeTrust
from idlegrid.store.nodes import list_trust
from idlegrid.store.schema import (
    accounts,
    jobs,
    nodes,
    shards,
    tasks,
    teams,
    web_sessions,
)
from idlegrid.verification.credit import CreditTotals

P = ParamSpec("P")
R = TypeVar("R")


class Conflict(ValueError):
    """A write lost a race for a unique name (an account, an email, a team)."""


class Web(database.Role):
    """The dashboard's way into the store (`store.web`): a function of this package (or of
    store/stats.py, store/uploads.py) run in a read or a write transaction."""

    async def web_read(
        self,
        fn: Callable[Concatenate[AsyncConnection, P], Awaitable[R]],
        /,
        *a: P.args,
        **k: P.kwargs,
    ) -> R:
        """`fn(connection, ...)` on a read connection (no write lock on SQLite)."""
        async with self.db.read() as conn:
            return await fn(conn, *a, **k)

    async def web_write(
        self,
        fn: Callable[Concatenate[AsyncConnection, P], Awaitable[R]],
        /,
        *a: P.args,
        **k: P.kwargs,
    ) -> R:
        """`fn(connection, ...)` in one write transaction, committed when it returns.

        A unique key another transaction took meanwhile raises `Conflict` (rolled back).
        """
        try:
            async with self.db.tx() as conn:
                return await fn(conn, *a, **k)
        except IntegrityError as exc:
            raise Conflict("taken a moment ago; try another name") from exc


# -- browser sessions ----------------------------------------------------------------------


@dataclass(frozen=True)
class WebSession:
    id: str  # SHA-256 of the cookie's secret
    account: WebAccount
    csrf: str
    expires_at: float


async def create_session(
    conn: AsyncConnection, session_id: str, account_id: int, *, csrf: str, now: float, ttl_s: float
) -> None:
    await conn.execute(
        insert(web_sessions).values(
            id=session_id, account_id=account_id, csrf=csrf, created_at=now, expires_at=now + ttl_s
        )
    )


async def find_session(conn: AsyncConnection, session_id: str, *, now: float) -> WebSession | None:
    """A live session of an enabled account, or None."""
    query = (
        select(accounts, web_sessions.c.csrf, web_sessions.c.expires_at)
        .join(web_sessions, web_sessions.c.account_id == accounts.c.id)
        .where(
            web_sessions.c.id == session_id,
            web_sessions.c.expires_at > now,
            accounts.c.disabled_at.is_(None),
        )
    )
    row = (await conn.execute(query)).first()
    if row is None:
        return None
    return WebSession(session_id, web_account_of(row), row.csrf, row.expires_at)


async def end_session(conn: AsyncConnection, session_id: str, *, now: float) -> None:
    """Sign out; expired sessions of anyone are swept on the way."""
    await conn.execute(
        delete(web_sessions).where(
            or_(web_sessions.c.id == session_id, web_sessions.c.expires_at <= now)
        )
    )


# -- teams ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TeamRecord:
    id: int
    name: str
    description: str
    founder_id: int
    members: int
    created_at: float
    credit: CreditTotals
    validated: int


class TeamExists(ValueError):
    """A team name that is taken."""


async def create_team(
    conn: AsyncConnection, name: str, *, description: str, founder_id: int, now: float
) -> int:
    """A new team; its founder leaves any team they were in and joins it."""
    taken = await conn.execute(select(teams.c.id).where(func.lower(teams.c.name) == name.lower()))
    if taken.first() is not None:
        raise TeamExists(f"a team named {name!r} exists")
    result = await conn.execute(
        insert(teams).values(
            name=name, description=description, founder_id=founder_id, created_at=now
        )
    )
    team_id = int(result.inserted_primary_key[0])  # type: ignore[index]
    await join_team(conn, founder_id, team_id)
    return team_id


async def get_team(conn: AsyncConnection, team_id: int) -> TeamRecord | None:
    row = (await conn.execute(select(teams).where(teams.c.id == team_id))).first()
    if row is None:
        return None
    return TeamRecord(
        row.id,
        row.name,
        row.description,
        row.founder_id,
        row.members,
        row.created_at,
        CreditTotals(row.credit_total, row.credit_decayed, row.credit_updated_at),
        row.validated_total,
    )


async def join_team(conn: AsyncConnection, account_id: int, team_id: int) -> bool:
    """Move an account into a team (out of its old one); False if there is no such team."""
    if (await conn.execute(select(teams.c.id).where(teams.c.id == team_id))).first() is None:
        return False
    await leave_team(conn, account_id)
    await conn.execute(update(accounts).where(accounts.c.id == account_id).values(team_id=team_id))
    await conn.execute(
        update(teams).where(teams.c.id == team_id).values(members=teams.c.members + 1)
    )
    return True


async def leave_team(conn: AsyncConnection, account_id: int) -> None:
    """Leave the account's team, if any; the credit earned in it stays with the team."""
    row = (
        await conn.execute(select(accounts.c.team_id).where(accounts.c.id == account_id))
    ).first()
    if row is None or row.team_id is None:
        return
    await conn.execute(update(accounts).where(accounts.c.id == account_id).values(team_id=None))
    await conn.execute(
        update(teams).where(teams.c.id == row.team_id).values(members=teams.c.members - 1)
    )


async def search_teams(conn: AsyncConnection, prefix: str, *, limit: int) -> list[TeamRecord]:
    query = (
        select(teams.c.id)
        .where(teams.c.name.startswith(prefix, autoescape=True))
        .order_by(teams.c.name)
        .limit(limit)
    )
    found = []
    for (team_id,) in (await conn.execute(query)).all():
        team = await get_team(conn, team_id)
        if team is not None:
            found.append(team)
    return found


# -- nodes ---------------------------------------------------------------------------------


async def live_tasks(conn: AsyncConnection, node_ids: list[int]) -> dict[int, int]:
    """Tasks each node holds now (an index lookup per node, never a scan of tasks)."""
    if not node_ids:
        return {}
    query = (
        select(tasks.c.node_id, func.count())
        .where(
            tasks.c.node_id.in_(node_ids),
            tasks.c.state.in_([s.value for s in LIVE_TASK_STATES if s.value != "ready"]),
        )
        .group_by(tasks.c.node_id)
    )
    return {int(node): int(n) for node, n in (await conn.execute(query)).all()}


async def set_suspended(
    conn: AsyncConnection, node_id: int, *, suspended: bool, now: float
) -> bool:
    """An admin suspends a node (it gets no tasks) or lifts a suspension (its trust then
    starts again on probation: `verification.ledger.lifted`)."""
    result = await conn.execute(
        update(nodes).where(nodes.c.id == node_id).values(suspended_at=now if suspended else None)
    )
    if not suspended:
        await trust_rows.lift_suspension(conn, node_id, now=now)
    return bool(result.rowcount)


async def list_all_nodes(
    conn: AsyncConnection, *, suspended: bool, limit: int, offset: int
) -> list[tuple[int, str, int, str, str, float | None]]:
    """Nodes for the admin page: id, name, owner id and name, state, suspended at."""
    query = (
        select(
            nodes.c.id,
            nodes.c.name,
            nodes.c.account_id,
            accounts.c.name.label("owner"),
            nodes.c.state,
            nodes.c.suspended_at,
        )
        .join(accounts, accounts.c.id == nodes.c.account_id)
        .order_by(nodes.c.id.desc())
        .limit(limit)
        .offset(offset)
    )
    if suspended:
        query = query.where(nodes.c.suspended_at.is_not(None))
    return [tuple(row) for row in (await conn.execute(query)).all()]  # type: ignore[misc]


async def validated_counts(conn: AsyncConnection, node_ids: list[int]) -> dict[int, int]:
    """Results of each node that earned credit."""
    if not node_ids:
        return {}
    query = select(nodes.c.id, nodes.c.validated_total).where(nodes.c.id.in_(node_ids))
    return {int(node): int(n) for node, n in (await conn.execute(query)).all()}


@dataclass(frozen=True)
class JobRow:
    """A job as the researcher's job list shows it."""

    id: int
    kind: str
    state: str
    shards_total: int
    shards_done: int
    items_total: int
    created_at: float

    @property
    def progress(self) -> float:
        return self.shards_done / self.shards_total if self.shards_total else 1.0


async def job_list(
    conn: AsyncConnection, account_id: int, *, limit: int, offset: int
) -> list[JobRow]:
    """A page of an account's jobs, newest first, with their done shards counted in one
    query (not each job's shards by state and its tasks, as its own page shows them)."""
    found = (
        await conn.execute(
            select(
                jobs.c.id,
                jobs.c.kind,
                jobs.c.state,
                jobs.c.shards_total,
                jobs.c.items_total,
                jobs.c.created_at,
            )
            .where(jobs.c.account_id == account_id)
            .order_by(jobs.c.id.desc())
            .limit(limit)
            .offset(offset)
        )
    ).all()
    done: dict[int, int] = {}
    if found:
        done = dict(
            (
                await conn.execute(
                    select(shards.c.job_id, func.count())
                    .where(
                        shards.c.job_id.in_([row.id for row in found]),
                        shards.c.state == ShardState.DONE.value,
                    )
                    .group_by(shards.c.job_id)
                )
            ).all()
        )
    return [
        JobRow(
            id=row.id,
            kind=row.kind,
            state=row.state,
            shards_total=row.shards_total,
            shards_done=int(done.get(row.id, 0)),
            items_total=row.items_total,
            created_at=row.created_at,
        )
        for row in found
    ]


async def trust_of_nodes(
    conn: AsyncConnection, node_ids: list[int], *, now: float
) -> dict[int, list[NodeTrust]]:
    """Each node's trust per kind and backend, in one transaction (a page of nodes)."""
    return {node_id: await list_trust(conn, node_id, now=now) for node_id in node_ids}
