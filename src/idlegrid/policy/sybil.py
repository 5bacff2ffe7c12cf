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
    shard at once, with the fix that works, or None when they can.

    `nodes`: (account id, network) of each. Replicas of a shard go to distinct nodes, and
    to distinct accounts and networks where the grid enforces them; the fewest of those
    is how many replicas the fleet can hold, and what binds it names the fix."""
    if replication <= 1:
        return None
    accounts = len({account for account, _ in nodes})
    networks = len({network for _, network in nodes})
    limits = {"nodes": len(nodes)}
    if distinct_accounts:
        limits["accounts"] = accounts
    if distinct_networks:
        limits["networks"] = networks
    usable = min(limits.values())
    if usable >= replication:
        return None
    axes = " and ".join(axis for axis in ("accounts", "networks") if axis in limits)
    needs = f"{replication} connected nodes that run this kind" + (
        f", on {replication} distinct {axes}" if axes else ""
    )
    has = f"{len(nodes)} such node(s) on {accounts} account(s) and {networks} network(s)"
    return (
        f"replication {replication} needs {needs}; the fleet has {has}, so it can hold "
        f"{usable} replica(s) of a shard. To run now: {_fixes(replication, usable, limits)}"
    )


def _fixes(replication: int, usable: int, limits: dict[str, int]) -> str:
    """What lets the job run, for the axes that bind. An axis binds only where nodes share
    it (fewer accounts than nodes, say): while nodes are too few (some still benchmark
    before they connect), more nodes is the fix, not accounts that every node has."""
    fixes = []
    nodes = limits["nodes"]
    if usable >= 1:
        fixes.append(f"submit with replication={usable} (CLI: --replication {usable})")
    if nodes < replication:
        own = " and ".join(axis for axis in ("accounts", "networks") if axis in limits)
        fixes.append(
            f"connect {replication - nodes} more node(s)"
            + (f" on {own} of their own" if own else "")
            + " (a worker connects once its first benchmark is done)"
        )
    if limits.get("accounts", nodes) < min(replication, nodes):
        fixes.append("give each volunteer's nodes an account of their own")
    if limits.get("networks", nodes) < min(replication, nodes):
        fixes.append(
            "if these nodes share one network you trust (a lab, an office, one machine), "
            "the coordinator's operator restarts it with `idlegrid serve --replica-networks "
            "shared` (IDLEGRID_DISTINCT_NETWORKS=false; docs/operations.md, "
            '"Replicas and networks")'
        )
    return "; or ".join(fixes)
