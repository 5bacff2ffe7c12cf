"""`idlegrid app` for real: the local control page in a pywebview window (WebKitGTK) under
Xvfb, screenshot, and the worker paused from inside the window with the keyboard.

Screenshots are kept in the test's folder (IDLEGRID_SCREENSHOTS names another one).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from desktop import close_window, find_colour, local_worker, require, screenshot, xdotool, xvfb
from helpers import wait_until

from idlegrid.worker.local_client import LocalWorker

# The page's state badge (worker/control_page.py, the dashboard's --ok-soft and
# --warn-soft): running, then paused.
RUNNING_BADGE = (0xE3, 0xF5, 0xEA)
PAUSED_BADGE = (0xFF, 0xF4, 0xDB)


def test_the_app_window_shows_the_page_and_pauses_the_worker(tmp_path: Path) -> None:
    require(tools=("Xvfb", "xdotool", "dbus-run-session"), modules=("webview", "gi"))
    shots = Path(os.environ.get("IDLEGRID_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    state_dir = tmp_path / "state"
    with local_worker(state_dir, tmp_path / "worker.log"), xvfb("1024x768") as display:
        env = {**os.environ, "DISPLAY": display}
        log = (tmp_path / "app.log").open("w")
        app = subprocess.Popen(
            ["dbus-run-session", "--", sys.executable, "-m", "idlegrid", "app",
             "--state-dir", str(state_dir)], env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            window = xdotool(display, "search", "--sync", "--name", "^idlegrid worker$").split()[0]

            def badge(colour: tuple[int, int, int], name: str) -> object:
                return find_colour(screenshot(display, shots / name), colour, tolerance=3)

            wait_until(lambda: badge(RUNNING_BADGE, "app-1-running.png"), "the page, running",
                       timeout_s=60, poll_s=0.5)  # fmt: skip
            worker = LocalWorker(state_dir)
            assert worker.status()["state"] == "running"
            # Into the page: the first control is the Pause button.
            xdotool(display, "windowfocus", "--sync", window)
            xdotool(display, "key", "--window", window, "--delay", "200", "Tab", "space")
            wait_until(lambda: worker.status()["controls"]["paused"], "the pause", timeout_s=10)
            wait_until(lambda: badge(PAUSED_BADGE, "app-2-paused.png"), "the page, paused",
                       timeout_s=15, poll_s=0.5)  # fmt: skip
            assert worker.status()["state"] == "paused"
            # Closed as a window manager's close button does: first the window goes, then
            # the process (WebKit's helpers end with it; slow on a loaded machine). The
            # request goes to each of the app's windows shown, again every few seconds while
            # one is, as a user clicks close again when nothing happens (with no window
            # manager here, a request that GTK misses is not repeated by anyone else).
            wait_until(lambda: _closed(display), "the window to close", timeout_s=30, poll_s=5)
            try:
                assert app.wait(90) == 0, (tmp_path / "app.log").read_text()
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    "the window closed but the app did not exit:\n"
                    + (tmp_path / "app.log").read_text()
                ) from None
        finally:
            if app.poll() is None:
                app.terminate()
                app.wait(10)
            log.close()


def _shown(display: str) -> list[int]:
    """The app's windows still mapped on the display."""
    found = subprocess.run(
        ["xdotool", "search", "--onlyvisible", "--name", "^idlegrid worker$"],
        env={**os.environ, "DISPLAY": display}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return [int(window) for window in found.stdout.split()]


def _closed(display: str) -> bool:
    """Whether the app's windows are gone; asks each one shown to close (and waits a
    moment for it) if not."""
    shown = _shown(display)
    for window in shown:
        with contextlib.suppress(Exception):  # gone meanwhile: Xlib's errors
            close_window(display, window)
    if shown:
        time.sleep(1.0)  # the close takes a moment: asked again at the next poll only
    return not _shown(display)
