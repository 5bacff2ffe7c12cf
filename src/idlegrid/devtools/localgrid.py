"""A whole grid on one machine, as real processes: for the demo, tests and benchmarks.

`LocalGrid` starts `idlegrid serve` on a free port and `idlegrid worker` processes that
connect to it over real WebSockets, and stops every process it started on exit, even
when the code inside the `with` block fails. Given a PostgreSQL database and a Redis
server it runs in production mode, where `add_coordinator` starts more coordinator
processes sharing them (and the data directory, for blobs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx

_LISTENING = re.compile(r"listening on (http://\S+)")


class LocalGrid:
    """A coordinator and its workers as local processes, stopped on exit.

    Every worker is a volunteer with an account of its own (replicas of a shard go to
    distinct accounts), and all connect from this machine, so "distinct networks" is off
    here.
    """

    def __init__(
        self,
        root: Path,
        *,
        heartbeat_s: float = 2.0,
        node_timeout_s: float = 6.0,
        min_lease_s: float = 60.0,
        extra_env: dict[str, str] | None = None,
        database: str = "",
        database_schema: str = "",
        redis: str = "",
        redis_prefix: str = "",
        replication: int | None = None,
        backoff_max_s: float = 2.0,
        p2p: bool = False,
        port: int = 0,
    ) -> None:
        """`replication`: the coordinator's default replicas per shard (None: its own).
        `backoff_max_s`: the workers' longest wait between reconnect attempts, which the
        coordinators are told too (their grace after a restart covers it). `p2p`: the
        coordinator runs a bootstrap DHT peer for peer-to-peer training (the p2p extra).
        `port`: the coordinator's first start listens there (0: any free port).
        """
        self.root = root
        self.data_dir = root / "coordinator"
        self.heartbeat_s = heartbeat_s
        self.node_timeout_s = node_timeout_s
        self.min_lease_s = min_lease_s
        self.env = _grid_env(
            backoff_max_s=backoff_max_s, p2p=p2p, replication=replication, extra_env=extra_env
        )
        self.p2p = p2p
        self.port = port
        self.database, self.database_schema = database, database_schema
        self.redis, self.redis_prefix = redis, redis_prefix
        self.backend_args = _backend_args(database, database_schema, redis, redis_prefix)
        self.url = ""
        self.admin_token = ""
        self.node_token = ""
        self._volunteer_tokens: dict[str, str] = {}
        self.coordinator: subprocess.Popen[str] | None = None
        # More coordinators sharing the database and Redis, by URL (production mode).
        self.others: dict[str, subprocess.Popen[str]] = {}
        self.workers: list[subprocess.Popen[str]] = []
        self._worker_logs: dict[int, Path] = {}  # by pid
        self.old_coordinators: list[subprocess.Popen[str]] = []
        self._logs: list[IO[str]] = []

    def __enter__(self) -> LocalGrid:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.start_coordinator(port=self.port)
            self.node_token = self.create_token(kind="node")["token"]
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- coordinator -------------------------------------------------------------------------

    def start_coordinator(self, *, port: int = 0, timeout: float = 60.0) -> str:
        """Start (or restart) the coordinator on the same data directory; with `p2p`,
        wait until its bootstrap DHT peer is up (it starts in the background)."""
        log = self.root / "coordinator.log"
        start = log.stat().st_size if log.exists() else 0
        self.coordinator, self.url = self._spawn_coordinator("coordinator.log", port, timeout)
        self.admin_token = (self.data_dir / "admin-token").read_text().strip()
        if self.p2p:
            _await_text(log, start, "bootstrap DHT peer listening on", timeout=300.0)
        return self.url

    def add_coordinator(self, *, port: int = 0, timeout: float = 60.0) -> str:
        """Start one more coordinator process on the same database, Redis and data dir."""
        if not self.backend_args:
            raise RuntimeError("several coordinators need a PostgreSQL database and Redis")
        name = f"coordinator-{len(self.others) + len(self.old_coordinators) + 2}.log"
        proc, url = self._spawn_coordinator(name, port, timeout)
        self.others[url] = proc
        return url

    @property
    def urls(self) -> list[str]:
        """Every running coordinator's URL, the first one first."""
        return [self.url, *self.others]

    def _spawn_coordinator(
        self, log_name: str, port: int, timeout: float
    ) -> tuple[subprocess.Popen[str], str]:
        log = self._log(log_name)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "idlegrid",
                "serve",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(port),
                "--heartbeat-interval",
                str(self.heartbeat_s),
                "--node-timeout",
                str(self.node_timeout_s),
                "--min-lease",
                str(self.min_lease_s),
                "--log-level",
                "info",
                *self.backend_args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        try:
            url = self._await_listening(proc, timeout)
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            self._await_health(url, timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc, url

    def _await_listening(self, proc: subprocess.Popen[str], timeout: float) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"coordinator exited early; see {self.root}/coordinator.log")
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
        raise TimeoutError("coordinator did not start listening")

    def _await_health(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("coordinator did not become healthy")

    def kill_coordinator(self, url: str | None = None) -> None:
        """SIGKILL a coordinator (the first one by default): no shutdown code runs."""
        proc = self.others.pop(url) if url and url != self.url else self.coordinator
        assert proc is not None
        proc.kill()
        proc.wait()
        self.old_coordinators.append(proc)

    def create_token(self, *, kind: str = "api", account: str | None = None) -> dict[str, Any]:
        response = httpx.post(
            f"{self.url}/v1/tokens",
            json={"kind": kind, "account": account},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        response.raise_for_status()
        return dict(response.json())

    def client(self, token: str | None = None) -> Any:
        from idlegrid.client import Client

        return Client(self.url, token or self.admin_token)

    # -- workers -----------------------------------------------------------------------------

    def start_worker(
        self,
        name: str,
        *,
        kinds: str = "",
        slots: int = 1,
        threads: int = 0,
        benchmark: bool = True,
        extra: tuple[str, ...] = (),
        servers: Sequence[str] = (),
        dedicated: bool = True,
        account: str | None = None,
        token: str | None = None,
        python: str = sys.executable,
    ) -> subprocess.Popen[str]:
        """Start a worker; `servers`: the coordinators it tries in turn (default: the first).

        It runs for the volunteer account `account` (default: one named after the worker),
        or with `token`, a node token made elsewhere (the dashboard's "add a node");
        `python`: the interpreter that runs it (another environment, e.g. another ONNX
        Runtime build, which then finds idlegrid through PYTHONPATH).
        """
        token = token or self.volunteer_token(account or f"volunteer-{name}")
        args = self._worker_command(
            name, python=python, servers=servers, slots=slots, dedicated=dedicated, extra=extra,
            kinds=kinds, threads=threads, benchmark=benchmark,
        )  # fmt: skip
        proc = subprocess.Popen(
            args,
            stdout=self._log(f"{name}.log"),
            stderr=subprocess.STDOUT,
            text=True,
            # In the environment, not on the command line, where `ps` would show it.
            env={**self.env, "IDLEGRID_NODE_TOKEN": token},
            start_new_session=True,
        )
        self.workers.append(proc)
        self._worker_logs[proc.pid] = self.root / f"{name}.log"
        return proc

    def _worker_command(
        self,
        name: str,
        *,
        python: str,
        servers: Sequence[str],
        slots: int,
        dedicated: bool,
        extra: tuple[str, ...],
        kinds: str,
        threads: int,
        benchmark: bool,
    ) -> list[str]:
        """The command line of worker `name` (its token goes in the environment)."""
        server_args = [arg for url in servers or [self.url] for arg in ("--server", url)]
        args = [
            python,
            "-m",
            "idlegrid",
            "worker",
            *server_args,
            "--state-dir",
            str(self.root / name),
            "--name",
            name,
            "--slots",
            str(slots),
            # A test grid on one machine computes whatever its owner is doing (dedicated).
            *(["--dedicated"] if dedicated else []),
            "--control-port",
            "0",
            *extra,
        ]
        if kinds:
            args += ["--kinds", kinds]
        if threads:
            args += ["--threads", str(threads)]
        if not benchmark:
            args.append("--no-benchmark")
        return args

    def volunteer_token(self, account: str) -> str:
        """A node token of the volunteer account `account` (made on first use)."""
        if account not in self._volunteer_tokens:
            made = self.create_token(kind="node", account=account)
            self._volunteer_tokens[account] = made["token"]
        return self._volunteer_tokens[account]

    def stop_worker(self, proc: subprocess.Popen[str], timeout: float = 15.0) -> None:
        """Stop one worker (SIGTERM, then SIGKILL if it lingers) and forget it."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc in self.workers:
            self.workers.remove(proc)

    def wait_for_nodes(
        self, count: int, *, timeout: float = 300.0, names: Sequence[str] = ()
    ) -> None:
        """Block until `count` nodes are connected (with `names`: until exactly those
        are, and no other). Each worker benchmarks itself first: seconds on a quiet
        machine, minutes on a busy one."""
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                online = [n["name"] for n in client.nodes() if n["online"]]
                if (sorted(online) == sorted(names)) if names else len(online) >= count:
                    return
                self._check_alive()
                time.sleep(0.2)
        raise TimeoutError(
            f"{count} workers did not connect in {timeout:.0f} s; the last lines of their logs:\n"
            + self._worker_log_tails()
        )

    def _worker_log_tails(self, lines: int = 3) -> str:
        """The last `lines` of each worker's log, for an error that outlives the folder."""
        tails = []
        for proc in self.workers:
            # A worker a caller started itself has no log of ours.
            log = self._worker_logs.get(proc.pid, self.root / f"pid-{proc.pid}.log")
            text = log.read_text(errors="replace").splitlines() if log.is_file() else []
            tails.append(f"  {log.stem}: " + (" | ".join(text[-lines:]) or "(nothing logged)"))
        return "\n".join(tails)

    def _check_alive(self) -> None:
        for proc in self.workers:
            if proc.poll() is not None and proc.returncode not in (0, -signal.SIGKILL):
                raise RuntimeError(
                    f"a worker exited with {proc.returncode}; the last lines of the logs:\n"
                    + self._worker_log_tails()
                )

    # -- teardown ----------------------------------------------------------------------------

    def stop(self, timeout: float = 15.0) -> None:
        """Stop workers, then the coordinators: SIGTERM, then SIGKILL if they linger."""
        coordinators = [*([self.coordinator] if self.coordinator else []), *self.others.values()]
        for proc in [*self.workers, *coordinators]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers, *coordinators]:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def _log(self, name: str) -> IO[str]:
        handle = open(self.root / name, "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(handle)
        return handle


def _await_text(path: Path, start: int, text: str, *, timeout: float) -> None:
    """Block until a log says `text` after byte `start`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with path.open("rb") as handle:
            handle.seek(start)
            if text.encode() in handle.read():
                return
        time.sleep(0.2)
    raise TimeoutError(f"{path} never said {text!r}")


def _drain(source: IO[str] | None, sink: IO[str]) -> None:
    """Copy what a child prints after start-up to its log, so its pipe never fills."""
    if source is None:
        return
    try:
        for line in source:
            sink.write(line)
        source.close()
    except (ValueError, OSError):
        pass  # closed at teardown


def _grid_env(
    *, backoff_max_s: float, p2p: bool, replication: int | None, extra_env: dict[str, str] | None
) -> dict[str, str]:
    """The environment of every process of the grid: this one's, and the grid's settings."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "IDLEGRID_DISTINCT_NETWORKS": "false",
        "IDLEGRID_BACKOFF_MAX_S": str(backoff_max_s),
        "IDLEGRID_WORKER_BACKOFF_MAX_S": str(backoff_max_s),
        "IDLEGRID_P2P": "auto" if p2p else "off",
        # Test and demo grids serve no /download: no wheel build at each start.
        "IDLEGRID_BUILD_DOWNLOADS": "false",
        **({"IDLEGRID_DEFAULT_REPLICATION": str(replication)} if replication else {}),
        **(extra_env or {}),
    }


def _backend_args(database: str, database_schema: str, redis: str, redis_prefix: str) -> list[str]:
    """`idlegrid serve`'s flags for the database and Redis given (none for the defaults)."""
    args: list[str] = []
    for flag, value in (
        ("--database", database),
        ("--database-schema", database_schema),
        ("--redis", redis),
        ("--redis-prefix", redis_prefix),
    ):
        if value:
            args += [flag, value]
    return args
