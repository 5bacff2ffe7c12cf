"""Idle detection: one small interface (`IdleProbe`), one probe per way of knowing.

`default_probes` lists this platform's probes, most exact first; `IdleSource` uses the
first that can tell and falls back when one cannot or breaks.
"""

from __future__ import annotations

import sys
from pathlib import Path

from idlegrid.worker.idle.base import (
    IdleProbe,
    IdleSource,
    ProbeReading,
    ProbeUnavailable,
    read_probe,
)
from idlegrid.worker.idle.desktop import HelperFileProbe, MacHidIdleProbe, WindowsLastInputProbe
from idlegrid.worker.idle.linux import (
    InputDevicesProbe,
    LogindProbe,
    TerminalsProbe,
    XScreenSaverProbe,
)
from idlegrid.worker.idle.wayland import GnomeIdleMonitorProbe, WaylandIdleProbe

__all__ = [
    "IdleProbe",
    "IdleSource",
    "ProbeReading",
    "ProbeUnavailable",
    "default_probes",
    "read_probe",
]


def default_probes(state_dir: Path, platform: str = sys.platform) -> list[IdleProbe]:
    """This platform's probes in the order they are trusted; the session helper last."""
    probes: list[IdleProbe]
    if platform == "darwin":
        probes = [MacHidIdleProbe()]
    elif platform == "win32":
        probes = [WindowsLastInputProbe()]
    else:
        probes = [
            XScreenSaverProbe(),
            WaylandIdleProbe(),
            GnomeIdleMonitorProbe(),
            InputDevicesProbe(),
            LogindProbe(),
            TerminalsProbe(),
        ]
    return [*probes, HelperFileProbe(state_dir)]
