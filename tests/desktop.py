"""A desktop for tests of the tray and the app window: an X server under Xvfb, a tray
host from Debian (trayer), screenshots read through python-xlib, input from xdotool, and
a local worker whose control page they drive.

Without the tools or the `desktop` extra the tests skip, except under CI=true, where they
fail (apt-get install xvfb xdotool trayer gir1.2-gtk-3.0 gir1.2-webkit2-4.1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from PIL import Image

ON_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(*, tools: tuple[str, ...], modules: tuple[str, ...]) -> None:
    """Skip (fail under CI=true) unless these programs and Python modules are here."""
    missing = [t for t in tools if shutil.which(t) is None]
    missing += [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        message = (f"needs {missing} (apt-get install xvfb xdotool trayer gir1.2-gtk-3.0 "
                   "gir1.2-webkit2-4.1; pip install '.[desktop]')")  # fmt: skip
        if ON_CI:
            pytest.fail(f"{message}; CI=true requires them")
        pytest.skip(message)


@contextlib.contextmanager
def xvfb(size: str = "800x600") -> Iterator[str]:
    """A display under Xvfb (a free number, that the server picks itself)."""
    read, write = os.pipe()
    server = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write), "-nolisten", "tcp", "-screen", "0", f"{size}x24"],
        pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(write)
    try:
        with os.fdopen(read) as numbers:
            number = numbers.readline().strip()  # written once the server listens
        assert number, "Xvfb did not start"
        yield f":{number}"
    finally:
        server.terminate()
        server.wait(10)


def screenshot(display: str, path: Path) -> Image.Image:
    """The whole screen as an RGB image, also saved to `path`."""
    from Xlib import X
    from Xlib.display import Display

    connection = Display(display)
    try:
        root = connection.screen().root
        geometry = root.get_geometry()
        raw = root.get_image(0, 0, geometry.width, geometry.height, X.ZPixmap, 0xFFFFFFFF)
        size = (geometry.width, geometry.height)
        image = Image.frombytes("RGB", size, raw.data, "raw", "BGRX")
    finally:
        connection.close()
    image.save(path)
    return image


def find_colour(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 12) -> Any:
    """The centre (x, y) of the pixels near `colour`, or None when there are none."""
    xs, ys = [], []
    pixels = image.load()
    width, height = image.size
    for y in range(height):
        for x in range(width):
            r, g, b = pixels[x, y]
            if max(abs(r - colour[0]), abs(g - colour[1]), abs(b - colour[2])) <= tolerance:
                xs.append(x)
                ys.append(y)
    if len(xs) < 4:
        return None
    return (sum(xs) // len(xs), sum(ys) // len(ys))


def xdotool(display: str, *args: str) -> str:
    done = subprocess.run(
        ["xdotool", *args], env={**os.environ, "DISPLAY": display},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@contextlib.contextmanager
def local_worker(state_dir: Path, log: Path) -> Iterator[subprocess.Popen[str]]:
    """A worker daemon with its control page on a free port; no coordinator answers it,
    which the page does not need. Stopped after."""
    out = log.open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "idlegrid", "worker", "--server", "http://127.0.0.1:9",
         "--token", "ign_desktop-test", "--state-dir", str(state_dir), "--dedicated",
         "--no-benchmark", "--control-port", "0"],
        stdout=out, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: (state_dir / "control.json").is_file() or worker.poll() is not None,
                   "the worker's control page", timeout_s=90)  # fmt: skip
        assert worker.poll() is None, log.read_text()
        yield worker
    finally:
        worker.terminate()
        worker.wait(60)
        out.close()


def close_window(display: str, window_id: int) -> None:
    """Ask a window to close as a window manager's close button does (WM_DELETE_WINDOW)."""
    from Xlib import X
    from Xlib.display import Display
    from Xlib.protocol import event

    connection = Display(display)
    try:
        window = connection.create_resource_object("window", window_id)
        protocols = connection.intern_atom("WM_PROTOCOLS")
        delete = connection.intern_atom("WM_DELETE_WINDOW")
        message = event.ClientMessage(
            window=window, client_type=protocols, data=(32, [delete, X.CurrentTime, 0, 0, 0])
        )
        window.send_event(message, event_mask=X.NoEventMask)
        connection.flush()
    finally:
        connection.close()
