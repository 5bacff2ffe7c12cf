"""A task the worker holds: its assignment, its progress, and where it runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from idlegrid import protocol
from idlegrid.worker.runner import TaskHost


@dataclass
class RunningTask:
    assign: protocol.Assign
    cancel: threading.Event = field(default_factory=threading.Event)
    progress: float = 0.0
    started: float = field(default_factory=time.monotonic)
    # When it got a slot (None while it waits in the prefetch buffer).
    started_at: float | None = None
    host: TaskHost | None = None  # the process running it, once it has a slot
    paused_since: float | None = None  # monotonic; None while it runs
    paused_s: float = 0.0  # time spent suspended before paused_since
    check: bytes | None = None  # a check task's claimed output, once fetched
