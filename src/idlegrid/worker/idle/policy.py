"""The idle policy: may the worker compute now, how much, and why not.

A pure function of what the probes read (user input idle time, other programs' CPU use,
battery, temperature, running programs, the local time) and the volunteer's settings,
as BOINC's client preferences are. Every answer carries a reason a person can read,
which the worker logs, its local page shows and the coordinator hears.

The checks run in a fixed order and the first that pauses wins: the owner's own pause
and snooze, the mode `never`, the time windows, battery, temperature, exclusive
programs, other programs' CPU use, then user activity. Mode `always` ignores only user
activity (it computes within the in-use limits while the owner works); everything else
still pauses it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import time as clock_time

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
# Percentage points between the "other programs" CPU limit and the mark it resumes under.
CPU_BAND = 10.0
_TIME = r"(\d{1,2}):(\d{2})"
_WINDOW_RE = re.compile(rf"^(?:(?P<days>[a-z,\-]+)\s+)?{_TIME}\s*-\s*{_TIME}$")


class SettingError(ValueError):
    """A policy setting that cannot be used; the message names the setting."""


class Mode(enum.StrEnum):
    ALWAYS = "always"
    IDLE = "idle"  # only when the machine has been idle for `idle_after_s`
    NEVER = "never"


class Action(enum.StrEnum):
    RUN = "run"
    THROTTLE = "throttle"  # run within a CPU-time percentage (a duty cycle)
    PAUSE = "pause"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How much of the machine tasks may use (one set while in use, one while idle)."""

    cores: int = 0  # CPU cores tasks may run on; 0: all
    cpu_percent: float = 100.0  # CPU time of those cores, enforced by a duty cycle
    memory_percent: float = 90.0  # RAM that task processes may hold together

    def check(self, prefix: str) -> None:
        if self.cores < 0:
            raise SettingError(f"{prefix}cores: {self.cores} is negative")
        if not 1.0 <= self.cpu_percent <= 100.0:
            raise SettingError(f"{prefix}cpu_percent: {self.cpu_percent} is not in 1..100")
        if not 1.0 <= self.memory_percent <= 100.0:
            raise SettingError(f"{prefix}memory_percent: {self.memory_percent} is not in 1..100")


@dataclass(frozen=True)
class Window:
    """A time of day when computing is allowed, on some weekdays (0 = Monday).

    An `end` at or before `start` runs past midnight into the next day; 24:00 is the end
    of the day.
    """

    days: frozenset[int]
    start: clock_time
    end: clock_time | None  # None: 24:00

    def covers(self, now: datetime) -> bool:
        today, moment = now.weekday(), now.time()
        end = self.end or clock_time.max
        if self.end is not None and self.end <= self.start:  # past midnight
            yesterday = (today - 1) % 7
            return (today in self.days and moment >= self.start) or (
                yesterday in self.days and moment < self.end
            )
        return today in self.days and self.start <= moment < end


@dataclass(frozen=True, kw_only=True)
class IdleSettings:
    """What a volunteer sets (see docs/worker.md for each setting and its default)."""

    cpu_mode: Mode = Mode.IDLE
    gpu_mode: Mode = Mode.IDLE
    idle_after_s: float = 180.0
    in_use: Limits = field(default_factory=lambda: Limits(cpu_percent=50.0, memory_percent=50.0))
    idle: Limits = field(default_factory=Limits)
    # Pause while programs other than idlegrid use more CPU than this (percent of the
    # whole machine, averaged by the probe); 0: never for this reason. Once paused for
    # it, resume only below the lower mark `resume_cpu_usage`, so a load that hovers at
    # the limit does not turn the worker on and off (hysteresis).
    suspend_cpu_usage: float = 25.0
    # Pause the GPU work while other programs (a game, another job) use more of a GPU the
    # worker computes on than this percent of its time; 0: never for this reason.
    suspend_gpu_usage: float = 25.0
    # GPUs (by index) the owner paused on their own: the others and the CPU go on.
    paused_gpus: tuple[int, ...] = ()
    exclusive_apps: tuple[str, ...] = ()
    pause_on_battery: bool = True
    # On battery (with pause_on_battery off), pause below this charge; 0: no minimum.
    min_battery_percent: float = 0.0
    # Allowed times; empty: any time. See `parse_windows`.
    windows: tuple[Window, ...] = ()
    max_cpu_temp_c: float = 0.0  # 0: no limit
    # When no probe can tell whether the machine is in use: "in-use" (safe on a desktop)
    # or "idle" (a headless machine).
    when_unknown: str = "in-use"

    @property
    def resume_cpu_usage(self) -> float:
        """The lower mark: 10 points under the limit, or half of it when that is less."""
        limit = self.suspend_cpu_usage
        return max(limit - CPU_BAND, limit / 2)

    def __post_init__(self) -> None:
        if self.idle_after_s < 0:
            raise SettingError(f"idle_after_s: {self.idle_after_s} is negative")
        self.in_use.check("in_use.")
        self.idle.check("idle.")
        if not 0.0 <= self.suspend_cpu_usage <= 100.0:
            raise SettingError(f"suspend_cpu_usage: {self.suspend_cpu_usage} is not in 0..100")
        if not 0.0 <= self.suspend_gpu_usage <= 100.0:
            raise SettingError(f"suspend_gpu_usage: {self.suspend_gpu_usage} is not in 0..100")
        if not 0.0 <= self.min_battery_percent <= 100.0:
            raise SettingError(f"min_battery_percent: {self.min_battery_percent} is not in 0..100")
        if self.max_cpu_temp_c < 0:
            raise SettingError(f"max_cpu_temp_c: {self.max_cpu_temp_c} is negative")
        if self.when_unknown not in {"in-use", "idle"}:
            raise SettingError(f"when_unknown: {self.when_unknown!r} is not in-use or idle")


@dataclass(frozen=True, kw_only=True)
class Readings:
    """What the probes saw at `now` (local time). None: that probe cannot tell."""

    now: datetime
    user_idle_s: float | None = None
    other_cpu_percent: float | None = None
    exclusive_running: tuple[str, ...] = ()
    on_battery: bool | None = None
    battery_percent: float | None = None
    cpu_temp_c: float | None = None
    # Other programs' use of each GPU the worker computes on: (index, percent) pairs.
    gpu_other_use: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Controls:
    """What the owner asked for on the local page or the CLI."""

    paused: bool = False
    snooze_until: datetime | None = None  # local time
    finishing: bool = False  # finish the current tasks, then pause


@dataclass(frozen=True, kw_only=True)
class Decision:
    cpu: Action
    gpu: Action  # the GPUs' mode; a GPU in `gpus_paused` pauses whatever it says
    reason: str
    limits: Limits
    # GPUs paused on their own, with why: (index, reason) pairs.
    gpus_paused: tuple[tuple[int, str], ...] = ()
    # False while finishing: running tasks go on, no new work is asked for.
    take_work: bool = True
    user_active: bool = False
    # Other programs' CPU use is over the limit (or, after it was, not yet under the
    # lower mark): the next decision's hysteresis reads it.
    cpu_busy: bool = False

    def action(self, *, gpu: bool) -> Action:
        return self.gpu if gpu else self.cpu

    def device_action(self, gpu_index: int | None) -> Action:
        """What a slot does: the CPU's answer (None), or that GPU's."""
        if gpu_index is None:
            return self.cpu
        return Action.PAUSE if self.gpu_paused_why(gpu_index) else self.gpu

    def gpu_paused_why(self, gpu_index: int) -> str:
        """Why this GPU is paused on its own ("": it is not)."""
        return next((why for index, why in self.gpus_paused if index == gpu_index), "")


def decide(
    settings: IdleSettings,
    readings: Readings,
    controls: Controls,
    previous: Decision | None = None,
) -> Decision:
    """The policy's answer for one moment; see the module docstring for the order.
    `previous`: the answer of the moment before, for the CPU limit's hysteresis."""
    busy = _cpu_busy(settings, readings.other_cpu_percent, previous)
    reason = _hard_pause(settings, readings, controls, busy)
    if reason is not None:
        return Decision(
            cpu=Action.PAUSE,
            gpu=Action.PAUSE,
            reason=reason,
            limits=settings.idle,
            cpu_busy=busy is not None,
        )
    active, activity = _activity(settings, readings)
    limits = settings.in_use if active else settings.idle
    cpu = _action(settings.cpu_mode, active, limits)
    gpu = _action(settings.gpu_mode, active, limits)
    paused = _paused_gpus(settings, readings) if gpu is not Action.PAUSE else ()
    if cpu is Action.PAUSE and gpu is Action.PAUSE:
        reason = f"paused: {activity}"
    elif active:
        reason = f"running: {activity}, within the limits while in use"
    else:
        reason = f"running: {activity}"
    if cpu is not Action.PAUSE and gpu is Action.PAUSE:
        reason += f" (GPU paused: its mode is {settings.gpu_mode})"
    for index, why in paused:
        reason += f" (GPU {index} paused: {why})"
    if controls.finishing:
        reason = "finishing the current tasks, then pausing; " + reason
    return Decision(
        cpu=cpu,
        gpu=gpu,
        reason=reason,
        limits=limits,
        gpus_paused=paused,
        take_work=not controls.finishing,
        user_active=active,
    )


def _cpu_busy(settings: IdleSettings, other: float | None, previous: Decision | None) -> str | None:
    """Why other programs' CPU use pauses the worker, or None: above the limit, or, when
    it paused the moment before, not yet under the lower mark."""
    limit = settings.suspend_cpu_usage
    if not limit or other is None:
        return None
    if previous is not None and previous.cpu_busy:
        mark = settings.resume_cpu_usage
        if other >= mark:
            return (
                f"paused: other programs use {other:.0f}% CPU "
                f"(limit {limit:.0f}%, resumes under {mark:.0f}%)"
            )
        return None
    if other > limit:
        return f"paused: other programs use {other:.0f}% CPU (limit {limit:.0f}%)"
    return None


def _paused_gpus(settings: IdleSettings, readings: Readings) -> tuple[tuple[int, str], ...]:
    """Each GPU that steps aside on its own, and why: the owner paused it, or other
    programs (a game, another job) use more of it than `suspend_gpu_usage`."""
    paused = {index: "paused by the owner" for index in settings.paused_gpus}
    limit = settings.suspend_gpu_usage
    for index, percent in readings.gpu_other_use:
        if limit and percent > limit and index not in paused:
            paused[index] = f"other programs use {percent:.0f}% of GPU {index}"
    return tuple(sorted(paused.items()))


def _action(mode: Mode, active: bool, limits: Limits) -> Action:
    if mode is Mode.NEVER or (mode is Mode.IDLE and active):
        return Action.PAUSE
    return Action.THROTTLE if limits.cpu_percent < 100.0 else Action.RUN


def _hard_pause(
    settings: IdleSettings, readings: Readings, controls: Controls, cpu_busy: str | None
) -> str | None:
    """The first reason to pause that no mode overrides, or None."""
    now = readings.now
    if controls.paused:
        return "paused by the owner"
    if controls.snooze_until is not None and now < controls.snooze_until:
        return f"paused: snoozed until {controls.snooze_until:%H:%M}"
    if settings.cpu_mode is Mode.NEVER and settings.gpu_mode is Mode.NEVER:
        return "paused: CPU and GPU modes are never"
    if settings.windows and not any(w.covers(now) for w in settings.windows):
        upcoming = next_window_start(settings.windows, now)
        when = f" (next at {upcoming:%a %H:%M})" if upcoming else ""
        return f"paused: outside the time windows{when}"
    battery = _battery_reason(settings, readings)
    if battery:
        return battery
    limit = settings.max_cpu_temp_c
    if limit and readings.cpu_temp_c is not None and readings.cpu_temp_c >= limit:
        return f"paused: CPU at {readings.cpu_temp_c:.0f} °C (limit {limit:.0f} °C)"
    if readings.exclusive_running:
        return f"paused: {', '.join(readings.exclusive_running)} is running"
    return cpu_busy


def _battery_reason(settings: IdleSettings, readings: Readings) -> str | None:
    if not readings.on_battery:
        return None
    if settings.pause_on_battery:
        return "paused: on battery"
    charge, minimum = readings.battery_percent, settings.min_battery_percent
    if minimum and charge is not None and charge < minimum:
        return f"paused: battery at {charge:.0f}% (minimum {minimum:.0f}%)"
    return None


def _activity(settings: IdleSettings, readings: Readings) -> tuple[bool, str]:
    """(in use?, a phrase saying why) from the input idle time."""
    idle_s = readings.user_idle_s
    if idle_s is None:
        if settings.when_unknown == "idle":
            return False, "idle time unknown, counted as idle"
        return True, "cannot tell whether the machine is in use (no idle probe works)"
    if idle_s < settings.idle_after_s:
        return True, f"user active {_ago(idle_s)} ago"
    return False, f"idle for {_ago(idle_s)}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- time windows ----------------------------------------------------------------------------


def parse_windows(text: str, *, setting: str = "windows") -> tuple[Window, ...]:
    """Windows from text such as "18:00-08:00; sat,sun 00:00-24:00".

    Entries are separated by ";". An entry without days applies to every day; entries
    that name days replace the everyday ones on those days (weekday overrides). Days are
    mon..sun, as lists ("sat,sun") or ranges ("mon-fri"). Raises SettingError naming
    `setting` and the entry.
    """
    default: list[tuple[clock_time, clock_time | None]] = []
    overrides: dict[int, list[tuple[clock_time, clock_time | None]]] = {}
    for entry in (part.strip().lower() for part in text.split(";")):
        if not entry:
            continue
        match = _WINDOW_RE.match(entry)
        if match is None:
            raise SettingError(f"{setting}: {entry!r} is not [days] HH:MM-HH:MM")
        start = _clock(match.group(2), match.group(3), setting, entry, allow_24=False)
        assert start is not None  # 24:00 is refused as a start
        end = _clock(match.group(4), match.group(5), setting, entry, allow_24=True)
        if match.group("days") is None:
            default.append((start, end))
        else:
            for day in _days(match.group("days"), setting, entry):
                overrides.setdefault(day, []).append((start, end))
    windows: list[Window] = []
    plain_days = frozenset(range(7)) - overrides.keys()
    if plain_days:
        windows += [Window(plain_days, start, end) for start, end in default]
    for day, spans in sorted(overrides.items()):
        windows += [Window(frozenset({day}), start, end) for start, end in spans]
    return tuple(windows)


def _clock(
    hours: str, minutes: str, setting: str, entry: str, *, allow_24: bool
) -> clock_time | None:
    h, m = int(hours), int(minutes)
    if allow_24 and (h, m) == (24, 0):
        return None
    if h > 23 or m > 59:
        raise SettingError(f"{setting}: {hours}:{minutes} in {entry!r} is not a time of day")
    return clock_time(h, m)


def _days(text: str, setting: str, entry: str) -> set[int]:
    days: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first not in DAYS or (last and last not in DAYS):
            raise SettingError(f"{setting}: unknown day {part!r} in {entry!r} (use mon..sun)")
        a = DAYS.index(first)
        b = DAYS.index(last) if last else a
        days.update(d % 7 for d in range(a, b + 1 if b >= a else b + 8))
    return days


def next_window_start(windows: tuple[Window, ...], now: datetime) -> datetime | None:
    """When the next window opens after `now` (within a week), for the pause reason."""
    best: datetime | None = None
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    for offset in range(8):
        day = midnight + timedelta(days=offset)
        for window in windows:
            if day.weekday() in window.days:
                opens = day.replace(hour=window.start.hour, minute=window.start.minute)
                if opens > now and (best is None or opens < best):
                    best = opens
        if best is not None:
            return best
    return None
