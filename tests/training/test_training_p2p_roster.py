"""A named group forms from its roster in the DHT, without electing a leader: the pure
rules (every member derives the same group) and three real Hivemind peers averaging."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import require_p2p

from idlegrid.p2p import averaging, roster
from idlegrid.p2p.group import Group


@dataclass
class Entry:
    value: Any


@dataclass
class Found:
    value: Any


def _found(entries: dict[Any, Any]) -> Found:
    return Found({sub: Entry(value) for sub, value in entries.items()})


def test_the_roster_is_complete_only_when_every_named_member_wrote_a_wellformed_entry() -> None:
    members = (0, 1, 2)
    assert roster.complete(None, members) is None
    assert roster.complete(Found("not a dict"), members) is None
    two = {0: (b"p0", b"g0"), 1: (b"p1", b"g1")}
    assert roster.complete(_found(two), members) is None
    # A malformed entry does not count; a stranger's extra entry is left out.
    bad = {**two, 2: ("not bytes", b"g2")}
    assert roster.complete(_found(bad), members) is None
    whole = {**two, 2: [b"p2", b"g2", ["/ip4/10.0.0.2/tcp/4001"]], 7: (b"p7", b"g7")}
    assert roster.complete(_found(whole), members) == {
        0: (b"p0", b"g0"), 1: (b"p1", b"g1"), 2: (b"p2", b"g2")
    }  # fmt: skip
    # The addresses a member wrote beside its entry (an entry of two has none).
    assert roster.addresses(_found(whole)) == {2: ("/ip4/10.0.0.2/tcp/4001",)}
    assert roster.own_addresses(["/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo", "/ip6/::1/tcp/5"]) == [
        "/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/5"
    ]  # fmt: skip


def test_every_member_derives_the_same_group_and_a_member_cannot_pick_its_place() -> None:
    peers = {0: b"peer-a", 1: b"peer-b", 2: b"peer-c"}
    shuffled = {2: b"peer-c", 0: b"peer-a", 1: b"peer-b"}
    assert roster.group_order("k", peers) == roster.group_order("k", shuffled)
    assert roster.group_id("k", peers) == roster.group_id("k", shuffled)
    assert roster.group_id("k", peers) != roster.group_id("other", peers)
    assert roster.group_id("k", peers) != roster.group_id("k", {**peers, 2: b"peer-d"})
    # The order comes from hashes, not from the shards' numbers: over many keys, shard 0
    # is not always first.
    firsts = {roster.group_order(f"key{i}", peers)[0] for i in range(32)}
    assert firsts == {0, 1, 2}


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Any]:
    """A DHT peer in this process, as the coordinator runs one: the members' way in."""
    require_p2p("a named group needs Hivemind's DHT")
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield dht
    finally:
        dht.shutdown()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_three_named_members_average_to_the_same_mean(bootstrap: Any) -> None:
    """Each member is the averaging child a worker starts (its own process, DHT peer and
    averagers); the whole group meets as named, without Hivemind's leader election."""
    group = Group(key="named-roster-test", members=(0, 1, 2), min_size=2, timeout_s=60.0,
                  peers=tuple(str(a) for a in bootstrap.get_visible_maddrs()))  # fmt: skip
    rng = np.random.default_rng(5)
    vectors = [rng.normal(size=64).astype(np.float32) for _ in range(3)]
    joined = [averaging.join(group, shard=shard, reachability_setting="public")
              for shard in range(3)]  # fmt: skip

    def member(shard: int) -> averaging.Averaged:
        return joined[shard].average(vectors[shard], shard=shard, holds_state=shard == 0)

    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(member, range(3)))
    means = [outcome.values for outcome in outcomes]
    assert all(mean is not None for mean in means), [outcome.reason for outcome in outcomes]
    # The first attempt: all three, as named. Every member reads back the same bytes,
    # the mean to the fixed point's rounding.
    assert [outcome.attempt for outcome in outcomes] == [1, 1, 1]
    assert all(np.array_equal(means[0], mean) for mean in means[1:])
    np.testing.assert_allclose(means[0], np.mean(vectors, axis=0), atol=1e-4)
    assert all(o.members == {0: True, 1: False, 2: False} for o in outcomes)
    # The meeting in the DHT alone, then the data step's group from its roster, each
    # member's entry with the addresses the others dialled.
    met = bootstrap.get(f"{group.key}-meet", latest=True)
    assert met is not None and set(met.value) == {0, 1, 2}
    found = bootstrap.get(f"{group.key}-data-roster", latest=True)
    assert found is not None and set(found.value) == {0, 1, 2}
    assert set(roster.addresses(found)) == {0, 1, 2}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_named_member_that_never_comes_is_named_in_the_reason(bootstrap: Any) -> None:
    group = Group(key="named-roster-missing", members=(0, 1, 2), min_size=3, timeout_s=8.0,
                  peers=tuple(str(a) for a in bootstrap.get_visible_maddrs()))  # fmt: skip
    joined = [averaging.join(group, shard=shard, reachability_setting="public")
              for shard in (0, 1)]  # fmt: skip
    vector = np.ones(8, np.float32)
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(
            lambda shard: joined[shard].average(vector, shard=shard, holds_state=True), (0, 1)
        ))  # fmt: skip
    for outcome in outcomes:
        assert outcome.values is None
        assert "did not meet in 8 s: members [2] never came" in outcome.reason, outcome.reason
