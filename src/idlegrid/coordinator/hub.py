"""Connected nodes of this coordinator process and how to send to them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from idlegrid.policy.scheduler import NodeView

log = logging.getLogger(__name__)

SendText = Callable[[str], Awaitable[None]]


@dataclass
class NodeSession:
    """One live WebSocket connection of a node."""

    node_id: int
    account_id: int
    name: str
    slots: int
    view: NodeView
    kind_rates: dict[str, float]
    send_text: SendText
    close: Callable[[], Awaitable[None]]
    # Where it connects from (replicas of a shard go to distinct networks) and the
    # backend it computes on (trust is kept per kind and backend).
    network: str = ""
    backend: str = "cpu"
    live: set[int] = field(default_factory=set)
    # No claims before this time (time.monotonic): its quota is used up or it is
    # suspended, so asking the store again at every new task would be wasted work.
    idle_until: float = 0.0
    requested: int = 0
    # Progress of running tasks by shard id (from heartbeats), and each task's shard.
    progress: dict[int, float] = field(default_factory=dict)
    shard_of: dict[int, int] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fill_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def wants(self) -> int:
        """Tasks to give now: what the node asked for, within its free slots."""
        return max(0, min(self.requested, self.slots - len(self.live)))

    def forget_task(self, task_id: int) -> None:
        self.live.discard(task_id)
        shard_id = self.shard_of.pop(task_id, None)
        if shard_id is not None:
            self.progress.pop(shard_id, None)

    async def send(self, message: BaseModel) -> bool:
        """Send one message; False when the connection is gone."""
        try:
            async with self.send_lock:
                await self.send_text(message.model_dump_json())
            return True
        except Exception as exc:  # a dead socket raises many kinds of errors
            log.info("send to node %s failed: %s", self.node_id, exc)
            return False


class Hub:
    """Sessions by node id. One session per node: a new connection replaces the old."""

    def __init__(self) -> None:
        self._sessions: dict[int, NodeSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, node_id: int) -> NodeSession | None:
        return self._sessions.get(node_id)

    def sessions(self) -> list[NodeSession]:
        return list(self._sessions.values())

    def add(self, session: NodeSession) -> NodeSession | None:
        """Register a session; return the one it replaces, if any."""
        old = self._sessions.get(session.node_id)
        self._sessions[session.node_id] = session
        return old

    def remove(self, session: NodeSession) -> bool:
        """Unregister `session` if it is still the node's current one."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
            return True
        return False
