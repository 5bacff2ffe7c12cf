"""Fault points: places where a test may have this process die as a crash would, or fail
as a broken device would.

`IDLEGRID_FAULTS` names the points (comma-separated). At a `point` the process kills
itself with SIGKILL: no shutdown code runs, and a transaction still open does not
commit (the tests that kill a coordinator mid-pass use them). At a `failure` the code
raises the error it is given, as a provider that breaks mid-shard does; a worker's task
processes read the variable too, so a test can break one worker's tasks. Unset, as in
production, a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal


def _armed(name: str) -> bool:
    return name in os.environ.get("IDLEGRID_FAULTS", "").split(",")


def point(name: str) -> None:
    """Die here if `name` is armed."""
    if _armed(name):
        os.kill(os.getpid(), signal.SIGKILL)


def failure(name: str, error: Exception) -> None:
    """Raise `error` here if `name` is armed."""
    if _armed(name):
        raise error
