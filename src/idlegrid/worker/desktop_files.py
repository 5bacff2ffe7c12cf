"""The files that start the tray at login and put the app window in the desktop's menu:
an XDG autostart entry and an application entry on Linux, a LaunchAgent on macOS, a
script in the Startup folder on Windows. Pure functions of the worker's command line;
`service.install` writes them, and the Debian package carries the Linux ones.
"""

from __future__ import annotations

import plistlib
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TRAY_LAUNCHD_LABEL = "org.idlegrid.tray"
AUTOSTART_FILE = "idlegrid-tray.desktop"
APP_MENU_FILE = "idlegrid-worker.desktop"
STARTUP_SCRIPT = "idlegrid-tray.vbs"
ICON_NAME = "idlegrid-worker"

# Characters that the Desktop Entry specification wants escaped inside a quoted argument.
_EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def exec_line(command: Sequence[str]) -> str:
    """A Desktop Entry `Exec=` value: arguments quoted and escaped as the spec says."""
    parts = []
    for part in command:
        part = part.replace("%", "%%")  # a field code otherwise
        if part and not set(part) & _EXEC_RESERVED:
            parts.append(part)
            continue
        quoted = "".join("\\" + c if c in '"`$\\' else c for c in part)
        # The string escape applies before the quoting: each backslash is written twice.
        parts.append('"' + quoted.replace("\\", "\\\\") + '"')
    return " ".join(parts)


def xdg_autostart_entry(command: Sequence[str]) -> str:
    """`~/.config/autostart/idlegrid-tray.desktop` (or `/etc/xdg/autostart/`): the tray."""
    return f"""[Desktop Entry]
Type=Application
Name=idlegrid worker tray
Comment=The idlegrid worker's state, with pause, resume and snooze
Exec={exec_line([*command, "tray"])}
Icon={ICON_NAME}
Terminal=false
NoDisplay=true
X-GNOME-Autostart-enabled=true
X-GNOME-Autostart-Delay=5
"""


def app_menu_entry(command: Sequence[str]) -> str:
    """`applications/idlegrid-worker.desktop`: the app window in the desktop's menu."""
    return f"""[Desktop Entry]
Type=Application
Name=idlegrid worker
GenericName=Volunteer computing
Comment=State, tasks and settings of the idlegrid worker on this machine
Exec={exec_line([*command, "app"])}
Icon={ICON_NAME}
Terminal=false
Categories=System;Monitor;
Keywords=idlegrid;grid;volunteer;compute;
StartupNotify=true
"""


def plist(entries: Mapping[str, Any]) -> str:
    """A launchd property list (XML) of `entries`."""
    return plistlib.dumps(dict(entries), sort_keys=False).decode()


def tray_launch_agent(command: Sequence[str]) -> str:
    """`~/Library/LaunchAgents/org.idlegrid.tray.plist`: the tray at login (Aqua only)."""
    return plist({
        "Label": TRAY_LAUNCHD_LABEL,
        "ProgramArguments": [*command, "tray"],
        "RunAtLoad": True,
        "LimitLoadToSessionType": "Aqua",
        "ProcessType": "Interactive",
    })  # fmt: skip


def windows_startup_script(command: Sequence[str]) -> str:
    """`Startup\\idlegrid-tray.vbs`: starts the tray at logon without a console window."""
    line = subprocess.list2cmdline([*command, "tray"]).replace('"', '""')
    return (
        "' Starts the idlegrid worker's tray icon at logon, without a console window.\r\n"
        f'CreateObject("WScript.Shell").Run "{line}", 0, False\r\n'
    )


def user_files(
    command: Sequence[str],
    *,
    platform: str,
    home: Path,
    environ: Mapping[str, str],
    tray_command: Sequence[str] | None = None,
) -> list[tuple[Path, str]]:
    """Where `idlegrid worker install` puts the tray's login entry (and on Linux the app's
    menu entry) for this user, with their text. `command` ends with the worker's options;
    `tray_command` is what starts the tray, with the same options, when that is another
    program (the build's tray app on macOS and Windows); `tray` follows either."""
    tray = command if tray_command is None else tray_command
    if platform.startswith("linux"):
        config = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
        data = Path(environ.get("XDG_DATA_HOME") or home / ".local" / "share")
        return [
            (config / "autostart" / AUTOSTART_FILE, xdg_autostart_entry(tray)),
            (data / "applications" / APP_MENU_FILE, app_menu_entry(command)),
        ]
    if platform == "darwin":
        agents = home / "Library" / "LaunchAgents"
        return [(agents / f"{TRAY_LAUNCHD_LABEL}.plist", tray_launch_agent(tray))]
    if platform == "win32":
        appdata = Path(environ.get("APPDATA") or home / "AppData" / "Roaming")
        startup = appdata / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup"
        return [(startup / STARTUP_SCRIPT, windows_startup_script(tray))]
    return []
