"""Daily statistics exports of users, teams and nodes (gzip CSV), as BOINC's db_dump.

Stats sites fetch these instead of crawling pages. `Exporter` writes them in the
background of the coordinator (an owned task, started and stopped with the app), a few
thousand rows per read so the event loop keeps serving; each file is written aside and
renamed into place, so a download never sees half a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import gzip
import io
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from idlegrid.store import Store, stats
from idlegrid.verification.credit import recent_average

log = logging.getLogger(__name__)
PAGE = 5000
FILES: dict[str, stats.Board] = {
    "users.csv.gz": "accounts",
    "teams.csv.gz": "teams",
    "nodes.csv.gz": "nodes",
}
HEADERS = {
    "accounts": ["id", "name", "team_id", "team", "credit_total", "recent_average", "validated"],
    "teams": ["id", "name", "members", "credit_total", "recent_average", "validated"],
    "nodes": ["id", "name", "owner_id", "owner", "credit_total", "recent_average", "validated"],
}


@dataclass(frozen=True)
class ExportFile:
    name: str
    size: int
    written_at: float


def folder(data_dir: Path) -> Path:
    return data_dir / "stats"


def listing(data_dir: Path) -> list[ExportFile]:
    found = []
    for name in FILES:
        path = folder(data_dir) / name
        if path.is_file():
            info = path.stat()
            found.append(ExportFile(name, info.st_size, info.st_mtime))
    return found


def path_of(data_dir: Path, name: str) -> Path | None:
    """The export file of that name, if it is one and was written."""
    if name not in FILES:
        return None
    path = folder(data_dir) / name
    return path if path.is_file() else None


async def write_exports(store: Store, data_dir: Path, *, now: float) -> list[Path]:
    """Write every export file now; return their paths."""
    target = folder(data_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, board in FILES.items():
        path = target / name
        await _write(store, board, path, now=now)
        written.append(path)
    return written


async def _write(store: Store, board: stats.Board, path: Path, *, now: float) -> None:
    partial = path.with_suffix(".partial")
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(HEADERS[board])
    with gzip.open(partial, "wt", encoding="utf-8", newline="") as out:
        after = 0
        while True:
            rows = await store.web.web_read(stats.export_page, board, after_id=after, limit=PAGE)
            for row in rows:
                writer.writerow(_fields(board, row, now))
            await asyncio.to_thread(out.write, buffer.getvalue())
            buffer.seek(0)
            buffer.truncate()
            if len(rows) < PAGE:
                break
            after = rows[-1].id
    os.replace(partial, path)


def _fields(board: stats.Board, row: stats.Standing, now: float) -> list[object]:
    credit = [
        round(row.credit.total, 6),
        round(recent_average(row.credit, now=now), 6),
        row.validated,
    ]
    if board == "teams":
        return [row.id, row.name, row.members, *credit]
    return [row.id, row.name, row.parent_id or "", row.parent_name or "", *credit]


class Exporter:
    """Writes the exports at start (if they are older than `interval_s`) and then every
    `interval_s`; an owned background task."""

    def __init__(self, store: object, data_dir: Path, *, interval_s: float) -> None:
        self.store = cast(Store, store)
        self.data_dir = data_dir
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="idlegrid-stats-exports")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            wait = self._due_in()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await write_exports(self.store, self.data_dir, now=time.time())
            except Exception:  # the next pass tries again; pages keep working meanwhile
                log.exception("writing the statistics exports failed")
                await asyncio.sleep(min(self.interval_s, 300.0))

    def _due_in(self) -> float:
        files = listing(self.data_dir)
        if len(files) < len(FILES):
            return 0.0
        oldest = min(f.written_at for f in files)
        return max(0.0, oldest + self.interval_s - time.time())
