"""Keep the cyclic garbage collector's full passes off a long-lived server's event loop.

A coordinator with 10,000 node connections holds hundreds of thousands of long-lived
objects (sockets, transports, sessions, buffers). CPython's collector walks all of them on
every full (generation 2) pass, and those passes come every few seconds while nodes
register: measured at 10,000 nodes (`benchmarks/fleet.py`), 0.8 to 1.8 s each, with
generation-1 passes of 0.1 to 0.2 s, during which no heartbeat is answered.

`HeapKeeper` moves the objects that have survived into the collector's permanent
generation (`gc.freeze()`) every `freeze_every_s` seconds, after a cheap young-generation
pass; later passes then walk only what is new. Reference counting still frees frozen
objects; only reference cycles among them wait for the next full pass, which the keeper
runs every `full_every_s` seconds (unfreeze, collect everything, freeze again) and logs
with its duration. This is the production practice that Instagram described for Django
(https://instagram-engineering.com/dismissing-python-garbage-collection-at-instagram-4dca40b29172)
and that `gc.freeze()`'s documentation names.

While it runs, the keeper owns the full passes: it raises the collector's generation-2
threshold so that no automatic full pass comes between its own. Without that, freezing
makes them more frequent, not less: CPython (3.11 to 3.13) starts a full pass when the
objects promoted since the last one exceed a quarter of those that survived it, and the
frozen ones no longer count, so every tenth generation-1 pass became a full walk of the
unfrozen survivors (0.35 to 0.54 s every 10 s at 10,000 nodes). Survivors now wait in
generation 2 for the next freeze, at most `freeze_every_s`; the young passes still run as
before and free short-lived cycles.

The collector belongs to the process, not to one app: only the process's owner (`idlegrid
serve`) starts a keeper; an application that embeds the coordinator decides for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

log = logging.getLogger(__name__)

# A generation-2 threshold no run reaches: a full pass after this many generation-1
# passes (one every few seconds under load: decades).
NO_AUTOMATIC_FULL_PASS = 1 << 30


class HeapKeeper:
    """Freezes survivors into the permanent generation; a full collection now and then."""

    def __init__(self, *, freeze_every_s: float, full_every_s: float) -> None:
        if freeze_every_s <= 0 or full_every_s < freeze_every_s:
            raise ValueError("need 0 < freeze_every_s <= full_every_s")
        self.freeze_every_s = freeze_every_s
        self.full_every_s = full_every_s
        self.last_full = time.monotonic()
        self.full_passes = 0

    def freeze(self) -> int:
        """Collect the young generations, freeze what survived; the frozen count."""
        gc.collect(1)
        gc.freeze()
        return gc.get_freeze_count()

    def full(self) -> float:
        """Unfreeze, collect everything, freeze again; the seconds it took."""
        began = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        took = time.perf_counter() - began
        self.last_full = time.monotonic()
        self.full_passes += 1
        log.info(
            "full garbage collection: %d unreachable, %d objects frozen, %.0f ms",
            found,
            gc.get_freeze_count(),
            took * 1000,
        )
        return took

    def step(self) -> None:
        """One tick: a full pass when one is due, else a freeze."""
        if time.monotonic() - self.last_full >= self.full_every_s:
            self.full()
        else:
            self.freeze()

    async def run(self, stopping: asyncio.Event) -> None:
        """Tick every `freeze_every_s` until `stopping` is set; unfreeze on the way out."""
        young, middle, full = gc.get_threshold()
        gc.set_threshold(young, middle, NO_AUTOMATIC_FULL_PASS)
        try:
            self.freeze()
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.freeze_every_s)
                if not stopping.is_set():
                    self.step()
        finally:
            gc.set_threshold(young, middle, full)
            gc.unfreeze()
