"""Wayland idle detection against a real compositor, a scripted peer, and a real D-Bus.

- sway, headless (Debian's sway 1.7 offers `org_kde_kwin_idle`), with `wtype` typing
  through the virtual-keyboard protocol: the probe goes idle after its 1 s timeout, a key
  makes it active, and the worker suspends its task within a second of that key.
- `ext_idle_notifier_v1`, which that sway lacks, against a peer in this file that speaks
  the wire protocol with opcodes and argument order read from the protocol's XML in
  /usr/share/wayland-protocols, so the probe's hand-written numbers are checked against
  the specification, not against themselves.
- GNOME's idle monitor through a real `dbus-daemon --session`, with a small service in
  place of Mutter that exports `GetIdletime` on it.

Without sway and wtype, wayland-protocols or dbus-daemon these tests skip, and fail
under CI=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_until
from test_worker_idle import _steps_aside_and_resumes, _worker, grid  # noqa: F401

from idlegrid.worker.idle import default_probes
from idlegrid.worker.idle.base import ProbeUnavailable
from idlegrid.worker.idle.wayland import (
    EXT_IDLE,
    KDE_IDLE,
    NOTIFY_TIMEOUT_MS,
    GnomeIdleMonitorProbe,
    WaylandIdleProbe,
)

PROTOCOLS_DIR = Path("/usr/share/wayland-protocols")
EXT_XML = PROTOCOLS_DIR / "staging/ext-idle-notify/ext-idle-notify-v1.xml"


def _need(missing: list[str], packages: str) -> None:
    if missing:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"CI must install the Debian packages {packages} (missing {missing})")
        pytest.skip(f"needs {missing} (Debian packages {packages})")


def _reading(probe: Any) -> float | None:
    try:
        return float(probe.idle_seconds())
    except ProbeUnavailable:
        return None


def test_linux_probe_order() -> None:
    names = [probe.name for probe in default_probes(Path("/nonexistent"), platform="linux")]
    assert names == [
        "x11-screensaver", "wayland-idle", "gnome-idle-monitor", "input-devices", "logind",
        "terminals", "session-helper",
    ]  # fmt: skip


def test_without_a_wayland_display_the_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    with pytest.raises(ProbeUnavailable, match="WAYLAND_DISPLAY is not set"):
        WaylandIdleProbe().idle_seconds()
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-idlegrid-none")
    monkeypatch.setenv("XDG_RUNTIME_DIR", tempfile.gettempdir())
    with pytest.raises(ProbeUnavailable, match="cannot connect to .*wayland-idlegrid-none"):
        WaylandIdleProbe().idle_seconds()


# -- a real compositor: headless sway ---------------------------------------------------------


@pytest.fixture
def sway(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A headless sway; its environment (XDG_RUNTIME_DIR, WAYLAND_DISPLAY) for clients."""
    _need([t for t in ("sway", "wtype") if shutil.which(t) is None], "sway, wtype")
    # Not under tmp_path: pytest's base directory is its user's alone, and sway may run as
    # another user.
    runtime = Path(tempfile.mkdtemp(prefix="idlegrid-sway-"))
    command = ["sway", "-c", "/dev/null"]
    if os.geteuid() == 0:  # sway will not run as root: as nobody, in its own runtime dir
        os.chown(runtime, 65534, 65534)
        command = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                   *command]  # fmt: skip
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(runtime),
        "XDG_RUNTIME_DIR": str(runtime), "WLR_BACKENDS": "headless",
        "WLR_LIBINPUT_NO_DEVICES": "1", "WLR_RENDERER": "pixman",
    }  # fmt: skip
    log = (tmp_path / "sway.log").open("wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:
        found = wait_until(
            lambda: server.poll() is None and [p for p in runtime.glob("wayland-*")
                                               if not p.name.endswith(".lock")],
            "sway's socket", timeout_s=20, poll_s=0.01,
        )  # fmt: skip
        assert server.poll() is None, (tmp_path / "sway.log").read_text()
        yield {"XDG_RUNTIME_DIR": str(runtime), "WAYLAND_DISPLAY": found[0].name}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)


def _wtype(env: dict[str, str], *args: str) -> None:
    subprocess.run(["wtype", *args], env={**os.environ, **env}, check=True, timeout=10)


def test_under_sway_the_probe_goes_idle_and_a_key_makes_it_active(
    sway: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in sway.items():
        monkeypatch.setenv(key, value)
    probe = WaylandIdleProbe()
    try:
        with pytest.raises(ProbeUnavailable, match="waiting for the compositor's first"):
            probe.idle_seconds()
        assert probe.protocol in (EXT_IDLE, KDE_IDLE)
        # Nobody touches the seat: the notification comes after its 1 s timeout.
        idle = wait_until(
            lambda: _reading(probe), "the compositor's idle notification", timeout_s=5, poll_s=0.01
        )
        assert idle >= NOTIFY_TIMEOUT_MS / 1000
        time.sleep(0.5)  # time passing is what the reading must show
        assert (_reading(probe) or 0) >= 1.4
        _wtype(sway, "a")
        wait_until(
            lambda: _reading(probe) == 0.0, "the probe to see the key", timeout_s=2, poll_s=0.01
        )
        # Quiet again for a second: idle again, counted from the key.
        idle = wait_until(lambda: _reading(probe), "idle after the key", timeout_s=5, poll_s=0.01)
        assert 1.0 <= idle < 1.5
    finally:
        probe.close()


async def test_under_sway_the_worker_suspends_within_a_second_of_a_key(
    sway: dict[str, str],
    grid: tuple[str, httpx.AsyncClient],  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    url, http = grid
    probe = WaylandIdleProbe(Path(sway["XDG_RUNTIME_DIR"]) / sway["WAYLAND_DISPLAY"])
    try:
        probe.wait_ready()
        worker = await _worker(url, http, tmp_path / "worker", probe, idle_after=2.0)
        elapsed = await _steps_aside_and_resumes(
            url, http, worker, lambda: asyncio.to_thread(_wtype, sway, "x"), 2.0
        )
    finally:
        probe.close()
    print(json.dumps({"wayland_step_aside_s": round(elapsed, 3)}))


# -- ext_idle_notifier_v1: a scripted peer driven by the protocol's XML ------------------------


def _opcodes(xml: Path) -> dict[str, dict[str, Any]]:
    """interface -> {"requests": {name: (opcode, [arg types and names])}, "events": ...}."""
    result: dict[str, dict[str, Any]] = {}
    for interface in ET.parse(xml).getroot().iter("interface"):
        entry: dict[str, Any] = {"requests": {}, "events": {}}
        for kind, tag in (("requests", "request"), ("events", "event")):
            for opcode, node in enumerate(interface.iter(tag)):
                args = [(a.get("type"), a.get("name")) for a in node.iter("arg")]
                entry[kind][node.get("name")] = (opcode, args)
        result[str(interface.get("name"))] = entry
    return result


def _string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("=I", len(data)) + data + b"\0" * (-len(data) % 4)


class ScriptedCompositor:
    """A Wayland peer with the globals it is given; records what clients ask of it.

    It answers wl_display.get_registry and sync, records binds and the idle protocol's
    requests (decoded by the XML's argument order), and sends the events the test asks for.
    """

    def __init__(self, path: Path, globals_: list[str], spec: dict[str, Any]) -> None:
        self.path, self.globals, self.spec = path, globals_, spec
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.connections: list[socket.socket] = []
        self.bound: dict[int, str] = {}  # object id -> interface
        self.notifications: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.changed:
                self.connections.append(conn)
                self.changed.notify_all()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        registry = 0
        try:
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buffer += chunk
                while len(buffer) >= 8:
                    obj, word = struct.unpack_from("=II", buffer)
                    size, opcode = word >> 16, word & 0xFFFF
                    if len(buffer) < size:
                        break
                    body, buffer = buffer[8:size], buffer[size:]
                    registry = self._request(conn, registry, obj, opcode, body)
        except OSError:
            return

    def _request(self, conn: socket.socket, registry: int, obj: int, opcode: int,
                 body: bytes) -> int:  # fmt: skip
        if obj == 1 and opcode == 1:  # wl_display.get_registry(new_id)
            (registry,) = struct.unpack("=I", body)
            for name, interface in enumerate(self.globals, start=1):
                self.send(conn, registry, 0, struct.pack("=I", name) + _string(interface)
                          + struct.pack("=I", 1))  # fmt: skip
        elif obj == 1 and opcode == 0:  # wl_display.sync(new_id) -> wl_callback.done
            (callback,) = struct.unpack("=I", body)
            self.send(conn, callback, 0, struct.pack("=I", 0))
        elif obj == registry and opcode == 0:  # wl_registry.bind(name, interface, version, id)
            (name,) = struct.unpack_from("=I", body)
            (length,) = struct.unpack_from("=I", body, 4)
            end = 8 + length + (-length % 4)
            interface = body[8 : 8 + length - 1].decode()
            _, new = struct.unpack_from("=II", body, end)
            assert self.globals[name - 1] == interface
            with self.changed:
                self.bound[new] = interface
        elif self.bound.get(obj) in self.spec:
            interface = self.bound[obj]
            requests = self.spec[interface]["requests"]
            name = next(n for n, (op, _) in requests.items() if op == opcode)
            args = requests[name][1]
            values = dict(
                zip((arg for _, arg in args), struct.unpack(f"={len(args)}I", body), strict=True)
            )
            with self.changed:
                self.notifications.append({"conn": conn, "request": name, **values})
                self.changed.notify_all()
        return registry

    @staticmethod
    def send(conn: socket.socket, obj: int, opcode: int, body: bytes = b"") -> None:
        conn.sendall(struct.pack("=II", obj, (8 + len(body)) << 16 | opcode) + body)

    def event(self, notification: dict[str, Any], name: str) -> None:
        opcode, _ = self.spec["ext_idle_notification_v1"]["events"][name]
        self.send(notification["conn"], notification["id"], opcode)

    def wait_notifications(self, count: int) -> list[dict[str, Any]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.notifications) >= count, 5)
            return list(self.notifications)

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            with_shutdown(conn)


def with_shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()


@pytest.fixture
def ext_spec() -> dict[str, Any]:
    _need([] if EXT_XML.exists() else [str(EXT_XML)], "wayland-protocols")
    return _opcodes(EXT_XML)


def test_ext_idle_notify_is_preferred_and_followed(
    ext_spec: dict[str, Any], tmp_path: Path
) -> None:
    peer = ScriptedCompositor(tmp_path / "wayland-ext", ["wl_seat", KDE_IDLE, EXT_IDLE], ext_spec)
    probe = WaylandIdleProbe(tmp_path / "wayland-ext", timeout_ms=300)
    try:
        with pytest.raises(ProbeUnavailable, match="first idle notification"):
            probe.idle_seconds()
        assert probe.protocol == EXT_IDLE
        (asked,) = peer.wait_notifications(1)
        assert asked["request"] == "get_idle_notification"
        assert asked["timeout"] == 300
        assert peer.bound[asked["seat"]] == "wl_seat"
        # No event within the timeout: the seat is in use.
        assert (
            wait_until(
                lambda: _reading(probe) is not None, "the first window", timeout_s=2, poll_s=0.01
            )
            is True
        )
        assert _reading(probe) == 0.0
        peer.event(asked, "idled")
        idle = wait_until(lambda: _reading(probe), "idled", timeout_s=2, poll_s=0.01)
        assert 0.3 <= idle < 0.5
        time.sleep(0.2)  # time passing is what the reading must show
        assert 0.5 <= (_reading(probe) or 0) < 0.7
        peer.event(asked, "resumed")
        wait_until(lambda: _reading(probe) == 0.0, "resumed", timeout_s=2, poll_s=0.01)
        # The compositor goes away: the next reading reconnects and asks again.
        with_shutdown(asked["conn"])
        wait_until(
            lambda: probe._connection is None,
            "the probe to see the disconnect",
            timeout_s=2,
            poll_s=0.01,
        )
        with pytest.raises(ProbeUnavailable, match="first idle notification"):
            probe.idle_seconds()
        _, again = peer.wait_notifications(2)
        assert again["request"] == "get_idle_notification"
        peer.event(again, "idled")
        assert (
            wait_until(
                lambda: _reading(probe), "idled after reconnecting", timeout_s=2, poll_s=0.01
            )
            >= 0.3
        )
    finally:
        probe.close()
        peer.close()


def test_a_compositor_without_idle_protocols_is_refused_and_not_asked_again(
    ext_spec: dict[str, Any], tmp_path: Path
) -> None:
    peer = ScriptedCompositor(tmp_path / "wayland-bare", ["wl_seat", "wl_compositor"], ext_spec)
    probe = WaylandIdleProbe(tmp_path / "wayland-bare")
    try:
        for _ in range(3):
            with pytest.raises(ProbeUnavailable, match="offers neither ext_idle_notifier_v1 or"):
                probe.idle_seconds()
        assert len(peer.connections) == 1  # one handshake, then the cached answer
    finally:
        probe.close()
        peer.close()


def test_a_protocol_error_is_reported_and_not_asked_again_at_once(
    ext_spec: dict[str, Any], tmp_path: Path
) -> None:
    peer = ScriptedCompositor(tmp_path / "wayland-err", ["wl_seat", EXT_IDLE], ext_spec)
    probe = WaylandIdleProbe(tmp_path / "wayland-err")
    try:
        with pytest.raises(ProbeUnavailable, match="first idle notification"):
            probe.idle_seconds()
        (asked,) = peer.wait_notifications(1)
        # wl_display.error(object, code, message): the core protocol's event 0 on object 1.
        body = struct.pack("=II", asked["id"], 3) + _string("timeout out of range")
        peer.send(asked["conn"], 1, 0, body)
        wait_until(
            lambda: probe._connection is None,
            "the probe to see the error",
            timeout_s=2,
            poll_s=0.01,
        )
        for _ in range(2):
            with pytest.raises(ProbeUnavailable, match="refused us: protocol error 3: timeout"):
                probe.idle_seconds()
        assert len(peer.connections) == 1
    finally:
        probe.close()
        peer.close()


# -- GNOME: a real session bus ------------------------------------------------------------------


@pytest.fixture
def session_bus(tmp_path: Path) -> Iterator[str]:
    _need([] if shutil.which("dbus-daemon") else ["dbus-daemon"], "dbus")
    address = f"unix:path={tmp_path / 'bus'}"
    daemon = subprocess.Popen(
        ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address={address}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Until the bus answers a client's Hello: its socket file exists before it listens.
        wait_until(lambda: _bus_answers(address, daemon), "dbus-daemon to answer", timeout_s=10)
        yield address
    finally:
        daemon.terminate()
        daemon.wait(10)


def _bus_answers(address: str, daemon: subprocess.Popen[bytes]) -> bool:
    from jeepney.io.blocking import open_dbus_connection

    assert daemon.poll() is None, f"dbus-daemon exited with {daemon.returncode}"
    try:
        connection = open_dbus_connection(bus=address)
    except OSError:
        return False
    connection.close()
    return True


class IdleMonitorService:
    """Mutter's `GetIdletime` on a session bus, answering the milliseconds it is set to."""

    def __init__(self, address: str) -> None:
        from jeepney.bus_messages import message_bus
        from jeepney.io.blocking import open_dbus_connection

        self.idle_ms = 0
        self.conn = open_dbus_connection(bus=address)
        reply = self.conn.send_and_get_reply(message_bus.RequestName(GnomeIdleMonitorProbe.SERVICE))
        assert reply.body == (1,)  # primary owner
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from jeepney import MessageType, new_error, new_method_return

        while True:
            try:
                msg = self.conn.receive()
            except (OSError, ValueError):
                return
            if msg.header.message_type != MessageType.method_call:
                continue
            fields = msg.header.fields
            if fields.get(1) == GnomeIdleMonitorProbe.PATH and fields.get(3) == "GetIdletime":
                self.conn.send(new_method_return(msg, "t", (self.idle_ms,)))
            else:
                self.conn.send(new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod"))

    def close(self) -> None:
        self.conn.close()


def test_gnome_idle_monitor_reads_mutters_idle_time(session_bus: str) -> None:
    service = IdleMonitorService(session_bus)
    probe = GnomeIdleMonitorProbe(session_bus)
    try:
        service.idle_ms = 12_345
        assert probe.idle_seconds() == pytest.approx(12.345)
        service.idle_ms = 40
        assert probe.idle_seconds() == pytest.approx(0.04)
    finally:
        probe.close()
        service.close()


def test_without_gnome_the_idle_monitor_probe_says_why(
    session_bus: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = GnomeIdleMonitorProbe(session_bus)
    try:
        for _ in range(2):
            with pytest.raises(ProbeUnavailable, match="ServiceUnknown"):
                probe.idle_seconds()
    finally:
        probe.close()
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    with pytest.raises(ProbeUnavailable, match="DBUS_SESSION_BUS_ADDRESS is not set"):
        GnomeIdleMonitorProbe().idle_seconds()
