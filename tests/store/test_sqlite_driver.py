"""The store's SQLite driver (`sqlite+idlegrid`): DBAPI behaviour through SQLAlchemy, one
thread crossing a statement, and clean failure, cancellation and shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import eventually
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idlegrid.store import SqlStore, sql_url, sqlite_driver
from idlegrid.store.sqlite_driver import Connection

metadata = MetaData()
items = Table(
    "items",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String, unique=True, nullable=False),
    Column("size", Integer, nullable=False),
)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(f"sqlite+idlegrid:///{tmp_path / 'driver.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    try:
        yield engine
    finally:
        await engine.dispose()


def driver_threads() -> set[threading.Thread]:
    """The driver's threads alive now. A test counts those it starts, not all of them:
    another test's connection in this process may end its thread at any time (when
    the garbage collector gets to it)."""
    return {t for t in threading.enumerate() if t.name == "idlegrid-sqlite"}


async def wait_for_threads(before: set[threading.Thread]) -> None:
    """Until none of the driver threads started since `before` is left: a closed
    connection's thread ends soon after."""
    started = driver_threads() - before
    await eventually(
        lambda: not any(t.is_alive() for t in started),
        f"the {len(started)} driver thread(s) started here to end",
        timeout_s=10,
    )


def test_sqlite_urls_get_the_driver() -> None:
    assert sql_url("sqlite:///data/x.db") == "sqlite+idlegrid:///data/x.db"
    assert sql_url("sqlite+aiosqlite:///x.db") == "sqlite+aiosqlite:///x.db"


async def test_insert_select_update_and_many(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        result = await conn.execute(insert(items).values(name="a", size=1))
        assert result.inserted_primary_key == (1,)
        await conn.execute(insert(items), [{"name": f"n{i}", "size": i} for i in range(5)])
        changed = await conn.execute(update(items).where(items.c.size < 3).values(size=0))
        assert changed.rowcount == 4  # a, n0, n1, n2
    async with engine.connect() as conn:
        rows = (await conn.execute(select(items.c.name, items.c.size).order_by(items.c.id))).all()
        assert [tuple(row) for row in rows] == [
            ("a", 0),
            ("n0", 0),
            ("n1", 0),
            ("n2", 0),
            ("n3", 3),
            ("n4", 4),
        ]
        assert (await conn.execute(select(items).where(items.c.size > 99))).first() is None
        streamed = await conn.stream(select(items.c.name).order_by(items.c.id))
        assert [row.name async for row in streamed] == ["a", "n0", "n1", "n2", "n3", "n4"]


async def test_rollback_discards_and_commit_keeps(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(insert(items).values(name="gone", size=1))
        await conn.rollback()
        await conn.execute(insert(items).values(name="kept", size=2))
        await conn.commit()
    async with engine.connect() as conn:
        names = (await conn.execute(select(items.c.name))).scalars().all()
    assert names == ["kept"]


async def test_errors_are_dbapi_errors_and_the_connection_survives(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(insert(items).values(name="a", size=1))
        with pytest.raises(IntegrityError):
            await conn.execute(insert(items).values(name="a", size=2))
        with pytest.raises(OperationalError, match="no such table"):
            await conn.execute(text("SELECT * FROM missing"))
        assert (await conn.execute(select(items.c.size))).scalar_one() == 1


async def test_a_statement_is_one_crossing(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    crossings = 0
    real_call = Connection.call

    async def counted(self: Connection, work: Callable[[], Any]) -> Any:
        nonlocal crossings
        crossings += 1
        return await real_call(self, work)

    async with engine.connect() as conn:
        await conn.execute(select(items))  # pool and statement cache warm
        monkeypatch.setattr(Connection, "call", counted)
        await conn.execute(insert(items).values(name="a", size=1))
        assert crossings == 1
        rows = (await conn.execute(select(items))).all()
        assert len(rows) == 1 and crossings == 2
        await conn.commit()
        assert crossings == 3


def _holding(gate: threading.Event, held: threading.Event) -> Callable[[], bool]:
    """Work that holds the database thread until `gate` opens, and says so in `held`."""

    def hold() -> bool:
        held.set()
        return gate.wait()

    return hold


def _queued(connection: Connection) -> int:
    """Calls waiting for the database thread."""
    return connection._link.jobs.qsize()


async def test_a_cancelled_statement_leaves_the_connection_usable(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, Connection)
        gate, held = threading.Event(), threading.Event()
        # Hold the database thread so the next statement waits in its queue.
        blocked = asyncio.create_task(driver.call(_holding(gate, held)))
        await eventually(held.is_set, "the database thread to be held")
        waiting = asyncio.create_task(conn.execute(text("SELECT 1")))
        await eventually(lambda: _queued(driver) == 1, "the statement to queue")
        waiting.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await blocked is True
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT 2"))).scalar_one() == 2


async def test_closed_connection_refuses_work_and_threads_end(tmp_path: Path) -> None:
    before = driver_threads()
    connection = await Connection.open(str(tmp_path / "c.db"))
    assert len(driver_threads() - before) == 1
    await connection.close()
    with pytest.raises(sqlite_driver.sqlite3.ProgrammingError):
        await connection.call(lambda: None)
    await wait_for_threads(before)


async def test_dispose_ends_the_pool_threads(tmp_path: Path) -> None:
    before = driver_threads()
    engine = create_async_engine(f"sqlite+idlegrid:///{tmp_path / 'pool.db'}")

    async def one(value: int) -> int:
        async with engine.connect() as conn:
            await asyncio.sleep(0.01)  # held a moment, so that the others need connections too
            return int((await conn.execute(text(f"SELECT {value}"))).scalar_one())

    assert await asyncio.gather(*(one(i) for i in range(4))) == [0, 1, 2, 3]
    assert len(driver_threads() - before) >= 2
    await engine.dispose()
    await wait_for_threads(before)


async def test_bad_path_is_an_operational_error(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+idlegrid:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    try:
        with pytest.raises(OperationalError, match="unable to open"):
            async with engine.connect():
                pass
    finally:
        await engine.dispose()


async def test_the_store_still_runs_on_aiosqlite(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}")
    await store.open()
    try:
        account = await store.accounts.create_account("ada", is_admin=False, now=1.0)
        assert (await store.accounts.get_account("ada")) == account
    finally:
        await store.close()


async def test_a_cancelled_close_still_ends_the_thread(tmp_path: Path) -> None:
    before = driver_threads()
    connection = await Connection.open(str(tmp_path / "c.db"))
    gate, held = threading.Event(), threading.Event()
    busy = asyncio.create_task(connection.call(_holding(gate, held)))
    await eventually(held.is_set, "the database thread to be held")
    closing = asyncio.create_task(connection.close())
    await eventually(lambda: _queued(connection) == 1, "the close to queue")
    closing.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert await busy is True
    await wait_for_threads(before)


async def test_connections_nobody_closed_end_their_threads_when_collected(
    tmp_path: Path,
) -> None:
    before = driver_threads()

    async def use_and_drop() -> None:
        engine = create_async_engine(f"sqlite+idlegrid:///{tmp_path / 'dropped.db'}")

        async def one(value: int) -> None:
            async with engine.connect() as conn:
                await asyncio.sleep(0.01)  # held a moment, so that the others need connections
                await conn.execute(text(f"SELECT {value}"))

        await asyncio.gather(*(one(i) for i in range(3)))
        assert driver_threads() - before  # and the engine is never disposed

    await use_and_drop()
    gc.collect()
    await wait_for_threads(before)
