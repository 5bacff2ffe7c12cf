"""End to end with real processes: `idlegrid serve`, `idlegrid worker`, real WebSockets.

These prove what the in-process tests cannot: a worker or the coordinator killed with
SIGKILL mid-job, and the job still completes with every shard's result stored once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import websockets
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow


@pytest.fixture
def grid(embedded_grid: Callable[..., LocalGrid]) -> LocalGrid:
    return embedded_grid()


def _expected_sleep_result(tasks: int) -> list[dict[str, object]]:
    return [json.loads(_digest(i)) for i in range(tasks)]


def _reconnects(grid: LocalGrid, worker: str) -> int:
    """How often the worker's log says it will connect again (after a drop or a failed try)."""
    return (grid.root / f"{worker}.log").read_text().count("reconnecting in")


def _shard_rows(grid: LocalGrid) -> list[tuple[int, str, int | None, str | None]]:
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        return db.execute(
            "SELECT idx, state, canonical_task_id, output_hash FROM shards ORDER BY idx"
        ).fetchall()


def _valid_or_pending_results(grid: LocalGrid) -> dict[int, int]:
    """Per shard, how many results were counted (canonical or accepted while open)."""
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        rows = db.execute(
            "SELECT shard_id, COUNT(*) FROM tasks WHERE state = 'completed' "
            "AND (outcome IS NULL OR outcome = 'valid') GROUP BY shard_id"
        ).fetchall()
    return dict(rows)


def test_embed_job_end_to_end_matches_reference(grid: LocalGrid) -> None:
    from idlegrid.kinds.embed_text.kind import embed_reference
    from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

    texts = stdlib_paragraphs(150)
    grid.start_worker("w1", kinds="embed-text", benchmark=False)
    grid.wait_for_nodes(1)
    with grid.client() as client:
        job = client.submit_embeddings(texts, shard_size=40)
        info = job.wait(timeout=240)
        vectors = job.result()
    assert info["shards_total"] == 4
    assert vectors.shape == (150, 384) and vectors.dtype == np.float32
    reference = embed_reference(texts)
    cosine = np.sum(vectors * reference, axis=1)
    assert cosine.min() >= 0.999


def test_worker_killed_mid_task_is_reassigned(grid: LocalGrid) -> None:
    doomed = grid.start_worker("doomed", kinds="sleep", benchmark=False)
    grid.wait_for_nodes(1)
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 3, "seconds": 1.5})
        wait_until(lambda: job.info()["state"] == "running", "a task to be assigned")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        grid.start_worker("rescuer", kinds="sleep", benchmark=False)
        info = job.wait(timeout=90)
        assert job.result() == _expected_sleep_result(3)
        shards = job.info(shards=True)["shards"]
    assert info["state"] == "completed"
    # The killed worker's shard needed a second attempt, and still counted once.
    assert max(s["attempts"] for s in shards) >= 2
    assert all(n == 1 for n in _valid_or_pending_results(grid).values())


@pytest.fixture
def grid_without_backups(embedded_grid: Callable[..., LocalGrid]) -> LocalGrid:
    """`grid`, without speculative copies: a task held across a restart looks like a
    straggler, and its backup would be a second valid result the test counts as a repeat."""
    return embedded_grid(backups=False)


def test_coordinator_killed_mid_job_finishes_every_shard_once(
    grid_without_backups: LocalGrid,
) -> None:
    grid = grid_without_backups
    for name in ("w1", "w2"):
        grid.start_worker(name, kinds="sleep", benchmark=False, slots=2)
    grid.wait_for_nodes(2)
    tasks = 24
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "seconds": 0.4})
        wait_until(
            lambda: 2 <= job.info()["shards_done"] < tasks - 6, "partial progress", timeout_s=60
        )
    port = int(grid.url.rsplit(":", 1)[1])
    before = {name: _reconnects(grid, name) for name in ("w1", "w2")}
    grid.kill_coordinator()
    # The workers notice, keep running their tasks, and retry at least once in vain.
    wait_until(
        lambda: all(_reconnects(grid, name) >= count + 2 for name, count in before.items()),
        "both workers to lose the coordinator and fail to reconnect",
    )
    grid.start_coordinator(port=port)
    with grid.client() as client:
        info = client.job(job.id).wait(timeout=120)
        assert client.job(job.id).result() == _expected_sleep_result(tasks)
    assert info["state"] == "completed"
    rows = _shard_rows(grid)
    assert len(rows) == tasks
    assert all(state == "done" and canonical is not None for _, state, canonical, _ in rows)
    assert all(n == 1 for n in _valid_or_pending_results(grid).values())


def test_malformed_frames_over_a_real_socket(grid: LocalGrid) -> None:
    async def talk() -> list[dict[str, object]]:
        url = grid.url.replace("http://", "ws://") + "/v1/nodes/ws"
        replies = []
        async with websockets.connect(url) as ws:
            for frame in (
                "{not json",
                json.dumps({"type": "bogus"}),
                json.dumps([1, 2]),
                json.dumps({"type": "ready", "free_slots": 1}),
            ):
                await ws.send(frame)
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            await ws.send(b"\xff\xfe binary")
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
        return replies

    replies = asyncio.run(talk())
    assert [r["type"] for r in replies] == ["error"] * 5
    assert [r["code"] for r in replies] == [
        "malformed",
        "unknown_type",
        "malformed",
        "out_of_order",
        "malformed",
    ]
    # The coordinator is unharmed.
    with grid.client() as client:
        assert client.jobs() == []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_demo_runs_on_the_port_given_and_leaves_no_process(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.process_iter()}
    port = _free_port()
    demo = [sys.executable, "-m", "idlegrid", "demo", "--texts", "120", "--workers", "2",
            "--shard-size", "30", "--port", str(port)]  # fmt: skip
    result = subprocess.run(demo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout and "texts/s" in result.stdout
    assert f"coordinator: http://127.0.0.1:{port} " in result.stdout
    # Its processes were told to stop; give the last ones a moment to leave the table.
    try:
        wait_until(lambda: not _demo_processes(before), "the demo's processes to end")
    except AssertionError:
        raise AssertionError(f"the demo left {_demo_processes(before)}") from None


def test_a_demo_on_a_taken_port_says_so_and_how_to_pick_another() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        demo = [sys.executable, "-m", "idlegrid", "demo", "--port", str(port)]
        result = subprocess.run(demo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stdout.split())
    assert f"port {port} on 127.0.0.1 is taken" in said and "--port 0" in said


def _demo_processes(before: set[int]) -> list[str]:
    """Command lines of the demo's coordinator and workers still running.

    The demo's own: their data and state live in its idlegrid-demo-* dir (other idlegrid
    processes may run on this machine meanwhile); `before`: pids from before it started.
    """
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if (
            process.info["pid"] not in before
            and "idlegrid-demo-" in " ".join(cmdline)
            and any(part in ("serve", "worker") for part in cmdline)
        ):
            found.append(" ".join(cmdline))
    return found
