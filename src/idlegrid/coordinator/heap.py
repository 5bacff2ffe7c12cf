"""Keep the cyclic garbage collector's long passes off a long-lived server's event loop.

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
unfrozen survivors (0.35 to 0.54 s every 10 s at 10,000 nodes).

It also runs the young passes on a clock (`young_every_s`, `gc.collect(1)`). The
collector's own trigger counts allocations minus deallocations, and a fleet's steady
state nets to zero: each heartbeat makes about 17 objects (the parsed message, the
coroutines and future of the connection's next receive) that live until that
connection's next heartbeat and then free the previous ones. So automatic young passes
came seldom, each walking every survivor since the last one: at 10,000 nodes 60,000 to
125,000 objects (the probe in docs/benchmarks-history.md), 0.15 to 0.45 s a pass, with no
heartbeat answered meanwhile. A pass every second walks one second's survivors (about
11,000 objects at 667 heartbeats a second) and moves them to generation 2, which no
automatic pass walks; the next freeze takes them out of every later pass.

The collector belongs to the process, not to one app: only the process's owner (`idlegrid
serve`) starts a keeper; an application that embeds the coordinator decides for itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger(__name__)

# A generation-2 threshold no run reaches: a full pass after this many generation-1
# passes (one every few seconds under load: decades).
NO_AUTOMATIC_FULL_PASS = 1 << 30


class HeapKeeper:
    """Young passes on a clock, survivors frozen, a full collection now and then."""

    def __init__(
        self, *, freeze_every_s: float, full_every_s: float, young_every_s: float = 1.0
    ) -> None:
        if not 0 < young_every_s <= freeze_every_s <= full_every_s:
            raise ValueError("need 0 < young_every_s <= freeze_every_s <= full_every_s")
        self.young_every_s = young_every_s
        self.freeze_every_s = freeze_every_s
        self.full_every_s = full_every_s
        self.last_freeze = self.last_full = time.monotonic()
        self.full_passes = 0

    def young(self) -> None:
        """Collect the young generations: what survives moves to generation 2."""
        gc.collect(1)

    def freeze(self) -> None:
        """Collect the young generations, freeze what survived.

        Not `gc.get_freeze_count()` here: it walks the whole permanent generation (0.13 to
        0.27 s at 10,000 nodes, the longest stall left in `benchmarks/fleet.py`); only
        the hourly full pass logs it.
        """
        self.young()
        gc.freeze()
        self.last_freeze = time.monotonic()

    def full(self) -> float:
        """Unfreeze, collect everything, freeze again; the seconds it took."""
        began = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        took = time.perf_counter() - began
        self.last_freeze = self.last_full = time.monotonic()
        self.full_passes += 1
        log.info(
            "full garbage collection: %d unreachable, %d objects frozen, %.0f ms",
            found,
            gc.get_freeze_count(),
            took * 1000,
        )
        return took

    def step(self) -> None:
        """One tick: a full pass when one is due, else a freeze when due, else a young pass."""
        now = time.monotonic()
        if now - self.last_full >= self.full_every_s:
            self.full()
        elif now - self.last_freeze >= self.freeze_every_s:
            self.freeze()
        else:
            self.young()

    async def run(self, stopping: asyncio.Event) -> None:
        """Tick every `young_every_s` until `stopping` is set (or cancelled); on the way
        out, the collector's thresholds as they were and nothing frozen."""
        young, middle, full = gc.get_threshold()
        gc.set_threshold(young, middle, NO_AUTOMATIC_FULL_PASS)
        try:
            self.freeze()
            while not stopping.is_set():
                await asyncio.sleep(self.young_every_s)
                if not stopping.is_set():
                    self.step()
        finally:
            gc.set_threshold(young, middle, full)
            gc.unfreeze()
