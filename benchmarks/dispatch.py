"""Dispatch rate of no-op tasks: the grid against arq, in one run.

    .venv/bin/python benchmarks/dispatch.py [--tasks 2000] [--workers 2] [--slots 8]
        [--prefetch 8] [--kind noop] [--redis redis://127.0.0.1:6379/0]
        [--database postgresql://postgres@127.0.0.1:5432/test]

Grid: a `LocalGrid` (one `idlegrid serve` process, SQLite store with synchronous=FULL,
in-process broker; with `--database`, production mode instead: PostgreSQL in a fresh
schema and the `--redis` Redis under a fresh key prefix, both removed afterwards) and
`--workers` `idlegrid worker` processes with `--slots` slots each
and a work buffer of `--prefetch` tasks each (`idlegrid worker --prefetch`),
over real WebSockets, with leases, result checks and verification at replication 1 (arq
has no redundancy). After a warm-up job the script submits one job of `--tasks` no-op
tasks and times it from just before the submit request to the job's `finished_at`.

arq: the same number of no-op jobs (`async def noop(ctx): return None`) enqueued on the
local Redis under a fresh queue name, then one `arq` worker process (arq's defaults,
`max_jobs=10`, burst mode, JSON serializer instead of arq's default pickle) runs them.
Timed the same way, submit to all done: enqueueing plus the worker's time from its
`on_startup` hook to the last job's `finish_time` (the interpreter's start-up before the
hook is left out: the grid's workers were connected before its clock started too).

Both run alternately `--rounds` times; the medians are compared. Last line:
`ratio: X.XX` (grid tasks/s over arq jobs/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from idlegrid.devtools.localgrid import LocalGrid

WARMUP_TASKS = 200
STARTED_SUFFIX = ":bench-started"
CPU_SUFFIX = ":bench-cpu"  # the arq worker's CPU seconds from on_startup to on_shutdown


# -- grid ------------------------------------------------------------------------------------


def grid_round(grid: LocalGrid, kind: str, tasks: int) -> tuple[float, float]:
    """Seconds from submitting `tasks` no-op tasks to the job's completion, and the CPU
    seconds the coordinator and workers used meanwhile."""
    processes = {
        "coordinator": [grid.coordinator.pid] if grid.coordinator else [],
        "workers": [worker.pid for worker in grid.workers],
    }
    before = {group: _cpu_seconds(pids) for group, pids in processes.items()}
    with grid.client() as client:
        started = time.time()
        job = client.submit(kind, params={"tasks": tasks}, replication=1)
        info = _wait_light(client, job.id)
    if info["state"] != "completed":
        raise SystemExit(f"grid job ended {info['state']}: {info.get('error')}")
    spent = {group: _cpu_seconds(pids) - before[group] for group, pids in processes.items()}
    print(
        "  grid CPU s: " + ", ".join(f"{group} {seconds:.1f}" for group, seconds in spent.items()),
        flush=True,
    )
    return float(info["finished_at"]) - started, sum(spent.values())


def _wait_light(client: Any, job_id: int) -> dict[str, Any]:
    """Wait for the job through the job list, which leaves out the per-shard rows that
    `GET /v1/jobs/{id}` builds (thousands here: polling it would load the coordinator).
    The finish time is the coordinator's own, so polling costs no precision."""
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        info = next(j for j in client.jobs(limit=10) if j["id"] == job_id)
        if info["state"] not in ("queued", "running"):
            return dict(info)
        time.sleep(0.5)
    raise SystemExit(f"job {job_id} did not finish within an hour")


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


# -- arq -------------------------------------------------------------------------------------


async def noop(ctx: dict[str, Any]) -> None:
    return None


async def _mark_started(ctx: dict[str, Any]) -> None:
    await ctx["redis"].set(ctx["queue_name"] + STARTED_SUFFIX, repr(time.time()), ex=3600)


def _json_dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _arq_worker(redis_url: str, queue: str) -> None:
    """The arq worker process: arq's defaults, burst mode, until the queue is empty."""
    from arq.connections import RedisSettings
    from arq.worker import Worker

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx["queue_name"] = queue
        ctx["cpu_at_start"] = time.process_time()
        await _mark_started(ctx)

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        used = time.process_time() - ctx["cpu_at_start"]
        await ctx["redis"].set(queue + CPU_SUFFIX, repr(used), ex=3600)

    worker = Worker(
        functions=[noop],  # type: ignore[list-item]
        redis_settings=RedisSettings.from_dsn(redis_url),
        queue_name=queue,
        burst=True,
        on_startup=on_startup,
        on_shutdown=on_shutdown,
        job_serializer=_json_dumps,
        job_deserializer=json.loads,
        handle_signals=False,
    )
    worker.run()


async def arq_round(redis_url: str, tasks: int) -> tuple[float, float]:
    """Seconds to enqueue `tasks` no-op jobs and have one arq worker run them all, and the
    CPU seconds of the arq worker (from its start-up hook on) and of the Redis server."""
    from arq.connections import RedisSettings, create_pool
    from arq.constants import job_key_prefix, result_key_prefix
    from arq.jobs import deserialize_result

    queue = f"idlegrid-bench:arq:{os.urandom(4).hex()}"
    ids = [f"{queue}:{i}" for i in range(tasks)]
    pool = await create_pool(
        RedisSettings.from_dsn(redis_url),
        job_serializer=_json_dumps,
        job_deserializer=json.loads,
        default_queue_name=queue,
    )
    redis_cpu = _redis_server_cpu()
    try:
        began = time.time()
        for job_id in ids:
            await pool.enqueue_job("noop", _job_id=job_id, _queue_name=queue)
        enqueue_s = time.time() - began
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--arq-worker",
            queue,
            "--redis",
            redis_url,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await worker.communicate()
        if worker.returncode != 0:
            raise SystemExit(f"arq worker failed:\n{stderr.decode()[-3000:]}")
        started = float(await pool.get(queue + STARTED_SUFFIX))
        raw = await pool.mget([result_key_prefix + job_id for job_id in ids])
        if any(r is None for r in raw):
            raise SystemExit(f"arq: {sum(r is None for r in raw)} jobs have no result")
        results = [deserialize_result(r, deserializer=json.loads) for r in raw]
        if not all(r.success for r in results):
            raise SystemExit("arq: a no-op job failed")
        finished = max(_timestamp(r.finish_time) for r in results)
        cpu = float(await pool.get(queue + CPU_SUFFIX)) + _redis_server_cpu() - redis_cpu
        return enqueue_s + (finished - started), cpu
    finally:
        keys = [queue, queue + STARTED_SUFFIX, queue + CPU_SUFFIX]
        for job_id in ids:
            keys += [result_key_prefix + job_id, job_key_prefix + job_id]
        for chunk in range(0, len(keys), 1000):
            await pool.delete(*keys[chunk : chunk + 1000])
        await pool.aclose()


def _redis_server_cpu() -> float:
    """CPU seconds of the local redis-server processes so far (0 if none is visible)."""
    total = 0.0
    for process in psutil.process_iter(["name", "cpu_times"]):
        if process.info["name"] == "redis-server" and process.info["cpu_times"]:
            total += process.info["cpu_times"].user + process.info["cpu_times"].system
    return total


def _timestamp(value: datetime) -> float:
    return value.timestamp()


async def _drop_production(
    *, database: str, database_schema: str, redis: str, redis_prefix: str
) -> None:
    """Remove the benchmark's PostgreSQL schema and Redis keys."""
    import asyncpg
    import redis.asyncio as aioredis

    conn = await asyncpg.connect(database)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{database_schema}" CASCADE')
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(redis)
    try:
        keys = [key async for key in client.scan_iter(match=redis_prefix + "*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# -- both ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2, help="grid worker processes")
    parser.add_argument("--slots", type=int, default=8, help="task slots per grid worker")
    parser.add_argument(
        "--prefetch",
        type=int,
        default=8,
        help="tasks a grid worker holds beyond its slots (its work buffer)",
    )
    parser.add_argument("--kind", default="noop", choices=["noop", "sleep"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--database",
        default="",
        help="PostgreSQL URL: run the grid in production mode (with --redis as its broker)",
    )
    parser.add_argument(
        "--coordinator-env",
        action="append",
        default=[],
        metavar="IDLEGRID_X=Y",
        help="a setting for the coordinator (repeatable), e.g. IDLEGRID_PROFILE=FILE",
    )
    parser.add_argument("--skip-arq", action="store_true", help="time the grid only")
    parser.add_argument("--arq-worker", metavar="QUEUE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arq_worker:
        _arq_worker(args.redis, args.arq_worker)
        return
    print(
        f"{args.tasks} no-op tasks per round, replication 1 on the grid "
        f"(kind {args.kind}, {args.workers} workers x {args.slots} slots, prefetch "
        f"{args.prefetch}; {'PostgreSQL + Redis' if args.database else 'SQLite'} store); "
        "one arq worker (defaults, max_jobs=10) on the local Redis",
        flush=True,
    )
    grid_rates, arq_rates = [], []
    production: dict[str, str] = {}
    if args.database:
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        production = dict(
            database=args.database,
            database_schema=schema,
            redis=args.redis,
            redis_prefix=f"idlegrid-bench:{schema}:",
        )
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-dispatch-") as tmp,
        LocalGrid(
            Path(tmp),
            heartbeat_s=15.0,
            node_timeout_s=45.0,
            extra_env=dict(item.split("=", 1) for item in args.coordinator_env),
            **production,
        ) as grid,
    ):
        for i in range(args.workers):
            grid.start_worker(
                f"worker-{i}",
                kinds=args.kind,
                slots=args.slots,
                benchmark=False,
                extra=("--prefetch", str(args.prefetch)),
            )
        grid.wait_for_nodes(args.workers)
        grid_round(grid, args.kind, WARMUP_TASKS)
        grid_cpu, arq_cpu = [], []
        for round_no in range(1, args.rounds + 1):
            grid_s, grid_used = grid_round(grid, args.kind, args.tasks)
            if args.skip_arq:
                print(f"grid {args.tasks / grid_s:.1f} tasks/s", flush=True)
                continue
            arq_s, arq_used = asyncio.run(arq_round(args.redis, args.tasks))
            grid_rates.append(args.tasks / grid_s)
            arq_rates.append(args.tasks / arq_s)
            grid_cpu.append(1000 * grid_used / args.tasks)
            arq_cpu.append(1000 * arq_used / args.tasks)
            print(
                f"round {round_no}: grid {grid_rates[-1]:.1f} tasks/s ({grid_s:.2f} s, "
                f"{grid_cpu[-1]:.2f} CPU ms a task), arq {arq_rates[-1]:.1f} jobs/s "
                f"({arq_s:.2f} s, {arq_cpu[-1]:.2f} CPU ms a job)",
                flush=True,
            )
    if production:
        asyncio.run(_drop_production(**production))
    if args.skip_arq:
        return
    grid_rate, arq_rate = statistics.median(grid_rates), statistics.median(arq_rates)
    print(f"grid: {grid_rate:.1f} tasks/s (median of {args.rounds}, replication 1)")
    print(f"arq:  {arq_rate:.1f} jobs/s (median of {args.rounds})")
    # CPU per task is what a busy shared machine distorts least: the rates depend on the
    # share of a core each process gets, the CPU each spends per task much less.
    print(
        f"CPU ms a task (median): grid {statistics.median(grid_cpu):.2f} (coordinator + "
        f"workers), arq {statistics.median(arq_cpu):.2f} (worker + redis-server); "
        f"arq over grid: {statistics.median(arq_cpu) / statistics.median(grid_cpu):.2f}"
    )
    print(f"ratio: {grid_rate / arq_rate:.2f}")


if __name__ == "__main__":
    main()
