"""Stragglers with real processes: a slow worker's shard is finished by a fast one.

`idlegrid serve` and two `idlegrid worker` processes over real WebSockets. The slow worker
runs with IDLEGRID_SLOWDOWN (its tasks take that many times longer and its benchmark says
so); it takes the job's only shard first. When the fast worker connects and finds nothing
ready, the coordinator gives it a backup copy; its result decides the shard and the slow
copy is cancelled.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

SLOWDOWN = 120
SECONDS = 0.5  # the shard's sleep on a normal node; SLOWDOWN x longer on the slow one


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[LocalGrid]:
    with LocalGrid(
        tmp_path,
        heartbeat_s=0.5,
        node_timeout_s=60.0,
        min_lease_s=120.0,
        extra_env={"IDLEGRID_BACKUP_MIN_GAIN_S": "1"},
        replication=1,
    ) as local:
        yield local


def _tasks(grid: LocalGrid) -> list[tuple[int, str, str | None, str]]:
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        return db.execute(
            "SELECT t.id, t.state, t.outcome, n.name FROM tasks t JOIN nodes n "
            "ON n.id = t.node_id ORDER BY t.id"
        ).fetchall()


def test_a_slow_workers_shard_is_finished_by_a_fast_one(grid: LocalGrid) -> None:
    plain_env = grid.env
    grid.env = {**plain_env, "IDLEGRID_SLOWDOWN": str(SLOWDOWN)}
    grid.start_worker("slow", kinds="sleep")
    grid.env = plain_env
    grid.wait_for_nodes(1)
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 1, "seconds": SECONDS})
        wait_until(
            lambda: job.info()["state"] == "running", "the slow worker's claim", timeout_s=30
        )
        started = time.monotonic()
        grid.start_worker("fast", kinds="sleep")
        info = job.wait(timeout=SLOWDOWN * SECONDS)
        took = time.monotonic() - started
        result = job.result()
    assert info["state"] == "completed"
    assert result == [json.loads(_digest(0))]
    # Well before the slow copy would have finished (60 s), the fast worker's start-up and
    # benchmark included.
    assert took < SLOWDOWN * SECONDS * 0.7, took
    rows = _tasks(grid)
    assert [(name, state) for _, state, _, name in rows] == [
        ("slow", "cancelled"),
        ("fast", "completed"),
    ]
    assert rows[1][2] == "valid"
