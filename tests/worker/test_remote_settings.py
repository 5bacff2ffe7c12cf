"""Settings from the dashboard on the worker: the merge rule, applying, refusing, reporting."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from idlegrid import protocol
from idlegrid.settings import WorkerSettings
from idlegrid.worker import remote_settings
from idlegrid.worker.daemon import Worker
from idlegrid.worker.downloads import DailyDownloads
from idlegrid.worker.idle.policy import Action


def stamp(value: object, source: str = "web", at: float = 10.0) -> protocol.Stamped:
    return protocol.Stamped(value=value, source=source, by="vera", at=at)  # type: ignore[arg-type]


# The later edit wins, setting by setting; equal times go to the web.
MERGES = [
    # theirs (source, at), mine (source, at) or None, theirs wins?
    (("web", 10.0), None, True),
    (("web", 10.0), ("local", 9.0), True),
    (("web", 10.0), ("local", 11.0), False),
    (("web", 10.0), ("local", 10.0), True),
    (("local", 10.0), ("web", 10.0), False),
    (("web", 10.0), ("web", 10.0), False),
    (("local", 12.0), ("web", 10.0), True),
]


@pytest.mark.parametrize(("theirs", "mine", "wins"), MERGES)
def test_the_later_edit_wins(
    theirs: tuple[str, float], mine: tuple[str, float] | None, wins: bool
) -> None:
    old = None if mine is None else stamp(1, *mine)
    assert remote_settings.newer(stamp(2, *theirs), old) is wins


def _worker(tmp_path: Path, **values: object) -> Worker:
    settings = WorkerSettings(
        token="ign_x", state_dir=tmp_path / "worker", kinds=("sleep",), benchmark=False,
        when_unknown="idle", suspend_cpu_usage=0, **values,  # type: ignore[arg-type]
    )  # fmt: skip
    worker = Worker(settings)
    worker.sensors.idle.probes = []
    return worker


async def test_web_settings_apply_and_are_reported_with_their_source(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    sent = [protocol.Settings(settings={
        "control": stamp({"action": "pause"}),
        "cpu_percent": stamp(40),
        "exclusive_apps": stamp(["blender"]),
        "daily_download_mb": stamp(500),
    })]  # fmt: skip
    reports: list[protocol.BaseModel] = []

    async def send(message: protocol.BaseModel) -> bool:
        reports.append(message)
        return True

    worker._send = send  # type: ignore[method-assign]
    await worker._on_settings(sent[0])
    assert worker.governor.action() is Action.PAUSE
    assert worker.governor.settings.idle.cpu_percent == 40
    assert worker.sensors.exclusive_apps == ("blender",)
    assert worker.download_cap_mb() == 500
    report = next(m for m in reports if isinstance(m, protocol.SettingsReport))
    assert report.error == ""
    assert report.settings["cpu_percent"].source == "web"
    assert report.settings["cpu_percent"].by == "vera"
    assert report.settings["cpu_mode"].source == "local"  # never changed: its configuration
    assert report.settings["cpu_mode"].at == 0
    # A later local resume wins over the web's pause; an older web resend changes nothing.
    worker.governor.resume()
    await worker._on_settings(sent[0])
    await worker.governor.step()
    assert worker.governor.action() is not Action.PAUSE
    assert remote_settings.current(worker.governor, worker.settings)["control"].source == "local"
    # The stamps survive a restart (controls.json).
    again = _worker(tmp_path)
    assert again.governor.owner.sources["cpu_percent"]["by"] == "vera"


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"cpu_cores": stamp(psutil.cpu_count() + 1)}, "more than this machine's"),
        ({"cpu_percent": stamp(0)}, "cpu_percent"),
        ({"windows": stamp("someday")}, "windows"),
        ({"overclock": stamp(True)}, "does not know this setting"),
    ],
)
async def test_settings_a_node_cannot_apply_change_nothing(
    tmp_path: Path, settings: dict[str, protocol.Stamped], problem: str
) -> None:
    worker = _worker(tmp_path)
    before = remote_settings.current(worker.governor, worker.settings)
    error = remote_settings.apply(
        worker.governor, worker.settings, {"cpu_percent": stamp(30), **settings}
    )
    assert problem in error and "kept the node's own" in error
    assert remote_settings.current(worker.governor, worker.settings) == before


async def test_an_unreadable_settings_frame_is_reported(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    reports: list[protocol.BaseModel] = []

    async def send(message: protocol.BaseModel) -> bool:
        reports.append(message)
        return True

    worker._send = send  # type: ignore[method-assign]
    await worker._on_frame('{"type": "settings", "v": 1, "settings": {"cpu_percent": 5}}')
    report = reports[-1]
    assert isinstance(report, protocol.SettingsReport)
    assert report.error.startswith("could not read the dashboard's settings")
    assert "kept its own" in worker.settings_error


def test_the_daily_download_cap_counts_today_only(tmp_path: Path) -> None:
    day = ["2026-12-06"]
    from datetime import date

    downloads = DailyDownloads(tmp_path / "d.json", today=lambda: date.fromisoformat(day[0]))
    downloads.add(600_000)
    assert not downloads.over(1.0) and not downloads.over(0)
    downloads.add(400_000)
    assert downloads.over(1.0)
    again = DailyDownloads(tmp_path / "d.json", today=lambda: date.fromisoformat(day[0]))
    assert again.today_mb() == 1.0
    day[0] = "2026-12-07"
    assert not again.over(1.0)


async def test_a_snooze_from_the_web_pauses_until_its_time(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    until = time.time() + 600
    remote_settings.apply(
        worker.governor, worker.settings, {"control": stamp({"action": "snooze", "until": until})}
    )
    await worker.governor.step()
    assert worker.governor.action() is Action.PAUSE
    value = remote_settings.control_value(worker.governor)
    assert value["action"] == "snooze" and abs(value["until"] - until) < 2


async def test_past_the_download_cap_the_node_asks_for_no_work(tmp_path: Path) -> None:
    worker = _worker(tmp_path, daily_download_mb=1.0)
    sent: list[protocol.BaseModel] = []

    async def send(message: protocol.BaseModel) -> bool:
        sent.append(message)
        return True

    worker._send = send  # type: ignore[method-assign]
    await worker.governor.step()
    await worker._send_ready()
    assert isinstance(sent[-1], protocol.Ready)
    worker.downloads.add(1_000_000)
    sent.clear()
    await worker._send_ready()
    assert [type(m) for m in sent] == [protocol.Status]
    assert isinstance(sent[0], protocol.Status) and sent[0].state == "paused"
    assert "downloads reached the cap of 1 MB" in sent[0].reason
    # Raised from the web: it asks again.
    sent.clear()
    await worker._on_settings(protocol.Settings(settings={"daily_download_mb": stamp(5)}))
    assert any(isinstance(m, protocol.Ready) for m in sent)
