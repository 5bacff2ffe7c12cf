"""The node's daily download cap: bytes of input blobs fetched today, kept across restarts.

Past the cap (`daily_download_mb`, 0: none) the worker asks for no new work until the
local date changes; tasks it holds go on (their inputs are already here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from datetime import date
from pathlib import Path

log = logging.getLogger(__name__)
MB = 1_000_000


class DailyDownloads:
    def __init__(self, path: Path, *, today: Callable[[], date] = date.today) -> None:
        self.path = path
        self._today = today
        self.day, self.bytes = today().isoformat(), 0
        try:
            raw = json.loads(path.read_text())
            if raw.get("day") == self.day:
                self.bytes = int(raw.get("bytes", 0))
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring %s: %s", path, exc)

    def add(self, size: int) -> None:
        """`size` more bytes arrived."""
        self._roll()
        self.bytes += size
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps({"day": self.day, "bytes": self.bytes}))
        os.replace(scratch, self.path)

    def today_mb(self) -> float:
        self._roll()
        return self.bytes / MB

    def over(self, cap_mb: float) -> bool:
        """Whether today's downloads reached `cap_mb` (never, for a cap of 0)."""
        return cap_mb > 0 and self.today_mb() >= cap_mb

    def _roll(self) -> None:
        day = self._today().isoformat()
        if day != self.day:
            self.day, self.bytes = day, 0
