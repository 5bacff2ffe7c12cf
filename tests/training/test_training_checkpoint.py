"""A training task killed mid-round goes on from its checkpoint and ends where an unbroken
run ends: the inner loop on its own, and `diloco-train` in a real worker process."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco.data import TokenData
from idlegrid.kinds.diloco.task_checkpoint import FILE, Checkpointer
from idlegrid.training import models

torch = pytest.importorskip("torch")
from idlegrid.kinds.diloco import inner  # noqa: E402

LM = models.LMConfig(vocab=103, context=32, width=16, layers=1, heads=2)
SETTINGS = inner.InnerSettings(steps=8, batch_size=4, seq_len=32, lr=3e-3)


class Killed(Exception):
    """Stands for the worker dying after a step."""


def _train(checkpoint: Checkpointer | None = None, kill_after: int = 0) -> inner.InnerResult:
    torch.set_num_threads(1)
    start = models.init_weights("transformer-lm", LM, 0)
    data = TokenData(corpus.train_tokens()[:20_000])

    def on_step(done: int) -> None:
        if done == kill_after:
            raise Killed()

    return inner.train_inner(
        "transformer-lm", LM, start, data, SETTINGS, seed=3, on_step=on_step,
        checkpoint=checkpoint,
    )  # fmt: skip


def test_a_killed_inner_loop_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    unbroken = _train()
    saved = Checkpointer(tmp_path, every_s=0.0)  # a checkpoint after every step
    with pytest.raises(Killed):
        _train(saved, kill_after=5)
    assert (tmp_path / FILE).is_file()
    assert saved.load(unbroken.delta.size).step == 5  # type: ignore[union-attr]
    # Starting again from step 5 (the first five batches drawn and dropped), it ends as
    # the unbroken run ends.
    steps: list[int] = []
    resumed = inner.train_inner(
        "transformer-lm", LM, models.init_weights("transformer-lm", LM, 0),
        TokenData(corpus.train_tokens()[:20_000]), SETTINGS, seed=3,
        on_step=steps.append, checkpoint=Checkpointer(tmp_path, every_s=0.0),
    )  # fmt: skip
    assert steps == [6, 7, 8]
    np.testing.assert_allclose(resumed.delta, unbroken.delta, rtol=1e-5, atol=1e-7)
    assert resumed.loss_first == unbroken.loss_first
    assert resumed.loss_mean == pytest.approx(unbroken.loss_mean, rel=1e-6)


def test_a_checkpoint_of_another_model_or_a_broken_file_is_ignored(tmp_path: Path) -> None:
    saved = Checkpointer(tmp_path, every_s=0.0)
    with pytest.raises(Killed):
        _train(saved, kill_after=2)
    size = models.parameter_count("transformer-lm", LM)
    assert saved.load(size) is not None
    assert saved.load(size + 1) is None
    (tmp_path / FILE).write_bytes(b"not a checkpoint")
    assert saved.load(size) is None
    steps: list[int] = []
    inner.train_inner(
        "transformer-lm", LM, models.init_weights("transformer-lm", LM, 0),
        TokenData(corpus.train_tokens()[:20_000]), SETTINGS, seed=3,
        on_step=steps.append, checkpoint=saved,
    )  # fmt: skip
    assert steps[0] == 1  # from the start


def test_checkpoints_wait_for_their_interval(tmp_path: Path) -> None:
    saved = Checkpointer(tmp_path, every_s=3600.0)
    _train(saved)
    assert not (tmp_path / FILE).exists()


# -- a real worker -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_diloco_task_killed_mid_round_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    from idlegrid.devtools.localgrid import LocalGrid
    from idlegrid.kinds.diloco.dataset import corpus_dataset_blob

    params = {
        "architecture": "transformer-lm",
        "model": {"width": 32, "layers": 1, "heads": 2, "context": 32},
        "rounds": 1, "workers": 1,
        "inner": {"steps": 400, "batch_size": 8, "seq_len": 32},
    }  # fmt: skip
    extra = {"IDLEGRID_CHECKPOINT_EVERY_S": "0.5"}
    with LocalGrid(tmp_path, extra_env=extra) as grid:
        worker = grid.start_worker("w", kinds="diloco-train", benchmark=False, threads=1)
        grid.wait_for_nodes(1)
        checkpoints = tmp_path / "w" / "checkpoints"
        with grid.client() as client:
            job = client.submit(
                "diloco-train", inputs={"dataset": corpus_dataset_blob()}, params=params
            )
            (saved,) = wait_until(
                lambda: list(checkpoints.glob(f"*/{FILE}")), "a checkpoint", timeout_s=120
            )
            with np.load(saved) as content:
                assert 0 < int(content["step"]) < 400
            worker.send_signal(signal.SIGKILL)  # mid-round, mid-task
            worker.wait(10)
            grid.start_worker("w", kinds="diloco-train", benchmark=False, threads=1)
            job.wait(timeout=600)
            assert job.info()["state"] == "completed"
        log = (tmp_path / "w.log").read_text()
        assert "going on from step" in log, log
        assert not list(checkpoints.iterdir()), "the checkpoint outlived its task"
