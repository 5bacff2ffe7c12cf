"""One leader for the grid-wide passes: two `idlegrid serve` processes on one PostgreSQL
schema and one Redis prefix; the leader is killed (SIGKILL) and the other takes over.

The second test kills the leader in the middle of a pass, right after the expiry of a
silent node's tasks committed and before the grid acted on it (the `monitor-expired`
fault point): the new leader finishes the work, and nothing is applied twice.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import off_loop
from helpers import wait_until
from test_production import _query

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

LEASE_S = 2.0


def _lease_holder_pid(redis_url: str, prefix: str) -> int | None:
    async def read() -> Any:
        import redis.asyncio as redis

        client = redis.Redis.from_url(redis_url)
        try:
            return await client.get(prefix + "lease:monitor")
        finally:
            await client.aclose()

    holder = off_loop(read())
    return int(holder.decode().split(":")[1]) if holder else None


@pytest.fixture
def make_grid(production_grid: Callable[..., LocalGrid]) -> Callable[..., LocalGrid]:
    """One coordinator of a production grid (the test adds the second), with a short
    leader lease and `env` on top."""

    def make(**env: str) -> LocalGrid:
        return production_grid(
            coordinators=1, extra_env={"IDLEGRID_LEADER_LEASE_S": str(LEASE_S), **env}
        )

    return make


def test_the_leader_dies_and_another_process_leads_within_a_few_seconds(
    make_grid: Callable[..., LocalGrid], redis_url: str, redis_prefix: str
) -> None:
    grid = make_grid()
    grid.add_coordinator()
    first = grid.coordinator
    assert first is not None
    wait_until(
        lambda: _lease_holder_pid(redis_url, redis_prefix) == first.pid, "a leader", timeout_s=10
    )
    [second] = grid.others.values()
    killed_at = time.monotonic()
    grid.kill_coordinator(grid.url)
    wait_until(
        lambda: _lease_holder_pid(redis_url, redis_prefix) == second.pid,
        "a new leader",
        timeout_s=10,
    )
    # The lease runs out (LEASE_S) and the survivor renews every third of it.
    assert time.monotonic() - killed_at < LEASE_S + 2.0


def test_a_leader_killed_mid_pass_leaves_nothing_undone_and_nothing_done_twice(
    make_grid: Callable[..., LocalGrid], redis_url: str, redis_prefix: str
) -> None:
    # Only the first coordinator, the leader, has the fault armed.
    grid = make_grid(IDLEGRID_FAULTS="monitor-expired")
    del grid.env["IDLEGRID_FAULTS"]
    leader = grid.coordinator
    assert leader is not None
    wait_until(
        lambda: _lease_holder_pid(redis_url, redis_prefix) == leader.pid, "a leader", timeout_s=10
    )
    survivor_url = grid.add_coordinator()
    [survivor] = grid.others.values()
    # No prefetch: the node holds exactly its two running tasks when it goes silent.
    silent = grid.start_worker(
        "silent", kinds="sleep", benchmark=False, slots=2, extra=("--prefetch", "0")
    )
    grid.wait_for_nodes(1)
    grid.volunteer_token("volunteer-healthy")  # made now: the leader will be gone
    tasks = 6
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 2})
    wait_until(
        lambda: _count(grid, "state = 'assigned'") == 2, "the node's two tasks", timeout_s=30
    )
    held = _query(grid, "SELECT id, shard_id, node_id FROM tasks WHERE state = 'assigned'")
    os.kill(silent.pid, signal.SIGSTOP)  # no more heartbeats: it goes silent
    try:
        # The leader expires its tasks, and dies with the expiry committed.
        assert leader.wait(timeout=30) == -signal.SIGKILL
        wait_until(
            lambda: _lease_holder_pid(redis_url, redis_prefix) == survivor.pid,
            "the survivor leads",
            timeout_s=10,
        )
        # The new leader tops the expired shards up; a healthy node finishes the job.
        grid.start_worker(
            "healthy", kinds="sleep", benchmark=False, slots=tasks, servers=[survivor_url]
        )
        wait_until(lambda: _job_state(grid, job.id) == "completed", "the job", timeout_s=120)
        # Checked while the silent node is still stopped (its late results would count).
        # Its tasks expired, and stay so (errors of the node) when their replacements
        # decided the shards.
        [node_id] = {row["node_id"] for row in held}
        expired = _query(grid, f"SELECT shard_id, state FROM tasks WHERE node_id = {node_id}")
        assert sorted(row["state"] for row in expired) == ["expired", "expired"]
        # Each expired shard got exactly one replacement; every other shard had one task.
        per_shard = _query(grid, "SELECT shard_id, COUNT(*) AS n FROM tasks GROUP BY shard_id")
        counts = {row["shard_id"]: row["n"] for row in per_shard}
        assert sorted(counts.values()) == [1] * (tasks - 2) + [2, 2]
        assert {row["shard_id"] for row in expired} == {s for s, n in counts.items() if n == 2}
        # The missed leases were counted against the node once each, not once per process.
        [trust] = _query(grid, f"SELECT error_total FROM node_trust WHERE node_id = {node_id}")
        assert trust["error_total"] == 2
    finally:
        os.kill(silent.pid, signal.SIGCONT)


def _count(grid: LocalGrid, where: str) -> int:
    return int(_query(grid, f"SELECT COUNT(*) AS n FROM tasks WHERE {where}")[0]["n"])


def _job_state(grid: LocalGrid, job_id: int) -> str:
    return str(_query(grid, f"SELECT state FROM jobs WHERE id = {job_id}")[0]["state"])
