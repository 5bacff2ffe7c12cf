"""The coordinator's bootstrap DHT peer, run as `python -m idlegrid.p2p.bootstrap`.

A child process of `idlegrid serve` (the coordinator itself never imports torch, which
Hivemind needs). It prints one line, `{"peers": [multiaddress, ...], "listen": "host:port"}`,
once the DHT listens, then serves until its standard input closes (the coordinator exited
or stopped it) or its parent is gone. Meanwhile it names the retry groups of peer-to-peer
rounds (`namer`): the members left after a failed attempt all-reduce with the group it
names. With `--identity` its peer id survives restarts, so the addresses in tasks already
handed out stay good.

It listens on `--host` only (the coordinator passes its own host unless the operator
named another), and asks no router to forward a port: a coordinator that serves on
127.0.0.1 opens nothing anyone else reaches.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading
from pathlib import Path

from idlegrid import p2p
from idlegrid.p2p import namer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m idlegrid.p2p.bootstrap")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--announce", default="", help="host that nodes reach it at")
    parser.add_argument("--identity", default="", help="file that keeps its peer id")
    parser.add_argument("--round-key", default="",
                        help="file with the coordinator's round key (p2p/seal.py)")  # fmt: skip
    options = parser.parse_args(argv)
    import hivemind

    announce = []
    if options.announce:
        announce = [f"/ip4/{options.announce}/tcp/{options.port}"]
    dht = hivemind.DHT(
        start=True,
        host_maddrs=[listen_maddr(options.host, options.port)],
        announce_maddrs=announce or None,
        identity_path=options.identity or None,
        # No UPnP / NAT-PMP: the daemon would bind UDP on every interface to find a
        # router and ask it to forward a port. Where nodes reach the coordinator from is
        # the operator's decision (--p2p-host, IDLEGRID_P2P_ANNOUNCE), never the router's.
        nat_port_map=False,
        wait_timeout=p2p.DHT_REQUEST_TIMEOUT_S,
    )
    peers = [str(address) for address in dht.get_visible_maddrs()]
    listen = f"{options.host}:{listen_port(peers, options.port)}"
    print(json.dumps({"peers": peers, "listen": listen}), flush=True)
    parent = os.getppid()
    closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    # The coordinator names each round's retry group, as it named the first (`namer`),
    # reading and writing only records sealed with the round's secret.
    key = Path(options.round_key).read_bytes() if options.round_key else b""
    namer.Namer(dht, key).run(lambda: closed.is_set() or os.getppid() != parent)
    dht.shutdown()
    return 0


def listen_maddr(host: str, port: int) -> str:
    """The multiaddress to listen on for `host` (an IPv4 or IPv6 address, or a name,
    resolved here: libp2p listens on addresses, not names)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        address = ipaddress.ip_address(sockaddr[0])
    protocol = "ip6" if address.version == 6 else "ip4"
    return f"/{protocol}/{address}/tcp/{port}"


def listen_port(peers: list[str], port: int) -> int:
    """The port the DHT got (`port` unless 0: then the one its addresses name)."""
    for peer in peers:
        parts = peer.split("/")
        if port == 0 and "tcp" in parts:
            return int(parts[parts.index("tcp") + 1])
    return port


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
