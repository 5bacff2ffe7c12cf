"""The governor tells the coordinator each turn between pause, throttle and full speed."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from idlegrid.worker.governor import Governor
from idlegrid.worker.idle.policy import Action, Decision, IdleSettings, Mode, Readings


class Owner:
    """Sensors whose user input idle time the test sets."""

    def __init__(self) -> None:
        self.idle_s = 1000.0

    def read(self) -> Readings:
        return Readings(now=datetime(2026, 1, 5, 12), user_idle_s=self.idle_s)


async def test_each_turn_between_run_throttle_and_pause_is_told(tmp_path: Path) -> None:
    owner = Owner()
    told: list[Action] = []

    async def on_change(decision: Decision) -> None:
        told.append(decision.action(gpu=False))

    governor = Governor(
        IdleSettings(cpu_mode=Mode.ALWAYS, idle_after_s=60.0),
        owner,  # type: ignore[arg-type]
        [],
        state_dir=tmp_path,
        on_change=on_change,
    )
    steps: list[Any] = []
    for idle_s in (1000.0, 1000.0, 0.0, 0.0, 1000.0):
        owner.idle_s = idle_s
        steps.append((await governor.step()).action(gpu=False))
    governor.pause()
    steps.append((await governor.step()).action(gpu=False))
    assert steps == [Action.RUN, Action.RUN, Action.THROTTLE, Action.THROTTLE, Action.RUN,
                     Action.PAUSE]  # fmt: skip
    assert told == [Action.RUN, Action.THROTTLE, Action.RUN, Action.PAUSE]
