"""The broker interface: the ready queue and node presence.

Everything here can be rebuilt from the SQL store (the ready queue from tasks in state
`ready`, presence from the next heartbeats), so a broker may lose its contents at any time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from idlegrid.store.base import ReadyTask


class Broker(Protocol):
    async def push_ready(self, entries: Sequence[ReadyTask]) -> None:
        """Add tasks to the ready queue (idempotent per task id)."""

    async def ready_candidates(self, *, limit: int) -> list[ReadyTask]:
        """Up to `limit` ready tasks, oldest first, without removing them."""

    async def discard(self, task_ids: Iterable[int]) -> None:
        """Remove tasks from the ready queue (claimed or cancelled)."""

    async def ready_count(self) -> int: ...

    async def replace_ready(self, entries: Sequence[ReadyTask]) -> None:
        """Drop the ready queue and refill it (rebuild from the store)."""

    async def node_seen(self, node_id: int, at: float) -> None: ...

    async def presence(self) -> dict[int, float]:
        """Last time each known node was heard from."""

    async def forget_node(self, node_id: int) -> None: ...

    async def close(self) -> None: ...
