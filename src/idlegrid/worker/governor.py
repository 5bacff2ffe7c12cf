"""The governor: asks the idle policy a few times a second and makes the tasks obey.

It reads the probes (in a thread: a D-Bus call may be slow), asks `policy.idle.decide`,
and then suspends or resumes the task processes, paces them with a duty cycle when the
policy throttles, and pins them to the allowed cores. It polls every `tick_s` (0.25 s),
so tasks stop within about a quarter of a second of the owner's first keystroke.

The owner's controls (pause, snooze, finish, modes, CPU %, windows) are kept in
`controls.json` in the state directory, so they survive a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil

from idlegrid.worker.idle.policy import (
    Action,
    Controls,
    Decision,
    IdleSettings,
    Limits,
    Mode,
    SettingError,
    decide,
    parse_windows,
)
from idlegrid.worker.idle.system import Sensors
from idlegrid.worker.runner import TaskHost

log = logging.getLogger(__name__)

TICK_S = 0.25
DUTY_PERIOD_S = 1.0  # a throttled task runs cpu_percent of each period
SNOOZE_S = 3600.0
# What the owner may change from the local page or the CLI, and how each is read.
ADJUSTABLE = ("cpu_mode", "gpu_mode", "cpu_percent", "in_use_cpu_percent", "windows")


@dataclasses.dataclass
class OwnerState:
    """The owner's controls and setting changes, as kept in controls.json."""

    paused: bool = False
    finishing: bool = False
    snooze_until: str | None = None  # ISO local time
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def controls(self) -> Controls:
        until = datetime.fromisoformat(self.snooze_until) if self.snooze_until else None
        return Controls(paused=self.paused, finishing=self.finishing, snooze_until=until)


def apply_overrides(base: IdleSettings, overrides: dict[str, Any]) -> IdleSettings:
    """`base` with the owner's changes; SettingError names a bad one."""
    values: dict[str, Any] = {}
    for name, value in overrides.items():
        if name not in ADJUSTABLE:
            raise SettingError(f"{name}: not a setting the owner can change here")
        if name in ("cpu_mode", "gpu_mode"):
            try:
                values[name] = Mode(value)
            except ValueError:
                raise SettingError(f"{name}: {value!r} is not always, idle or never") from None
        elif name == "windows":
            values[name] = parse_windows(str(value))
        else:
            try:
                percent = float(value)
            except (TypeError, ValueError):
                raise SettingError(f"{name}: {value!r} is not a number") from None
            which = "in_use" if name.startswith("in_use") else "idle"
            values[which] = dataclasses.replace(
                values.get(which, getattr(base, which)), cpu_percent=percent
            )
    changed = dataclasses.replace(base, **values)
    return changed


class Governor:
    def __init__(
        self,
        base: IdleSettings,
        sensors: Sensors,
        hosts: Sequence[TaskHost],
        *,
        gpu: bool,
        state_dir: Path,
        tick_s: float = TICK_S,
        on_change: Callable[[Decision], Awaitable[None]] | None = None,
    ) -> None:
        self.base = base
        self.sensors = sensors
        self.hosts = hosts
        self.gpu = gpu
        self.tick_s = tick_s
        self.on_change = on_change
        self.path = state_dir / "controls.json"
        self.owner = self._load()
        self.settings = apply_overrides(base, self.owner.overrides)
        self.decision: Decision | None = None
        self.may_run = asyncio.Event()
        self._cores: list[int] | None = None
        self._memory_total = psutil.virtual_memory().total
        self._wake = asyncio.Event()

    # -- the owner's controls --------------------------------------------------------------

    def _load(self) -> OwnerState:
        try:
            raw = json.loads(self.path.read_text())
            state = OwnerState(**raw)
            apply_overrides(self.base, state.overrides)
            return state
        except FileNotFoundError:
            return OwnerState()
        except (ValueError, TypeError, SettingError) as exc:
            log.warning("ignoring %s: %s", self.path, exc)
            return OwnerState()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(dataclasses.asdict(self.owner)))
        os.replace(scratch, self.path)
        self._wake.set()  # decide again now, not at the next tick

    def pause(self) -> None:
        self.owner.paused, self.owner.finishing, self.owner.snooze_until = True, False, None
        self._save()

    def resume(self) -> None:
        self.owner.paused, self.owner.finishing, self.owner.snooze_until = False, False, None
        self._save()

    def finish(self) -> None:
        self.owner.finishing = True
        self._save()

    def snooze(self, seconds: float = SNOOZE_S) -> None:
        until = datetime.now() + timedelta(seconds=seconds)
        self.owner.snooze_until = until.isoformat(timespec="seconds")
        self._save()

    def change(self, overrides: dict[str, Any]) -> None:
        """Apply and keep the owner's setting changes (SettingError: nothing changes)."""
        merged = {**self.owner.overrides, **overrides}
        self.settings = apply_overrides(self.base, merged)
        self.owner.overrides = merged
        self._save()

    def finished(self) -> None:
        """The daemon's word that no task runs any more: finishing becomes paused."""
        if self.owner.finishing:
            self.pause()

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Decide and apply every tick, until cancelled; pace throttled tasks meanwhile."""
        pacer = asyncio.create_task(self._pace())
        try:
            while True:
                await self.step()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.tick_s)
        finally:
            pacer.cancel()
            await asyncio.gather(pacer, return_exceptions=True)
            for host in self.hosts:
                host.resume()  # never leave a stopped process behind

    async def step(self) -> Decision:
        """One pass: read, decide, apply. Callable once from a test."""
        readings = await asyncio.to_thread(self.sensors.read)
        decision = decide(self.settings, readings, self.owner.controls())
        self.apply(decision)
        self.enforce_memory(decision.limits)
        previous, self.decision = self.decision, decision
        if previous is None or self._paused(previous) != self._paused(decision):
            log.info("%s", decision.reason)
            if self.on_change is not None:
                await self.on_change(decision)
        return decision

    def action(self) -> Action:
        if self.decision is None:
            return Action.PAUSE
        return self.decision.action(gpu=self.gpu)

    def _paused(self, decision: Decision) -> bool:
        return decision.action(gpu=self.gpu) is Action.PAUSE

    def apply(self, decision: Decision) -> None:
        action = decision.action(gpu=self.gpu)
        if action is Action.PAUSE:
            self.may_run.clear()
            for host in self.hosts:
                host.suspend()
            return
        self.may_run.set()
        if action is Action.RUN:
            for host in self.hosts:
                host.resume()
        cores = _allowed_cores(decision.limits)
        if cores != self._cores:
            self._cores = cores
            for host in self.hosts:
                host.set_affinity(cores)

    async def _pace(self) -> None:
        """The duty cycle: while throttled, tasks run `cpu_percent` of every period."""
        while True:
            decision = self.decision
            if decision is None or decision.action(gpu=self.gpu) is not Action.THROTTLE:
                await asyncio.sleep(self.tick_s)
                continue
            share = decision.limits.cpu_percent / 100.0
            for host in self.hosts:
                host.resume()
            await asyncio.sleep(DUTY_PERIOD_S * share)
            if self.action() is Action.THROTTLE:
                for host in self.hosts:
                    host.suspend()
                await asyncio.sleep(DUTY_PERIOD_S * (1.0 - share))

    def enforce_memory(self, limits: Limits) -> None:
        """Over the memory cap, the biggest task process is killed (its task fails,
        retryable); BOINC suspends instead, which keeps the memory held."""
        cap = int(self._memory_total * limits.memory_percent / 100.0)
        sizes = [(host.rss_bytes(), host) for host in self.hosts if host.task_id is not None]
        if sizes and sum(size for size, _ in sizes) > cap:
            size, host = max(sizes, key=lambda pair: pair[0])
            reason = f"memory limit: tasks hold {size / 2**20:.0f} MB, over {cap / 2**20:.0f} MB"
            log.warning("task %s: %s", host.task_id, reason)
            host.kill(reason)


def _allowed_cores(limits: Limits) -> list[int] | None:
    total = psutil.cpu_count() or 1
    if not limits.cores or limits.cores >= total:
        return None
    return list(range(limits.cores))


def idle_settings(settings: Any) -> IdleSettings:
    """The idle policy's settings from WorkerSettings; SettingError names a bad value."""
    if settings.dedicated:
        full = Limits(cpu_percent=100.0, memory_percent=100.0)
        return IdleSettings(
            cpu_mode=Mode.ALWAYS, gpu_mode=Mode.ALWAYS, in_use=full, idle=full,
            suspend_cpu_usage=0.0, pause_on_battery=False, when_unknown="idle",
        )  # fmt: skip
    modes = {}
    for name in ("cpu_mode", "gpu_mode"):
        value = getattr(settings, name)
        try:
            modes[name] = Mode(value)
        except ValueError:
            raise SettingError(f"{name}: {value!r} is not always, idle or never") from None
    return IdleSettings(
        **modes,
        idle_after_s=settings.idle_after_s,
        idle=Limits(
            cores=settings.cpu_cores,
            cpu_percent=settings.cpu_percent,
            memory_percent=settings.memory_percent,
        ),
        in_use=Limits(
            cores=settings.in_use_cpu_cores,
            cpu_percent=settings.in_use_cpu_percent,
            memory_percent=settings.in_use_memory_percent,
        ),
        suspend_cpu_usage=settings.suspend_cpu_usage,
        exclusive_apps=tuple(settings.exclusive_apps),
        pause_on_battery=settings.pause_on_battery,
        min_battery_percent=settings.min_battery_percent,
        windows=parse_windows(settings.windows),
        max_cpu_temp_c=settings.max_cpu_temp_c,
        when_unknown=settings.when_unknown,
    )
