"""Leases: how long a task may run on a node, and what happens when one runs out.

A lease is the coordinator's estimate of the shard's run time on the node (from what it
measured of the node, never from what the node says), with slack, clamped to the
minimum. A task that outlived its lease, or whose node went silent, is expired; its
shard then gets a new task (`Leases.replenish`, which also fails shards out of attempts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.hub import NodeSession
from idlegrid.policy import scheduler
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import NodeTask, ReadyTask

log = logging.getLogger(__name__)


def lease_for(
    settings: CoordinatorSettings,
    view: scheduler.NodeView,
    kind: str,
    *,
    items: int,
    cost_flops: float,
) -> float:
    """Lease length for a shard of `items` / `cost_flops` (each shard its own) on a node."""
    estimate = scheduler.expected_seconds(view, kind, items=items, cost_flops=cost_flops)
    return max(settings.min_lease_s, estimate * settings.lease_slack)


def lease_seconds(settings: CoordinatorSettings, session: NodeSession, entry: ReadyTask) -> float:
    """Estimated run time of this shard on this node with slack, at least the minimum."""
    return lease_for(
        settings, session.view, entry.kind, items=entry.items, cost_flops=entry.cost_flops
    )


class Leases:
    """Requeues the shards of expired tasks and tops up shards short of tasks."""

    def __init__(self, ctx: Context, fanout: FanOut) -> None:
        self._ctx = ctx
        self._fanout = fanout

    async def replenish(self) -> None:
        """New tasks for shards short of them; jobs whose shard ran out of attempts fail."""
        ready, failed_jobs, to_cancel = await self._ctx.store.replenish(now=self._ctx.clock())
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
