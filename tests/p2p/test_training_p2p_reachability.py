"""How a member joins the p2p network: the `p2p_reachability` setting and `auto`'s choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from idlegrid.p2p.reachability import ReachabilityError, choose, host_of, is_public
from idlegrid.settings import WorkerSettings
from idlegrid.worker.daemon import Worker

LOOPBACK = ("/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWtest",)
LAN = ("/ip4/192.168.1.10/tcp/31337/p2p/12D3KooWtest",)
TAILSCALE = ("/ip4/100.101.102.103/tcp/31337/p2p/12D3KooWtest",)
PUBLIC = ("/ip4/127.0.0.1/tcp/31337/p2p/X", "/ip4/1.2.3.4/tcp/31337/p2p/X")
HOME = ("127.0.0.1", "192.168.1.23", "fe80::1", "::1")


def test_explicit_settings_are_taken_as_they_are() -> None:
    assert choose("public", PUBLIC, HOME)[0] == "public"
    assert choose("client", LOOPBACK, ["8.8.8.8"])[0] == "client"


def test_auto_is_a_full_peer_unless_the_dht_is_public_and_this_machine_is_not() -> None:
    for peers in (LOOPBACK, LAN, TAILSCALE, ("/dns4/dht.example.org/tcp/31337/p2p/X",)):
        mode, why = choose("auto", peers, HOME)
        assert mode == "public" and "private network" in why, peers
    served = ("public", "this machine has a public address")
    assert choose("auto", PUBLIC, [*HOME, "5.6.7.8"]) == served
    assert choose("auto", PUBLIC, [*HOME, "2a00:1450:4001::1"]) == served
    # Documentation and carrier-grade NAT ranges are not public.
    assert choose("auto", PUBLIC, [*HOME, "203.0.113.9", "100.64.1.1"])[0] == "client"
    mode, why = choose("auto", PUBLIC, HOME)
    assert mode == "client" and "behind NAT" in why


def test_addresses() -> None:
    assert host_of("/ip6/::1/tcp/5/p2p/X") == "::1" and host_of("/dns4/a.b/tcp/1") is None
    assert is_public("8.8.8.8") and not is_public("100.64.0.1") and not is_public("10.1.2.3")
    assert not is_public("not an address")


def test_the_worker_setting_comes_from_its_flag_or_environment(tmp_path: Path) -> None:
    env = {"IDLEGRID_P2P_REACHABILITY": "client"}
    assert WorkerSettings.from_env(env).p2p_reachability == "client"
    assert WorkerSettings.from_env(env, p2p_reachability="public").p2p_reachability == "public"
    assert WorkerSettings.from_env({}).p2p_reachability == "auto"
    with pytest.raises(ReachabilityError, match="p2p_reachability: 'nat' is not one of auto"):
        choose("nat", LOOPBACK, HOME)
    bad = WorkerSettings(token="ign_x", state_dir=tmp_path, p2p_reachability="nat")
    with pytest.raises(ValueError, match="p2p_reachability"):
        Worker(bad)
