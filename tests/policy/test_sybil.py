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


def test_the_shortfall_names_the_axis_that_binds_and_its_fix() -> None:
    one_lab = [(1, "10.0.0.0/24"), (2, "10.0.0.0/24"), (3, "10.0.0.0/24")]
    reason = replication_shortfall(3, one_lab, distinct_accounts=True, distinct_networks=True)
    assert reason is not None
    assert "3 such node(s) on 3 account(s) and 1 network(s)" in reason
    assert "can hold 1 replica(s)" in reason
    assert "submit with replication=1" in reason
    assert "IDLEGRID_DISTINCT_NETWORKS=false" in reason
    assert "idlegrid serve --replica-networks shared" in reason
    assert "account of their own" not in reason and "more node" not in reason
    shared = [(1, "a"), (1, "b"), (1, "c")]
    reason = replication_shortfall(3, shared, distinct_accounts=True, distinct_networks=True)
    assert reason is not None and "account of their own" in reason
    assert "DISTINCT_NETWORKS" not in reason
    assert (
        replication_shortfall(3, one_lab, distinct_accounts=True, distinct_networks=False) is None
    )


def test_too_few_nodes_each_on_its_own_account_asks_for_nodes_not_accounts() -> None:
    # The quickstart's three volunteers, one connected while the others still benchmark.
    first = [(1, "127.0.0.0/24")]
    reason = replication_shortfall(3, first, distinct_accounts=True, distinct_networks=False)
    assert reason is not None
    assert "connect 2 more node(s) on accounts of their own" in reason
    assert "benchmark" in reason
    assert "give each volunteer's nodes an account of their own" not in reason
    two_on_one_account = [(1, "a"), (1, "b")]
    reason = replication_shortfall(
        3, two_on_one_account, distinct_accounts=True, distinct_networks=True
    )
    assert reason is not None and "connect 1 more node(s)" in reason
    assert "give each volunteer's nodes an account of their own" in reason  # they share one
    assert "DISTINCT_NETWORKS" not in reason  # each is on a network of its own
