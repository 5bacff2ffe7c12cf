"""Training through a real grid: `idlegrid serve`, `idlegrid worker` processes, WebSockets.

A tiny character transformer on the built-in corpus (no data bytes travel), a few rounds
of a few inner steps; one test kills a worker in the middle of a round.
"""

from __future__ import annotations

import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import wait_until

from idlegrid.cli.main import main
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob
from idlegrid.training import models

pytestmark = pytest.mark.slow

TINY_LM: dict[str, Any] = {
    "model": {"width": 32, "layers": 1, "heads": 2, "context": 32},
    "inner": {"steps": 30, "batch_size": 8, "seq_len": 32, "lr": 0.003},
    "workers": 2,
    "rounds": 4,
    "eval_batches": 8,
}


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[LocalGrid]:
    with LocalGrid(tmp_path, heartbeat_s=0.5, node_timeout_s=3.0, min_lease_s=30.0) as local:
        for name in ("w1", "w2"):
            local.start_worker(name, kinds="diloco-train", threads=1, benchmark=False)
        local.wait_for_nodes(2)
        yield local


def _holds_a_task_after_round_0(grid: LocalGrid, worker: str, job_id: int) -> bool:
    """Whether `worker`'s node holds a live training task of round 1 or later of the job."""
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        (held,) = db.execute(
            "SELECT COUNT(*) FROM tasks t JOIN nodes n ON n.id = t.node_id"
            " JOIN shards s ON s.id = t.shard_id"
            " JOIN training_rounds r ON r.job_id = s.job_id AND s.idx >= r.first_shard"
            " AND s.idx < r.first_shard + r.train_shards"
            " WHERE n.name = ? AND s.job_id = ? AND t.state = 'assigned' AND r.round >= 1",
            (worker, job_id),
        ).fetchone()
    return bool(held)


def test_training_through_workers_lowers_the_eval_loss(grid: LocalGrid) -> None:
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params=TINY_LM)  # fmt: skip
        job.wait(timeout=120)
        metrics = job.metrics()
        result = job.result()
        result_hash = job.info()["result"]
    rounds = metrics["rounds"]
    assert metrics["state"] == "completed" and metrics["rounds_done"] == 4
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4] and rounds[-1]["final"]
    evals = [r["eval_loss"] for r in rounds]
    assert all(loss is not None for loss in evals), evals
    assert evals[-1] < evals[0] - 0.5, evals
    assert all(r["updates"] == 2 and r["nodes"] == 2 for r in rounds[:-1])
    config = models.parse_config("transformer-lm", TINY_LM["model"])
    fp32_weights = 4 * models.parameter_count("transformer-lm", config)
    # Round 0 moves no weights (nodes draw them from the seed); later rounds one int8
    # update per node (about a quarter of the fp32 weights), never the weights.
    assert rounds[0]["bytes_down"] < fp32_weights / 10
    assert all(r["bytes_down"] < 2 * fp32_weights / 3 for r in rounds[1:-1])
    # The result is the trained weights, parsed from safetensors: one array per parameter.
    assert rounds[-1]["checkpoint"] == result_hash
    assert isinstance(result, dict) and all(isinstance(a, np.ndarray) for a in result.values())
    assert sum(a.size for a in result.values()) == models.parameter_count("transformer-lm", config)
    shown = CliRunner().invoke(main, ["metrics", str(job.id), "--watch", "--server", grid.url,
                                      "--token", grid.admin_token])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert f"job {job.id} completed: 4/4 rounds" in shown.output


def test_a_worker_killed_mid_round_does_not_stop_training(grid: LocalGrid) -> None:
    params = {**TINY_LM, "inner": {**TINY_LM["inner"], "steps": 60}, "round_timeout_s": 8.0}
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params=params)  # fmt: skip
        # Kill the second worker while it holds a training task of round 1 or later.
        wait_until(
            lambda: _holds_a_task_after_round_0(grid, "w2", job.id),
            "w2 to hold a task of round 1",
            timeout_s=90,
        )
        grid.workers[1].send_signal(signal.SIGKILL)
        grid.workers[1].wait()
        job.wait(timeout=120)
        metrics = job.metrics()
    rounds = metrics["rounds"]
    assert metrics["state"] == "completed" and metrics["rounds_done"] == 4
    after = rounds[1:-1]
    # The round the worker died in (round 1, or a later one when the machine is slow to
    # report round 0) closed on the timer or the survivor ran the lost shard too; every
    # round after it had the survivor alone.
    died = next(
        (i for i, r in enumerate(after) if r["closed_by"] == "timer" or r["nodes"] == 1), None
    )
    assert died is not None, rounds
    assert all(r["nodes"] == 1 for r in after[died + 1 :]), rounds
    assert any(r["closed_by"] == "timer" or r["updates"] == 2 for r in after)
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"]


def test_asynchronous_training_applies_late_updates_through_workers(grid: LocalGrid) -> None:
    # Three shards a round on two workers with a quorum of two: the third shard of a round
    # is still running (or not yet started) when its round closes, and its update lands
    # in a later round, weighted by its staleness.
    params = {**TINY_LM, "workers": 3, "min_updates": 2, "asynchronous": True,
              "max_staleness": 2, "rounds": 5}  # fmt: skip
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params=params)  # fmt: skip
        job.wait(timeout=180)
        metrics = job.metrics()
    rounds = metrics["rounds"]
    assert metrics["state"] == "completed" and metrics["rounds_done"] == 5
    assert metrics["asynchronous"] and metrics["stale_applied"] >= 1, rounds
    assert metrics["stale_applied"] == sum(r["stale_applied"] or 0 for r in rounds)
    assert all(r["updates"] >= 2 for r in rounds[:-1]), rounds
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"] - 0.3
    shown = CliRunner().invoke(main, ["metrics", str(job.id), "--server", grid.url,
                                      "--token", grid.admin_token])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert f"stale updates {metrics['stale_applied']} applied" in shown.output
