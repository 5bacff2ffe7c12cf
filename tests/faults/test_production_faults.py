"""Faults of production mode: two `idlegrid serve` processes on one PostgreSQL schema and
one Redis key prefix, replication 3, workers spread over both coordinators.

- Every Redis key flushed mid-job (a Redis restart without persistence).
- One coordinator of the two SIGKILLed mid-job; its workers fail over to the other.

After each, the tables must show one valid, credited canonical result per shard, no
work credited twice, and trust counters equal to the tasks' outcomes. No worker was
harmed, so no node may be charged an error: connected nodes are never taken for
silent by the coordinator they are not connected to.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from conftest import delete_keys, off_loop
from grids import spread_workers
from helpers import wait_until
from invariants import all_judged, assert_exactly_once, errors, query_of, shards_done

from idlegrid.client import Client
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

SHARDS = 150  # a job; one for each fault
WORKERS = 3  # replicas of a shard go to distinct accounts: one each


@pytest.fixture
def grid(production_grid: Callable[..., LocalGrid]) -> LocalGrid:
    grid = production_grid(replication=3, backoff_max_s=2.0)
    spread_workers(
        grid, WORKERS, kinds="sleep", benchmark=False, slots=2, extra=("--prefetch", "2")
    )
    return grid


def _job_through(grid: LocalGrid, fault: Callable[[], None], *, jobs_before: int, url: str) -> None:
    """Run a job through the coordinator at `url`, apply `fault` a quarter of the way,
    then check the tables (over every job)."""
    query = query_of(grid)
    done_before = jobs_before * SHARDS
    with Client(url, grid.admin_token) as client:
        job = client.submit("sleep", params={"tasks": SHARDS, "seconds": 0.01})
        wait_until(
            lambda: shards_done(query) >= done_before + SHARDS // 4, "progress", timeout_s=300
        )
        fault()
        assert shards_done(query) < done_before + SHARDS, "the job finished before the fault"
        info = client.job(job.id).wait(timeout=300)
        assert info["state"] == "completed"
        assert client.job(job.id).result() == [json.loads(_digest(i)) for i in range(SHARDS)]
    wait_until(lambda: all_judged(query), "late results judged", timeout_s=30)
    assert_exactly_once(query, shards=done_before + SHARDS)
    assert errors(query) == 0


def test_redis_flushed_then_one_coordinator_of_two_killed(
    grid: LocalGrid, redis_url: str, redis_prefix: str
) -> None:
    # One grid for both faults (starting one costs more than a job): each in a job.
    def flush() -> None:
        assert off_loop(delete_keys(redis_url, redis_prefix)) > 0

    _job_through(grid, flush, jobs_before=0, url=grid.url)
    # The first one (most likely the leader: it started first): the other takes over the
    # grid-wide passes once its lease runs out, and the first one's workers fail over.
    survivor = grid.urls[1]
    _job_through(grid, grid.kill_coordinator, jobs_before=1, url=survivor)
