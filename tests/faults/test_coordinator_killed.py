"""SIGKILL of the coordinator (embedded mode: SQLite, in-process broker), three times
during one job of 500 shards, restarted each time on the same port and data directory.

The workers keep running their tasks, reconnect with their backoff, and reclaim what
they hold; the restarted coordinator expires nothing until they can be back. Afterwards
the tables must show every shard with one valid, credited canonical result, nothing
credited twice, trust counters that equal the tasks' outcomes, and no error charged to
any (honest) node.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from helpers import wait_until
from invariants import all_judged, assert_exactly_once, errors, query_of, shards_done

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

SHARDS = 500
KILLS = 3


@pytest.mark.parametrize("replication", [1, 3])
def test_coordinator_killed_three_times_mid_job(
    embedded_grid: Callable[..., LocalGrid], replication: int
) -> None:
    grid = embedded_grid(
        replication=replication,
        # Longer than the node timeout, as a real worker's backoff (30 s) is longer than
        # a heartbeat: a restart that gave the workers one timeout would expire tasks.
        backoff_max_s=4.0,
        # One result per replica is what is counted: no speculative copies.
        backups=False,
    )
    workers = max(2, replication)
    for i in range(workers):
        grid.start_worker(
            f"w{i}", kinds="sleep", benchmark=False, slots=2, extra=("--prefetch", "8")
        )
    grid.wait_for_nodes(workers)
    query = query_of(grid)
    port = int(grid.url.rsplit(":", 1)[1])
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": SHARDS, "seconds": 0})
    for kill in range(1, KILLS + 1):
        wait_until(
            lambda k=kill: shards_done(query) >= k * SHARDS // (KILLS + 1),
            f"progress before kill {kill}",
            timeout_s=300,
        )
        assert shards_done(query) < SHARDS, "the job finished before the kill"
        grid.kill_coordinator()
        grid.start_coordinator(port=port)
    with grid.client() as client:
        info = client.job(job.id).wait(timeout=300)
        assert info["state"] == "completed"
        assert client.job(job.id).result() == [json.loads(_digest(i)) for i in range(SHARDS)]
    wait_until(lambda: all_judged(query), "late results judged", timeout_s=30)
    assert_exactly_once(query, shards=SHARDS)
    # Nothing expired: every worker was back within the restart's grace.
    assert errors(query) == 0
