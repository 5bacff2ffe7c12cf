"""Table tests of the network rule and the replication shortfall message (pure)."""

from __future__ import annotations

import pytest

from idlegrid.policy.sybil import network_of, replication_shortfall


@pytest.mark.parametrize(
    ("address", "network"),
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("203.0.113.250", "203.0.113.0/24"),
        ("198.51.100.1", "198.51.100.0/24"),
        ("2001:db8:abcd:12::1", "2001:db8:abcd::/48"),
        ("2001:db8:abcd:ffff::2", "2001:db8:abcd::/48"),
        ("::ffff:203.0.113.9", "203.0.113.0/24"),  # IPv4-mapped counts as IPv4
        ("[2001:db8:1::5]", "2001:db8:1::/48"),
        ("testclient", "testclient"),  # not an address: its own network
    ],
)
def test_network_of(address: str, network: str) -> None:
    assert network_of(address) == network


def test_network_prefixes_are_settings() -> None:
    assert network_of("203.0.113.7", v4_prefix=16) == "203.0.0.0/16"
    assert network_of("2001:db8:abcd:12::1", v6_prefix=64) == "2001:db8:abcd:12::/64"


@pytest.mark.parametrize(
    ("replication", "nodes", "accounts", "networks", "short"),
    [
        (1, [], True, True, False),
        (3, [(1, "a"), (2, "b"), (3, "c")], True, True, False),
        (3, [(1, "a"), (1, "b"), (2, "c")], True, True, True),  # two accounts
        (3, [(1, "a"), (1, "b"), (2, "c")], False, True, False),
        (3, [(1, "a"), (2, "a"), (3, "b")], True, True, True),  # two networks
        (3, [(1, "a"), (2, "a"), (3, "b")], True, False, False),
        (2, [(1, "a")], False, False, True),
    ],
)
def test_replication_shortfall(
    replication: int, nodes: list[tuple[int, str]], accounts: bool, networks: bool, short: bool
) -> None:
    reason = replication_shortfall(
        replication, nodes, distinct_accounts=accounts, distinct_networks=networks
    )
    assert (reason is not None) is short
    if reason:
        assert f"replication {replication} needs {replication}" in reason
