"""`idlegrid serve` with its defaults listens only on its own host, and only where it says.

The coordinator is started as an operator starts it (no IDLEGRID_* variables; `--p2p`
left at auto, so with the p2p extra installed its bootstrap DHT peer runs), then every
socket its process tree listens on is read from the kernel (psutil) and compared with
what it printed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from idlegrid.p2p.bootstrap import listen_maddr, listen_port

pytestmark = pytest.mark.slow

HTTP_LINE = re.compile(r"listening on http://([^\s:]+):(\d+)")
P2P_LINE = re.compile(r"bootstrap DHT peer listening on (\S+):(\d+)")
P2P_REFUSED = "peer-to-peer training jobs are refused here"
P2P_STARTED_IN_S = 300.0  # importing torch and hivemind on a loaded 2-core machine


class Output:
    """The lines a process prints (stdout and stderr), read in a thread as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float) -> str:
        """The first line that matches, waiting for it up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if re.search(pattern, line):
                        return line
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} in:\n{self.text()}")
                self._changed.wait(left)

    def close(self, proc: subprocess.Popen[str]) -> None:
        """Once the process ended: the rest of its output read, its pipe closed."""
        self._reader.join(30)
        assert proc.stdout is not None
        proc.stdout.close()

    def text(self) -> str:
        return "".join(self.lines)


def _await_health(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    """Until the coordinator answers (it prints its address before the app has started)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout:g} s")


def listening(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, protocol) of every socket the process and its descendants listen
    on: TCP sockets in LISTEN, and UDP sockets bound with no peer (QUIC, say)."""
    found: set[tuple[str, int, str]] = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            sockets = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for sock in sockets:
            tcp = sock.type == psutil.socket.SOCK_STREAM  # type: ignore[attr-defined]
            if (tcp and sock.status == psutil.CONN_LISTEN) or (not tcp and not sock.raddr):
                found.add((sock.laddr.ip, sock.laddr.port, "tcp" if tcp else "udp"))
    return found


def test_serve_with_defaults_listens_only_on_its_host_and_prints_each_address(
    tmp_path: Path,
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("IDLEGRID_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "idlegrid", "serve", "--data-dir", str(tmp_path / "data"),
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    output = Output(proc)
    tree: list[psutil.Process] = []
    try:
        host, http_port = HTTP_LINE.search(output.wait_for(HTTP_LINE, 60.0)).groups()  # type: ignore[union-attr]
        assert host == "127.0.0.1"
        _await_health(f"http://{host}:{http_port}/healthz", proc, 120.0)
        printed = {(host, int(http_port))}
        plan = output.wait_for("peer-to-peer training:", 5.0)
        if importlib.util.find_spec("hivemind") is not None:
            assert "will listen on 127.0.0.1, any free port" in plan
            p2p_host, p2p_port = P2P_LINE.search(  # type: ignore[union-attr]
                output.wait_for(P2P_LINE, P2P_STARTED_IN_S)
            ).groups()
            printed.add((p2p_host, int(p2p_port)))
        else:
            output.wait_for(P2P_REFUSED, 60.0)
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
        sockets = listening(root)
        assert {(ip, port) for ip, port, _ in sockets} == printed, output.text()
        assert all(ip == "127.0.0.1" for ip, _, _ in sockets), sockets
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        output.close(proc)
        for process in tree[1:]:  # a child that outlived its parent (p2pd, say)
            if process.is_running():
                process.kill()


@pytest.mark.parametrize(
    ("host", "port", "maddr"),
    [
        ("127.0.0.1", 0, "/ip4/127.0.0.1/tcp/0"),
        ("0.0.0.0", 31337, "/ip4/0.0.0.0/tcp/31337"),
        ("::1", 5, "/ip6/::1/tcp/5"),
        ("[::]", 0, "/ip6/::/tcp/0"),
        ("localhost", 7, None),  # a name is resolved: libp2p listens on addresses
    ],
)
def test_the_bootstrap_peer_listens_on_the_address_it_is_given(
    host: str, port: int, maddr: str | None
) -> None:
    got = listen_maddr(host, port)
    if maddr is None:
        assert re.fullmatch(r"/ip4/127\.\d+\.\d+\.\d+/tcp/7|/ip6/::1/tcp/7", got), got
    else:
        assert got == maddr


def test_the_port_a_free_port_request_got_is_read_from_the_addresses() -> None:
    peers = ["/ip4/127.0.0.1/tcp/40123/p2p/12D3KooWabc"]
    assert listen_port(peers, 0) == 40123
    assert listen_port(peers, 31337) == 31337
