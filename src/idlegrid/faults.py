"""Fault points: places where a test may have this process die as a crash would.

`IDLEGRID_FAULTS` names the points (comma-separated) at which the process kills itself
with SIGKILL: no shutdown code runs, and a transaction still open does not commit. The
tests that kill a coordinator mid-pass use them. Unset, as in production, a point costs
one environment lookup.
"""

from __future__ import annotations

import os
import signal


def point(name: str) -> None:
    """Die here if `name` is armed."""
    armed = os.environ.get("IDLEGRID_FAULTS")
    if armed and name in armed.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
