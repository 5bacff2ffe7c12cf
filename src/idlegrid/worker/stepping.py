"""How the worker daemon steps aside: its side of the idle policy.

The governor (worker/governor.py) suspends and resumes the task processes; this part of
the daemon tells the coordinator (a `status` message), asks for work again when the
policy allows, serves the local control page, and gives back suspended tasks by rule.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from idlegrid import protocol
from idlegrid.worker import remote_settings
from idlegrid.worker.idle.policy import Action, Decision

if TYPE_CHECKING:
    from idlegrid.worker.downloads import DailyDownloads
    from idlegrid.worker.governor import Governor
    from idlegrid.worker.held import RunningTask
    from idlegrid.worker.runner import TaskHost
    from idlegrid.worker.slots import Slots

log = logging.getLogger(__name__)
_STATE_WORDS: dict[Action, Any] = {
    Action.RUN: "running", Action.THROTTLE: "throttled", Action.PAUSE: "paused",
}  # fmt: skip
# How often the control page's credit is read from the coordinator, while the page is open.
CREDIT_EVERY_S = 30.0
CREDIT_AFTER_ACK_S = 1.0


class Stepping:
    """Mixed into Worker; the attributes below are the Worker's."""

    governor: Governor
    hosts: list[TaskHost]
    slots: Slots
    running: dict[int, RunningTask]
    settings: Any
    device: str
    downloads: DailyDownloads
    credit: float | None
    node_id: int | None
    _http: Any
    # Why the last settings from the dashboard were not applied ("": they were).
    settings_error: str = ""
    # Whether the daily download cap stops it asking for work (the coordinator was told).
    capped: bool = False
    _credit_read_at: float = -CREDIT_EVERY_S
    _credit_read: Any = None
    # What the coordinator was last told of each device.
    _devices_told: list[protocol.DeviceStatus] | None = None

    def refresh_credit(self) -> None:
        """Read the node's credit from the coordinator in the background, at most every
        CREDIT_EVERY_S: the control page asks while it is open, and only then."""
        now = time.monotonic()
        if (
            self._http is None
            or self.node_id is None
            or now - self._credit_read_at < CREDIT_EVERY_S
        ):
            return
        self._credit_read_at = now
        self._credit_read = asyncio.create_task(self._read_credit(self._http, self.node_id))

    def credit_may_change(self) -> None:
        """A result was taken: the page's next poll, a second from now, reads the credit
        again (a result decided at once has earned its credit by then)."""
        self._credit_read_at = min(
            self._credit_read_at, time.monotonic() - CREDIT_EVERY_S + CREDIT_AFTER_ACK_S
        )

    async def _read_credit(self, http: Any, node_id: int) -> None:
        try:
            response = await http.get(f"/v1/nodes/{node_id}/credit", timeout=10)
            response.raise_for_status()
            self.credit = float(response.json()["credit_total"])
        except Exception as exc:  # the page keeps the figure it had
            log.debug("reading the node's credit: %s", exc)

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
        """The policy turned between pause, throttle and run: tell the coordinator, and ask
        for work."""
        now = time.monotonic()
        self.slots.poke()  # a device that may run again takes the tasks waiting for it
        for task in self.running.values():
            device = task.host.device.index if task.host is not None else None
            paused = (
                self.governor.device_action(device) is Action.PAUSE
                if task.host is not None
                else self.governor.action() is Action.PAUSE
            )
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
        action = self.governor.action()
        paused = action is Action.PAUSE
        reason = decision.reason
        if self.capped and not paused:
            paused, reason = True, f"paused: today's downloads reached the cap ({reason})"
        self._devices_told = self.device_statuses()
        await self._send(
            protocol.Status(
                state="paused" if paused else "running",
                reason=reason[:300],
                device=self.device[:40],
                throttled=action is Action.THROTTLE and not paused,
                devices=self._devices_told,
            )
        )

    async def _report_devices(self) -> None:
        """Tell the coordinator when a device's state or reason changed since it was last
        told (a heartbeat's turn). Which task runs where changes with every task: the
        heartbeats carry that, and the coordinator keeps it in memory, not in SQL."""
        if self.governor.decision is None:
            return
        if self.device_statuses() != self._devices_told:
            await self._send_status()

    def device_statuses(self) -> list[protocol.DeviceStatus]:
        """Each device of the slots (the CPU's slots together): its state and why."""
        decision = self.governor.decision
        out: dict[str, protocol.DeviceStatus] = {}
        for host in self.hosts:
            device = host.device
            if device.label in out:
                continue
            action = self.governor.device_action(device.index)
            index = device.index
            why = decision.gpu_paused_why(index) if decision and index is not None else ""
            out[device.label] = protocol.DeviceStatus(
                device=device.label,
                name=(device.name or self._cpu_name())[:200],
                state=_STATE_WORDS[action],
                reason=(why or (decision.reason if decision else "starting"))[:300],
            )
        return list(out.values())

    def _cpu_name(self) -> str:
        hardware = getattr(self, "hardware", None)
        return hardware.cpu_model if hardware is not None and hardware.cpu_model else "CPU"

    def download_cap_mb(self) -> float:
        cap = self.governor.owner.overrides.get("daily_download_mb")
        return float(self.settings.daily_download_mb if cap is None else cap)

    async def _capped(self) -> bool:
        """Whether the daily download cap holds new work back; tells the coordinator when
        that starts and ends (a `status`)."""
        cap = self.download_cap_mb()
        capped = self.downloads.over(cap)
        if capped != self.capped:
            self.capped = capped
            if capped:
                reason = f"paused: today's downloads reached the cap of {cap:g} MB"
                log.info("%s", reason)
                status = protocol.Status(state="paused", reason=reason, device=self.device[:40])
                await self._send(status)
            else:
                await self._send_status()
        return capped

    async def _on_settings(self, message: protocol.Settings) -> None:
        """Settings from the dashboard: apply those that win, and say what runs now."""
        self.settings_error = remote_settings.apply(
            self.governor, self.settings, dict(message.settings)
        )
        if not self.running:
            self.governor.finished()  # "finish, then pause" with nothing to finish: paused
        await self.governor.step()
        await self._report_settings()
        await self._send_ready()  # a raised download cap, say, lets it ask for work again

    async def _unreadable_settings(self, problem: str) -> None:
        """A `settings` message this worker cannot read: keep its own, and say so."""
        self.settings_error = f"could not read the dashboard's settings ({problem}); kept its own"
        log.warning("%s", self.settings_error)
        await self._report_settings()

    async def _report_settings(self) -> None:
        report = remote_settings.report(self.governor, self.settings, self.settings_error)
        await self._send(report)

    async def settings_changed(self) -> None:
        """The owner changed a setting on the local page: the dashboard hears of it."""
        self.settings_error = ""
        await self._report_settings()

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
