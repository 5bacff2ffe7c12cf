"""The grid's fan-out: what one part's change means for the others and for other processes.

New ready tasks wake the dispatchers of every process; a cancel reaches the node here or
goes to the process that holds it; a job that ended drops its plan everywhere, and the
suspicions of its results that no verdict will settle now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from idlegrid.coordinator import peers
from idlegrid.coordinator.context import Context
from idlegrid.coordinator.matching import Matcher
from idlegrid.coordinator.plans import Plans
from idlegrid.store.base import NodeTask, ReadyTask


class GridFanOut:
    """The `FanOut` of one coordinator process."""

    def __init__(self, ctx: Context, *, plans: Plans, matcher: Matcher) -> None:
        self._ctx = ctx
        self._plans = plans
        self._matcher = matcher

    async def enqueue(self, ready: Sequence[ReadyTask]) -> None:
        if ready:
            self._matcher.invalidate()
            await self._ctx.broker.push_ready(ready)
            self._ctx.work_available.set()
            await self.publish({"type": "work"})

    async def send_cancels(self, held: Sequence[NodeTask], *, reason: str) -> None:
        for task in held:
            if not await self._ctx.hub.cancel(task.node_id, task.task_id, reason):
                # Perhaps connected to another coordinator process: the holder tells it.
                await self.publish(
                    {
                        "type": "cancel",
                        "node_id": task.node_id,
                        "task_id": task.task_id,
                        "reason": reason,
                    }
                )
        self._ctx.work_available.set()

    async def job_ended(self, job_id: int) -> None:
        self._plans.forget(job_id)
        self._ctx.job_watch.changed([job_id])
        await self.publish({"type": "job_ended", "job_id": job_id})
        # Its results still suspected will get no verdict: their nodes' streaks come back.
        await self._ctx.store.verification.drop_undecided_suspicions(job_id, now=self._ctx.clock())

    async def publish(self, message: dict[str, Any]) -> None:
        await peers.publish(self._ctx, message)
