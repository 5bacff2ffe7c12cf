"""The grids the tests run, each kind set up in one place (conftest.py makes them fixtures).

- In process: `grid_in_process` is a coordinator's `Grid` in the test's event loop, on a
  store the test opened, with an in-process broker; `serving` and `serving_in_thread` run
  the whole app with uvicorn on a real socket in this process (conftest's `api` fixture
  is the app under TestClient).
- Embedded, real processes: `idlegrid serve` on SQLite and its in-process broker, and
  `idlegrid worker` processes (`LocalGrid`), with `QUICK` timings unless a test says
  otherwise.
- Production, real processes: two (or more) `idlegrid serve` processes on one PostgreSQL
  schema and one Redis key prefix; `spread_workers` starts workers that prefer one
  coordinator or the other and fail over.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from idlegrid.app import create_app
from idlegrid.blobs.files import BlobStore
from idlegrid.broker import Broker, MemoryBroker
from idlegrid.coordinator.grid import Grid
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.sql import SqlStore

Query = Callable[[str], list[dict[str, Any]]]

# Timings that keep process tests short: a silent node is noticed within seconds, and a
# task's lease outlasts any test that does not mean to see one expire.
QUICK: dict[str, Any] = {"heartbeat_s": 0.5, "node_timeout_s": 3.0, "min_lease_s": 60.0}

# Speculative copies off: tests that count one task per shard must see no backup task.
NO_BACKUPS = {"IDLEGRID_BACKUPS": "false"}


# -- in process ---------------------------------------------------------------------------


def grid_in_process(
    store: SqlStore,
    root: Path,
    settings: CoordinatorSettings | None = None,
    *,
    broker: Broker | None = None,
    clock: Callable[[], float] | None = None,
    max_blob_bytes: int = 1 << 20,
) -> Grid:
    """A coordinator's `Grid` on `store`, its blobs under `root`/blobs; an in-process
    broker unless one is given. The caller closes it (and a broker it gave)."""
    return Grid(
        settings=settings or CoordinatorSettings(data_dir=root / "coordinator"),
        store=store,
        broker=broker or MemoryBroker(),
        blobs=BlobStore(root / "blobs", max_bytes=max_blob_bytes),
        **({"clock": clock} if clock is not None else {}),
    )


def _bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def serving(
    settings: CoordinatorSettings, server: uvicorn.Server | None = None
) -> AsyncIterator[str]:
    """The app (or `server`) served by uvicorn in this event loop; its URL once started."""
    from helpers import eventually

    server = server or uvicorn.Server(
        uvicorn.Config(create_app(settings), lifespan="on", log_level="warning")
    )
    sock = _bound_socket()
    running = asyncio.create_task(server.serve(sockets=[sock]))

    def started() -> bool:
        assert not running.done(), "the coordinator did not start"
        return bool(server.started)

    try:
        await eventually(started, "the coordinator to start", timeout_s=30)
        yield _url(sock)
    finally:
        server.should_exit = True
        await running
        sock.close()


@contextlib.contextmanager
def serving_in_thread(
    settings: CoordinatorSettings, server: uvicorn.Server | None = None
) -> Iterator[str]:
    """`serving` for a test that blocks: uvicorn runs in a thread with its own loop."""
    from helpers import wait_until

    server = server or uvicorn.Server(
        uvicorn.Config(create_app(settings), lifespan="on", log_level="warning")
    )
    sock = _bound_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "the coordinator did not start"
        return bool(server.started)

    try:
        wait_until(started, "the coordinator to start", timeout_s=30, poll_s=0.02)
        yield _url(sock)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


# -- real processes -----------------------------------------------------------------------


def local_grid(
    root: Path,
    *,
    backups: bool = True,
    extra_env: dict[str, str] | None = None,
    **options: Any,
) -> LocalGrid:
    """A `LocalGrid` (not started) with `QUICK` timings and one replica per shard, unless
    `options` say otherwise; `backups=False` turns speculative copies off."""
    env = {**({} if backups else NO_BACKUPS), **(extra_env or {})}
    return LocalGrid(root, **{**QUICK, "replication": 1, **options, "extra_env": env})


def spread_workers(grid: LocalGrid, count: int, **worker: Any) -> None:
    """Start `count` workers w0, w1, ...: the even ones prefer the first coordinator, the
    odd ones the second, and each fails over to the other; wait until all are connected."""
    first, second = grid.urls[:2]
    for i in range(count):
        servers = [first, second] if i % 2 == 0 else [second, first]
        grid.start_worker(f"w{i}", servers=servers, **worker)
    grid.wait_for_nodes(count)


def query_of(grid: LocalGrid) -> Query:
    """Run SQL on the grid's store (its SQLite file, or its PostgreSQL schema)."""
    if not grid.database:
        path = grid.data_dir / "idlegrid.db"

        def sqlite_query(sql: str) -> list[dict[str, Any]]:
            conn = sqlite3.connect(path, timeout=30)
            conn.row_factory = sqlite3.Row
            try:
                return [dict(row) for row in conn.execute(sql).fetchall()]
            finally:
                conn.close()

        return sqlite_query

    async def fetch(sql: str) -> list[dict[str, Any]]:
        import asyncpg

        conn = await asyncpg.connect(
            grid.database, server_settings={"search_path": grid.database_schema}
        )
        try:
            return [dict(row) for row in await conn.fetch(sql)]
        finally:
            await conn.close()

    from conftest import off_loop

    return lambda sql: list(off_loop(fetch(sql)))
