"""Linux idle probes: X11's XScreenSaver, input devices, logind, and terminals (Wayland:
wayland.py).

Why four: each sees a different part of the machine, and each is blind somewhere.
XScreenSaver is exact but needs the X display (a Wayland session's XWayland sees only
X11 clients, so it is refused there). Reading /dev/input is exact on X11, Wayland and the
console, but needs the `input` group or root. logind's IdleHint comes from the desktop's
own idle timer (coarse, but it works for a system service on any session type). Terminal
access times catch SSH and console typing, as BOINC's idle_detect does.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from idlegrid.worker.idle.base import ProbeUnavailable

EV_KEY, EV_REL = 1, 2
RESCAN_S = 10.0  # how often the input-device probe looks for new (hot-plugged) devices


class XScreenSaverProbe:
    """Idle time from the X server's MIT-SCREEN-SAVER extension (python-xlib)."""

    name = "x11-screensaver"

    def __init__(self, display: str | None = None) -> None:
        self.display_name = display
        self._display: Any = None

    def idle_seconds(self) -> float:
        name = self.display_name or os.environ.get("DISPLAY")
        if not name:
            raise ProbeUnavailable("no X display (DISPLAY is not set)")
        if os.environ.get("XDG_SESSION_TYPE") == "wayland" and self.display_name is None:
            raise ProbeUnavailable("a Wayland session: XWayland sees only X11 clients' input")
        display = self._connect(name)
        try:
            info = display.screen().root.screensaver_query_info()
        except Exception:
            self.close()  # the server went away: reconnect at the next reading
            raise
        return float(info.idle) / 1000.0

    def _connect(self, name: str) -> Any:
        if self._display is not None:
            return self._display
        try:
            from Xlib import display as xdisplay
            from Xlib.error import DisplayError
            from Xlib.ext import screensaver  # noqa: F401  (registers the request)
        except ImportError:
            raise ProbeUnavailable("python-xlib is not installed") from None
        try:
            connection = xdisplay.Display(name)
        except DisplayError as exc:
            raise ProbeUnavailable(f"cannot open display {name}: {exc}") from None
        if not connection.has_extension("MIT-SCREEN-SAVER"):
            connection.close()
            raise ProbeUnavailable(f"display {name} has no MIT-SCREEN-SAVER extension")
        self._display = connection
        return connection

    def close(self) -> None:
        if self._display is not None:
            try:
                self._display.close()
            finally:
                self._display = None


class InputDevicesProbe:
    """Input events read from /dev/input/event* (keyboards, mice, touchpads).

    Events queue in the kernel between readings, so a reading that finds any knows there
    was input since the last one. Before the first event it answers the time since it
    started watching, a lower bound. Without permission to read the devices it falls
    back to their access times, which relatime mounts update at most daily: coarse.
    """

    name = "input-devices"

    def __init__(
        self, devices: Path = Path("/dev/input"), sysfs: Path = Path("/sys/class/input")
    ) -> None:
        self.devices, self.sysfs = devices, sysfs
        self._fds: dict[str, int] = {}
        self._unreadable: list[Path] = []
        self._scanned_at = -RESCAN_S
        self._last_input = time.monotonic()

    def idle_seconds(self) -> float:
        now = time.monotonic()
        if now - self._scanned_at >= RESCAN_S:
            self._scan()
            self._scanned_at = now
        if not self._fds and not self._unreadable:
            raise ProbeUnavailable(f"no keyboard or mouse under {self.devices}")
        if self._drain():
            self._last_input = now
        idle = now - self._last_input
        if self._unreadable:
            newest = max((p.stat().st_atime for p in self._unreadable), default=0.0)
            idle = min(idle, max(0.0, time.time() - newest))
        return idle

    def _scan(self) -> None:
        self._unreadable = []
        for path in sorted(self.devices.glob("event*")):
            if str(path) in self._fds or not self._is_human_input(path.name):
                continue
            try:
                self._fds[str(path)] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except PermissionError:
                self._unreadable.append(path)
            except OSError:
                continue

    def _is_human_input(self, event: str) -> bool:
        """Keys or relative motion: not accelerometers, lid switches or power meters."""
        try:
            bits = int((self.sysfs / event / "device" / "capabilities" / "ev").read_text(), 16)
        except (OSError, ValueError):
            return True  # cannot tell: count it
        return bool(bits & (1 << EV_KEY | 1 << EV_REL))

    def _drain(self) -> bool:
        seen = False
        for path, fd in list(self._fds.items()):
            try:
                while os.read(fd, 24 * 64):
                    seen = True
            except BlockingIOError:
                continue
            except OSError:  # unplugged
                os.close(fd)
                del self._fds[path]
        return seen

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class TerminalsProbe:
    """The newest access time of the consoles and pseudo-terminals (SSH, terminals).

    The kernel updates a terminal's access time when a program reads input from it, to
    8 s granularity: good enough for minutes of idleness, not for a one-second answer.
    """

    name = "terminals"

    def __init__(self, dev: Path = Path("/dev")) -> None:
        self.dev = dev

    def idle_seconds(self) -> float:
        newest = 0.0
        found = False
        for pattern in ("tty[0-9]*", "pts/[0-9]*"):
            for path in self.dev.glob(pattern):
                try:
                    newest = max(newest, path.stat().st_atime)
                    found = True
                except OSError:
                    continue
        if not found:
            raise ProbeUnavailable(f"no terminals under {self.dev}")
        return max(0.0, time.time() - newest)


class LogindProbe:
    """systemd-logind's IdleHint and IdleSinceHint over the system D-Bus (jeepney).

    The session is the worker's own (XDG_SESSION_ID) or else seat0's active one, so a
    system service sees the desktop's session. IdleHint comes from the desktop's idle
    timer (often minutes): while it is false the probe answers 0, in use.
    """

    name = "logind"
    SERVICE = "org.freedesktop.login1"

    def __init__(self, bus_address: str | None = None) -> None:
        self.bus_address = bus_address
        self._connection: Any = None

    def idle_seconds(self) -> float:
        try:
            props = self._session_properties()
        except ProbeUnavailable:
            raise
        except Exception:
            self.close()
            raise
        if not props.get("IdleHint", False):
            return 0.0
        since_us = int(props.get("IdleSinceHint", 0))
        if since_us <= 0:
            return 0.0
        return max(0.0, time.time() - since_us / 1e6)

    def _session_properties(self) -> dict[str, Any]:
        from jeepney import DBusAddress, Properties, new_method_call
        from jeepney.wrappers import DBusErrorResponse, unwrap_msg

        conn = self._connect()
        manager = DBusAddress(
            "/org/freedesktop/login1", self.SERVICE, "org.freedesktop.login1.Manager"
        )
        try:
            session_id = os.environ.get("XDG_SESSION_ID")
            if session_id:
                call = new_method_call(manager, "GetSession", "s", (session_id,))
                (path,) = unwrap_msg(conn.send_and_get_reply(call, timeout=2))
            else:
                seat = DBusAddress(
                    "/org/freedesktop/login1/seat/seat0", self.SERVICE,
                    "org.freedesktop.login1.Seat",
                )  # fmt: skip
                reply = unwrap_msg(conn.send_and_get_reply(Properties(seat).get("ActiveSession")))
                _, (_, path) = reply[0]
                if not path or path == "/":
                    raise ProbeUnavailable("logind: seat0 has no active session")
            session = DBusAddress(path, self.SERVICE, "org.freedesktop.login1.Session")
            (values,) = unwrap_msg(conn.send_and_get_reply(Properties(session).get_all()))
        except DBusErrorResponse as exc:
            raise ProbeUnavailable(f"logind: {exc.name}: {exc.data}") from None
        return {key: value for key, (_, value) in values.items()}

    def _connect(self) -> Any:
        if self._connection is not None:
            return self._connection
        from jeepney.io.blocking import open_dbus_connection

        bus = self.bus_address or os.environ.get("IDLEGRID_SYSTEM_BUS") or "SYSTEM"
        try:
            self._connection = open_dbus_connection(bus=bus)
        except (OSError, KeyError) as exc:
            raise ProbeUnavailable(f"no system D-Bus: {exc}") from None
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            finally:
                self._connection = None
