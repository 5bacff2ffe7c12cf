"""What every part of the coordinator is handed: a narrow context and a fan-out interface.

The parts (job intake, dispatch, leases, the result path, verification, matching, the
round driver, peers, metrics) each receive the `Context` of their process and, where
they change what other parts or processes must hear of, a `FanOut`. None of them holds
the `Grid` facade that wires them, so none can reach into another's internals, and the
import graph of `coordinator/` has no cycle.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from idlegrid.blobs.files import BlobStore
from idlegrid.broker.base import Broker
from idlegrid.coordinator.hub import Hub
from idlegrid.coordinator.jobwatch import JobWatch
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.base import NodeTask, ReadyTask

# The broker channel the coordinator processes of one grid talk on (see `peers`).
CHANNEL = "grid"


@dataclass
class Counters:
    """What this process counted: results by receipt, verdicts, lease expiries."""

    results: Counter[str] = field(default_factory=Counter)
    verified: Counter[str] = field(default_factory=Counter)
    # Adaptive replication: shards run alone, alone with a spot check, escalated back.
    alone: Counter[str] = field(default_factory=Counter)
    lease_expiries: int = 0
    backups: int = 0  # speculative backup tasks handed out


@dataclass
class PresencePause:
    """After the broker failed to record presence, node messages skip it until `until`
    (time.monotonic), so that every message does not wait for an unreachable Redis."""

    until: float = 0.0


@dataclass(frozen=True)
class Context:
    """One coordinator process's shared resources. Frozen: a part cannot swap them; the
    mutable ones (counters, the wake-up event, the pause) are shared objects."""

    settings: CoordinatorSettings
    store: Store
    broker: Broker
    blobs: BlobStore
    hub: Hub
    clock: Callable[[], float]
    counters: Counters
    # Names this process in the broker: which process holds which node's connection.
    process_id: str
    # Set when a node here may get work: new ready tasks, a freed replica, a cancel.
    work_available: asyncio.Event
    # Draws of adaptive replication; a test may seed or replace it.
    random: random.Random
    presence_pause: PresencePause
    # Long polls of jobs (`GET /v1/jobs/{id}?wait_s=`), woken by results and job ends.
    job_watch: JobWatch = field(default_factory=JobWatch)

    async def connected(self) -> set[int]:
        """The nodes connected to this process or, with a shared broker, to any."""
        return set(await self.broker.connections()) | {s.node_id for s in self.hub.sessions()}


class FanOut(Protocol):
    """What a part tells the rest of the grid: this process's other parts, its connected
    nodes, and the other coordinator processes."""

    async def enqueue(self, ready: Sequence[ReadyTask]) -> None:
        """New ready tasks: into the shared queue; wake dispatchers here and elsewhere."""

    async def send_cancels(self, held: Sequence[NodeTask], *, reason: str) -> None:
        """Tell the holders of these tasks (here or in another process) to drop them."""

    async def job_ended(self, job_id: int) -> None:
        """A job reached a terminal state: every process drops what it cached of it."""

    async def publish(self, message: dict[str, Any]) -> None:
        """Tell the other coordinator processes (see `peers`)."""
