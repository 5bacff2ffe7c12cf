"""The coordinator's side of its bootstrap DHT peer: start the child, read its addresses,
stop it. No torch, no hivemind here (`bootstrap` runs in the child)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The bootstrap DHT peer did not start; the message says why."""


class BootstrapPeer:
    """One bootstrap DHT peer in a child process, owned by the coordinator's lifespan."""

    def __init__(self, *, host: str, port: int, announce: str, identity: Path | None,
                 round_key: Path | None = None) -> None:  # fmt: skip
        self._args = ["--host", host, "--port", str(port)]
        if announce:
            self._args += ["--announce", announce]
        if identity is not None:
            self._args += ["--identity", str(identity)]
        if round_key is not None:  # the file's path: the key itself stays off `ps`
            self._args += ["--round-key", str(round_key)]
        self._process: subprocess.Popen[str] | None = None
        self.peers: tuple[str, ...] = ()
        self.listen = ""  # host:port it listens on, once started

    def start(self, *, timeout_s: float = 120.0) -> tuple[str, ...]:
        """Start the child and return its addresses (blocking: call in a thread)."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "idlegrid.p2p.bootstrap", *self._args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        try:
            said = json.loads(line[0]) if line and line[0] else {}
            self.peers, self.listen = tuple(said["peers"]), str(said.get("listen", ""))
        except (ValueError, KeyError, TypeError):
            self.peers = ()
        if not self.peers:
            self.stop()
            raise BootstrapError(f"the bootstrap DHT peer gave no address within {timeout_s:g} s")
        # Warning level: an open port is something the operator should see at any log level.
        log.warning(
            "p2p bootstrap DHT peer listening on %s (nodes reach it at %s)",
            self.listen or "?",
            ", ".join(self.peers),
        )
        return self.peers

    def _readline(self) -> str:
        assert self._process is not None and self._process.stdout is not None
        return self._process.stdout.readline()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Close the child's stdin (it exits), then kill it if it lingers."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
