"""The tray icon: the worker's state and its reason, with pause, resume, snooze 1 h, the
app window, the local page in a browser, and quit.

It is a client of the local control page (worker/local_client.py), like the CLI's
subcommands, so it works with a worker its own account started: by hand, or as the
user's service (the control token is readable by its owner only). pystray draws it: through
GTK (a StatusIcon, which XEmbed trays such as trayer or stalonetray host, or an
AppIndicator where the desktop has one), through X11 directly without GTK, or the
platform's own tray on macOS and Windows.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import webbrowser
from pathlib import Path
from typing import Any

from idlegrid.worker.local_client import LocalWorker, LocalWorkerError
from idlegrid.worker.service import worker_command
from idlegrid.worker.tray_view import TrayView, icon_image, view_of

log = logging.getLogger(__name__)

SNOOZE_S = 3600.0


def linux_backend() -> str:
    """pystray's backend for this desktop: an AppIndicator where its library is installed
    (GNOME with its extension, KDE, Unity), else GTK's StatusIcon (XEmbed trays), else
    X11 directly. pystray's own choice stops at the first library it cannot load."""
    try:
        import gi
    except ImportError:
        return "xorg"
    for namespace in ("AyatanaAppIndicator3", "AppIndicator3"):
        try:
            gi.require_version(namespace, "0.1")
        except ValueError:
            continue
        return "appindicator"
    try:
        gi.require_version("Gtk", "3.0")
    except ValueError:
        return "xorg"
    return "gtk"


class Tray:
    """One tray icon over the worker at `state_dir`, refreshed every `every` seconds."""

    def __init__(self, state_dir: Path, *, every: float = 2.0) -> None:
        if sys.platform.startswith("linux"):
            os.environ.setdefault("PYSTRAY_BACKEND", linux_backend())
        import pystray

        self.state_dir = state_dir
        self.worker = LocalWorker(state_dir, timeout=5.0)
        self.every = every
        self.view: TrayView = view_of(None, "starting")
        self._stopped = threading.Event()
        self.icon = pystray.Icon(
            "idlegrid-worker", icon_image(self.view.state), self.view.title, menu=self._menu()
        )

    def _menu(self) -> Any:
        from pystray import Menu, MenuItem

        reachable = lambda item: self.view.state != "unreachable"  # noqa: E731
        return Menu(
            MenuItem(lambda item: self.view.title, None, enabled=False),
            Menu.SEPARATOR,
            MenuItem("Pause", self._act("pause"), enabled=lambda item: self.view.can_pause),
            MenuItem("Resume", self._act("resume"), enabled=lambda item: self.view.can_resume),
            MenuItem("Snooze 1 hour", self._act("snooze", seconds=SNOOZE_S), enabled=reachable),
            Menu.SEPARATOR,
            MenuItem("Open the app window", self._open_app, default=True),
            MenuItem("Open the local page in a browser", self._open_page, enabled=reachable),
            MenuItem("Quit the tray", self._quit),
        )

    def run(self) -> None:
        """Show the icon until Quit (blocks: the toolkit's loop runs here)."""
        try:
            self.icon.run(setup=self._setup)
        except Exception:
            if not self._stopped.is_set():
                raise
            # After Quit the icon is gone; pystray's GTK backend then fails to close its
            # notification where the desktop runs no notification service.
            log.debug("the tray's toolkit failed while closing", exc_info=True)

    def _setup(self, icon: Any) -> None:
        icon.visible = True
        threading.Thread(target=self._watch, name="tray-status", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            self.refresh()
            self._stopped.wait(self.every)

    def refresh(self, status: dict[str, Any] | None = None) -> None:
        """Read the worker's status (or take `status`) and redraw what changed."""
        problem = ""
        if status is None:
            try:
                status = self.worker.status()
            except LocalWorkerError as exc:
                problem = str(exc)
        view = view_of(status, problem)
        if view == self.view:
            return
        if view.state != self.view.state:
            self.icon.icon = icon_image(view.state)
        self.view = view
        self.icon.title = view.title
        self.icon.update_menu()

    def _act(self, action: str, **body: Any) -> Any:
        def act() -> None:
            try:
                self.refresh(self.worker.act(action, body))
            except LocalWorkerError as exc:
                log.warning("%s: %s", action, exc)
                self.refresh()

        return lambda icon, item: act()

    def _open_app(self, icon: Any, item: Any) -> None:
        command = [*worker_command(), "--state-dir", str(self.state_dir), "app"]
        subprocess.Popen(command, start_new_session=True)  # a window of its own process

    def _open_page(self, icon: Any, item: Any) -> None:
        try:
            webbrowser.open(self.worker.page_url())
        except LocalWorkerError as exc:
            log.warning("open the page: %s", exc)

    def _quit(self, icon: Any, item: Any) -> None:
        self._stopped.set()
        icon.stop()


def run_tray(state_dir: Path, *, every: float = 2.0) -> None:
    """`idlegrid worker tray`."""
    Tray(state_dir, every=every).run()
