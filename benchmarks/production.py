"""What the benchmarks of production mode (PostgreSQL + Redis) share: CPU seconds of
process groups, the service processes, and removing a run's schema and Redis keys."""

from __future__ import annotations

import psutil


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """CPU seconds (user + system) so far of each group's processes, by pid (gone: left out)."""
    totals: dict[str, dict[int, float]] = {}
    for group, group_pids in pids.items():
        totals[group] = {}
        for pid in group_pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            totals[group][pid] = times.user + times.system
    return totals


def cpu_spent(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
) -> dict[str, float]:
    """CPU seconds each group spent between two readings. A process first seen in
    `after` (a database backend started meanwhile: list the service's pids again for
    it) counts whole; one gone by then takes its CPU with it (counted as none, never
    negative)."""
    return {
        group: sum(seconds - before[group].get(pid, 0.0) for pid, seconds in after[group].items())
        for group in before
    }


def service_pids(name: str) -> list[int]:
    """The processes of a local service (postgres, redis-server) by name."""
    return [p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "") == name]


async def drop_run(database: str, schema: str, redis_url: str, prefix: str) -> None:
    """Remove the run's PostgreSQL schema and Redis keys."""
    import asyncpg
    import redis.asyncio as redis

    conn = await asyncpg.connect(database)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
