"""The registered fleet as a job's status reads it: a snapshot reused for a few seconds.

What a live job waits for (`Intake.waiting_for`) is judged against every registered
node, and reading and parsing every node is O(fleet): over a second at 10,000 nodes. A
job page polls that status every two seconds for each viewer, so requests read this
snapshot instead. Past its age a request still gets the old copy while one refresh runs
in the background; only the first request of a process waits for a read. A node that
registers on this process is put into the snapshot at once, so a job waiting for a
machine like it stops waiting on the next poll; other changes (another coordinator's
registrations, a suspension) show within `ttl_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from idlegrid import protocol
from idlegrid.coordinator.hub import node_view
from idlegrid.kinds.base import Requirements
from idlegrid.policy import scheduler
from idlegrid.store import Store
from idlegrid.store.base import NodeRecord

log = logging.getLogger(__name__)

# How old a snapshot may be before a request starts a refresh (seconds).
FLEET_TTL_S = 10.0


@dataclass(frozen=True)
class FleetNode:
    """A registered node and what the scheduler can read of it (None: a row this
    version cannot parse, which no requirement can be matched against)."""

    record: NodeRecord
    view: scheduler.NodeView | None


def fleet_node(record: NodeRecord) -> FleetNode:
    try:
        hardware = protocol.read_stored(protocol.HardwareProfile, record.hardware)
        bench = protocol.read_stored(protocol.Benchmark, record.benchmark)
    except ValueError:
        return FleetNode(record, None)
    return FleetNode(
        record, node_view(record.id, record.kinds, hardware, bench, account_id=record.account_id)
    )


def _meets(node: FleetNode, kind: str, requirements: Requirements) -> bool:
    return node.view is not None and not scheduler.unmet_needs(node.view, kind, requirements)


def _parse_all(records: list[NodeRecord], previous: dict[int, FleetNode]) -> dict[int, FleetNode]:
    """Each record's FleetNode, reusing the view of one whose profile is unchanged."""
    out = {}
    for record in records:
        before = previous.get(record.id)
        if (
            before is not None
            and before.record.hardware == record.hardware
            and before.record.benchmark == record.benchmark
            and before.record.kinds == record.kinds
        ):
            out[record.id] = FleetNode(record, before.view)
        else:
            out[record.id] = fleet_node(record)
    return out


class Fleet:
    """Registered nodes by id, read from the store at most once per `ttl_s`."""

    def __init__(
        self, store: Store, *, clock: Callable[[], float], ttl_s: float = FLEET_TTL_S
    ) -> None:
        self._store = store
        self._clock = clock
        self._ttl_s = ttl_s
        self._nodes: dict[int, FleetNode] | None = None
        self._read_at = float("-inf")
        self._first_read = asyncio.Lock()
        self._refresh: asyncio.Task[None] | None = None
        # Nodes seen here while a read runs: newer than what that read returns.
        self._seen_during_read: dict[int, FleetNode] = {}
        # Answers over this snapshot, by question; emptied whenever the snapshot changes
        # (every poll of a job's status asks the same question of 10,000 nodes).
        self._answers: dict[tuple[object, ...], object] = {}

    async def nodes(self) -> list[FleetNode]:
        """Every registered node as of at most `ttl_s` ago (or the last refresh, while a
        newer one runs)."""
        if self._nodes is None:
            async with self._first_read:
                if self._nodes is None:
                    await self._read()
        elif self._clock() - self._read_at > self._ttl_s and not self._refreshing():
            self._refresh = asyncio.create_task(self._read(), name="fleet-snapshot")
        assert self._nodes is not None
        return list(self._nodes.values())

    async def unmet(self, requirements: Requirements, kind: str) -> str | None:
        """Why no registered node can run a job of `kind` with `requirements` (None when
        one can): `scheduler.unmet` over the snapshot."""
        nodes = await self.nodes()
        key = ("unmet", kind, requirements)
        if key not in self._answers:
            views = [node.view for node in nodes if node.view is not None]
            self._answers[key] = scheduler.unmet(requirements, kind, views)
        return self._answers[key]  # type: ignore[return-value]

    async def able(
        self, kind: str, requirements: Requirements | None = None
    ) -> list[tuple[int, int, str]]:
        """(node id, account id, network) of each unsuspended node that offers `kind`,
        and meets `requirements` where they are given (`scheduler.unmet_needs`: a node
        whose profile cannot be read meets none)."""
        nodes = await self.nodes()
        key = ("able", kind, requirements)
        if key not in self._answers:
            self._answers[key] = [
                (n.record.id, n.record.account_id, n.record.network)
                for n in nodes
                if kind in n.record.kinds
                and n.record.suspended_at is None
                and (requirements is None or _meets(n, kind, requirements))
            ]
        return self._answers[key]  # type: ignore[return-value]

    def saw(self, record: NodeRecord) -> None:
        """A node registered (or said hello again) here: its row as it is now."""
        node = fleet_node(record)
        self._seen_during_read[record.id] = node
        if self._nodes is not None:
            self._nodes[record.id] = node
            self._answers = {}

    async def aclose(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
            self._refresh = None

    def _refreshing(self) -> bool:
        return self._refresh is not None and not self._refresh.done()

    async def _read(self) -> None:
        started = self._clock()
        self._seen_during_read = {}
        try:
            records = await self._store.nodes.list_nodes()
        except Exception:
            if self._nodes is None:
                raise  # the first read: the caller's request fails with it
            log.exception("reading the fleet failed; the job status keeps the last copy")
            return
        # Parsing 10,000 hardware profiles takes a second of CPU: in a thread, so that
        # the event loop (node sockets, other requests) is not held up by it, and only
        # for rows that changed since the last read.
        fresh = await asyncio.to_thread(_parse_all, records, dict(self._nodes or {}))
        fresh.update(self._seen_during_read)
        self._nodes, self._read_at, self._answers = fresh, started, {}
