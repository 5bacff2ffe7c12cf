"""A member behind a real NAT: network namespaces, veth pairs and a masquerading router.

    public  11.0.0.1/24: the bootstrap DHT peer and two full-peer members
       |
    router  11.0.0.254 (wan) / 192.168.77.1 (lan): SNAT of the home's traffic to its wan
       |    address; forwards nothing inbound but replies (conntrack)
    home    192.168.77.2/24: one member, default route through the router

11.0.0.0/24 is a public (globally routed) range, so that `auto` sees what it would see at
home: a public bootstrap peer and no public address of its own. The namespaces have no
way out of the test, so nothing reaches the real owner of the range. Every member runs as
a worker's task does (`tests/p2p/nat_member.py`: `averaging.join` and its averaging
child) inside its namespace. Needs root, `ip` and `iptables`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from idlegrid import p2p
from idlegrid.p2p.group import Group

pytestmark = pytest.mark.slow

MEMBER = Path(__file__).resolve().parent / "nat_member.py"
PUBLIC, ROUTER_WAN, ROUTER_LAN, HOME = "11.0.0.1", "11.0.0.254", "192.168.77.1", "192.168.77.2"
# Seconds: the group's timeout (each attempt's), and a member's whole run, its start
# (torch, hivemind, the p2p daemon) and up to two attempts included.
GROUP_TIMEOUT_S = 60.0
MEMBER_LIMIT_S = 200.0


@dataclass(frozen=True)
class Nat:
    """The three namespaces' names (unique to one run)."""

    public: str
    router: str
    home: str


def _unable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{reason}; CI=true requires it (root, iproute2, iptables, idlegrid[p2p])")
    pytest.skip(f"{reason}: the NAT test needs it")


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def _in(namespace: str, *command: str) -> list[str]:
    """`command` run in `namespace`."""
    return ["ip", "netns", "exec", namespace, *command]


def _build(nat: Nat) -> None:
    for name in (nat.public, nat.router, nat.home):
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
    # Each pair is made with its ends in their namespaces: no name lives in the host's.
    _run("ip", "link", "add", "wan", "netns", nat.router, "type", "veth",
         "peer", "name", "eth0", "netns", nat.public)  # fmt: skip
    _run("ip", "link", "add", "lan", "netns", nat.router, "type", "veth",
         "peer", "name", "eth0", "netns", nat.home)  # fmt: skip
    for name, device, address in ((nat.public, "eth0", f"{PUBLIC}/24"),
                                  (nat.router, "wan", f"{ROUTER_WAN}/24"),
                                  (nat.router, "lan", f"{ROUTER_LAN}/24"),
                                  (nat.home, "eth0", f"{HOME}/24")):  # fmt: skip
        _run("ip", "-n", name, "addr", "add", address, "dev", device)
        _run("ip", "-n", name, "link", "set", device, "up")
    _run("ip", "-n", nat.home, "route", "add", "default", "via", ROUTER_LAN)
    # The public side even has a route to the home's network: what stops it connecting in
    # is the router, not a missing route.
    _run("ip", "-n", nat.public, "route", "add", "192.168.77.0/24", "via", ROUTER_WAN)
    router = ("ip", "netns", "exec", nat.router)
    _run(*router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    _run(*router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
    _run(*router, "iptables", "-P", "FORWARD", "DROP")
    _run(*router, "iptables", "-A", "FORWARD", "-m", "conntrack",
         "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
    _run(*router, "iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")


def _tear_down(nat: Nat) -> None:
    """End whatever still runs in the namespaces (this test's processes), then delete them."""
    for name in (nat.home, nat.router, nat.public):
        found = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in found.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def nat() -> Iterator[Nat]:
    if not sys.platform.startswith("linux"):
        _unable(f"network namespaces are Linux's, not {sys.platform}'s")
    if os.geteuid() != 0:
        _unable("building a NAT from network namespaces needs root")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            _unable(f"{tool} is not installed")
    reason = p2p.unavailable()
    if reason is not None:
        _unable(reason)
    run = secrets.token_hex(3)
    built = Nat(f"idlegrid-{run}-public", f"idlegrid-{run}-router", f"idlegrid-{run}-home")
    try:
        _build(built)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _tear_down(built)
        _unable(f"the NAT could not be built ({exc})")
    try:
        yield built
    finally:
        _tear_down(built)


def _masqueraded(nat: Nat) -> int:
    """How many connections the router has masqueraded (its SNAT rule's packet count: the
    nat table sees the first packet of each)."""
    listing = subprocess.run(
        _in(nat.router, "iptables", "-t", "nat", "-L", "POSTROUTING", "-v", "-x", "-n"),
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return sum(int(line.split()[0]) for line in listing.splitlines() if "MASQUERADE" in line)


# -- probes: plain sockets in a namespace ---------------------------------------------------

LISTEN = """
import socket
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
while True:
    connection, peer = server.accept()
    print(peer[0], flush=True)
    connection.close()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


class Listener:
    """A TCP server in a namespace that prints each connecting peer's address."""

    def __init__(self, namespace: str) -> None:
        self._process = subprocess.Popen(_in(namespace, sys.executable, "-c", LISTEN),
                                         stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self._process.stdout is not None
        self.port = int(self._process.stdout.readline())

    def accepted(self) -> str:
        """The address of the next peer that connected (one whose connect returned: the
        kernel had completed its handshake, so the server accepts it)."""
        assert self._process.stdout is not None
        return self._process.stdout.readline().strip()

    def stop(self) -> None:
        self._process.kill()
        self._process.communicate()


def _connect(namespace: str, host: str, port: int) -> str:
    command = _in(namespace, sys.executable, "-c", CONNECT, host, str(port))
    return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()


def test_the_home_connects_out_through_the_nat_and_nothing_connects_in(nat: Nat) -> None:
    outside = Listener(nat.public)
    try:
        assert _connect(nat.home, PUBLIC, outside.port) == "connected"
        # Masqueraded: the public side sees the router's address, never the home's.
        assert outside.accepted() == ROUTER_WAN
    finally:
        outside.stop()
    inside = Listener(nat.home)
    try:
        # A route to the home's network, but the router forwards nothing inbound (the SYN
        # is dropped: a timeout), and the router's own address forwards no port.
        assert _connect(nat.public, HOME, inside.port) == "TimeoutError"
        assert _connect(nat.public, ROUTER_WAN, inside.port) == "ConnectionRefusedError"
        # It was listening: the router's own connection is the first it accepts.
        assert _connect(nat.router, HOME, inside.port) == "connected"
        assert inside.accepted() == ROUTER_LAN
    finally:
        inside.stop()


# -- the group --------------------------------------------------------------------------------


class Bootstrap:
    """The coordinator's bootstrap DHT peer (`python -m idlegrid.p2p.bootstrap`), public."""

    def __init__(self, namespace: str) -> None:
        command = _in(namespace, sys.executable, "-m", "idlegrid.p2p.bootstrap", "--host", PUBLIC)
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)  # fmt: skip

    def peers(self) -> tuple[str, ...]:
        assert self._process.stdout is not None
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(self._process.stdout.readline)
            try:
                return tuple(json.loads(line.result(timeout=120))["peers"])
            except BaseException:  # a timeout, or an interrupt: the reader must not wait on
                self._process.kill()
                raise

    def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        assert self._process.stdout is not None
        self._process.stdout.close()


class Member:
    """One member's task (`nat_member.py`) in a namespace, with reachability `auto`."""

    def __init__(self, namespace: str, group: Group, shard: int, vector: np.ndarray,
                 scratch: Path) -> None:  # fmt: skip
        given = scratch / f"in-{shard}.npy"
        self._taken, self._errors = scratch / f"out-{shard}.json", scratch / f"err-{shard}.txt"
        np.save(given, vector)
        command = _in(namespace, sys.executable, str(MEMBER), json.dumps(group.to_json()),
                      str(shard), "auto", str(given), str(self._taken))  # fmt: skip
        with self._errors.open("w") as errors:
            self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)

    def result(self, deadline: float) -> dict[str, Any]:
        """What it came to, once it ends (by `deadline`, a monotonic time)."""
        code = self._process.wait(max(0.0, deadline - time.monotonic()))
        assert code == 0 and self._taken.exists(), self._errors.read_text()[-2000:]
        return dict(json.loads(self._taken.read_text()))

    def kill(self) -> None:
        """End it if it still runs (its averaging child follows: it watches its parent)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def test_a_member_behind_nat_averages_in_client_mode(nat: Nat, tmp_path: Path) -> None:
    masqueraded = _masqueraded(nat)
    bootstrap = Bootstrap(nat.public)
    try:
        peers = bootstrap.peers()
        assert all(f"/ip4/{PUBLIC}/" in peer for peer in peers), peers
        group = Group("nat-test", (0, 1, 2), min_size=2, timeout_s=GROUP_TIMEOUT_S, peers=peers)
        rng = np.random.default_rng(7)
        vectors = {s: rng.normal(size=1000).astype(np.float32) for s in group.members}
        where = {0: nat.public, 1: nat.public, 2: nat.home}
        members = {s: Member(where[s], group, s, vectors[s], tmp_path) for s in group.members}
        try:
            deadline = time.monotonic() + MEMBER_LIMIT_S
            done = {s: member.result(deadline) for s, member in members.items()}
        finally:
            for member in members.values():
                member.kill()
    finally:
        bootstrap.stop()
    reasons = {s: d["reason"] for s, d in done.items()}
    assert all(d["values"] is not None for d in done.values()), reasons
    # The home member's connections (to the bootstrap peer, the full peers) went out
    # through the router, under the router's address.
    assert _masqueraded(nat) > masqueraded
    # `auto` read each namespace's addresses: the home has no public one, so client mode.
    assert {s: (d["chosen"], d["ran"]) for s, d in done.items()} == {
        0: ("public", "public"), 1: ("public", "public"), 2: ("client", "client")
    }  # fmt: skip
    met = {s: (d["attempt"], d["members"]) for s, d in done.items()}
    assert all(seen == (1, [0, 1, 2]) for seen in met.values()), met
    means = {s: np.array(d["values"], np.float32) for s, d in done.items()}
    digests = {hashlib.sha256(mean.tobytes()).hexdigest() for mean in means.values()}
    assert len(digests) == 1
    expected = np.mean([v.astype(np.float64) for v in vectors.values()], axis=0)
    peak = max(float(np.abs(v).max()) for v in vectors.values())
    np.testing.assert_allclose(means[2], expected, rtol=0, atol=peak * 2.0**-16)
