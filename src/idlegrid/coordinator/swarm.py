"""Where the members of peer-to-peer training rounds meet: the coordinator's bootstrap
DHT peer (`idlegrid.p2p.supervisor`, in a child process: this process never imports
torch), or the addresses of a DHT run elsewhere (`p2p_peers`).

The round driver names these addresses in each member's task; without them, intake
refuses peer-to-peer jobs with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from idlegrid import p2p
from idlegrid.p2p import seal
from idlegrid.p2p.supervisor import BootstrapError, BootstrapPeer
from idlegrid.settings import CoordinatorSettings

log = logging.getLogger(__name__)
MODES = ("auto", "on", "off")
ROUND_KEY_FILE = "p2p-round.key"


class Swarm:
    """The bootstrap DHT peer this coordinator runs, if any, and the addresses to hand out."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        if settings.p2p not in MODES:
            raise ValueError(f"p2p must be one of {', '.join(MODES)}, got {settings.p2p!r}")
        self._settings = settings
        self._peer: BootstrapPeer | None = None
        self._starting: asyncio.Task[None] | None = None
        self.peers: tuple[str, ...] = tuple(settings.p2p_peers)
        # The coordinator's round key: each p2p round's secret derives from it, which
        # seals the round's records in the DHT (p2p/seal.py). Kept in the data folder,
        # so that rounds handed out before a restart are still named after it.
        self.key_path = settings.data_dir / ROUND_KEY_FILE
        self.key = b""

    def start_soon(self, ready: Callable[[tuple[str, ...], bytes], None]) -> None:
        """Start the bootstrap peer in the background (importing torch and hivemind takes
        seconds: the coordinator serves meanwhile and refuses p2p jobs until `ready`)."""
        if self.peers:
            self.key = seal.load_key(self.key_path)
            ready(self.peers, self.key)
            return

        async def run() -> None:
            try:
                ready(await self.start(), self.key)
            except RuntimeError as exc:  # p2p "on" without a peer: said, not fatal here
                log.error("%s", exc)

        self._starting = asyncio.create_task(run(), name="p2p-bootstrap")

    async def start(self) -> tuple[str, ...]:
        """Start the bootstrap peer when asked to; the addresses nodes get (may be none)."""
        settings = self._settings
        if settings.p2p == "off" or self.peers:
            return self.peers
        reason = p2p.unavailable()
        if reason is None:
            self.key = seal.load_key(self.key_path)
            self._peer = BootstrapPeer(
                host=settings.p2p_listen_host, port=settings.p2p_port,
                announce=settings.p2p_announce,
                identity=settings.data_dir / "p2p-identity.key", round_key=self.key_path,
            )  # fmt: skip
            try:
                self.peers = await asyncio.to_thread(self._peer.start)
                return self.peers
            except BootstrapError as exc:
                reason = str(exc)
        if settings.p2p == "on":
            raise RuntimeError(f"p2p is on but no bootstrap DHT peer runs: {reason}")
        log.info("peer-to-peer training jobs are refused here: %s", reason)
        return ()

    async def stop(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
            self._starting = None
        if self._peer is not None:
            await asyncio.to_thread(self._peer.stop)
            self._peer = None
