"""The broker interface: the ready queue, node presence, and messages between processes.

Everything here can be rebuilt from the SQL store (the ready queue from tasks in state
`ready`, presence and connections from the next heartbeats), so a broker may lose its
contents at any time: `needs_rebuild` says when it did. Messages are best effort: a lost
one delays work (the monitor's passes make up for it), it never loses any.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from idlegrid.store.base import ReadyTask


class Broker(Protocol):
    # -- ready queue --------------------------------------------------------------------------

    async def push_ready(self, entries: Sequence[ReadyTask]) -> None:
        """Add tasks to the ready queue (idempotent per task id)."""

    async def ready_candidates(self, *, limit: int) -> list[ReadyTask]:
        """Up to `limit` ready tasks, oldest first, without removing them."""

    async def discard(self, task_ids: Iterable[int]) -> None:
        """Remove tasks from the ready queue (claimed or cancelled)."""

    async def ready_count(self) -> int: ...

    async def replace_ready(self, entries: Sequence[ReadyTask]) -> None:
        """Refill the ready queue from the store and mark it complete.

        Entries another process pushed meanwhile stay (a claim discards stale ones), so
        several processes may rebuild at once.
        """

    async def needs_rebuild(self) -> bool:
        """True until `replace_ready` ran, and again after the broker lost its contents."""

    # -- nodes --------------------------------------------------------------------------------

    async def node_seen(self, node_id: int, at: float, *, owner: str = "") -> None:
        """The node was heard from at `at`; through a connection process `owner` holds."""

    async def presence(self) -> dict[int, float]:
        """Last time each known node was heard from."""

    async def silent_nodes(self, *, before: float) -> list[int]:
        """Known nodes last heard from before `before`: found without reading the fleet,
        as every process looks for them every pass."""

    async def forget_node(self, node_id: int) -> None:
        """Drop a node's presence and connection (it went offline)."""

    async def node_disconnected(self, node_id: int, owner: str) -> None:
        """Forget the node's connection if `owner` still holds it."""

    async def connections(self) -> dict[int, str]:
        """Which process holds each connected node."""

    # -- leadership ---------------------------------------------------------------------------

    async def hold_lease(self, name: str, holder: str, *, ttl_s: float) -> bool:
        """Take the lease `name` for `holder`, or renew it, for `ttl_s` seconds.

        False while another holder's lease runs. A lease lost with the broker's contents
        is taken again by whoever asks first: leadership saves work, it does not make
        anything correct (the store's conditional updates do).
        """
        ...

    async def release_lease(self, name: str, holder: str) -> None:
        """Give up the lease `name` if `holder` holds it."""
        ...

    # -- messages between coordinator processes -----------------------------------------------

    async def publish(self, channel: str, payload: Mapping[str, Any]) -> None:
        """Send a JSON-able message to every subscriber of `channel`, in every process."""

    def subscribe(self, channel: str) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Subscribed once entered: the messages published on `channel` from then on."""
        ...

    async def close(self) -> None: ...
