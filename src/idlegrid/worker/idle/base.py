"""The idle-probe interface: how long since the owner last touched this machine.

One small interface, one probe per way of knowing. A probe that cannot tell raises
`ProbeUnavailable` with the reason (no X display, no permission, not this platform); any
other exception is a probe that broke. `IdleSource` asks its probes in order, uses the
first that can tell, and logs once when one breaks or stops being able to tell, so a
broken probe falls back to the next instead of leaving the worker blind.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


class ProbeUnavailable(Exception):
    """This probe cannot tell on this machine now; the message says why."""


class IdleProbe(Protocol):
    name: str

    def idle_seconds(self) -> float:
        """Seconds since the last user input; raises ProbeUnavailable if it cannot tell."""
        ...


@dataclass(frozen=True)
class ProbeReading:
    probe: str
    idle_s: float | None  # None: this probe cannot tell
    detail: str = ""  # why it cannot tell, or what it broke with


class IdleSource:
    """The user's idle time from the first of `probes` that can tell."""

    def __init__(self, probes: Sequence[IdleProbe]) -> None:
        self.probes = list(probes)
        self.current: str | None = None  # name of the probe that gave the last reading
        self._complained: set[str] = set()

    def read(self) -> ProbeReading:
        """The first usable reading; a reading with idle_s None when no probe can tell."""
        for probe in self.probes:
            reading = read_probe(probe)
            if reading.idle_s is not None:
                self._switch(reading.probe)
                return reading
            if reading.probe == self.current or reading.detail.startswith("failed"):
                self._complain(reading)
        self._switch(None)
        return ProbeReading("none", None, "no probe can tell how long the machine was idle")

    def read_all(self) -> list[ProbeReading]:
        """Every probe's reading, for `idlegrid worker --show-idle` and the local page."""
        return [read_probe(probe) for probe in self.probes]

    def _switch(self, name: str | None) -> None:
        if name != self.current:
            log.info("idle detection: using %s", name or "no probe (none can tell)")
            self.current = name

    def _complain(self, reading: ProbeReading) -> None:
        if reading.probe not in self._complained:
            self._complained.add(reading.probe)
            log.warning(
                "idle probe %s: %s; falling back to the next", reading.probe, reading.detail
            )


def read_probe(probe: IdleProbe) -> ProbeReading:
    try:
        return ProbeReading(probe.name, max(0.0, float(probe.idle_seconds())))
    except ProbeUnavailable as exc:
        return ProbeReading(probe.name, None, str(exc))
    except Exception as exc:  # a broken probe must not stop the worker: the next one reads
        return ProbeReading(probe.name, None, f"failed: {type(exc).__name__}: {exc}")
