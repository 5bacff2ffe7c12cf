"""Shared fixtures: the backends (a real SqlStore on a temporary SQLite file or in its own
PostgreSQL schema; brokers in-process or in Redis under their own key prefix), the
coordinator app under starlette's TestClient with its lifespan running, and one fixture
for each kind of grid (tests/grids.py): a `Grid` in process, an embedded grid of real
processes, a production grid of two coordinator processes on PostgreSQL and Redis.

PostgreSQL and Redis tests use the services named by IDLEGRID_TEST_POSTGRES_URL and
IDLEGRID_TEST_REDIS_URL (default: the local ones). When one is unreachable its tests are
skipped with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from grids import grid_in_process, local_grid

from idlegrid.app import create_app
from idlegrid.broker import Broker, MemoryBroker
from idlegrid.coordinator.grid import Grid
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import sql_url
from idlegrid.store.sql import SqlStore

# Small limits so the 413 paths are cheap to reach.
MAX_BLOB_BYTES = 4096
MAX_REQUEST_BYTES = 2048


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> str:
    """Every API error is JSON {"error", "message"}; return the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) >= {"error", "message"}, body
    assert isinstance(body["error"], str) and body["error"]
    assert isinstance(body["message"], str) and body["message"]
    if code is not None:
        assert body["error"] == code, body
    return str(body["message"])


# -- services -----------------------------------------------------------------------------

POSTGRES_URL = os.environ.get(
    "IDLEGRID_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("IDLEGRID_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def off_loop(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, whatever loop the caller is in."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _unreachable(service: str, url: str, error: BaseException) -> None:
    message = f"{service} at {url} is unreachable ({type(error).__name__}: {error})"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{message}; CI=true requires it")
    pytest.skip(f"{message}; start it or set IDLEGRID_TEST_{service.upper()}_URL")


async def _postgres_execute(statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL, timeout=5)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _redis_ping() -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        await client.ping()
    finally:
        await client.aclose()


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test PostgreSQL server's URL, once it answered."""
    try:
        off_loop(_postgres_execute("SELECT 1"))
    except Exception as exc:
        _unreachable("postgres", POSTGRES_URL, exc)
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis server's URL, once it answered."""
    try:
        off_loop(_redis_ping())
    except Exception as exc:
        _unreachable("redis", REDIS_URL, exc)
    return REDIS_URL


@pytest.fixture
def pg_schema(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL schema name for one test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    off_loop(_postgres_execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A fresh key prefix for one test; its keys are deleted afterwards."""
    prefix = f"idlegrid-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    off_loop(delete_keys(redis_url, prefix))


async def delete_keys(url: str, prefix: str) -> int:
    """Delete every key under `prefix` (what a Redis restart without persistence does to
    a grid's keys); how many there were."""
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        return int(await client.delete(*keys)) if keys else 0
    finally:
        await client.aclose()


# -- store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    """Where a test's store lives: a SQLAlchemy URL and, on PostgreSQL, its own schema."""

    url: str
    schema: str = ""

    def store(self) -> SqlStore:
        return SqlStore(self.url, schema=self.schema)


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    if request.param == "sqlite":
        return Database(f"sqlite+idlegrid:///{tmp_path / 'store.db'}")
    schema = request.getfixturevalue("pg_schema")
    return Database(sql_url(request.getfixturevalue("postgres_url")), schema)


@pytest.fixture
async def store(db: Database) -> AsyncIterator[SqlStore]:
    sql_store = db.store()
    await sql_store.open()
    try:
        yield sql_store
    finally:
        await sql_store.close()


# -- broker -------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """Every broker implementation, empty, with its own key space."""
    instance: Broker
    if request.param == "memory":
        instance = MemoryBroker()
    else:
        from idlegrid.broker.redis import RedisBroker

        url = request.getfixturevalue("redis_url")
        instance = RedisBroker(url, prefix=request.getfixturevalue("redis_prefix"))
    try:
        yield instance
    finally:
        await instance.close()


# -- coordinator app ------------------------------------------------------------------------


@pytest.fixture
def settings(tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        data_dir=tmp_path / "coordinator",
        max_blob_bytes=MAX_BLOB_BYTES,
        max_request_bytes=MAX_REQUEST_BYTES,
        # The monitor's periodic passes stay out of the way; its startup pass still runs.
        monitor_interval_s=3600.0,
        # One mechanism at a time: these tests' nodes share an account and an address,
        # and a job has one replica unless it asks for more. tests/verification/test_verification.py
        # runs the shipped defaults (3 replicas on distinct accounts).
        default_replication=1,
        distinct_accounts=False,
        distinct_networks=False,
    )


@dataclass
class Api:
    """A TestClient with the admin's token and helpers to make more tokens."""

    client: TestClient
    settings: CoordinatorSettings
    admin_token: str

    @property
    def admin(self) -> dict[str, str]:
        return bearer(self.admin_token)

    def token(self, *, account: str | None = None, kind: str = "api") -> str:
        body: dict[str, Any] = {"kind": kind}
        if account is not None:
            body["account"] = account
        response = self.client.post("/v1/tokens", json=body, headers=self.admin)
        assert response.status_code == 201, response.text
        return str(response.json()["token"])

    def upload(self, data: bytes, token: str | None = None) -> str:
        blob_hash = sha(data)
        response = self.client.put(
            f"/v1/blobs/{blob_hash}", content=data, headers=bearer(token or self.admin_token)
        )
        assert response.status_code == 201, response.text
        return blob_hash

    def submit(self, token: str, **body: Any) -> dict[str, Any]:
        response = self.client.post("/v1/jobs", json=body, headers=bearer(token))
        assert response.status_code == 201, response.text
        return dict(response.json())

    def job(self, token: str, job_id: int) -> dict[str, Any]:
        response = self.client.get(f"/v1/jobs/{job_id}", headers=bearer(token))
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture
def api(settings: CoordinatorSettings) -> Iterator[Api]:
    with TestClient(create_app(settings)) as client:
        admin_token = settings.admin_token_file.read_text().strip()
        yield Api(client=client, settings=settings, admin_token=admin_token)


# -- grids ----------------------------------------------------------------------------------


@pytest.fixture
async def in_process_grid(store: SqlStore, tmp_path: Path) -> AsyncIterator[Callable[..., Grid]]:
    """Make coordinator `Grid`s on the test's store (`grids.grid_in_process`, with the
    same arguments less the store and folder); each is closed after the test, with the
    broker made for it."""
    made: list[tuple[Grid, bool]] = []

    def make(settings: CoordinatorSettings | None = None, **options: Any) -> Grid:
        grid = grid_in_process(store, tmp_path, settings, **options)
        made.append((grid, "broker" not in options))
        return grid

    yield make
    for grid, own_broker in reversed(made):
        await grid.aclose()
        if own_broker:
            await grid.broker.close()


@pytest.fixture
def embedded_grid(tmp_path: Path) -> Iterator[Callable[..., LocalGrid]]:
    """Start embedded grids of real processes (SQLite, the in-process broker):
    `embedded_grid(**options)` takes `grids.local_grid`'s options and returns the grid
    started; every process it started is stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(root: Path = tmp_path, **options: Any) -> LocalGrid:
            return stack.enter_context(local_grid(root, **options))

        yield start


@pytest.fixture
def production_grid(
    tmp_path: Path, postgres_url: str, pg_schema: str, redis_url: str, redis_prefix: str
) -> Iterator[Callable[..., LocalGrid]]:
    """Start production grids: `coordinators` (default 2) `idlegrid serve` processes on
    this test's PostgreSQL schema and its own Redis key prefix (or the `redis` and
    `redis_prefix` given), backups off (these tests count tasks), other options as
    `grids.local_grid`'s. Everything started is stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(*, coordinators: int = 2, **options: Any) -> LocalGrid:
            options = {
                "redis": redis_url,
                "redis_prefix": redis_prefix,
                "backups": False,
                **options,
            }
            grid = stack.enter_context(
                local_grid(tmp_path, database=postgres_url, database_schema=pg_schema, **options)
            )
            for _ in range(coordinators - 1):
                grid.add_coordinator()
            return grid

        yield start
