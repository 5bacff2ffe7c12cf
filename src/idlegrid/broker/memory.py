"""In-process broker: the embedded default for a single coordinator process."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from idlegrid.store.base import ReadyTask


class MemoryBroker:
    def __init__(self) -> None:
        # Insertion-ordered: task ids grow, so iteration is oldest first.
        self._ready: dict[int, ReadyTask] = {}
        self._seen: dict[int, float] = {}

    async def push_ready(self, entries: Sequence[ReadyTask]) -> None:
        for entry in entries:
            self._ready.setdefault(entry.task_id, entry)

    async def ready_candidates(self, *, limit: int) -> list[ReadyTask]:
        out = []
        for entry in self._ready.values():
            out.append(entry)
            if len(out) >= limit:
                break
        return out

    async def discard(self, task_ids: Iterable[int]) -> None:
        for task_id in task_ids:
            self._ready.pop(task_id, None)

    async def ready_count(self) -> int:
        return len(self._ready)

    async def replace_ready(self, entries: Sequence[ReadyTask]) -> None:
        self._ready = {entry.task_id: entry for entry in sorted(entries, key=lambda e: e.task_id)}

    async def node_seen(self, node_id: int, at: float) -> None:
        self._seen[node_id] = max(at, self._seen.get(node_id, 0.0))

    async def presence(self) -> dict[int, float]:
        return dict(self._seen)

    async def forget_node(self, node_id: int) -> None:
        self._seen.pop(node_id, None)

    async def close(self) -> None:
        self._ready.clear()
