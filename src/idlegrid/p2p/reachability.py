"""How a member's averaging process takes part in the p2p network: as a full peer that
others connect to, or in Hivemind's client mode (it connects out only).

`public`: a full peer (its DHT and averager serve; in a group's butterfly all-reduce it
reduces a part). `client`: Hivemind's client mode, for a node behind NAT: it joins groups
that some full peer leads, sends its vector and reads the mean back over connections it
opened itself, and reduces no part (bandwidth share 0). Both dial peers through libp2p
circuit relays where a peer is only reachable through one. `auto` (the default) picks
`client` only when the evidence is plain: the DHT's bootstrap peer is on a public address
and this machine has none (it sits behind a NAT that others cannot connect through);
otherwise `public`, which a LAN, a VPN or one machine needs. Pure: no hivemind here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from typing import Literal

import psutil

MODES = ("auto", "public", "client")
Mode = Literal["public", "client"]


class ReachabilityError(ValueError):
    """An unknown reachability setting; the message names the allowed ones."""


def check(setting: str) -> str:
    """The setting if it is known, else ReachabilityError."""
    if setting not in MODES:
        raise ReachabilityError(f"p2p_reachability: {setting!r} is not one of {', '.join(MODES)}")
    return setting


def host_of(multiaddress: str) -> str | None:
    """The IP address of an /ip4/ or /ip6/ multiaddress; None for any other (/dns, ...)."""
    parts = multiaddress.strip("/").split("/")
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6"):
        return parts[1]
    return None


def is_public(address: str) -> bool:
    """Whether an IP address is globally routable (not private, loopback, link-local, CGNAT)."""
    try:
        return ipaddress.ip_address(address).is_global
    except ValueError:
        return False


def local_addresses() -> list[str]:
    """This machine's interface addresses (IPv4 and IPv6)."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.append(entry.address.split("%")[0])
    return found


def choose(setting: str, peers: Sequence[str], own: Iterable[str]) -> tuple[Mode, str]:
    """(mode, why): the mode ("public" or "client") for `setting`, given the bootstrap
    peers' multiaddresses and this machine's addresses."""
    check(setting)
    if setting != "auto":
        return ("client" if setting == "client" else "public"), f"p2p_reachability is {setting}"
    hosts = [h for h in (host_of(p) for p in peers) if h is not None]
    if not any(is_public(h) for h in hosts):
        return "public", "the DHT's bootstrap peer is on a private network (LAN, VPN, one machine)"
    if any(is_public(a) for a in own):
        return "public", "this machine has a public address"
    return "client", (
        "the DHT's bootstrap peer is public and this machine has no public address "
        "(behind NAT): client mode, connecting out only"
    )
