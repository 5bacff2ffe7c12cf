"""How the worker daemon steps aside: its side of the idle policy.

The governor (worker/governor.py) suspends and resumes the task processes; this part of
the daemon tells the coordinator (a `status` message), asks for work again when the
policy allows, serves the local control page, and gives back suspended tasks by rule.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from idlegrid import protocol
from idlegrid.worker.idle.policy import Action, Decision

if TYPE_CHECKING:
    from idlegrid.worker.governor import Governor
    from idlegrid.worker.held import RunningTask
    from idlegrid.worker.runner import TaskHost

log = logging.getLogger(__name__)


class Stepping:
    """Mixed into Worker; the attributes below are the Worker's."""

    governor: Governor
    hosts: list[TaskHost]
    running: dict[int, RunningTask]
    settings: Any

    async def _send(self, message: protocol.BaseModel) -> bool:
        raise NotImplementedError

    async def _send_ready(self) -> None:
        raise NotImplementedError

    def _drop(self, task_id: int, reason: str) -> None:
        raise NotImplementedError

    def own_pids(self) -> list[int]:
        """This daemon and its task processes (not "other programs" for the CPU limit)."""
        return [os.getpid(), *(pid for host in self.hosts if (pid := host.pid) is not None)]

    async def _start_control_page(self) -> Any:
        if self.settings.control_port < 0:
            return None
        from idlegrid.worker.control import ControlPage

        page = ControlPage(
            self,  # type: ignore[arg-type]
            port=self.settings.control_port,
        )
        await page.start()
        return page

    async def _on_policy_change(self, decision: Decision) -> None:
        """The policy turned between pause and run: tell the coordinator, and ask for work."""
        now = time.monotonic()
        paused = self.governor.action() is Action.PAUSE
        for task in self.running.values():
            if paused and task.paused_since is None:
                task.paused_since = now
            elif not paused and task.paused_since is not None:
                task.paused_s += now - task.paused_since
                task.paused_since = None
        await self._send_status()
        await self._send_ready()

    async def _send_status(self) -> None:
        decision = self.governor.decision
        if decision is None:
            return
        paused = self.governor.action() is Action.PAUSE
        await self._send(
            protocol.Status(state="paused" if paused else "running", reason=decision.reason[:300])
        )

    async def _give_back_paused(self) -> None:
        """Hand back suspended tasks that waited too long or can no longer meet their lease.

        The lease is the coordinator's: it neither extends nor shortens it for a paused
        node. The worker gives a task back (a retryable failure) once it has been paused
        `give_back_after_s`, or once the time it still needs (from its pace so far) would
        run past the lease deadline, so its shard goes to another node at once instead of
        waiting for the lease to expire.
        """
        now = time.monotonic()
        wall_now = datetime.now(UTC)
        for task_id, task in list(self.running.items()):
            if task.paused_since is None:
                continue
            paused_for = now - task.paused_since
            if give_back_due(
                paused_for=paused_for,
                ran_s=max(0.0, now - task.started - task.paused_s - paused_for),
                progress=task.progress,
                lease_left_s=(task.assign.lease_deadline - wall_now).total_seconds(),
                give_back_after_s=self.settings.give_back_after_s,
            ):
                why = self.governor.decision.reason if self.governor.decision else "paused"
                reason = f"given back: {why}"
                log.info("task %s %s", task_id, reason)
                self._drop(task_id, reason)
                await self._send(protocol.Failure(task_id=task_id, reason=reason[:2000]))


def give_back_due(
    *, paused_for: float, ran_s: float, progress: float, lease_left_s: float,
    give_back_after_s: float,
) -> bool:  # fmt: skip
    """Whether a suspended task goes back to the coordinator now: it has been paused
    `give_back_after_s`, or the time it still needs at its pace so far (`ran_s` of
    computing for `progress`; with no progress yet, as long again) is more than its lease
    has left."""
    if paused_for >= give_back_after_s:
        return True
    needed = ran_s * (1.0 - progress) / progress if progress > 0 else ran_s
    return needed > lease_left_s
