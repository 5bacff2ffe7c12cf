"""Leases: how long a task may run on a node, and what happens when one runs out.

A lease is the coordinator's decision, never the node's: the shard's nominal cost over
the speed the coordinator measured of this node for the kind (its validated tasks, timed
from assignment to result), or over the kind's default speed before it has measured any;
times `lease_slack`, clamped to [`min_lease_s`, `max_lease_s`]. A node's benchmark ranks
candidates for it but never lengthens its leases, and heartbeats never extend one. A
task that outlived its lease, or whose node went silent, is expired; its shard then gets
a new task (`Leases.replenish`, which also fails shards out of attempts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.hub import NodeSession
from idlegrid.devtools import faults
from idlegrid.kinds import UnknownKind, get_kind
from idlegrid.policy import sizing
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import NodeTask, ReadyTask

log = logging.getLogger(__name__)

# A node's measured speeds are read again from the store after this long.
MEASURE_TTL_S = 60.0
# Validated tasks a node's measure is made of (the latest).
MEASURED_TASKS = 50


def lease_for(
    settings: CoordinatorSettings,
    kind: str,
    *,
    cost_flops: float,
    measured_flops: float | None,
) -> float:
    """Lease length for a shard of nominal `cost_flops` on a node measured at
    `measured_flops` FLOP/s for the kind (None: not measured yet)."""
    speed = measured_flops if measured_flops and measured_flops > 0 else default_speed(kind)
    return sizing.lease_seconds(cost_flops, speed, lease_rule(settings))


def lease_rule(settings: CoordinatorSettings) -> sizing.LeaseRule:
    return sizing.LeaseRule(
        slack=settings.lease_slack, min_s=settings.min_lease_s, max_s=settings.max_lease_s
    )


def default_speed(kind: str) -> float:
    """FLOP/s assumed of a node the coordinator has not measured for the kind yet."""
    try:
        return get_kind(kind).default_gflops * 1e9
    except UnknownKind:
        return 1e9


def lease_seconds(settings: CoordinatorSettings, session: NodeSession, entry: ReadyTask) -> float:
    """This shard's lease on this node (the module docstring's rule)."""
    return lease_for(
        settings,
        entry.kind,
        cost_flops=entry.cost_flops,
        measured_flops=session.measured_flops.get(entry.kind),
    )


async def measure(ctx: Context, session: NodeSession) -> None:
    """Read the node's measured speeds again when they are older than MEASURE_TTL_S."""
    if time.monotonic() - session.measured_at < MEASURE_TTL_S:
        return
    session.measured_flops = await ctx.store.nodes.measured_speeds(
        session.node_id, last=MEASURED_TASKS
    )
    session.measured_at = time.monotonic()


class Leases:
    """Expires tasks past their lease or of silent nodes, requeues their shards, and tops
    up shards short of tasks."""

    def __init__(self, ctx: Context, fanout: FanOut) -> None:
        self._ctx = ctx
        self._fanout = fanout

    async def replenish(self) -> None:
        """New tasks for shards short of them; jobs whose shard ran out of attempts fail."""
        ready, failed_jobs, to_cancel = await self._ctx.store.scheduling.replenish(
            now=self._ctx.clock()
        )
        for job_id in failed_jobs:
            log.warning("job %s failed: a shard ran out of attempts", job_id)
            await self._fanout.job_ended(job_id)
        await self._fanout.send_cancels(to_cancel, reason="the job failed")
        await self._fanout.enqueue(ready)

    async def expire(self, expired: Sequence[NodeTask], *, why: str) -> None:
        """Requeue the shards of expired tasks; tell connected holders."""
        if not expired:
            return
        log.info("%d task(s) expired: %s", len(expired), why)
        self._ctx.counters.lease_expiries += len(expired)
        for task in expired:
            session = self._ctx.hub.get(task.node_id)
            if session is not None:
                session.forget_task(task.task_id)
                session.tasks_expired += 1
        await self.replenish()

    async def expire_overdue(self) -> int:
        """Overdue tasks lose their lease; their shards get new tasks. How many expired."""
        expired = await self._ctx.store.results.expire_overdue(now=self._ctx.clock())
        if expired:
            faults.point("monitor-expired")
        await self.expire(expired, why="lease deadline passed")
        return len(expired)

    async def node_went_silent(self, node_id: int, *, now: float) -> None:
        """A node not heard from within the timeout: recorded offline, forgotten by the
        broker's presence, and its tasks expired."""
        log.info("node %s missed its heartbeats: offline", node_id)
        await self._ctx.store.nodes.set_node_offline(node_id, now=now)
        await self._ctx.broker.forget_node(node_id)
        expired = await self._ctx.store.results.expire_node_tasks(node_id, now=now)
        if expired:
            faults.point("monitor-expired")
        await self.expire(expired, why=f"node {node_id} went silent")

    async def reconcile(self, session: NodeSession, claimed: set[int]) -> set[int]:
        """Match what a reconnecting node holds with what the store says it holds; the
        tasks it claims that the store does not know (it drops them).

        Tasks it still runs (or has results of) stay its own. Tasks the store leased to it
        that it does not have are released at once, not left to their leases: most often
        a coordinator that died claimed them and never sent them, and the node is not
        charged for that.
        """
        store = self._ctx.store
        held = {task.task_id: task for task in await store.nodes.node_tasks(session.node_id)}
        lost = sorted(held.keys() - claimed)
        if lost and await store.claims.release_claims(lost, session.node_id, now=self._ctx.clock()):
            log.info("node %s reconnected without %d task(s): released", session.node_id, len(lost))
            await self.replenish()
        session.live = set(held.keys() & claimed)
        return claimed - held.keys()
