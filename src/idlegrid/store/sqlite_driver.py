"""SQLite for SQLAlchemy's async engine with one thread hop per statement: `sqlite+idlegrid`.

SQLAlchemy's `sqlite+aiosqlite` dialect crosses to aiosqlite's thread and back four times
for every statement (open a cursor, execute, fetch the rows, close the cursor), and each
crossing is a wake-up of the other thread plus a wake-up of the event loop. On a busy
coordinator those crossings, not SQLite, set how long a claim takes
(`benchmarks/sqlite_statement.py`, docs/benchmarks.md). Here a statement is one crossing:
the database thread executes it and fetches its rows in one go, and the cursor lives and
dies there. Commit and rollback are one crossing each.

Everything else is SQLAlchemy's pysqlite dialect (same SQL, same transaction behaviour as
`sqlite3`'s default), so the store's statements and tests do not change. Each connection
owns one daemon thread; a connection is used by one task at a time (SQLAlchemy's pool
hands it out), so its statements run in order. A connection dropped without `close()`
still ends its thread when collected.

As with aiosqlite: `stream()` buffers the whole result; a commit cancelled while it runs
may have committed; connections do not survive `fork()` (open the store after forking).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import sqlite3
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import util
from sqlalchemy.connectors.asyncio import (
    AsyncAdapt_dbapi_connection,
    AsyncAdapt_dbapi_module,
    AsyncAdapt_terminate,
)
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite
from sqlalchemy.util.concurrency import await_

T = TypeVar("T")
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]
_STOP = None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _Link:
    """What the database thread shares with its `Connection`: the job queue and the
    `sqlite3` connection. The thread holds only this, so a `Connection` nobody closed can
    still be collected, and its finalizer then stops the thread."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.sqlite: sqlite3.Connection | None = None

    def close_sqlite(self) -> None:
        if self.sqlite is not None:
            self.sqlite.close()
            self.sqlite = None


def _serve(link: _Link) -> None:
    """The database thread: run jobs in order until told to stop, then close."""
    while (job := link.jobs.get()) is not _STOP:
        loop, future, work = job
        if future.cancelled():  # its caller gave up before it started: skip it
            continue
        try:
            result, error = work(), None
        except BaseException as exc:  # handed to the awaiting task
            result, error = None, exc
        # RuntimeError: the loop closed while this ran, so nobody is waiting.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, result, error)
    link.close_sqlite()


class Connection:
    """A `sqlite3` connection driven from asyncio through its own thread."""

    def __init__(self) -> None:
        self._link = _Link()
        self._stopped = False
        thread = threading.Thread(target=_serve, args=(self._link,), name="idlegrid-sqlite")
        thread.daemon = True
        thread.start()
        # Dropped without close() (a pool discarded mid-checkout, a cancelled close): the
        # thread still ends and closes the database.
        weakref.finalize(self, self._link.jobs.put, _STOP)

    @classmethod
    async def open(cls, database: str, **options: Any) -> Connection:
        connection = cls()
        link = connection._link
        options["check_same_thread"] = False

        def connect() -> None:
            # Kept by the thread: closed at its end even if the opener was cancelled.
            link.sqlite = sqlite3.connect(database, **options)

        try:
            await connection.call(connect)
        except BaseException:
            connection.stop()
            raise
        return connection

    async def call(self, work: Callable[[], T]) -> T:
        """Run `work` in the database thread (after what was queued before it)."""
        if self._stopped:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._link.jobs.put((loop, future, work))
        return await future

    @property
    def sqlite(self) -> sqlite3.Connection:
        sqlite = self._link.sqlite
        if sqlite is None:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        return sqlite

    @property
    def isolation_level(self) -> str | None:
        return self.sqlite.isolation_level

    async def set_isolation_level(self, value: str | None) -> None:
        sqlite = self.sqlite
        await self.call(lambda: setattr(sqlite, "isolation_level", value))

    async def create_function(self, *args: Any, **options: Any) -> None:
        sqlite = self.sqlite
        await self.call(lambda: sqlite.create_function(*args, **options))

    def cursor(self) -> Cursor:
        return Cursor(self)

    async def commit(self) -> None:
        await self.call(self.sqlite.commit)

    async def rollback(self) -> None:
        await self.call(self.sqlite.rollback)

    async def close(self) -> None:
        """Close the connection (what it had not committed is rolled back) and its thread."""
        if not self._stopped:
            try:
                await self.call(self._link.close_sqlite)
            finally:  # cancelled or not, the thread ends and closes the database
                self.stop()

    def stop(self) -> None:
        """End the thread after the work already queued, closing the connection."""
        if not self._stopped:
            self._stopped = True
            self._link.jobs.put(_STOP)


class Cursor:
    """A cursor whose statement runs and fetches all its rows in one crossing."""

    arraysize = 1

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._rows: collections.deque[Any] = collections.deque()
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def execute(self, operation: str, parameters: Sequence[Any] = ()) -> Cursor:
        sqlite = self._connection.sqlite

        def run() -> tuple[Any, int, int | None, collections.deque[Any]]:
            with contextlib.closing(sqlite.cursor()) as cursor:
                cursor.execute(operation, parameters)
                rows = collections.deque(cursor.fetchall() if cursor.description else ())
                return cursor.description, cursor.rowcount, cursor.lastrowid, rows

        self.description, self.rowcount, self.lastrowid, self._rows = await self._connection.call(
            run
        )
        return self

    async def executemany(self, operation: str, parameters: Sequence[Sequence[Any]]) -> Cursor:
        sqlite = self._connection.sqlite

        def run() -> tuple[int, int | None]:
            with contextlib.closing(sqlite.cursor()) as cursor:
                cursor.executemany(operation, parameters)
                return cursor.rowcount, cursor.lastrowid

        self.rowcount, self.lastrowid = await self._connection.call(run)
        self.description, self._rows = None, collections.deque()
        return self

    async def fetchone(self) -> Any | None:
        return self._rows.popleft() if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        size = self.arraysize if size is None else size
        return [self._rows.popleft() for _ in range(min(size, len(self._rows)))]

    async def fetchall(self) -> list[Any]:
        rows, self._rows = list(self._rows), collections.deque()
        return rows

    async def close(self) -> None:
        self._rows.clear()


class AsyncAdapt_idlegrid_connection(AsyncAdapt_terminate, AsyncAdapt_dbapi_connection):
    """SQLAlchemy's sync face of a `Connection` (it runs in SQLAlchemy's greenlet)."""

    __slots__ = ()
    _connection: Connection  # type: ignore[assignment]

    @property
    def isolation_level(self) -> str | None:
        return self._connection.isolation_level

    @isolation_level.setter
    def isolation_level(self, value: str | None) -> None:
        try:
            await_(self._connection.set_isolation_level(value))
        except Exception as error:
            self._handle_exception(error)

    def create_function(self, *args: Any, **options: Any) -> None:
        try:
            await_(self._connection.create_function(*args, **options))
        except Exception as error:
            self._handle_exception(error)

    async def _terminate_graceful_close(self) -> None:
        await self._connection.close()

    def _terminate_force_close(self) -> None:
        self._connection.stop()


class AsyncAdapt_idlegrid_dbapi(AsyncAdapt_dbapi_module):
    """The DBAPI "module" the dialect sees: sqlite3's names, `Connection` behind connect."""

    def __init__(self) -> None:
        super().__init__(sqlite3, dbapi_module=sqlite3)
        self.sqlite = sqlite3
        self.paramstyle = "qmark"
        self.has_stop = True
        for name in (
            "DatabaseError",
            "Error",
            "IntegrityError",
            "InterfaceError",
            "NotSupportedError",
            "OperationalError",
            "ProgrammingError",
            "sqlite_version",
            "sqlite_version_info",
            "PARSE_COLNAMES",
            "PARSE_DECLTYPES",
            "Binary",
        ):
            setattr(self, name, getattr(sqlite3, name))

    def connect(self, database: str, **options: Any) -> AsyncAdapt_idlegrid_connection:
        if options.pop("async_creator_fn", None) is not None:
            raise NotImplementedError("sqlite+idlegrid makes its own connections: no async_creator")
        connection = await_(Connection.open(database, **options))
        # SQLAlchemy's protocol for a driver connection also asks for open-ended
        # __getattr__/__setattr__, which `Connection` deliberately lacks.
        return AsyncAdapt_idlegrid_connection(self, connection)  # type: ignore[arg-type]


class SQLiteDialect_idlegrid(SQLiteDialect_aiosqlite):
    """SQLAlchemy's aiosqlite dialect with `Connection` as its driver."""

    driver = "idlegrid"
    supports_statement_cache = True

    @classmethod
    def import_dbapi(cls) -> AsyncAdapt_idlegrid_dbapi:  # type: ignore[override]
        return AsyncAdapt_idlegrid_dbapi()

    def retrieve_dbapi_version(self, dbapi: Any) -> Any:
        return util.parse_version_string(sqlite3.sqlite_version)


registry.register("sqlite.idlegrid", __name__, "SQLiteDialect_idlegrid")
dialect = SQLiteDialect_idlegrid
