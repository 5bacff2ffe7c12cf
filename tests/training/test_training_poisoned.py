"""A poisoned pseudo-gradient through a real grid: absorbed by trimmed mean, not by the mean.

`idlegrid serve`, three honest `idlegrid worker` processes and one adversary
(`tests/training/poisoned_worker.py`: an honest worker that scales every update it returns by
1000, re-compressed so the coordinator's output checks accept it). Every result counts
alone (no replica, no spot check, as for nodes trusted already), so the poisoned updates
reach aggregation: trimmed mean absorbs them, the plain mean is wrecked by them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob

pytestmark = pytest.mark.slow

POISONER = Path(__file__).resolve().parent / "poisoned_worker.py"
TINY_LM: dict[str, Any] = {
    "model": {"width": 32, "layers": 1, "heads": 2, "context": 32},
    "inner": {"steps": 20, "batch_size": 8, "seq_len": 32, "lr": 0.003},
    "workers": 4,
    "rounds": 3,
    "eval_batches": 8,
}


@contextmanager
def _grid(root: Path, env: dict[str, str]) -> Iterator[LocalGrid]:
    """Three honest workers and the poisoner, all connected."""
    with (
        LocalGrid(
            root, heartbeat_s=0.5, node_timeout_s=5.0, min_lease_s=30.0, extra_env=env
        ) as local,  # fmt: skip
        (root / "poisoner.log").open("w") as log,
    ):
        for name in ("honest-1", "honest-2", "honest-3"):
            local.start_worker(name, kinds="diloco-train", threads=1, benchmark=False)
        local.workers.append(subprocess.Popen(
            [sys.executable, str(POISONER), "--server", local.url,
             "--token", local.volunteer_token("volunteer-poisoner"),
             "--state-dir", str(root / "poisoner"), "--name", "poisoner", "--scale", "1000"],
            stdout=log, stderr=subprocess.STDOUT, env=local.env, start_new_session=True,
        ))  # fmt: skip
        local.wait_for_nodes(4)
        yield local


def _train(grid: LocalGrid, aggregation: dict[str, Any]) -> dict[str, Any]:
    """One training job with this aggregation rule; its metrics when it ends."""
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params={**TINY_LM, "aggregation": aggregation})  # fmt: skip
        job.wait(timeout=180)
        return dict(job.metrics())


def test_trimmed_mean_absorbs_a_poisoned_update_that_wrecks_the_mean(tmp_path: Path) -> None:
    # Every result counts alone, unchecked: only the aggregation rule stands in the way.
    alone = {"IDLEGRID_MIN_CREDIBILITY": "0", "IDLEGRID_SPOT_CHECK_RATE": "0"}
    with _grid(tmp_path, alone) as grid:
        robust = _train(grid, {"rule": "trimmed-mean", "trim_fraction": 0.25})
        plain = _train(grid, {"rule": "mean"})
    # The poisoner's update was in: one update sits far from the aggregate (the mean is
    # dragged toward it, so there it sits 3 times the aggregate's length away).
    for metrics, far in ((robust, 100.0), (plain, 2.0)):
        assert metrics["state"] == "completed", metrics
        training = metrics["rounds"][:-1]
        assert all(r["updates"] == 4 for r in training), training
        assert max(r["max_suspicion"] for r in training) > far, training
    first, last = robust["rounds"][0]["eval_loss"], robust["eval_loss"]
    assert last < first - 0.5, robust["rounds"]  # it trained despite the poisoned updates
    assert plain["eval_loss"] > first + 1.0, plain["rounds"]  # the mean was wrecked
