"""Which coordinator process runs the grid-wide passes: the holder of a broker lease.

Several processes share one store and one broker. Passes over the whole grid (lease
expiry, top-up, late results, round timers, presence) need to run in one of them only;
work for a process's own connections runs in each. The lease is renewed every third of
its length; when its holder dies, another process takes it once it runs out.

Leadership saves work; it does not make anything correct. Every pass is a set of
conditional updates, so two processes that both believe they lead for a moment (the
broker lost the lease and two asked at once) apply each change once.
"""

from __future__ import annotations

import logging

from idlegrid.broker.base import Broker

log = logging.getLogger(__name__)

LEASE_NAME = "monitor"


class Leadership:
    """This process's claim to lead; `renew` is called on a clock (`Monitor` does)."""

    def __init__(self, broker: Broker, holder: str, *, lease_s: float) -> None:
        self.broker = broker
        self.holder = holder
        self.lease_s = lease_s
        self.is_leader = False

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / 3

    async def renew(self) -> bool:
        """Take or renew the lease; whether this process leads now."""
        try:
            leads = await self.broker.hold_lease(LEASE_NAME, self.holder, ttl_s=self.lease_s)
        except Exception:
            # A broker that cannot be reached cannot tell: stop leading until it can, so
            # that two processes do not both run the passes for long.
            log.exception("could not renew the monitor lease")
            leads = False
        if leads != self.is_leader:
            log.info("this process %s the grid-wide passes", "runs" if leads else "stopped running")
        self.is_leader = leads
        return leads

    async def release(self) -> None:
        """Give the lease up (on shutdown), so another process takes over at once."""
        if self.is_leader:
            self.is_leader = False
            try:
                await self.broker.release_lease(LEASE_NAME, self.holder)
            except Exception:
                log.exception("could not release the monitor lease")
