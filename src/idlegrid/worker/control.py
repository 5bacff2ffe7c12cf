"""The worker's local control page and JSON API, on 127.0.0.1 only.

Like Folding@home's client page: the state and its reason, the tasks and their progress,
the hardware, the benchmark and the credit, with pause, resume, finish, snooze and the
settings an owner changes most. It is a few routes over h11 (which httpx already brings)
rather than a web framework, to keep the idle daemon small.

Who may use it: requests from loopback only, with a `Host` of this machine (a web page
elsewhere cannot reach it by DNS rebinding), and with the token kept in `control-token`
in the state directory, readable by its owner only. A browser brings the token once
(`/?token=...`, which `idlegrid worker status` prints) and keeps it in a strict
same-site cookie; the CLI sends it as a bearer header.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

import h11

from idlegrid.worker import remote_settings
from idlegrid.worker.control_page import PAGE, sign_in
from idlegrid.worker.idle.policy import Action, SettingError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping

    from idlegrid import protocol
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker.governor import Governor
    from idlegrid.worker.idle.system import Sensors


class Worker(Protocol):
    """What the page reads of the daemon (`worker.daemon.Worker`), which starts it."""

    settings: WorkerSettings
    governor: Governor
    sensors: Sensors
    running: Mapping[int, Any]  # task id -> the daemon's RunningTask
    outbox: Any
    completed: int
    hardware: protocol.HardwareProfile | None
    benchmark: protocol.Benchmark
    device: str
    credit: float | None
    settings_error: str
    _online: asyncio.Event

    async def settings_changed(self) -> None: ...
    def device_statuses(self) -> list[protocol.DeviceStatus]: ...
    def refresh_credit(self) -> None: ...


log = logging.getLogger(__name__)

TOKEN_FILE = "control-token"
ADDRESS_FILE = "control.json"
COOKIE = "idlegrid_control"
MAX_BODY = 64 * 1024


def control_token(state_dir: Path) -> str:
    """The page's token, made once, in a file only its owner can read (0600, whatever
    the umask; one found readable by others is made private again). A state directory
    with the setgid bit (the Debian package's, group `idlegrid`) shares it with its
    group (0640), so the desktop user's tray and app window can use the service's page.
    Written whole or not at all: a crash never leaves an empty token behind."""
    path = state_dir / TOKEN_FILE
    state_dir.mkdir(parents=True, exist_ok=True)
    mode = 0o640 if state_dir.stat().st_mode & stat.S_ISGID else 0o600
    token = _read_token(path, mode)
    if token:
        return token
    token = secrets.token_urlsafe(24)
    # An empty file (left by a crash of an older version) is replaced; otherwise a file
    # that appeared meanwhile (another process made it first) holds.
    if not write_atomically(path, token + "\n", mode=mode, replace=path.exists()):
        return _read_token(path, mode) or token
    return token


def _read_token(path: Path, mode: int) -> str:
    """The token in `path` ("" if there is none), its file made no more open than `mode`."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return ""
    info = path.stat()
    # POSIX only (Windows has no such bits); never another account's file (a reader in
    # its group must not change it).
    extra = info.st_mode & 0o077 & ~mode
    if token and hasattr(os, "getuid") and extra and info.st_uid == os.getuid():
        os.chmod(path, mode)
        log.warning("%s was readable by others: made mode %o", path, mode)
    return token


def write_atomically(path: Path, text: str, *, mode: int, replace: bool = True) -> bool:
    """Write `text` to a new file with `mode`, then move it to `path` in one step, so a
    reader sees the old file or the new one, never a part. `replace=False` keeps a file
    that is already there (and returns False)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.replace(scratch, path)
            return True
        try:
            os.link(scratch, path)
        except FileExistsError:
            return False
        return True
    finally:
        scratch.unlink(missing_ok=True)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def json_reply(status: int, value: object) -> Reply:
    return Reply(status, json.dumps(value).encode())


class ControlPage:
    def __init__(self, worker: Worker, *, port: int, host: str = "127.0.0.1") -> None:
        self.worker = worker
        self.host = host
        self.wanted_port = port
        self.port = 0
        self.token = control_token(worker.settings.state_dir)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.wanted_port)
        except OSError as exc:  # the port is taken (another worker): any free one
            log.warning("control page: port %s: %s; using a free port", self.wanted_port, exc)
            self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        address = self.worker.settings.state_dir / ADDRESS_FILE
        write_atomically(address, json.dumps({"url": self.url, "pid": os.getpid()}), mode=0o644)
        log.info("control page: %s (token in %s)", self.url, self.worker.settings.state_dir)

    async def close(self) -> None:
        """Stop listening, and end open (keep-alive) connections: their handlers return."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    # -- HTTP --------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Owned here, cancelled and awaited by close(); the cancellation ends this handler
        # quietly (asyncio.start_server would log a handler task that ended cancelled).
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._converse(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read_request(conn, reader)
                if request is None:
                    break
                reply = self._refused(peer, request, body) or await self._route(request, body)
                writer.write(_encode(conn, reply))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except (h11.RemoteProtocolError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(65536), 30)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise h11.RemoteProtocolError("body too large")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    def _refused(self, peer: Any, request: h11.Request, body: bytes) -> Reply | None:
        """403 for anyone but this machine; without the token, the sign-in page (a
        browser) or 401; the sign-in form's post."""
        address = peer[0] if isinstance(peer, tuple) else ""
        try:
            loopback = ipaddress.ip_address(address).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            return json_reply(403, {"error": "the control page answers this machine only"})
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        host = headers.get("host", "").rsplit(":", 1)[0].strip("[]")
        if host not in {"127.0.0.1", "localhost", "::1"}:
            return json_reply(403, {"error": f"unexpected Host {host!r}"})
        target = urlsplit(request.target.decode("latin-1"))
        method = request.method.decode()
        if method == "POST" and target.path == "/signin":
            return self._sign_in(body)
        offered = _offered_token(headers, target.query)
        if offered is None or not hmac.compare_digest(offered, self.token):
            if method == "GET" and not target.path.startswith("/api/"):
                return self._sign_in_page(401, "A wrong token." if offered else "")
            return json_reply(401, {"error": "a control token is required"})
        return None

    def _sign_in_page(self, status: int, error: str = "") -> Reply:
        page = sign_in(str(self.worker.settings.state_dir), error)
        return Reply(status, page.encode(), "text/html; charset=utf-8")

    def _sign_in(self, body: bytes) -> Reply:
        """The sign-in form's post: the right token becomes the strict same-site cookie."""
        offered = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()
        if not offered or not hmac.compare_digest(offered.encode(), self.token.encode()):
            return self._sign_in_page(401, "That is not this worker's control token.")
        return self._enter()

    def _enter(self) -> Reply:
        cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
        return Reply(303, b"", "text/plain", (("Location", "/"), ("Set-Cookie", cookie)))

    async def _route(self, request: h11.Request, body: bytes) -> Reply:
        method = request.method.decode()
        target = urlsplit(request.target.decode("latin-1"))
        path = target.path
        if method == "GET" and path == "/":
            if "token" in parse_qs(target.query):  # keep it in a cookie, off the address bar
                return self._enter()
            return Reply(200, PAGE.encode(), "text/html; charset=utf-8")
        if method == "GET" and path == "/api/status":
            self.worker.refresh_credit()  # for the next read: the coordinator's figure
            return json_reply(200, status_of(self.worker))
        if method == "POST" and path.startswith("/api/"):
            return await self._act(path.removeprefix("/api/"), body)
        return json_reply(404, {"error": f"no {method} {path}"})

    async def _act(self, action: str, body: bytes) -> Reply:
        governor = self.worker.governor
        try:
            values = json.loads(body) if body.strip() else {}
            if not isinstance(values, dict):
                raise SettingError("the body must be a JSON object")
            match action:
                case "pause":
                    governor.pause()
                case "resume":
                    governor.resume()
                case "finish":
                    governor.finish()
                case "snooze":
                    governor.snooze(float(values.get("seconds", 3600)))
                case "settings":
                    governor.change(values)
                case _:
                    return json_reply(404, {"error": f"no action {action!r}"})
        except (SettingError, ValueError, TypeError) as exc:
            return json_reply(400, {"error": str(exc)})
        await governor.step()  # the answer shows the state the action made
        await self.worker.settings_changed()
        return json_reply(200, status_of(self.worker))


def _offered_token(headers: dict[str, str], query: str) -> str | None:
    authorization = headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    tokens = parse_qs(query).get("token")
    return tokens[0] if tokens else None


def _encode(conn: h11.Connection, reply: Reply) -> bytes:
    headers = [
        ("Content-Type", reply.content_type),
        ("Content-Length", str(len(reply.body))),
        ("Cache-Control", "no-store"),
        ("X-Frame-Options", "DENY"),
        ("Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; "
         "script-src 'unsafe-inline'; frame-ancestors 'none'"),
        *reply.headers,
    ]  # fmt: skip
    out = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
    out += conn.send(h11.Data(data=reply.body)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    return out


# The words the page, the CLI and the coordinator's status message use for the policy's
# answer (the page styles its badge by them).
STATES = {Action.RUN: "running", Action.THROTTLE: "throttled", Action.PAUSE: "paused"}


def status_of(worker: Worker) -> dict[str, Any]:
    """What the page and `idlegrid worker status` show."""
    governor = worker.governor
    decision = governor.decision
    idle = worker.sensors.last_idle
    now = asyncio.get_running_loop().time()
    return {
        "state": STATES[governor.action()],
        "reason": decision.reason if decision else "starting",
        "why": why(decision.reason) if decision else "starting",
        "idle": {"probe": idle.probe, "seconds": idle.idle_s, "detail": idle.detail},
        "controls": {
            "paused": governor.owner.paused,
            "finishing": governor.owner.finishing,
            "snooze_until": governor.owner.snooze_until,
        },
        "settings": _settings_shown(worker),
        "devices": [device.model_dump() for device in worker.device_statuses()],
        "sources": {
            name: stamp.model_dump()
            for name, stamp in remote_settings.current(governor, worker.settings).items()
        },
        "settings_error": worker.settings_error,
        "tasks": _tasks_shown(worker, now),
        "completed": worker.completed,
        "outbox": len(worker.outbox),
        "hardware": worker.hardware.model_dump() if worker.hardware else None,
        "benchmark": worker.benchmark.model_dump(),
        "device": worker.device,
        "credit": worker.credit,
        "connected": worker._online.is_set(),
    }


def _settings_shown(worker: Worker) -> dict[str, Any]:
    """The idle policy's settings in force, as the page shows them."""
    governor = worker.governor
    settings = governor.settings
    return {
        "cpu_mode": str(settings.cpu_mode),
        "gpu_mode": str(settings.gpu_mode),
        "cpu_percent": settings.idle.cpu_percent,
        "in_use_cpu_percent": settings.in_use.cpu_percent,
        "windows": governor.owner.overrides.get("windows", worker.settings.windows),
        "idle_after_s": settings.idle_after_s,
        "paused_gpus": list(settings.paused_gpus),
    }


def _tasks_shown(worker: Worker, now: float) -> list[dict[str, Any]]:
    """The tasks the worker holds: each one's job, kind, progress, state and device."""
    return [
        {
            "task_id": task_id,
            "kind": task.assign.kind,
            "job_id": task.assign.job_id,
            "progress": round(task.progress, 4),
            "state": _task_state(task, now),
            "device": task.host.device.label if task.host is not None else "",
        }
        for task_id, task in worker.running.items()
    ]


def why(reason: str) -> str:
    """The policy's reason without the state it starts with ("running: idle for 3 h" ->
    "idle for 3 h"), for beside a badge that says the state."""
    head, sep, rest = reason.partition(": ")
    return rest if sep and head in ("running", "paused") else reason


def _task_state(task: Any, now: float) -> str:
    if task.host is None:
        return "waiting"
    return "suspended" if task.host.suspended else "running"
