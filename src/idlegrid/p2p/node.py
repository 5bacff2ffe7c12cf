"""A standing averager's DHT peer: Hivemind's `DHTNode` in the averager's own event loop.

`hivemind.DHT` runs its node in a forked process and hands every read and write to it
through a pipe and a future shared through torch; an averager needs neither (it runs
one member's meetings and all-reduce, all in one event loop). Here the node and its
p2p daemon live in that loop, and the averager's threads call them through `LocalDHT`,
whose `get` and `store` answer as `hivemind.DHT`'s do (what `roster` and `namer` use).
"""

from __future__ import annotations

import asyncio
from typing import Any

from idlegrid import p2p


class LocalDHT:
    """Synchronous `get` / `store` on a `DHTNode` that runs in `loop` (another thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, node: Any) -> None:
        self._loop, self._node = loop, node

    @classmethod
    def join(cls, loop: asyncio.AbstractEventLoop, peers: list[str], mode: str) -> LocalDHT:
        """Join the DHT at `peers` as a full peer (`mode` "public") or in client mode.
        Either way libp2p's circuit relays are on: a peer only reachable through a relay
        (the bootstrap peer relays) can still be dialled."""
        from hivemind.dht.node import DHTNode

        created = DHTNode.create(
            initial_peers=peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"],
            client_mode=mode == "client", use_relay=True, use_auto_relay=False,
            wait_timeout=p2p.DHT_REQUEST_TIMEOUT_S,
        )  # fmt: skip
        return cls(loop, asyncio.run_coroutine_threadsafe(created, loop).result())

    @property
    def client_mode(self) -> bool:
        return bool(self._node.protocol.client_mode)

    @property
    def p2p(self) -> Any:
        """The node's `hivemind.p2p.P2P` (its daemon): the all-reduce's streams use it."""
        return self._node.p2p

    def get(self, key: Any, latest: bool = False) -> Any:
        """The value under `key` (a `ValueWithExpiration`, or None), as `hivemind.DHT.get`."""
        return self._call(self._node.get(key, latest=latest))

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store `value` until `expiration_time` (wall clock), as `hivemind.DHT.store`."""
        return bool(self._call(self._node.store(key, value, expiration_time, subkey=subkey)))

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
