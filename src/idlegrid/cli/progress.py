"""Progress of a job while the SDK or the CLI waits for it.

On a terminal (or in a notebook) a rich bar, with what the job waits for, if anything,
on the line below it. Anywhere else (a pipe, a log file) one plain line each time
something changes, so a log shows the whole story and a stuck job says why at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.text import Text

Metrics = Callable[[], dict[str, Any]]


def waiting_note(info: dict[str, Any]) -> str:
    """The job's `waiting_for` reasons as one line ('' when nothing holds it up)."""
    reasons = info.get("waiting_for") or []
    return "waiting for: " + "; ".join(reasons) if reasons else ""


class _NotedProgress(Progress):
    """A rich Progress with one line of text under its bars."""

    note = ""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.note:
            yield Text(self.note, style="yellow")


class JobProgress:
    """Shows one job's progress: shards for most kinds, rounds for training jobs."""

    def __init__(
        self,
        job_id: int,
        *,
        metrics: Metrics | None = None,
        tokens: Callable[[], tuple[int, int]] | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        """`metrics`: how to read a training job's rounds (None: not a training job);
        `tokens`: how to read a generation job's tokens done and in all."""
        self.job_id = job_id
        self.metrics = metrics
        self.tokens = tokens
        self.stream = stream if stream is not None else sys.stderr
        self.console = Console(file=self.stream)
        self.live = self.console.is_terminal or self.console.is_jupyter
        self.started = time.monotonic()
        self._last_line = ""
        self.progress: _NotedProgress | None = None
        if self.live:
            self.progress = _NotedProgress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.main = self.progress.add_task(f"job {job_id}", total=None)
            self.round = self.progress.add_task("", total=None, visible=False)

    def update(self, info: dict[str, Any]) -> None:
        state, note = info["state"], waiting_note(info)
        if self.tokens is not None:
            (done, total), unit, extra, round_part = self.tokens(), "tokens", "", None
        elif self.metrics is None:
            done, total, unit, extra = info["shards_done"], info["shards_total"], "shards", ""
            round_part = None
        else:
            found = self.metrics()
            done, total, unit = found["rounds_done"], found["rounds_total"], "rounds"
            loss = found.get("eval_loss")
            extra = "" if loss is None else f" eval loss {loss:.4f}"
            round_part = _open_round(found)
        if self.progress is not None:
            self._update_bar(state, done, total, unit, extra, round_part, note)
            return
        line = f"job {self.job_id} {state}: {done}/{total} {unit}{extra}"
        if round_part is not None:
            line += f", round {round_part[0]} {round_part[1]}/{round_part[2]} updates"
        if note:
            line += f"; {note}"
        if line != self._last_line:
            elapsed = time.monotonic() - self.started
            print(f"[{elapsed:6.1f} s] {line}", file=self.stream, flush=True)
            self._last_line = line

    def _update_bar(
        self,
        state: str,
        done: int,
        total: int,
        unit: str,
        extra: str,
        round_part: tuple[int, int, int] | None,
        note: str,
    ) -> None:
        assert self.progress is not None
        self.progress.update(
            self.main,
            total=total,
            completed=done,
            description=f"job {self.job_id} {unit} [{state}]{extra}",
        )
        if round_part is not None:
            number, updates, needed = round_part
            self.progress.update(
                self.round,
                total=needed,
                completed=updates,
                description=f"round {number} updates",
                visible=True,
            )
        self.progress.note = note
        self.progress.refresh()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _open_round(metrics: dict[str, Any]) -> tuple[int, int, int] | None:
    """(round, updates, updates needed) of the open round of a training job, if any."""
    current = metrics["rounds"][-1] if metrics["rounds"] else None
    if current is None or current["state"] != "open" or current["final"]:
        return None
    return current["round"], current["updates"] or 0, current["updates_needed"] or 0


class UploadProgress:
    """Shows each chunked upload (a model's weights): a bar with bytes on a terminal,
    else a line at the start and one at the end (`Client(upload_progress=...)`)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream or sys.stderr
        self._progress: Progress | None = None
        self._task: Any = None

    def __call__(self, name: str, sent: int, size: int) -> None:
        from rich.progress import DownloadColumn, TransferSpeedColumn

        if self._progress is None:
            if not self._stream.isatty():
                self._plain(name, sent, size)
                return
            self._progress = Progress(
                f"uploading {name}",
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                console=Console(file=self._stream),
            )
            self._progress.start()
            self._task = self._progress.add_task(name, total=size)
        self._progress.update(self._task, completed=sent)
        if sent >= size:
            self._progress.stop()
            self._progress = None

    def _plain(self, name: str, sent: int, size: int) -> None:
        if sent >= size:
            state = "done"
        elif name != self._task:  # its first call: from 0, or where a broken one ended
            state = f"going on from byte {sent:,}" if sent else "starting"
        else:
            return
        self._task = None if sent >= size else name
        print(f"upload of {name} ({size:,} bytes): {state}", file=self._stream, flush=True)
