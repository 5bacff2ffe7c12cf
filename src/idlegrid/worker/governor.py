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
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil

from idlegrid.worker.devices import DeviceError, check_gpu_indices
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
# What the owner may change from the local page, the CLI or the dashboard, and how each
# is read: a setting of the idle limits (which set, which field), or one of its own.
ADJUSTABLE = (
    "cpu_mode", "gpu_mode", "cpu_percent", "in_use_cpu_percent", "windows",
    "cpu_cores", "memory_percent", "exclusive_apps", "daily_download_mb", "paused_gpus",
)  # fmt: skip
_LIMITS = {
    "cpu_percent": ("idle", "cpu_percent"),
    "in_use_cpu_percent": ("in_use", "cpu_percent"),
    "cpu_cores": ("idle", "cores"),
    "memory_percent": ("idle", "memory_percent"),
}
# Who changed a setting when no one says: the owner, on this machine.
LOCAL = "local page"


@dataclasses.dataclass
class OwnerState:
    """The owner's controls and setting changes, as kept in controls.json."""

    paused: bool = False
    finishing: bool = False
    snooze_until: str | None = None  # ISO local time
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Where each changed setting (and "control") came from: {"source", "by", "at"}.
    sources: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def controls(self) -> Controls:
        until = datetime.fromisoformat(self.snooze_until) if self.snooze_until else None
        return Controls(paused=self.paused, finishing=self.finishing, snooze_until=until)


def local_stamp() -> dict[str, Any]:
    return {"source": "local", "by": LOCAL, "at": time.time()}


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
        elif name == "paused_gpus":
            values[name] = _gpu_indices(name, value)
        elif name == "exclusive_apps":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise SettingError(f"{name}: {value!r} is not a list of program names")
            values[name] = tuple(value)
        else:
            number = _number(name, value)
            if name in _LIMITS:
                which, limit = _LIMITS[name]
                limits = values.get(which, getattr(base, which))
                value = int(number) if limit == "cores" else number
                values[which] = dataclasses.replace(limits, **{limit: value})
            elif number < 0:  # daily_download_mb: the daemon's, not the idle policy's
                raise SettingError(f"{name}: {value!r} is negative")
    return dataclasses.replace(base, **values)


def _gpu_indices(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 63 for v in value
    ):
        raise SettingError(f"{name}: {value!r} is not a list of GPU indices (0-63)")
    return tuple(sorted(set(value)))


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise SettingError(f"{name}: {value!r} is not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SettingError(f"{name}: {value!r} is not a number") from None


class Governor:
    def __init__(
        self,
        base: IdleSettings,
        sensors: Sensors,
        hosts: Sequence[TaskHost],
        *,
        state_dir: Path,
        tick_s: float = TICK_S,
        on_change: Callable[[Decision], Awaitable[None]] | None = None,
    ) -> None:
        self.base = base
        self.sensors = sensors
        self.hosts = hosts  # each on its device: the CPU's answer or its GPU's applies
        self.tick_s = tick_s
        self.on_change = on_change
        self.path = state_dir / "controls.json"
        self.owner = self._load()
        self.settings = apply_overrides(base, self.owner.overrides)
        self.sensors.exclusive_apps = self.settings.exclusive_apps
        # The GPUs' indices, once the hardware probe listed them (None: not yet known).
        self.gpus: tuple[int, ...] | None = None
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

    def pause(self, *, stamp: dict[str, Any] | None = None) -> None:
        self.owner.paused, self.owner.finishing, self.owner.snooze_until = True, False, None
        self._stamp(("control",), stamp)
        self._save()

    def resume(self, *, stamp: dict[str, Any] | None = None) -> None:
        self.owner.paused, self.owner.finishing, self.owner.snooze_until = False, False, None
        self._stamp(("control",), stamp)
        self._save()

    def finish(self, *, stamp: dict[str, Any] | None = None) -> None:
        self.owner.finishing = True
        self._stamp(("control",), stamp)
        self._save()

    def snooze(self, seconds: float = SNOOZE_S, *, stamp: dict[str, Any] | None = None) -> None:
        until = datetime.now() + timedelta(seconds=seconds)
        self.owner.paused, self.owner.finishing = False, False
        self.owner.snooze_until = until.isoformat(timespec="seconds")
        self._stamp(("control",), stamp)
        self._save()

    def check(self, overrides: dict[str, Any]) -> IdleSettings:
        """The settings these changes make, or SettingError naming one this node cannot
        use (a GPU index it does not have, among others)."""
        merged = apply_overrides(self.base, {**self.owner.overrides, **overrides})
        if "paused_gpus" in overrides and self.gpus is not None:
            try:
                check_gpu_indices(merged.paused_gpus, self.gpus, setting="paused_gpus")
            except DeviceError as exc:
                raise SettingError(str(exc)) from None
        return merged

    def change(self, overrides: dict[str, Any], *, stamp: dict[str, Any] | None = None) -> None:
        """Apply and keep the owner's setting changes (SettingError: nothing changes)."""
        merged = {**self.owner.overrides, **overrides}
        self.settings = self.check(overrides)
        self.sensors.exclusive_apps = self.settings.exclusive_apps
        self.owner.overrides = merged
        self._stamp(tuple(overrides), stamp)
        self._save()

    def _stamp(self, names: tuple[str, ...], stamp: dict[str, Any] | None) -> None:
        for name in names:
            self.owner.sources[name] = dict(stamp or local_stamp())

    def finished(self) -> None:
        """The daemon's word that no task runs any more: finishing becomes paused (the
        finish keeps its source: it is what was asked for)."""
        if self.owner.finishing:
            self.owner.paused, self.owner.finishing = True, False
            self._save()

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
        decision = decide(self.settings, readings, self.owner.controls(), self.decision)
        self.apply(decision)
        self.enforce_memory(decision.limits)
        previous, self.decision = self.decision, decision
        # A turn of any device between pause, throttle and full speed is news for the
        # coordinator.
        if previous is None or self._turns(previous) != self._turns(decision):
            log.info("%s", decision.reason)
            if self.on_change is not None:
                await self.on_change(decision)
        return decision

    def devices(self) -> list[int | None]:
        """The devices the slots run on: None for the CPU, else a GPU's index."""
        found = {host.device.index for host in self.hosts}
        return sorted(found, key=lambda index: -1 if index is None else index) or [None]

    def _turns(self, decision: Decision) -> tuple[Action, ...]:
        return tuple(decision.device_action(index) for index in self.devices())

    def action(self) -> Action:
        """The node's answer: the best of its devices' (it runs while any device runs)."""
        if self.decision is None:
            return Action.PAUSE
        actions = set(self._turns(self.decision))
        return next((a for a in (Action.RUN, Action.THROTTLE) if a in actions), Action.PAUSE)

    def device_action(self, gpu_index: int | None) -> Action:
        """One device's answer (None: the CPU's)."""
        if self.decision is None:
            return Action.PAUSE
        return self.decision.device_action(gpu_index)

    def may_take(self, host: TaskHost) -> bool:
        """Whether a slot may start a task now (its device is not paused)."""
        return self.device_action(host.device.index) is not Action.PAUSE

    def apply(self, decision: Decision) -> None:
        actions = [decision.device_action(host.device.index) for host in self.hosts]
        # Some slot may compute: tasks may fetch their inputs and wait for it.
        if any(action is not Action.PAUSE for action in actions or [decision.cpu]):
            self.may_run.set()
        else:
            self.may_run.clear()
        for host, action in zip(self.hosts, actions, strict=True):
            if action is Action.PAUSE:
                host.suspend()
            elif action is Action.RUN:
                host.resume()
        cores = _allowed_cores(decision.limits)
        if cores != self._cores:
            self._cores = cores
            for host in self.hosts:
                host.set_affinity(cores)

    async def _pace(self) -> None:
        """The duty cycle: while throttled, a slot runs `cpu_percent` of every period."""
        while True:
            decision = self.decision
            throttled = self._throttled(decision)
            if decision is None or not throttled:
                await asyncio.sleep(self.tick_s)
                continue
            share = decision.limits.cpu_percent / 100.0
            for host in throttled:
                host.resume()
            await asyncio.sleep(DUTY_PERIOD_S * share)
            for host in self._throttled(self.decision):
                host.suspend()
            await asyncio.sleep(DUTY_PERIOD_S * (1.0 - share))

    def _throttled(self, decision: Decision | None) -> list[TaskHost]:
        if decision is None:
            return []
        return [
            host
            for host in self.hosts
            if decision.device_action(host.device.index) is Action.THROTTLE
        ]

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
            suspend_cpu_usage=0.0, suspend_gpu_usage=0.0, pause_on_battery=False,
            when_unknown="idle",
        )  # fmt: skip
    modes: dict[str, Mode] = {}
    for name in ("cpu_mode", "gpu_mode"):
        value = getattr(settings, name)
        try:
            modes[name] = Mode(value)
        except ValueError:
            raise SettingError(f"{name}: {value!r} is not always, idle or never") from None
    return IdleSettings(
        cpu_mode=modes["cpu_mode"],
        gpu_mode=modes["gpu_mode"],
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
        suspend_gpu_usage=settings.suspend_gpu_usage,
        exclusive_apps=tuple(settings.exclusive_apps),
        pause_on_battery=settings.pause_on_battery,
        min_battery_percent=settings.min_battery_percent,
        windows=parse_windows(settings.windows),
        max_cpu_temp_c=settings.max_cpu_temp_c,
        when_unknown=settings.when_unknown,
    )
