"""A training task's progress on disk, so a long task survives its worker.

A `diloco-train` task saves its inner loop (the step reached, the local weights, AdamW's
moments, the losses so far) every `every_s` seconds, as BOINC's clients checkpoint every
60 s. After a worker restart, a reboot, or a task given back and handed here again, the
same task (the same payload: job, round, shard, seed, starting weights) starts from
there instead of from step 0, and ends with the update it would have sent unbroken: the
batches are drawn from the task's seed and the skipped ones are drawn again and dropped.

The file is written next to its final name and renamed into place, so a worker killed
while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import io
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idlegrid.kinds.diloco.worker_state import OptimizerState

log = logging.getLogger(__name__)

FILE = "inner.npz"


@dataclass(frozen=True)
class InnerProgress:
    """Where an inner loop stands after `step` steps."""

    step: int
    local: np.ndarray  # the local weights, flat float32
    optimizer: OptimizerState
    losses: tuple[float, ...]


class Checkpointer:
    """Saves a task's progress to `directory` at most every `every_s` seconds."""

    def __init__(self, directory: Path, every_s: float) -> None:
        self.path = directory / FILE
        self.every_s = every_s
        self._clock = time.monotonic
        self._last = self._clock()

    def due(self) -> bool:
        return self._clock() - self._last >= self.every_s

    def save(self, progress: InnerProgress) -> None:
        buffer = io.BytesIO()
        np.savez(
            buffer,
            step=np.int64(progress.step),
            local=progress.local.astype(np.float32),
            optimizer_step=np.int64(progress.optimizer.step),
            exp_avg=progress.optimizer.exp_avg,
            exp_avg_sq=progress.optimizer.exp_avg_sq,
            losses=np.asarray(progress.losses, dtype=np.float64),
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_bytes(buffer.getvalue())
        os.replace(partial, self.path)
        self._last = self._clock()

    def load(self, size: int) -> InnerProgress | None:
        """The saved progress of a model of `size` parameters, or None (none, or unusable:
        then the task starts from step 0, which costs time and nothing else)."""
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                progress = InnerProgress(
                    step=int(saved["step"]),
                    local=saved["local"].astype(np.float32),
                    optimizer=OptimizerState(
                        int(saved["optimizer_step"]),
                        saved["exp_avg"].astype(np.float32),
                        saved["exp_avg_sq"].astype(np.float32),
                    ),
                    losses=tuple(float(x) for x in saved["losses"]),
                )
        except FileNotFoundError:
            return None
        except (OSError, KeyError, ValueError) as exc:
            log.warning("ignoring the unreadable checkpoint %s: %s", self.path, exc)
            return None
        if progress.local.size != size or not progress.optimizer.fits(size):
            log.warning("ignoring the checkpoint %s: it is of another model", self.path)
            return None
        log.info("going on from step %d, saved in %s", progress.step, self.path)
        return progress
