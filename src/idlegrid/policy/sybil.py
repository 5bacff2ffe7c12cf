"""Which network an address belongs to, for "one replica per network". Pure."""

from __future__ import annotations

import ipaddress


def network_of(address: str, *, v4_prefix: int = 24, v6_prefix: int = 48) -> str:
    """The address's network as CIDR text (IPv4 /24, IPv6 /48 by default).

    Nodes behind one home router share one public address, and a person with several
    machines or cloud instances often shares a /24 (IPv4) or a /48 (an IPv6 site): two
    replicas from one such network are not independent witnesses. An IPv4-mapped IPv6
    address counts as its IPv4 address. Anything that is not an address (a test
    client's name) is its own network.
    """
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = v4_prefix if ip.version == 4 else v6_prefix
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def replication_shortfall(
    replication: int,
    nodes: list[tuple[int, str]],
    *,
    distinct_accounts: bool,
    distinct_networks: bool,
) -> str | None:
    """Why the connected nodes able to run a job cannot hold `replication` replicas of a
    shard at once, or None when they can. `nodes`: (account id, network) of each."""
    if (
        replication <= 1
        or len(nodes) >= replication
        and not (distinct_accounts or distinct_networks)
    ):
        return None
    accounts = len({account for account, _ in nodes})
    networks = len({network for _, network in nodes})
    # Nodes that can hold one replica each: distinct on every axis the grid enforces.
    usable = min(
        len(nodes),
        accounts if distinct_accounts else len(nodes),
        networks if distinct_networks else len(nodes),
    )
    if usable >= replication:
        return None
    rules = ["nodes"]
    if distinct_accounts:
        rules.append("accounts")
    if distinct_networks:
        rules.append("networks")
    return (
        f"replication {replication} needs {replication} connected nodes on distinct "
        f"{' and '.join(rules[1:]) or 'nodes'} that run this kind; the fleet has "
        f"{len(nodes)} such node(s) on {accounts} account(s) and {networks} network(s)"
    )
