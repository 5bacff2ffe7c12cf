"""The tray icon for real: under Xvfb, hosted by Debian's trayer (an XEmbed system tray),
drawn by pystray through GTK, driven by xdotool, over a running worker.

Screenshots of each step are kept in the test's folder (IDLEGRID_SCREENSHOTS names
another one to keep them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from desktop import find_colour, local_worker, require, screenshot, xdotool, xvfb
from helpers import wait_until
from PIL import Image, ImageChops

from idlegrid.worker.local_client import LocalWorker
from idlegrid.worker.tray_view import COLOURS, TrayView, view_of

RUNNING = {"state": "running", "reason": "running: dedicated", "controls": {"paused": False}}
OWNER_PAUSED = {"state": "paused", "reason": "paused by the owner", "controls": {"paused": True}}
SNOOZED = {"state": "paused", "reason": "paused: snoozed", "controls": {"snooze_until": 9.0}}
USER_ACTIVE = {"state": "paused", "reason": "paused: user active 3 s ago", "controls": {}}
THROTTLED = {"state": "throttled", "reason": "in use, 50% of the CPU", "controls": {}}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (RUNNING, TrayView("running", "idlegrid: running: dedicated", True, False)),
        (OWNER_PAUSED, TrayView("paused", "idlegrid: paused by the owner", False, True)),
        (SNOOZED, TrayView("paused", "idlegrid: paused: snoozed", False, True)),
        # Paused by the policy: the owner may still pause (it outlasts the policy's pause).
        (USER_ACTIVE, TrayView("paused", "idlegrid: paused: user active 3 s ago", True, True)),
        (
            THROTTLED,
            TrayView("throttled", "idlegrid: throttled: in use, 50% of the CPU", True, False),
        ),  # fmt: skip
        (None, TrayView("unreachable", "idlegrid: no worker answers", False, False)),
    ],
)
def test_the_tray_shows_the_state_its_reason_and_what_can_be_done(
    status: dict[str, object] | None, expected: TrayView
) -> None:
    assert view_of(status) == expected


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("IDLEGRID_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _icon_at(display: str, shots: Path, name: str, state: str) -> tuple[int, int]:
    """Where the icon in `state`'s colour is on screen (a screenshot saved as `name`)."""

    def find() -> tuple[int, int] | None:
        return find_colour(screenshot(display, shots / name), COLOURS[state])

    return wait_until(find, f"the tray icon in {state}'s colour", timeout_s=30, poll_s=0.5)


def _menu_item(display: str, where: tuple[int, int], keys: list[str], shot: Path) -> None:
    """Open the icon's menu with a right click (a screenshot of it saved as `shot`), then
    choose an item with the keyboard."""
    xdotool(display, "mousemove", str(where[0]), str(where[1]))
    before = screenshot(display, shot)
    xdotool(display, "click", "3")
    # GTK grabs the keyboard as the menu maps: once the menu shows, keys go to it.
    wait_until(lambda: _menu_shown(before, screenshot(display, shot)), "the icon's menu",
               timeout_s=30, poll_s=0.1)  # fmt: skip
    xdotool(display, "key", "--delay", "150", *keys)


def _menu_shown(before: Image.Image, now: Image.Image) -> bool:
    """Whether something menu-sized appeared (not the icon's own hover highlight)."""
    changed = ImageChops.difference(before, now).getbbox()
    return changed is not None and changed[2] - changed[0] >= 60 and changed[3] - changed[1] >= 30


def test_the_tray_icon_pauses_and_resumes_the_worker_and_quits(tmp_path: Path) -> None:
    require(tools=("Xvfb", "xdotool", "trayer", "dbus-run-session"), modules=("pystray", "gi"))
    shots = _shots(tmp_path)
    state_dir = tmp_path / "state"
    with (
        local_worker(state_dir, tmp_path / "worker.log"),
        xvfb("640x260") as display,
    ):
        env = {**os.environ, "DISPLAY": display}
        env.pop("PYSTRAY_BACKEND", None)  # the tray picks GTK itself (no AppIndicator here)
        host = subprocess.Popen(
            ["trayer", "--edge", "top", "--align", "left", "--widthtype", "request",
             "--height", "48", "--iconspacing", "4", "--tint", "0xffffff", "--transparent",
             "false"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        tray = subprocess.Popen(
            # A desktop session has a session bus, which pystray's GTK backend wants.
            ["dbus-run-session", "--", sys.executable, "-m", "idlegrid", "worker",
             "--state-dir", str(state_dir), "tray", "--every", "0.5"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            worker = LocalWorker(state_dir)
            assert worker.status()["state"] == "running"
            where = _icon_at(display, shots, "tray-1-running.png", "running")
            _menu_item(display, where, ["Down", "Return"], shots / "tray-menu-running.png")
            paused = wait_until(lambda: worker.status()["controls"]["paused"], "the pause")
            assert paused and worker.status()["state"] == "paused"
            where = _icon_at(display, shots, "tray-2-paused.png", "paused")
            # Now the first enabled item is Resume: Pause is disabled.
            _menu_item(display, where, ["Down", "Return"], shots / "tray-menu-paused.png")
            wait_until(lambda: worker.status()["state"] == "running", "the resume")
            where = _icon_at(display, shots, "tray-3-running-again.png", "running")
            _menu_item(display, where, ["Up", "Return"], shots / "tray-menu-quit.png")  # the last
            assert tray.wait(30) == 0, tray.stdout.read() if tray.stdout else ""
        finally:
            for process in (tray, host):
                if process.poll() is None:
                    process.terminate()
                    process.wait(10)
            if tray.stdout is not None:
                tray.stdout.close()
