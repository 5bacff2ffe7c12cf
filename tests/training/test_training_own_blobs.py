"""A training job whose checkpoints are larger than the largest blob a client may send in
one request still trains: the coordinator keeps its own blobs (weights, optimizer state,
the result) without that limit, which bounds what arrives from outside."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_training_driver import T0, Harness

from idlegrid.coordinator.grid import Grid
from idlegrid.store.sql import SqlStore


async def test_checkpoints_over_max_blob_bytes_are_kept_and_the_job_completes(
    store: SqlStore, in_process_grid: Callable[..., Grid], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [T0]
    grid = in_process_grid(clock=lambda: now[0], max_blob_bytes=1 << 30)
    account = await store.accounts.create_account("alice", is_admin=False, now=T0)
    harness = Harness(grid, now, account.id)
    # Wide enough that weights, not metadata, make up the blobs (about 260 KB a checkpoint).
    job = await harness.submit(model={"inputs": 8, "hidden": [256, 256], "classes": 3})
    nodes = [await harness.node("a"), await harness.node("b")]
    first = (await harness.metrics(job.id))["rounds"][0]["checkpoint"]
    checkpoint = grid.blobs.size(first)
    # From here on a client's blob may be at most half a checkpoint: the nodes' updates
    # (int8, a quarter of the weights) still fit, the coordinator's weights do not.
    grid.blobs.max_bytes = checkpoint // 2
    for _ in range(40):
        if not any([await harness.work(node, monkeypatch) for node in nodes]):
            break
    done = await grid.store.jobs.get_job(job.id)
    assert done is not None and done.state == "completed", done
    rows = (await harness.metrics(job.id))["rounds"]
    assert len(rows) == 4 and all(grid.blobs.size(r["checkpoint"]) == checkpoint for r in rows)
    assert grid.blobs.size(done.result_hash or "") > grid.blobs.max_bytes
