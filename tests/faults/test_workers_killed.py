"""SIGKILL of half the workers mid-job (embedded mode, replication 1).

The killed workers' tasks expire once they are silent for a node timeout, and their
shards get new tasks on the workers left. Their expired tasks stay errors of their
nodes (and only those): the tables must show one valid, credited result per shard and
trust counters equal to the tasks' outcomes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest
from helpers import wait_until
from invariants import Query, all_judged, assert_exactly_once, errors, query_of, shards_done

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

SHARDS = 400
WORKERS = 4


def test_half_the_workers_killed_mid_job(embedded_grid: Callable[..., LocalGrid]) -> None:
    grid = embedded_grid(backups=False)
    workers = [
        grid.start_worker(
            f"w{i}", kinds="sleep", benchmark=False, slots=2, extra=("--prefetch", "4")
        )
        for i in range(WORKERS)
    ]
    grid.wait_for_nodes(WORKERS)
    query = query_of(grid)
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": SHARDS, "seconds": 0.01})
        victims = [f"w{i}" for i in range(WORKERS // 2)]
        # Killed while they hold tasks: stopped first, so that what they hold cannot
        # finish between the look and the kill (a task takes 10 ms; on a loaded machine a
        # worker may also be between its tasks, or not have asked for any yet).
        wait_until(lambda: shards_done(query) >= SHARDS // 4, "a quarter done", timeout_s=300)
        wait_until(
            lambda: _stopped_holding(query, workers[: WORKERS // 2], victims),
            "the workers to kill stopped while they hold tasks",
            timeout_s=120,
        )
        for proc in workers[: WORKERS // 2]:
            os.kill(proc.pid, signal.SIGKILL)
        assert shards_done(query) < SHARDS, "the job finished before the kill"
        info = client.job(job.id).wait(timeout=300)
        assert info["state"] == "completed"
        assert client.job(job.id).result() == [json.loads(_digest(i)) for i in range(SHARDS)]
    wait_until(lambda: all_judged(query), "late results judged", timeout_s=30)
    assert_exactly_once(query, shards=SHARDS)
    # The killed workers held tasks: those expired, each one error of its node.
    expired = query("SELECT COUNT(*) AS n FROM tasks WHERE state = 'expired'")[0]["n"]
    assert expired > 0 and errors(query) == expired


def _stopped_holding(query: Query, procs: list[subprocess.Popen[str]], names: list[str]) -> bool:
    """Stop `procs`; True if each still holds a task once what they sent before they
    stopped has landed (the same tasks at two looks), else they run on and False."""
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    first = _held(query, names)
    time.sleep(0.3)  # results already on the wire land meanwhile; stopped, they send no more
    if first == _held(query, names) and all(first.get(name) for name in names):
        return True
    for proc in procs:
        os.kill(proc.pid, signal.SIGCONT)
    return False


def _held(query: Query, names: list[str]) -> dict[str, int]:
    rows = query(
        "SELECT nodes.name AS name, COUNT(*) AS held FROM tasks"
        " JOIN nodes ON nodes.id = tasks.node_id"
        " WHERE tasks.state = 'assigned' GROUP BY nodes.name"
    )
    return {row["name"]: row["held"] for row in rows if row["name"] in names}
