"""Dashboard pages on a big store: p50 and p95 render time of every page.

Seeds a store (default 100,000 accounts, 5,000 teams, 10,000 nodes, 1,000,000 tasks, and
30 days of per-hour and per-node-day aggregates), then asks each page `--requests` times
through the coordinator app in this process (starlette's TestClient: the time includes
routing, the queries and the templates, not a network) and prints its p50 and p95, and
the CPU time a request took in this process. The last line is `pages: N p95_ms: X`, X
the worst page's p95.

    python benchmarks/dashboard.py                          # SQLite in a temporary dir
    python benchmarks/dashboard.py --database postgresql://postgres@127.0.0.1/test
    python benchmarks/dashboard.py --scale 0.1              # a tenth of every count
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import insert, text

from idlegrid.app import create_app
from idlegrid.dashboard import exports
from idlegrid.dashboard.accounts import set_login
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import sql_url
from idlegrid.store.schema import (
    accounts,
    grid_hourly,
    jobs,
    node_daily,
    nodes,
    shards,
    tasks,
    teams,
)
from idlegrid.store.sql import SqlStore
from idlegrid.verification.credit import CreditTotals, rank_key

CHUNK = 5000
SEEDED = ("accounts", "teams", "nodes", "jobs", "shards", "tasks", "grid_hourly", "node_daily")
PASSWORD = "a long seeding passphrase"
SHARDS_PER_JOB = 250
TASKS_PER_SHARD = 4


def _credit(rng: random.Random, now: float) -> dict[str, Any]:
    total = rng.paretovariate(1.2) * 10
    totals = CreditTotals(total, total * rng.random() * 0.3, now - rng.random() * 30 * 86_400)
    return {
        "credit_total": totals.total,
        "credit_decayed": totals.decayed,
        "credit_updated_at": totals.updated_at,
        "credit_rank": rank_key(totals),
        "validated_total": int(total * 3),
    }


async def _insert(conn: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    for start in range(0, len(rows), CHUNK):
        await conn.execute(insert(table), rows[start : start + CHUNK])


async def seed(store: SqlStore, *, scale: float, now: float) -> None:
    """Fill the store; the first account ("bench") is the one the benchmark signs in as."""
    rng = random.Random(7)
    n_accounts, n_teams = int(100_000 * scale), int(5_000 * scale)
    n_nodes, n_tasks = int(10_000 * scale), int(1_000_000 * scale)
    async with store.engine.begin() as conn:
        await _insert(
            conn,
            accounts,
            [
                {"id": i, "name": "bench" if i == 1 else f"user-{i}", "is_admin": i == 1,
                 "role": "admin" if i == 1 else "volunteer", "created_at": now,
                 "team_id": rng.randint(1, n_teams) if i % 2 and n_teams else None,
                 **_credit(rng, now)}
                for i in range(1, n_accounts + 1)
            ],
        )  # fmt: skip
        await _insert(
            conn,
            teams,
            [
                {"id": i, "name": f"team-{i}", "description": "", "founder_id": 1,
                 "members": 20, "created_at": now, **_credit(rng, now)}
                for i in range(1, n_teams + 1)
            ],
        )  # fmt: skip
        backends = ["cpu", "cpu", "cpu", "cuda", "cuda", "mps", "rocm"]
        await _insert(
            conn,
            nodes,
            [
                {"id": i, "account_id": 1 if i <= 20 else rng.randint(2, n_accounts),
                 "node_key": uuid.uuid4().hex, "name": f"node-{i}",
                 "state": "online" if rng.random() < 0.3 else "offline", "worker_version": "0.1.0",
                 "hardware": {"cpu_model": "Ryzen 7", "cpu_cores": 8, "memory_mb": 32768,
                              "gpus": []},
                 "benchmark": {"backend": rng.choice(backends), "matmul_gflops": 200.0},
                 "kinds": ["embed-text"], "slots": 1, "address": "10.0.0.1", "network": "10.0.0",
                 "created_at": now, "last_seen_at": now, "connected_seconds": 3600.0,
                 **_credit(rng, now)}
                for i in range(1, n_nodes + 1)
            ],
        )  # fmt: skip
        await _seed_work(conn, rng, n_tasks=n_tasks, n_nodes=n_nodes, now=now)
        await _insert(
            conn,
            grid_hourly,
            [{"hour": int(now // 3600) - h, "validated": 900, "flops": 4e15, "credit": 90.0}
             for h in range(30 * 24)],
        )  # fmt: skip
        await _insert(
            conn,
            node_daily,
            [{"node_id": n, "day": int(now // 86_400) - d, "validated": 30, "flops": 1e14,
              "credit": 2.0}
             for n in range(1, n_nodes + 1) for d in range(30)],
        )  # fmt: skip


async def _seed_work(
    conn: Any, rng: random.Random, *, n_tasks: int, n_nodes: int, now: float
) -> None:
    n_shards = max(1, n_tasks // TASKS_PER_SHARD)
    n_jobs = max(1, n_shards // SHARDS_PER_JOB)
    await _insert(
        conn,
        jobs,
        [
            {"id": j, "account_id": 1, "kind": "sleep", "params": {"tasks": SHARDS_PER_JOB},
             "inputs": {}, "state": "completed" if j > 3 else "running", "replication": 3,
             "min_quorum": 2, "max_attempts": 10, "priority": 0, "shards_total": SHARDS_PER_JOB,
             "items_total": SHARDS_PER_JOB, "created_at": now, "started_at": now}
            for j in range(1, n_jobs + 1)
        ],
    )  # fmt: skip
    shard_rows, task_rows = [], []
    for s in range(1, n_shards + 1):
        job_id = (s - 1) // SHARDS_PER_JOB + 1
        shard_rows.append(
            {"id": s, "job_id": job_id, "idx": (s - 1) % SHARDS_PER_JOB,
             "state": "done" if job_id > 3 else "open", "input_hash": "0" * 64, "input_size": 10,
             "item_count": 1, "cost_flops": 1e12, "target": 3, "quorum": 2}
        )  # fmt: skip
        for _ in range(TASKS_PER_SHARD):
            task_rows.append(
                {"shard_id": s, "job_id": job_id, "node_id": rng.randint(1, n_nodes),
                 "state": "completed" if job_id > 3 else "assigned", "created_at": now,
                 "credit": 0.002}
            )  # fmt: skip
        if len(task_rows) >= 50_000:
            await _insert(conn, shards, shard_rows)
            await _insert(conn, tasks, task_rows)
            shard_rows, task_rows = [], []
    await _insert(conn, shards, shard_rows)
    await _insert(conn, tasks, task_rows)


def _pages(client: TestClient) -> dict[str, str]:
    board = client.get("/leaderboard/accounts").text
    team = re.search(r'href="/teams/(\d+)"', client.get("/teams").text)
    user = re.search(r'href="/users/(\d+)"', board)
    return {
        "status": "/",
        "accounts by total": "/leaderboard/accounts",
        "accounts by recent, page 200": "/leaderboard/accounts?sort=recent&page=200",
        "teams by recent": "/leaderboard/teams?sort=recent",
        "nodes by total": "/leaderboard/nodes",
        "teams": "/teams",
        "team": f"/teams/{team.group(1) if team else 1}",
        "profile": f"/users/{user.group(1) if user else 1}",
        "node": "/nodes/1",
        "my nodes": "/my/nodes",
        "account": "/account",
        "jobs": "/research/jobs",
        "job": "/research/jobs/1",
        "admin": "/admin",
        "exports": "/stats",
    }


def measure(client: TestClient, *, requests: int) -> list[tuple[str, float, float, float, float]]:
    """Each page's p50, p95 and slowest wall time and median CPU time of this process (ms).

    Pages are asked in turn, round after round, so a burst of load from elsewhere on a
    shared machine falls on every page alike rather than on one. CPU time counts this
    process only (the app, its queries under SQLite's driver thread, the templates), not
    a PostgreSQL server's; unlike wall time it hardly grows when other processes compete
    for the cores.
    """
    pages = _pages(client)
    walls: dict[str, list[float]] = {name: [] for name in pages}
    cpus: dict[str, list[float]] = {name: [] for name in pages}
    for _ in range(requests):
        for name, path in pages.items():
            started, cpu = time.perf_counter(), time.process_time()
            response = client.get(path)
            walls[name].append((time.perf_counter() - started) * 1000)
            cpus[name].append((time.process_time() - cpu) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{path}: {response.status_code}")
    rows = []
    for name, times in walls.items():
        times.sort()
        p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
        rows.append((name, statistics.median(times), p95, times[-1], statistics.median(cpus[name])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default="", help="postgresql://... (default: SQLite)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of every count")
    parser.add_argument("--requests", type=int, default=40, help="requests per page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idlegrid-dashboard-") as tmp:
        schema = f"bench_{uuid.uuid4().hex[:8]}" if args.database else ""
        url = sql_url(args.database) if args.database else f"sqlite+idlegrid:///{tmp}/store.db"
        settings = CoordinatorSettings(
            data_dir=Path(tmp), database_url=url, database_schema=schema,
            monitor_interval_s=3600.0,
        )  # fmt: skip
        now = time.time()
        started = time.perf_counter()
        asyncio.run(_prepare(url, schema, scale=args.scale, now=now))
        print(f"seeded in {time.perf_counter() - started:.0f} s (scale {args.scale})")
        try:
            with TestClient(create_app(settings)) as client:
                _wait_for_exports(Path(tmp))
                _sign_in(client)
                rows = measure(client, requests=args.requests)
        finally:
            if schema:
                asyncio.run(_drop(url, schema))
    for name, p50, p95, slowest, cpu in rows:
        print(
            f"{name:30s} p50 {p50:7.1f} ms  p95 {p95:7.1f} ms  max {slowest:7.1f} ms"
            f"  cpu {cpu:6.1f} ms"
        )
    print(f"pages: {len(rows)} p95_ms: {max(row[2] for row in rows):.1f}")


def _wait_for_exports(data_dir: Path) -> None:
    """The daily statistics exports are written at start (there are none yet): a pass
    over every account, team and node once a day, timed here, not mixed into the pages."""
    started = time.perf_counter()
    while len(exports.listing(data_dir)) < len(exports.FILES):
        if time.perf_counter() - started > 900:
            raise RuntimeError("the statistics exports were not written in 15 minutes")
        time.sleep(0.2)
    print(f"daily exports written in {time.perf_counter() - started:.1f} s (at start)")


def _sign_in(client: TestClient) -> None:
    page = client.get("/signin").text
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None
    done = client.post(
        "/signin",
        data={"csrf": token.group(1), "login": "bench", "password": PASSWORD},
        follow_redirects=False,
    )
    if done.status_code != 303:
        raise RuntimeError(f"sign-in failed: {done.status_code}")


async def _prepare(url: str, schema: str, *, scale: float, now: float) -> None:
    store = SqlStore(url, schema=schema)
    await store.open()
    try:
        await seed(store, scale=scale, now=now)
        await set_login(store, "bench", email=None, password=PASSWORD, role="admin")
        if not store.is_sqlite:
            async with store.engine.begin() as conn:
                for table in ("accounts", "teams", "nodes", "jobs", "shards", "tasks"):
                    await conn.execute(
                        text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'),"
                             f" (SELECT max(id) FROM {table}))")
                    )  # fmt: skip
            # What autovacuum would have done to tables this size by now: statistics, and
            # the visibility map that lets counts and id lists read indexes alone.
            async with store.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                for table in SEEDED:
                    await conn.execute(text(f"VACUUM ANALYZE {table}"))
    finally:
        await store.close()


async def _drop(url: str, schema: str) -> None:
    store = SqlStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        await store.close()


if __name__ == "__main__":
    main()
