"""Members behind NAT: Hivemind's client mode, with real processes (the coordinator's
bootstrap DHT peer and each member's averaging child) on localhost.

A member in client mode connects out only and reduces no part of the vector; a group
with one still averages and every member reads back the same bytes. A group of client
members only cannot (nobody serves): each says so at once and falls back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import require_p2p

from idlegrid.p2p import averaging
from idlegrid.p2p.averaging import ALL_CLIENTS, Averaged
from idlegrid.p2p.group import Group
from idlegrid.p2p.supervisor import BootstrapPeer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[str, ...]]:
    require_p2p("client mode needs Hivemind")
    bootstrap = BootstrapPeer(host="127.0.0.1", port=0, announce="", identity=None)
    try:
        yield bootstrap.start()
    finally:
        averaging.REGISTRY.close()  # the standing averagers of this process's members
        bootstrap.stop()


def _average(
    group: Group, settings: dict[int, str], vectors: dict[int, np.ndarray]
) -> dict[int, Averaged]:
    """Each member's averaging child, all at once, as a member's task runs them."""
    joining = {
        s: averaging.join(group, shard=s, reachability_setting=settings[s]) for s in settings
    }
    try:
        with ThreadPoolExecutor(len(joining)) as pool:
            futures = {
                s: pool.submit(j.average, vectors[s], shard=s, holds_state=True)
                for s, j in joining.items()
            }
            return {s: f.result() for s, f in futures.items()}
    finally:
        for handle in joining.values():
            handle.close()


def test_a_client_mode_member_averages_with_full_peers(peers: tuple[str, ...]) -> None:
    group = Group("client-test-mixed", (0, 1, 2), min_size=2, timeout_s=60.0, peers=peers)
    rng = np.random.default_rng(5)
    vectors = {s: rng.normal(size=1000).astype(np.float32) for s in group.members}
    # Loopback bootstrap peer: auto picks a full peer (a LAN or one machine needs it).
    done = _average(group, {0: "auto", 1: "public", 2: "client"}, vectors)
    assert all(d.values is not None for d in done.values()), {s: d.reason for s, d in done.items()}
    assert [done[s].reachability for s in (0, 1, 2)] == ["public", "public", "client"]
    digests = {hashlib.sha256(d.values.tobytes()).hexdigest() for d in done.values()}  # type: ignore[union-attr]
    assert len(digests) == 1
    assert all(set(d.members) == {0, 1, 2} and d.attempt == 1 for d in done.values())
    expected = np.mean([v.astype(np.float64) for v in vectors.values()], axis=0)
    peak = max(float(np.abs(v).max()) for v in vectors.values())
    np.testing.assert_allclose(done[2].values, expected, rtol=0, atol=peak * 2.0**-16)


def test_a_group_of_client_members_only_falls_back_at_once(peers: tuple[str, ...]) -> None:
    group = Group("client-test-only", (0, 1), min_size=2, timeout_s=60.0, peers=peers)
    vectors = {s: np.full(10, float(s), np.float32) for s in group.members}
    done = _average(group, {0: "client", 1: "client"}, vectors)
    assert all(d.values is None and d.reachability == "client" for d in done.values())
    # Before its first attempt, not after a timeout: each saw the other's mode in the DHT.
    assert all(d.reason == ALL_CLIENTS and d.attempt == 1 for d in done.values()), done
