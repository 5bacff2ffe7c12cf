"""Wayland idle probes: the compositor's idle notifications, and GNOME's idle monitor.

A Wayland compositor tells no client about other clients' input, so there is no idle
time to query as X11's XScreenSaver answers. What a compositor may offer is a
notification: "tell me when the seat has been idle for N ms, and when it is used again".
`WaylandIdleProbe` asks for one with a 1 s timeout, over the staging protocol
`ext_idle_notifier_v1` (sway 1.8+, KDE Plasma 5.27+, Hyprland, labwc) or,
where the compositor lacks it, KDE's older `org_kde_kwin_idle` (KWin, wlroots'
compositors such as sway 1.7). It speaks the Wayland wire protocol itself over the
compositor's unix socket (no libwayland), and a reader thread keeps the state, so a
reading is a lock and two numbers.

GNOME's Mutter offers its idle time on the session bus instead
(`org.gnome.Mutter.IdleMonitor.GetIdletime`, milliseconds), which
`GnomeIdleMonitorProbe` asks over jeepney.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from idlegrid.worker.idle.base import ProbeUnavailable

log = logging.getLogger(__name__)

NOTIFY_TIMEOUT_MS = 1000  # "idle" means no input for this long; below it the probe says 0
HANDSHAKE_S = 2.0  # a compositor that does not answer the registry round trip in this
UNSUPPORTED_RETRY_S = 60.0  # a compositor without either protocol is asked again after this
UNREACHABLE_RETRY_S = 5.0  # a socket that refused us is tried again after this
FIRST_WINDOW_GRACE_S = 0.2  # beyond the timeout, for the compositor's timer and our thread

# Core protocol opcodes (wayland.xml; stable since Wayland 1.0).
WL_DISPLAY_SYNC, WL_DISPLAY_GET_REGISTRY = 0, 1
WL_DISPLAY_ERROR, WL_DISPLAY_DELETE_ID = 0, 1
WL_REGISTRY_BIND = 0
WL_REGISTRY_GLOBAL = 0
WL_CALLBACK_DONE = 0

# The idle protocols: (global interface, request that makes a notification, its argument
# order, the notification's interface, event opcode of "idle", of "active again").
EXT_IDLE = "ext_idle_notifier_v1"
KDE_IDLE = "org_kde_kwin_idle"
PROTOCOLS: dict[str, tuple[int, str]] = {
    # ext-idle-notify-v1.xml: get_idle_notification(new_id, uint timeout, object seat)
    EXT_IDLE: (1, "timeout-seat"),
    # KDE's idle.xml: get_idle_timeout(new_id, object seat, uint timeout)
    KDE_IDLE: (0, "seat-timeout"),
}
EVENT_IDLE, EVENT_ACTIVE = 0, 1  # ext: idled/resumed; kde: idle/resumed


class WaylandError(Exception):
    """The compositor closed the connection or sent a protocol error."""


class WaylandProtocolError(WaylandError):
    """wl_display.error: the compositor found a request of ours invalid."""


def wayland_socket(environ: dict[str, str] | None = None) -> Path:
    """The compositor's socket, as libwayland finds it; ProbeUnavailable if there is none."""
    env = os.environ if environ is None else environ
    display = env.get("WAYLAND_DISPLAY")
    if not display:
        raise ProbeUnavailable("no Wayland display (WAYLAND_DISPLAY is not set)")
    if display.startswith("/"):
        return Path(display)
    runtime = env.get("XDG_RUNTIME_DIR")
    if not runtime:
        raise ProbeUnavailable("XDG_RUNTIME_DIR is not set: cannot find the Wayland socket")
    return Path(runtime) / display


def _pack_string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("=I", len(data)) + data + b"\0" * (-len(data) % 4)


def _unpack_string(body: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("=I", body, offset)
    start = offset + 4
    text = body[start : start + length - 1].decode(errors="replace") if length else ""
    return text, start + length + (-length % 4)


class WaylandConnection:
    """One client connection: just enough of the wire protocol for the idle protocols."""

    def __init__(self, path: Path, timeout_s: float = HANDSHAKE_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self._next_id = 2  # 1 is wl_display
        self.registry = 0  # the wl_registry's id, once asked for
        self._buffer = b""

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def send(self, obj: int, opcode: int, body: bytes = b"") -> None:
        size = 8 + len(body)
        self.sock.sendall(struct.pack("=II", obj, size << 16 | opcode) + body)

    def receive(self) -> tuple[int, int, bytes]:
        """The next event (object, opcode, body); WaylandError when the compositor left."""
        while True:
            if len(self._buffer) >= 8:
                obj, word = struct.unpack_from("=II", self._buffer)
                size = word >> 16
                if size < 8:
                    raise WaylandError(f"malformed message from the compositor (size {size})")
                if len(self._buffer) >= size:
                    body = self._buffer[8:size]
                    self._buffer = self._buffer[size:]
                    if obj == 1 and word & 0xFFFF == WL_DISPLAY_ERROR:
                        _, code = struct.unpack_from("=II", body)
                        message, _ = _unpack_string(body, 8)
                        raise WaylandProtocolError(f"protocol error {code}: {message}")
                    return obj, word & 0xFFFF, body
            chunk = self.sock.recv(4096)
            if not chunk:
                raise WaylandError("the compositor closed the connection")
            self._buffer += chunk

    def roundtrip_globals(self) -> dict[str, tuple[int, int]]:
        """wl_display.get_registry and a sync: every global as interface -> (name, version)."""
        registry, callback = self.new_id(), self.new_id()
        self.send(1, WL_DISPLAY_GET_REGISTRY, struct.pack("=I", registry))
        self.send(1, WL_DISPLAY_SYNC, struct.pack("=I", callback))
        found: dict[str, tuple[int, int]] = {}
        while True:
            obj, opcode, body = self.receive()
            if obj == registry and opcode == WL_REGISTRY_GLOBAL:
                (name,) = struct.unpack_from("=I", body)
                interface, offset = _unpack_string(body, 4)
                (version,) = struct.unpack_from("=I", body, offset)
                found.setdefault(interface, (name, version))
            elif obj == callback and opcode == WL_CALLBACK_DONE:
                self.registry = registry
                return found

    def bind(self, name: int, interface: str, version: int) -> int:
        new = self.new_id()
        body = struct.pack("=I", name) + _pack_string(interface) + struct.pack("=II", version, new)
        self.send(self.registry, WL_REGISTRY_BIND, body)
        return new

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class WaylandIdleProbe:
    """The seat's idleness from the compositor's idle notifications (1 s timeout).

    After the compositor says "idle", the reading is the time since the last input (the
    notification's time less its timeout); after "resumed", or while no notification
    came, it is 0: used within the last second. The first reading after connecting
    waits for one timeout to pass, so until then the probe says it cannot tell yet. An
    idle time is counted from the connection at the earliest: a probe connected to a
    seat left alone for an hour answers from when it connected.
    """

    name = "wayland-idle"

    def __init__(
        self, socket_path: Path | None = None, timeout_ms: int = NOTIFY_TIMEOUT_MS,
        prefer: tuple[str, ...] = (EXT_IDLE, KDE_IDLE),
    ) -> None:  # fmt: skip
        self.socket_path = socket_path
        self.timeout_ms = timeout_ms
        self.prefer = prefer
        self.protocol: str | None = None  # the idle protocol in use, once connected
        self.handshake_s: float | None = None  # the last handshake's duration
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._connection: WaylandConnection | None = None
        self._reader: threading.Thread | None = None
        self._ready_at = 0.0  # monotonic time after which "no event" means active
        self._idle_since: float | None = None  # monotonic time of the last input, when idle
        self._events = 0
        self._refused: tuple[float, str] | None = None  # (retry at, why), cached refusal

    def idle_seconds(self) -> float:
        now = time.monotonic()
        with self._lock:
            connected = self._connection is not None
            if connected:
                return self._reading(now)
            if self._refused is not None and now < self._refused[0]:
                raise ProbeUnavailable(self._refused[1])
        self._connect()
        with self._lock:
            return self._reading(time.monotonic())

    def _reading(self, now: float) -> float:
        if self._idle_since is not None:
            return now - self._idle_since
        if self._events == 0 and now < self._ready_at:
            raise ProbeUnavailable(
                f"waiting for the compositor's first idle notification ({self.protocol})"
            )
        return 0.0

    def wait_ready(self, within_s: float = 1.5) -> None:
        """Connect, and wait until a reading is real (for `idlegrid worker --show-idle`)."""
        with contextlib.suppress(ProbeUnavailable):
            self.idle_seconds()
        deadline = time.monotonic() + within_s
        with self._changed:
            while self._connection is not None and self._events == 0:
                left = min(deadline, self._ready_at) - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)

    def _connect(self) -> None:
        path = self.socket_path or wayland_socket()
        started = time.monotonic()
        try:
            connection = WaylandConnection(path)
        except OSError as exc:
            self._refuse(UNREACHABLE_RETRY_S, f"cannot connect to {path}: {exc}")
        try:
            found = connection.roundtrip_globals()
            protocol = next((p for p in self.prefer if p in found), None)
            if protocol is None:
                wanted = " or ".join(self.prefer)
                self._refuse(
                    UNSUPPORTED_RETRY_S,
                    f"the compositor at {path} offers neither {wanted} (asked again in "
                    f"{UNSUPPORTED_RETRY_S:.0f} s)",
                )
            if "wl_seat" not in found:
                self._refuse(UNSUPPORTED_RETRY_S, f"the compositor at {path} has no seat")
            seat = connection.bind(found["wl_seat"][0], "wl_seat", 1)
            manager = connection.bind(found[protocol][0], protocol, 1)
            notification = connection.new_id()
            opcode, order = PROTOCOLS[protocol]
            args = (seat, self.timeout_ms) if order == "seat-timeout" else (self.timeout_ms, seat)
            connection.send(manager, opcode, struct.pack("=III", notification, *args))
        except ProbeUnavailable:
            connection.close()
            raise
        except (OSError, WaylandError) as exc:
            connection.close()
            # A compositor that hangs or refuses the handshake is not asked every reading:
            # each try could hold the governor for HANDSHAKE_S.
            self._refuse(UNSUPPORTED_RETRY_S, f"Wayland handshake with {path} failed: {exc}")
        connection.sock.settimeout(None)
        now = time.monotonic()
        with self._lock:
            self.handshake_s = now - started
            self.protocol = protocol
            self._connection = connection
            self._ready_at = now + self.timeout_ms / 1000 + FIRST_WINDOW_GRACE_S
            self._idle_since = None
            self._events = 0
            self._refused = None
        self._reader = threading.Thread(
            target=self._read_events, args=(connection, notification),
            name="wayland-idle", daemon=True,
        )  # fmt: skip
        self._reader.start()

    def _refuse(self, retry_s: float, why: str) -> NoReturn:
        with self._lock:
            self._refused = (time.monotonic() + retry_s, why)
        raise ProbeUnavailable(why)

    def _read_events(self, connection: WaylandConnection, notification: int) -> None:
        try:
            while True:
                obj, opcode, _ = connection.receive()
                if obj != notification:
                    continue  # the seat's capabilities and name, delete_id: not needed
                now = time.monotonic()
                with self._changed:
                    self._events += 1
                    if opcode == EVENT_IDLE:
                        self._idle_since = now - self.timeout_ms / 1000
                    elif opcode == EVENT_ACTIVE:
                        self._idle_since = None
                    self._changed.notify_all()
        except (OSError, WaylandError) as exc:
            with self._changed:
                if self._connection is connection:  # not closed by us: reconnect next time
                    log.info("wayland idle probe: %s; reconnecting at the next reading", exc)
                    self._connection = None
                    if isinstance(exc, WaylandProtocolError):  # it would only refuse again
                        retry_at = time.monotonic() + UNSUPPORTED_RETRY_S
                        self._refused = (retry_at, f"the compositor refused us: {exc}")
                    self._changed.notify_all()
            connection.close()

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
        if self._reader is not None:
            self._reader.join(2)
            self._reader = None


class GnomeIdleMonitorProbe:
    """Mutter's idle time over the session D-Bus (GNOME on Wayland or X11; jeepney)."""

    name = "gnome-idle-monitor"
    SERVICE = "org.gnome.Mutter.IdleMonitor"
    PATH = "/org/gnome/Mutter/IdleMonitor/Core"

    def __init__(self, bus_address: str | None = None) -> None:
        self.bus_address = bus_address
        self._connection: Any = None
        self._refused: tuple[float, str] | None = None

    def idle_seconds(self) -> float:
        from jeepney import DBusAddress, new_method_call
        from jeepney.wrappers import DBusErrorResponse, unwrap_msg

        if self._refused is not None and time.monotonic() < self._refused[0]:
            raise ProbeUnavailable(self._refused[1])
        conn = self._connect()
        monitor = DBusAddress(self.PATH, self.SERVICE, self.SERVICE)
        try:
            (milliseconds,) = unwrap_msg(
                conn.send_and_get_reply(new_method_call(monitor, "GetIdletime"), timeout=2)
            )
        except DBusErrorResponse as exc:
            why = f"no GNOME idle monitor on the session bus ({exc.name}; not GNOME?)"
            self._refused = (time.monotonic() + UNSUPPORTED_RETRY_S, why)
            raise ProbeUnavailable(why) from None
        except Exception:
            self.close()  # the bus went away: reconnect at the next reading
            raise
        return int(milliseconds) / 1000.0

    def _connect(self) -> Any:
        if self._connection is not None:
            return self._connection
        from jeepney.io.blocking import open_dbus_connection

        bus = self.bus_address or os.environ.get("DBUS_SESSION_BUS_ADDRESS")
        if not bus:
            raise ProbeUnavailable("no session D-Bus (DBUS_SESSION_BUS_ADDRESS is not set)")
        try:
            self._connection = open_dbus_connection(bus=bus)
        except (OSError, KeyError, ValueError) as exc:
            raise ProbeUnavailable(f"cannot open the session D-Bus {bus}: {exc}") from None
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            finally:
                self._connection = None
