"""The idle policy, by tables: readings and settings in, action and reason out."""

from __future__ import annotations

import logging
from datetime import datetime

import pytest

from idlegrid.worker.idle.policy import (
    Action,
    Controls,
    IdleSettings,
    Limits,
    Mode,
    Readings,
    SettingError,
    decide,
    next_window_start,
    parse_windows,
)

MONDAY_NOON = datetime(2025, 6, 2, 12, 0)  # a Monday
SATURDAY_NOON = datetime(2025, 6, 7, 12, 0)


def read(**values: object) -> Readings:
    values.setdefault("now", MONDAY_NOON)
    return Readings(**values)  # type: ignore[arg-type]


R, T, P = Action.RUN, Action.THROTTLE, Action.PAUSE

CASES = [
    # (settings, readings, controls, cpu, gpu, reason fragment)
    (IdleSettings(), read(user_idle_s=12), Controls(), P, P, "paused: user active 12 s ago"),
    (IdleSettings(), read(user_idle_s=179), Controls(), P, P, "user active 3 min ago"),
    (IdleSettings(), read(user_idle_s=300), Controls(), R, R, "running: idle for 5 min"),
    (IdleSettings(idle_after_s=600), read(user_idle_s=300), Controls(), P, P, "user active 5 min"),
    # Mode always: computes while the owner works, within the in-use limits (50% CPU).
    (
        IdleSettings(cpu_mode=Mode.ALWAYS),
        read(user_idle_s=3),
        Controls(),
        T,
        P,
        "within the limits while in use (GPU paused",
    ),
    (
        IdleSettings(cpu_mode=Mode.ALWAYS, in_use=Limits(cpu_percent=100)),
        read(user_idle_s=3),
        Controls(),
        R,
        P,
        "running: user active 3 s ago",
    ),
    (IdleSettings(cpu_mode=Mode.NEVER), read(user_idle_s=900), Controls(), P, R, "idle for 15"),
    (
        IdleSettings(cpu_mode=Mode.NEVER, gpu_mode=Mode.NEVER),
        read(user_idle_s=900),
        Controls(),
        P,
        P,
        "CPU and GPU modes are never",
    ),
    (IdleSettings(idle=Limits(cpu_percent=40)), read(user_idle_s=900), Controls(), T, T, "idle"),
    # Unknown idle time: safe by default, idle on request (a headless machine).
    (IdleSettings(), read(), Controls(), P, P, "cannot tell whether the machine is in use"),
    (IdleSettings(when_unknown="idle"), read(), Controls(), R, R, "counted as idle"),
    # The owner's controls come first.
    (IdleSettings(), read(user_idle_s=900), Controls(paused=True), P, P, "paused by the owner"),
    (
        IdleSettings(),
        read(user_idle_s=900),
        Controls(snooze_until=datetime(2025, 6, 2, 13, 0)),
        P,
        P,
        "snoozed until 13:00",
    ),
    (
        IdleSettings(),
        read(user_idle_s=900),
        Controls(snooze_until=datetime(2025, 6, 2, 11, 0)),
        R,
        R,
        "idle",
    ),
    # Battery, temperature, exclusive programs, other programs' load.
    (IdleSettings(), read(user_idle_s=900, on_battery=True), Controls(), P, P, "on battery"),
    (
        IdleSettings(pause_on_battery=False, min_battery_percent=30),
        read(user_idle_s=900, on_battery=True, battery_percent=20),
        Controls(),
        P,
        P,
        "battery at 20% (minimum 30%)",
    ),
    (
        IdleSettings(pause_on_battery=False, min_battery_percent=30),
        read(user_idle_s=900, on_battery=True, battery_percent=80),
        Controls(),
        R,
        R,
        "idle",
    ),
    (
        IdleSettings(max_cpu_temp_c=85),
        read(user_idle_s=900, cpu_temp_c=91),
        Controls(),
        P,
        P,
        "CPU at 91 °C (limit 85 °C)",
    ),
    (IdleSettings(max_cpu_temp_c=85), read(user_idle_s=900, cpu_temp_c=60), Controls(), R, R, ""),
    (
        IdleSettings(),
        read(user_idle_s=900, exclusive_running=("steam",)),
        Controls(),
        P,
        P,
        "steam is running",
    ),
    (
        IdleSettings(cpu_mode=Mode.ALWAYS),
        read(user_idle_s=900, other_cpu_percent=63),
        Controls(),
        P,
        P,
        "other programs use 63% CPU (limit 25%)",
    ),
    (
        IdleSettings(suspend_cpu_usage=0),
        read(user_idle_s=900, other_cpu_percent=99),
        Controls(),
        R,
        R,
        "",
    ),
    # Time windows.
    (
        IdleSettings(windows=parse_windows("18:00-08:00")),
        read(user_idle_s=900),
        Controls(),
        P,
        P,
        "outside the time windows (next at Mon 18:00)",
    ),
    (
        IdleSettings(windows=parse_windows("18:00-08:00; sat,sun 00:00-24:00")),
        read(user_idle_s=900, now=SATURDAY_NOON),
        Controls(),
        R,
        R,
        "idle",
    ),
    # Finishing: the current tasks go on, no new work.
    (IdleSettings(), read(user_idle_s=900), Controls(finishing=True), R, R, "finishing"),
    # The GPU: other programs' use of a GPU the worker computes on (a game, another job).
    (IdleSettings(), read(user_idle_s=900, gpu_other_use=((0, 87.0),)), Controls(), R, P,
     "running: idle for 15 min (GPU 0 paused: other programs use 87% of GPU 0)"),
    (IdleSettings(), read(user_idle_s=900, gpu_other_use=((0, 3.0), (1, 40.0))), Controls(),
     R, P, "other programs use 40% of GPU 1"),
    (IdleSettings(), read(user_idle_s=900, gpu_other_use=((0, 25.0),)), Controls(), R, R,
     "running: idle for 15 min"),
    (IdleSettings(suspend_gpu_usage=90), read(user_idle_s=900, gpu_other_use=((0, 87.0),)),
     Controls(), R, R, "running: idle for 15 min"),
    (IdleSettings(suspend_gpu_usage=0), read(user_idle_s=900, gpu_other_use=((0, 100.0),)),
     Controls(), R, R, "running"),
    # Already paused for the owner's input: the GPU's own reason does not replace that.
    (IdleSettings(), read(user_idle_s=12, gpu_other_use=((0, 87.0),)), Controls(), P, P,
     "paused: user active 12 s ago"),
    # GPUs only: the CPU's mode never, the GPU computes while it is free.
    (IdleSettings(cpu_mode=Mode.NEVER), read(user_idle_s=900, gpu_other_use=((0, 0.0),)),
     Controls(), P, R, "running: idle for 15 min"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "readings", "controls", "cpu", "gpu", "reason"), CASES)
def test_decide(
    settings: IdleSettings,
    readings: Readings,
    controls: Controls,
    cpu: Action,
    gpu: Action,
    reason: str,
) -> None:
    decision = decide(settings, readings, controls)
    # The GPU column: the busiest GPU the readings name (each GPU steps aside on its own).
    busiest = max(readings.gpu_other_use, key=lambda pair: pair[1], default=(None, 0.0))[0]
    on_gpu = decision.gpu if busiest is None else decision.device_action(busiest)
    assert (decision.cpu, on_gpu) == (cpu, gpu), decision.reason
    assert reason in decision.reason
    assert decision.take_work is not controls.finishing


@pytest.mark.parametrize(
    ("limit", "loads", "actions"),
    [
        # Over 25% pauses; it resumes only under 15%, not at 24% or 15%.
        (25, [20, 26, 24, 20, 15, 14, 20, 25, 26], [R, P, P, P, P, R, R, R, P]),
        # A load that hovers at the limit turns the worker off once, not at every sample.
        (25, [26, 24, 26, 24, 26, 24, 26], [P, P, P, P, P, P, P]),
        # A low limit resumes under half of it (5% -> 2.5%).
        (5, [6, 3, 2, 6], [P, P, R, P]),
        # No limit: never paused for other programs.
        (0, [99, 99], [R, R]),
    ],
)
def test_the_cpu_limit_resumes_under_a_lower_mark(
    limit: float, loads: list[float], actions: list[Action]
) -> None:
    settings = IdleSettings(suspend_cpu_usage=limit)
    previous = None
    seen = []
    for load in loads:
        previous = decide(
            settings, read(user_idle_s=900, other_cpu_percent=load), Controls(), previous
        )
        seen.append(previous.cpu)
    assert seen == actions


def test_the_lower_mark_outlasts_another_pause_and_says_so() -> None:
    settings = IdleSettings()
    busy = decide(settings, read(user_idle_s=900, other_cpu_percent=30), Controls())
    owner = decide(
        settings, read(user_idle_s=900, other_cpu_percent=20), Controls(paused=True), busy
    )
    assert owner.reason == "paused by the owner" and owner.cpu_busy
    after = decide(settings, read(user_idle_s=900, other_cpu_percent=20), Controls(), owner)
    assert after.cpu is P
    assert after.reason == "paused: other programs use 20% CPU (limit 25%, resumes under 15%)"


def test_limits_follow_activity() -> None:
    settings = IdleSettings(cpu_mode=Mode.ALWAYS, in_use=Limits(cores=2, cpu_percent=30))
    assert decide(settings, read(user_idle_s=1), Controls()).limits.cores == 2
    assert decide(settings, read(user_idle_s=999), Controls()).limits == settings.idle


@pytest.mark.parametrize(
    ("text", "moment", "inside"),
    [
        ("18:00-08:00", datetime(2025, 6, 2, 19, 0), True),
        ("18:00-08:00", datetime(2025, 6, 3, 7, 59), True),  # Tuesday morning, from Monday
        ("18:00-08:00", datetime(2025, 6, 3, 8, 0), False),
        ("mon-fri 09:00-17:00", datetime(2025, 6, 6, 16, 59), True),  # Friday
        ("mon-fri 09:00-17:00", SATURDAY_NOON, False),
        ("fri-mon 00:00-24:00", datetime(2025, 6, 1, 12, 0), True),  # Sunday, in a wrap
        ("fri-mon 00:00-24:00", datetime(2025, 6, 4, 12, 0), False),  # Wednesday
        # The weekend override replaces the everyday window on Saturday and Sunday.
        ("09:00-17:00; sat,sun 20:00-22:00", SATURDAY_NOON, False),
        ("09:00-17:00; sat,sun 20:00-22:00", datetime(2025, 6, 7, 21, 0), True),
        ("09:00-17:00; sat,sun 20:00-22:00", MONDAY_NOON, True),
        # Sunday's window past midnight reaches Monday morning.
        ("sun 22:00-02:00", datetime(2025, 6, 2, 1, 0), True),
    ],
)
def test_windows(text: str, moment: datetime, inside: bool) -> None:
    assert any(w.covers(moment) for w in parse_windows(text)) is inside


def test_next_window_start_skips_to_the_next_allowed_day() -> None:
    windows = parse_windows("sat 10:00-11:00")
    assert next_window_start(windows, MONDAY_NOON) == datetime(2025, 6, 7, 10, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("18:00", "is not [days] HH:MM-HH:MM"),
        ("25:00-08:00", "25:00 in '25:00-08:00' is not a time of day"),
        ("moonday 10:00-11:00", "unknown day 'moonday'"),
        ("mon 10-11", "is not [days]"),
        ("mon,funday 10:00-11:00", "unknown day 'funday'"),
        ("24:00-08:00", "is not a time of day"),
    ],
)
def test_malformed_windows_name_the_setting(text: str, message: str) -> None:
    with pytest.raises(SettingError, match="^windows: ") as caught:
        parse_windows(text)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("values", "name"),
    [
        ({"idle_after_s": -1}, "idle_after_s"),
        ({"suspend_cpu_usage": 120}, "suspend_cpu_usage"),
        ({"suspend_gpu_usage": -1}, "suspend_gpu_usage"),
        ({"min_battery_percent": -5}, "min_battery_percent"),
        ({"in_use": Limits(cpu_percent=0)}, "in_use.cpu_percent"),
        ({"idle": Limits(cores=-1)}, "idle.cores"),
        ({"when_unknown": "maybe"}, "when_unknown"),
    ],
)
def test_bad_settings_are_refused_by_name(values: dict[str, object], name: str) -> None:
    with pytest.raises(SettingError, match=f"^{name}: "):
        IdleSettings(**values)  # type: ignore[arg-type]


# -- giving a suspended task back (worker/stepping.py) --------------------------------------


@pytest.mark.parametrize(
    ("paused_for", "ran_s", "progress", "lease_left_s", "due"),
    [
        (5, 10, 0.5, 600, False),  # needs 10 s more, 600 s left: keep it suspended
        (600, 10, 0.5, 6000, True),  # paused for give_back_after_s: back
        (599, 10, 0.5, 6000, False),
        (5, 100, 0.5, 99, True),  # needs 100 s more, 99 s left: back now
        (5, 100, 0.5, 100, False),
        (5, 30, 0.0, 20, True),  # no progress yet: counted as needing as long again
        (5, 30, 0.0, 40, False),
        (5, 30, 1.0, 0, False),  # done but for delivery: nothing more needed
        (5, 1, 0.1, -1, True),  # the lease already ran out
    ],
)
def test_a_suspended_task_is_given_back_when_due(
    paused_for: float, ran_s: float, progress: float, lease_left_s: float, due: bool
) -> None:
    from idlegrid.worker.stepping import give_back_due

    assert (
        give_back_due(
            paused_for=paused_for, ran_s=ran_s, progress=progress, lease_left_s=lease_left_s,
            give_back_after_s=600,
        )
        is due
    )  # fmt: skip


# -- idle probes fall back (worker/idle/base.py) --------------------------------------------


class _Probe:
    def __init__(self, name: str, answer: float | Exception) -> None:
        self.name, self.answer = name, answer

    def idle_seconds(self) -> float:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_probe_that_raises_falls_back_to_the_next_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from idlegrid.worker.idle.base import IdleSource, ProbeUnavailable

    broken = _Probe("broken", RuntimeError("X connection reset"))
    source = IdleSource([_Probe("blind", ProbeUnavailable("no display")), broken,
                         _Probe("next", 42.0)])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="idlegrid.worker.idle.base"):
        for _ in range(3):
            reading = source.read()
            assert (reading.probe, reading.idle_s) == ("next", 42.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "idle probe broken: failed: RuntimeError: X connection reset; falling back to the next"
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "idle detection: using next"
    ]
    # When the first probe can tell again, it is used again (and said once).
    broken.answer = 3.0
    assert source.read().probe == "broken"
    broken.answer = ProbeUnavailable("gone")
    assert source.read().probe == "next"
