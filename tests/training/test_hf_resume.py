"""A worker SIGKILLed in the middle of a researcher's model's round, and started again.

One `idlegrid worker` process trains a trimmed llama's only shard, saving its task
checkpoint every second. It is killed once a checkpoint is on disk; the worker started
again on the same state directory gets the same task back and goes on from the newest
checkpoint (its AdamW moments and its place in the data), not from step 0: it loses at
most the steps since that checkpoint, one interval.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from hf_helpers import needs_transformers, text, tiny_folder

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

STEPS = 600
PARAMS = {"architecture": "hf-causal-lm", "rounds": 1, "workers": 1, "eval_batches": 2,
          "inner": {"steps": STEPS, "batch_size": 8, "seq_len": 16, "lr": 0.003}}  # fmt: skip


def _saved_step(state_dir: Path) -> int:
    """The step of the task checkpoint under a worker's state directory (0: none yet)."""
    for path in (state_dir / "checkpoints").glob("*/inner.npz"):
        try:
            with np.load(path) as saved:
                return int(saved["step"])
        except (OSError, ValueError, KeyError):
            return 0  # caught mid-rename: the next poll reads it whole
    return 0


def test_a_killed_worker_goes_on_from_its_task_checkpoint(tmp_path: Path) -> None:
    needs_transformers()
    base = tiny_folder(tmp_path / "base")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text(600))
    settings = {"heartbeat_s": 0.5, "node_timeout_s": 3.0, "min_lease_s": 60.0}
    env = {"IDLEGRID_CHECKPOINT_EVERY_S": "1"}
    with LocalGrid(tmp_path / "grid", extra_env=env, **settings) as grid:
        worker = grid.start_worker("w1", kinds="diloco-train", threads=1, benchmark=False)
        grid.wait_for_nodes(1)
        state_dir = grid.root / "w1"
        with grid.client() as client:
            job = client.train(base, dataset=corpus, params=PARAMS)
            wait_until(lambda: _saved_step(state_dir) >= 20, "a task checkpoint past step 20",
                       timeout_s=120, poll_s=0.05)  # fmt: skip
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            saved = _saved_step(state_dir)  # the newest: nothing writes it any more
            assert 0 < saved < STEPS, "the task ended before the kill"
            grid.start_worker("w1", kinds="diloco-train", threads=1, benchmark=False)
            job.wait(timeout=300)
            metrics = job.metrics()
    assert metrics["state"] == "completed" and metrics["rounds_done"] == 1
    log = (grid.root / "w1.log").read_text()
    resumed = [int(step) for step in re.findall(r"going on from step (\d+)", log)]
    assert resumed == [saved], log[-3000:]
    rounds = metrics["rounds"]
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"], rounds
