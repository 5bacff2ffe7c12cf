"""Per-task scratch directories: where a kind keeps a long task's checkpoint.

A task's directory is named by what it computes (kind, params, and its input's hash: the
input was checked against that hash on arrival), not by its task id, so the same work
handed to this node again (after a restart, a reboot, or a task given back and
reassigned) finds the progress saved by the earlier attempt. It is removed when the task
ends with a result or a failure; one left by work that never came back is removed after
`KEEP_S`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEEP_S = 7 * 86400.0


class ScratchDirs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def for_task(self, kind: str, params: dict[str, Any], input_hash: str) -> Path:
        digest = hashlib.sha256()
        digest.update(kind.encode())
        digest.update(json.dumps(params, sort_keys=True, default=str).encode())
        digest.update(input_hash.encode())
        return self.root / digest.hexdigest()[:32]

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def prune(self, now: float | None = None) -> None:
        """Remove directories untouched for `KEEP_S` (work that never came back)."""
        now = time.time() if now is None else now
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            try:
                newest = max([path.stat().st_mtime, *(f.stat().st_mtime for f in path.iterdir())])
            except OSError:
                continue
            if now - newest > KEEP_S:
                log.info("removing the stale task checkpoint %s", path.name)
                self.remove(path)
