"""The node's settings as the dashboard sees them, and the dashboard's changes applied here.

One rule merges the two places a volunteer edits a node (this machine's local page and
the web): **the later edit wins, setting by setting**. Every setting carries its source
(`web` or `local`), who changed it and when (epoch seconds); a setting that was never
changed is the worker's own configuration (`local`, at 0). Equal times go to the web, so
both sides reach the same answer. The coordinator keeps the web's side in SQL and sends
it after each welcome; this module answers with what the node runs (`settings_report`).

A change this node cannot apply (a value it cannot read, more cores than it has, a
setting it does not know) changes nothing: the node keeps all its settings and reports
why, and the dashboard shows that next to the node.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psutil

from idlegrid import protocol
from idlegrid.worker.governor import ADJUSTABLE
from idlegrid.worker.idle.policy import SettingError

if TYPE_CHECKING:
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker.governor import Governor

log = logging.getLogger(__name__)

CONFIGURED = "the worker's configuration"


def newer(theirs: protocol.Stamped, mine: protocol.Stamped | None) -> bool:
    """Whether `theirs` wins over `mine`: later, or as late and from the web."""
    if mine is None:
        return True
    return (theirs.at, theirs.source == "web") > (mine.at, mine.source == "web")


def winners(
    mine: dict[str, protocol.Stamped], theirs: dict[str, protocol.Stamped]
) -> dict[str, protocol.Stamped]:
    """The settings of `theirs` that replace this node's (the merge rule, pure)."""
    return {name: stamp for name, stamp in theirs.items() if newer(stamp, mine.get(name))}


def current(governor: Governor, settings: WorkerSettings) -> dict[str, protocol.Stamped]:
    """Every setting this node runs with, stamped with where it came from."""
    owner = governor.owner
    policy = governor.settings
    values: dict[str, Any] = {
        "control": control_value(governor),
        "cpu_mode": str(policy.cpu_mode),
        "gpu_mode": str(policy.gpu_mode),
        "cpu_percent": policy.idle.cpu_percent,
        "in_use_cpu_percent": policy.in_use.cpu_percent,
        "cpu_cores": policy.idle.cores,
        "memory_percent": policy.idle.memory_percent,
        "windows": owner.overrides.get("windows", settings.windows),
        "exclusive_apps": list(policy.exclusive_apps),
        "daily_download_mb": owner.overrides.get("daily_download_mb", settings.daily_download_mb),
        "paused_gpus": list(policy.paused_gpus),
    }
    out = {}
    for name, value in values.items():
        stamp = owner.sources.get(name) or {"source": "local", "by": CONFIGURED, "at": 0.0}
        out[name] = protocol.Stamped(value=value, **stamp)
    return out


def control_value(governor: Governor) -> dict[str, Any]:
    owner = governor.owner
    if owner.paused:
        return {"action": "pause", "until": None}
    if owner.finishing:
        return {"action": "finish", "until": None}
    if owner.snooze_until:
        until = datetime.fromisoformat(owner.snooze_until).timestamp()
        if until > time.time():
            return {"action": "snooze", "until": until}
    return {"action": "run", "until": None}


def report(
    governor: Governor, settings: WorkerSettings, error: str = ""
) -> protocol.SettingsReport:
    return protocol.SettingsReport(settings=current(governor, settings), error=error[:500])


def apply(
    governor: Governor, settings: WorkerSettings, incoming: dict[str, protocol.Stamped]
) -> str:
    """Apply the settings of `incoming` that win; "" when done, else why nothing changed."""
    wins = winners(current(governor, settings), incoming)
    if not wins:
        return ""
    try:
        values = {name: _checked(name, stamp.value) for name, stamp in wins.items()}
        check_all(governor, {k: v for k, v in values.items() if k != "control"})
    except (ValueError, SettingError) as exc:
        log.warning("settings from the coordinator not applied: %s", exc)
        return f"could not apply the dashboard's settings: {exc}; kept the node's own"
    control = values.pop("control", None)
    stamps = {name: stamp.model_dump(exclude={"value"}) for name, stamp in wins.items()}
    for name, value in values.items():
        governor.change({name: value}, stamp=stamps[name])
    if control is not None:
        _control(governor, control, stamps["control"])
    log.info("settings from the dashboard: %s", ", ".join(sorted(wins)))
    return ""


def _checked(name: str, value: Any) -> Any:
    """A value this node can use, or ValueError/SettingError saying why not."""
    if name not in ("control", *ADJUSTABLE):
        raise SettingError(f"{name}: this worker does not know this setting")
    value = protocol.check_setting(name, value)
    if name == "cpu_cores" and value > (psutil.cpu_count() or 1):
        raise SettingError(f"cpu_cores: {value} is more than this machine's {psutil.cpu_count()}")
    return value


def check_all(governor: Governor, values: dict[str, Any]) -> None:
    """Every value at once against the node's settings (SettingError: one cannot be used)."""
    governor.check(values)


def _control(governor: Governor, control: dict[str, Any], stamp: dict[str, Any]) -> None:
    match control["action"]:
        case "pause":
            governor.pause(stamp=stamp)
        case "finish":
            governor.finish(stamp=stamp)
        case "snooze":
            governor.snooze(max(0.0, float(control["until"]) - time.time()), stamp=stamp)
        case _:
            governor.resume(stamp=stamp)
