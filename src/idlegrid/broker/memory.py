"""In-process broker: the embedded default for a single coordinator process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from idlegrid.store.base import ReadyTask


class MemoryBroker:
    def __init__(self) -> None:
        # Kept in task id order (ids grow, so mostly by insertion): oldest first. Urgent
        # entries (`ReadyTask.urgent`) come before all others.
        self._ready: dict[int, ReadyTask] = {}
        self._urgent: dict[int, ReadyTask] = {}
        self._built = False
        self._seen: dict[int, float] = {}
        self._owners: dict[int, str] = {}
        self._subscribers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # name -> holder, until (monotonic)

    async def push_ready(self, entries: Sequence[ReadyTask]) -> None:
        unsorted: set[bool] = set()
        for entry in entries:
            if entry.task_id in self._ready or entry.task_id in self._urgent:
                continue
            lane = self._urgent if entry.urgent else self._ready
            if lane and entry.task_id < next(reversed(lane)):
                unsorted.add(entry.urgent)
            lane[entry.task_id] = entry
        if True in unsorted:  # rare: keep oldest first
            self._urgent = dict(sorted(self._urgent.items()))
        if False in unsorted:
            self._ready = dict(sorted(self._ready.items()))

    async def ready_candidates(self, *, limit: int) -> list[ReadyTask]:
        out: list[ReadyTask] = []
        for entry in (*self._urgent.values(), *self._ready.values()):
            if len(out) >= limit:
                break
            out.append(entry)
        return out

    async def discard(self, task_ids: Iterable[int]) -> None:
        for task_id in task_ids:
            self._ready.pop(task_id, None)
            self._urgent.pop(task_id, None)

    async def ready_count(self) -> int:
        return len(self._ready) + len(self._urgent)

    async def replace_ready(self, entries: Sequence[ReadyTask]) -> None:
        merged = {
            **{entry.task_id: entry for entry in entries},
            **self._ready,
            **self._urgent,
        }
        self._urgent = {t: e for t, e in sorted(merged.items()) if e.urgent}
        self._ready = {t: e for t, e in sorted(merged.items()) if not e.urgent}
        self._built = True

    async def needs_rebuild(self) -> bool:
        return not self._built

    async def node_seen(self, node_id: int, at: float, *, owner: str = "") -> None:
        self._seen[node_id] = max(at, self._seen.get(node_id, 0.0))
        if owner:
            self._owners[node_id] = owner

    async def presence(self) -> dict[int, float]:
        return dict(self._seen)

    async def silent_nodes(self, *, before: float) -> list[int]:
        return [node_id for node_id, seen in self._seen.items() if seen < before]

    async def forget_node(self, node_id: int) -> None:
        self._seen.pop(node_id, None)
        self._owners.pop(node_id, None)

    async def node_disconnected(self, node_id: int, owner: str) -> None:
        if self._owners.get(node_id) == owner:
            del self._owners[node_id]

    async def connections(self) -> dict[int, str]:
        return dict(self._owners)

    async def hold_lease(self, name: str, holder: str, *, ttl_s: float) -> bool:
        now = time.monotonic()
        current = self._leases.get(name)
        if current is not None and current[0] != holder and current[1] > now:
            return False
        self._leases[name] = (holder, now + ttl_s)
        return True

    async def release_lease(self, name: str, holder: str) -> None:
        if self._leases.get(name, ("", 0.0))[0] == holder:
            del self._leases[name]

    async def publish(self, channel: str, payload: Mapping[str, Any]) -> None:
        message = json.loads(json.dumps(payload))  # what Redis would deliver: a copy
        for queue in self._subscribers.get(channel, ()):
            queue.put_nowait(message)

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.setdefault(channel, set()).add(queue)
        try:
            yield _drain(queue)
        finally:
            self._subscribers[channel].discard(queue)

    async def close(self) -> None:
        self._ready.clear()


async def _drain(queue: asyncio.Queue[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    while True:
        yield await queue.get()
