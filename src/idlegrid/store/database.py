"""The shared `Database` of the store's roles: engine, migrations, transactions.

State changes are conditional updates (`UPDATE ... WHERE state = ...`) checked by their
row count: a claim, a decision or an expiry that lost a race changes nothing, in one
process or across several sharing a PostgreSQL database (a conditional update re-checks
its condition after waiting for a concurrent writer, also under READ COMMITTED). What a
single update cannot decide alone (how many tasks a shard still needs) takes row locks
on PostgreSQL. SQLite allows one writer at a time, so on SQLite this process serializes
its write transactions with an asyncio lock instead of spinning on "database is locked".
SQLite URLs normally name the store's own driver, `sqlite+idlegrid` (`sqlite_driver.py`).

A role (`store.accounts`, `store.claims`, ...) is a `Role`: it holds the `Database`, and
each of its operations is one method that `@read` or `@write` hands a connection, so the
transaction (or the running batch it joins) is opened in one place, not per operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from idlegrid.store import dialect, totals
from idlegrid.store import sqlite_driver as _sqlite_driver  # noqa: F401  registers sqlite+idlegrid
from idlegrid.store.base import StoreConflict
from idlegrid.store.writelock import WriteLock
from idlegrid.store.writelock import urgent as urgent_commit
from idlegrid.verification.trust import TrustSettings

# PostgreSQL aborts one side of a deadlock (40P01) or a serialization conflict (40001);
# the transaction it rolled back is safe to run again.
_RETRY_SQLSTATES = frozenset({"40P01", "40001"})
_RETRIES = 4
# Any fixed number: the key of the advisory lock that serializes migrations.
_MIGRATION_LOCK = 0x1D1E
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Batch:
    """The running `Database.batch`: its transaction, opened by the first call inside."""

    stack: contextlib.AsyncExitStack
    conn: AsyncConnection | None = None
    # What the caller does once the batch committed (`Database.after_commit`).
    after_commit: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


_BATCH: ContextVar[_Batch | None] = ContextVar("idlegrid_store_batch", default=None)


def is_conflict(exc: DBAPIError) -> bool:
    """PostgreSQL aborted the transaction for a deadlock or a serialization conflict."""
    return getattr(exc.orig, "sqlstate", None) in _RETRY_SQLSTATES


def in_batch() -> bool:
    """A `Database.batch` runs in this task: a conflict aborts all of it, not one call."""
    return _BATCH.get() is not None


async def retrying(once: Callable[[], Awaitable[R]]) -> R:
    """`once()` run again (a few times) when PostgreSQL aborted it for a deadlock.

    Inside a `batch` the whole batch was aborted: the batch raises, not the call retries.
    """
    if in_batch():
        return await once()
    for attempt in range(_RETRIES):
        try:
            return await once()
        except DBAPIError as exc:
            if not is_conflict(exc) or attempt == _RETRIES - 1:
                raise
            await asyncio.sleep(0.01 * 2**attempt)
    raise AssertionError("unreachable")


class Database:
    """One SQL database (SQLite file or PostgreSQL), shared by the store's roles."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "",
        echo: bool = False,
        trust: TrustSettings | None = None,
    ) -> None:
        """`schema`: PostgreSQL schema to use (made on `open`); empty: the default.

        `trust`: the policy the store applies to trust rows when it records verdicts.
        """
        self.url = url
        self.trust = trust or TrustSettings()
        self.schema = schema
        is_postgres = make_url(url).get_backend_name() == "postgresql"
        connect_args: dict[str, Any] = {}
        if schema:
            if not is_postgres or not _SCHEMA_NAME.fullmatch(schema):
                raise ValueError(f"schema {schema!r}: a lower-case SQL name, PostgreSQL only")
            connect_args["server_settings"] = {"search_path": schema}
        # A coordinator runs many short transactions at once: a pool big enough that they
        # seldom open (and close) overflow connections, which costs more than the query.
        pool = {"pool_size": 10, "max_overflow": 20} if is_postgres else {}
        self.engine: AsyncEngine = create_async_engine(
            url, echo=echo, connect_args=connect_args, **pool
        )
        self.is_sqlite = dialect.is_sqlite(self.engine)
        # Whether commits run one at a time (SQLite), so that fewer, bigger ones pay.
        self.serial_commits = self.is_sqlite
        self.write_lock = WriteLock() if self.is_sqlite else None
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)

    async def open(self) -> None:
        """Bring the schema to the newest migration (one process at a time on PostgreSQL)."""
        from idlegrid.store.migrate import upgrade

        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                # Coordinators starting together would otherwise race to create tables.
                await conn.execute(text(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})"))
                if self.schema:
                    await conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))
            await conn.run_sync(upgrade)

    async def close(self) -> None:
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Run the store calls made inside in one transaction, committed once at the end.

        All or nothing: if anything inside raises, every write of the batch is rolled
        back. On SQLite every commit waits for an fsync, one at a time behind the write
        lock: a batch of claims or results pays it once. The transaction (and the write
        lock) starts with the first write inside; reads after it see the batch's writes.
        On PostgreSQL a batch saves the round trips and the pool checkouts of a
        transaction a call; it starts with the first call inside. There a deadlock or a
        serialization failure aborts the whole batch: it raises `StoreConflict`, and the
        caller may run it again (`run_batch` does).
        """
        if _BATCH.get() is not None:
            yield
            return
        batch = _Batch(contextlib.AsyncExitStack())
        try:
            async with batch.stack, totals.deferred() as pending:
                token = _BATCH.set(batch)
                try:
                    yield
                finally:
                    _BATCH.reset(token)
                if pending:  # the shared rows last, just before the commit
                    await totals.write(await self._batch_connection(batch), pending)
        except DBAPIError as exc:
            if is_conflict(exc):
                raise StoreConflict(f"the database aborted a batch: {exc.orig}") from exc
            raise
        for action in batch.after_commit:
            try:
                await action()
            except Exception:  # committed: one failed follow-up must not undo the rest
                log.exception("after-commit action of a store batch failed")

    async def run_batch(self, work: Callable[[], Awaitable[R]]) -> R:
        """`work()` in one `batch`, run again (a few times) when a conflict aborted it."""
        for attempt in range(_RETRIES):
            try:
                async with self.batch():
                    return await work()
            except StoreConflict:
                if attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    async def after_commit(self, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` once what the caller wrote is committed: at the end of the running
        `batch` (dropped if the batch rolls back), or now outside one."""
        batch = _BATCH.get()
        if batch is not None:
            batch.after_commit.append(action)
        else:
            await action()

    @contextlib.asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction (the write lock on SQLite), or the running batch's."""
        batch = _BATCH.get()
        if batch is not None:
            yield await self._batch_connection(batch)
            return
        if self.write_lock is None:
            async with self.engine.begin() as conn, totals.deferred() as pending:
                yield conn
                await totals.write(conn, pending)
            return
        async with self.write_lock, self.engine.begin() as conn, totals.deferred() as pending:
            yield conn
            await totals.write(conn, pending)

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection to read on (the batch's once it wrote, or on PostgreSQL)."""
        batch = _BATCH.get()
        # SQLite: a read does not take the write lock; PostgreSQL: one connection a batch.
        if batch is not None and (batch.conn is not None or self.write_lock is None):
            yield await self._batch_connection(batch)
            return
        async with self.engine.connect() as conn:
            yield conn

    async def _batch_connection(self, batch: _Batch) -> AsyncConnection:
        if batch.conn is None:
            if self.write_lock is not None:
                await batch.stack.enter_async_context(self.write_lock)
            batch.conn = await batch.stack.enter_async_context(self.engine.begin())
        return batch.conn


class Role:
    """A part of the store (`store.jobs`, `store.claims`, ...) over the shared `Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @property
    def trust(self) -> TrustSettings:
        """The trust policy the store applies (settable on the store, for tests)."""
        return self.db.trust


S = TypeVar("S", bound=Role)
Operation = Callable[Concatenate[S, AsyncConnection, P], Awaitable[R]]
Bound = Callable[Concatenate[S, P], Coroutine[Any, Any, R]]


def read(method: Operation[S, P, R]) -> Bound[S, P, R]:
    """The operation runs on a read connection (`Database.read`), passed as `conn`."""

    @functools.wraps(method)
    async def reading(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        async with self.db.read() as conn:
            return await method(self, conn, *args, **kwargs)

    return reading


@overload
def write(method: Operation[S, P, R], /) -> Bound[S, P, R]: ...
@overload
def write(
    *, retry_conflicts: bool = False, urgent: bool = False
) -> Callable[[Operation[S, P, R]], Bound[S, P, R]]: ...


def write(
    method: Operation[S, P, R] | None = None,
    /,
    *,
    retry_conflicts: bool = False,
    urgent: bool = False,
) -> Bound[S, P, R] | Callable[[Operation[S, P, R]], Bound[S, P, R]]:
    """The operation runs in one write transaction (`Database.tx`), passed as `conn`.

    `retry_conflicts`: run it again when PostgreSQL aborted it for a deadlock (outside a
    batch). `urgent`: a node waits for this commit, so it goes ahead of background ones
    for the SQLite write lock.
    """

    def decorate(operation: Operation[S, P, R]) -> Bound[S, P, R]:
        @functools.wraps(operation)
        async def writing(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            async def once() -> R:
                with urgent_commit() if urgent else contextlib.nullcontext():
                    async with self.db.tx() as conn:
                        return await operation(self, conn, *args, **kwargs)

            return await (retrying(once) if retry_conflicts else once())

        return writing

    return decorate if method is None else decorate(method)


def retry_conflicts(method: Bound[S, P, R]) -> Bound[S, P, R]:
    """For an operation that opens its transaction itself (it may need none): run it
    again when PostgreSQL aborted it for a deadlock (outside a batch)."""

    @functools.wraps(method)
    async def retried(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await retrying(lambda: method(self, *args, **kwargs))

    return retried


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; synchronous=FULL makes a commit durable
    # before the coordinator acknowledges a result to its node.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
