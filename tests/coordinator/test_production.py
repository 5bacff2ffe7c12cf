"""Production mode end to end: two `idlegrid serve` processes sharing one PostgreSQL schema
and one Redis key prefix, `idlegrid worker` processes spread over both.

Each test checks what the SQL truth says afterwards: every shard done, and exactly one
counted result per shard (no shard got more live replicas than it needed).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import delete_keys, off_loop
from grids import query_of, spread_workers
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

WORKERS = 2  # two task slots each: claims race across both processes
MIN_LEASE_S = 60.0
# Well under the lease: a task stranded by a failure (claimed, never sent) would only come
# back when its lease expired, and fail the test instead of slowing it.
FINISH_S = 45.0


@pytest.fixture
def grid(production_grid: Callable[..., LocalGrid]) -> LocalGrid:
    grid = production_grid(min_lease_s=MIN_LEASE_S)
    # Half the workers prefer the first coordinator, half the second; each fails over.
    spread_workers(grid, WORKERS, kinds="sleep", benchmark=False, slots=2)
    return grid


def _query(grid: LocalGrid, sql: str) -> list[Any]:
    return query_of(grid)(sql)


def _assert_every_shard_counted_once(grid: LocalGrid, shards: int) -> None:
    rows = _query(grid, "SELECT state, canonical_task_id FROM shards")
    assert len(rows) == shards
    assert all(r["state"] == "done" and r["canonical_task_id"] is not None for r in rows)
    counted = _query(
        grid,
        "SELECT shard_id, COUNT(*) AS n FROM tasks WHERE state = 'completed' "
        "AND (outcome IS NULL OR outcome = 'valid') GROUP BY shard_id",
    )
    assert len(counted) == shards and all(r["n"] == 1 for r in counted)


def _connected_here(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    [line] = [ln for ln in text.splitlines() if ln.startswith("idlegrid_connected_nodes ")]
    return int(float(line.split()[1]))


def _expected(tasks: int) -> list[dict[str, object]]:
    return [json.loads(_digest(i)) for i in range(tasks)]


def test_two_coordinators_complete_every_shard_exactly_once(grid: LocalGrid) -> None:
    assert [_connected_here(url) for url in grid.urls] == [WORKERS // 2, WORKERS // 2]
    tasks = 40
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 0.05})
        info = job.wait(timeout=FINISH_S)
        assert job.result() == _expected(tasks)
    assert info["state"] == "completed"
    _assert_every_shard_counted_once(grid, tasks)
    # No shard was given out twice: one task per shard, and both processes dispatched.
    assert _query(grid, "SELECT COUNT(*) AS n FROM tasks")[0]["n"] == tasks
    owners = _query(
        grid, "SELECT COUNT(DISTINCT node_id) AS n FROM tasks WHERE state = 'completed'"
    )
    assert owners[0]["n"] == WORKERS


def test_a_killed_coordinator_s_workers_fail_over_and_the_job_completes(
    grid: LocalGrid,
) -> None:
    doomed = grid.urls[1]
    tasks = 24
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 0.4})
        wait_until(
            lambda: 2 <= job.info()["shards_done"] < tasks - 8, "partial progress", timeout_s=60
        )
        grid.kill_coordinator(doomed)
        # Its workers reconnect to the survivor; their running tasks finish and count.
        wait_until(lambda: _connected_here(grid.url) == WORKERS, "fail-over", timeout_s=30)
        info = job.wait(timeout=FINISH_S)
        assert job.result() == _expected(tasks)
    assert info["state"] == "completed"
    _assert_every_shard_counted_once(grid, tasks)


def test_redis_losing_everything_mid_job_loses_no_task(
    grid: LocalGrid, redis_url: str, redis_prefix: str
) -> None:
    tasks = 30
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 0.3})
        wait_until(
            lambda: 2 <= job.info()["shards_done"] < tasks - 10, "partial progress", timeout_s=60
        )
        # What a Redis restart without persistence does to this grid: every key gone.
        assert off_loop(delete_keys(redis_url, redis_prefix)) > 0
        info = job.wait(timeout=FINISH_S)
        assert job.result() == _expected(tasks)
    assert info["state"] == "completed"
    _assert_every_shard_counted_once(grid, tasks)
    # The coordinators rebuilt the queue marker and their nodes' connections.
    assert off_loop(_count_keys(redis_url, redis_prefix + "ready:built")) == 1
    wait_until(lambda: _grid_connected(grid.url) == WORKERS, "connections rebuilt", timeout_s=10)


def _grid_connected(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    [line] = [ln for ln in text.splitlines() if ln.startswith("idlegrid_grid_connected_nodes ")]
    return int(float(line.split()[1]))


async def _count_keys(url: str, pattern: str) -> int:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        return len([key async for key in client.scan_iter(match=pattern)])
    finally:
        await client.aclose()


def test_production_settings_come_from_the_environment(
    tmp_path: Path, postgres_url: str, pg_schema: str, redis_url: str, redis_prefix: str
) -> None:
    """IDLEGRID_DATABASE_URL / _SCHEMA / IDLEGRID_REDIS_URL / _PREFIX configure `serve`."""
    env = {
        "IDLEGRID_DATABASE_URL": postgres_url,
        "IDLEGRID_DATABASE_SCHEMA": pg_schema,
        "IDLEGRID_REDIS_URL": redis_url,
        "IDLEGRID_REDIS_PREFIX": redis_prefix,
    }
    with LocalGrid(tmp_path, extra_env=env, replication=1) as local:
        tables = off_loop(_tables(postgres_url, pg_schema))
        marker = off_loop(_count_keys(redis_url, redis_prefix + "ready:built"))
        metrics = httpx.get(f"{local.url}/metrics", timeout=10).text
    assert {"accounts", "jobs", "shards", "tasks"} <= tables
    assert marker == 1
    assert 'idlegrid_tasks{state="ready"} 0' in metrics


async def _tables(url: str, schema: str) -> set[str]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1", schema
        )
    finally:
        await conn.close()
    return {r["table_name"] for r in rows}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of this test's own, that the test may restart (no persistence)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (needed to restart one)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = _RedisServer(binary, port, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class _RedisServer:
    def __init__(self, binary: str, port: int, root: Path) -> None:
        self.binary, self.port, self.root = binary, port, root
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: _answers(self.port), "redis-server to start", timeout_s=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _lost_subscriptions(log: Path) -> int:
    """How often a coordinator's log says its Redis subscription was lost."""
    return log.read_text().count("subscription to")


def test_a_redis_restart_mid_job_loses_no_task(
    private_redis: Any, production_grid: Callable[..., LocalGrid]
) -> None:
    grid = production_grid(
        min_lease_s=MIN_LEASE_S, backups=True, redis=private_redis.url, redis_prefix="idlegrid:"
    )
    spread_workers(grid, 2, kinds="sleep", benchmark=False, slots=2)
    tasks = 30
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 0.3})
        wait_until(lambda: 2 <= job.info()["shards_done"] < tasks - 10, "progress", timeout_s=60)
        logs = [grid.root / "coordinator.log", grid.root / "coordinator-2.log"]
        before = {log: _lost_subscriptions(log) for log in logs}
        private_redis.stop()  # SIGKILL: everything in it is gone
        wait_until(
            lambda: all(_lost_subscriptions(log) > n for log, n in before.items()),
            "both coordinators to lose Redis",
        )
        private_redis.start()
        info = job.wait(timeout=FINISH_S)
        assert job.result() == _expected(tasks)
    assert info["state"] == "completed"
    _assert_every_shard_counted_once(grid, tasks)
    wait_until(lambda: _grid_connected(grid.url) == 2, "connections rebuilt", timeout_s=20)
