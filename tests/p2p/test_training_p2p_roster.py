"""Where members meet before they all-reduce (p2p/roster.py): the rules of the first
attempt's and the retry's meetings over a DHT in memory, and three real averagers."""

from __future__ import annotations

import time
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


class FakeDHT:
    """The DHT's store and read of subkeyed entries, in memory; `arrive`: entries that
    other members write once this one has read the meeting `after` times."""

    def __init__(self, arrive: dict[int, list[tuple[int, Any]]] | None = None) -> None:
        self.entries: dict[str, dict[Any, Any]] = {}
        self.reads = 0
        self.arrive = arrive or {}

    def store(self, key: str, value: Any, expiration: float, *, subkey: Any) -> bool:
        self.entries.setdefault(key, {})[subkey] = value
        return True

    def get(self, key: str, *, latest: bool) -> Found | None:
        self.reads += 1
        for sub, value in self.arrive.pop(self.reads, []):
            self.entries.setdefault(key, {})[sub] = value
        return _found(self.entries[key]) if key in self.entries else None


def entry(shard: int, blamed: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"shard": shard, "peer": f"peer{shard}", "blamed": list(blamed)}


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roster, "POLL_S", 0.01)
    monkeypatch.setattr(roster, "QUIET_S", 0.2)


def test_the_first_attempt_meets_when_every_named_member_wrote(quick: None) -> None:
    dht = FakeDHT({3: [(1, entry(1))], 5: [(2, entry(2)), (9, entry(9))]})
    found, reason, missing = roster.meet(dht, "k", (0, 1, 2), 0, entry(0), 5.0)
    assert reason == "" and missing == []
    assert [e["shard"] for e in found or []] == [0, 1, 2]  # a stranger's entry left out


def test_a_named_member_that_never_writes_is_named(quick: None) -> None:
    dht = FakeDHT({2: [(1, entry(1))]})
    found, reason, missing = roster.meet(dht, "k", (0, 1, 2), 0, entry(0), 0.3)
    assert found is None and missing == [2] and "members [2] never came" in reason


def test_a_retry_forms_of_every_member_left_at_once(quick: None) -> None:
    # The first attempt blamed member 3 (dead); the others wrote: no quiet wait needed.
    dht = FakeDHT({2: [(1, entry(1, (3,))), (2, entry(2, (3,)))]})
    started = time.monotonic()
    found, reason = roster.gather(dht, "k", (0, 1, 2), 0, entry(0, (3,)), 2, 5.0)
    assert reason == "" and sorted(found or {}) == [0, 1, 2]
    assert time.monotonic() - started < roster.QUIET_S


def test_a_retry_goes_on_without_a_silent_member_after_a_quiet_spell(quick: None) -> None:
    dht = FakeDHT({2: [(1, entry(1))]})
    found, reason = roster.gather(dht, "k", (0, 1, 2), 0, entry(0), 2, 5.0)
    assert reason == "" and sorted(found or {}) == [0, 1]
    # Fewer than min_size: no group, and why.
    found, reason = roster.gather(FakeDHT(), "k2", (0, 1, 2), 0, entry(0), 2, 0.5)
    assert found is None and "no retry group of 2+" in reason


def test_a_member_blamed_by_another_is_left_out_of_the_retry(quick: None) -> None:
    # Member 1 says member 2's part did not decode: 0 and 1 go on without it; 2 learns it.
    def blaming() -> FakeDHT:
        return FakeDHT({2: [(1, entry(1, (2,)))]})

    found, _ = roster.gather(blaming(), "k", (0, 1, 2), 0, entry(0), 2, 5.0)
    assert sorted(found or {}) == [0, 1]
    found, reason = roster.gather(blaming(), "k", (0, 1, 2), 2, entry(2), 2, 5.0)
    assert found is None and "left out" in reason


def test_own_addresses_drop_the_peer_id() -> None:
    assert roster.own_addresses(["/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo", "/ip6/::1/tcp/5"]) == [
        "/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/5"
    ]  # fmt: skip


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Any]:
    """A DHT peer in this process, as the coordinator runs one: the members' way in."""
    require_p2p("a named group needs Hivemind's DHT")
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield dht
    finally:
        averaging.REGISTRY.close()  # the standing averagers of this process's members
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
    # The first attempt: all three, as named. Every member reads back the same bytes.
    assert [outcome.attempt for outcome in outcomes] == [1, 1, 1]
    assert all(np.array_equal(means[0], mean) for mean in means[1:])
    np.testing.assert_allclose(means[0], np.mean(vectors, axis=0), atol=1e-6)
    assert all(o.members == {0: True, 1: False, 2: False} for o in outcomes)
    # The meeting in the DHT, each member's entry with the addresses the others dialled.
    met = bootstrap.get(f"{group.key}-meet", latest=True)
    assert met is not None and set(met.value) == {0, 1, 2}
    assert all(entry.value["addrs"] and entry.value["peer"] for entry in met.value.values())
    assert all(o.wire_bytes > 0 for o in outcomes)
    for handle in joined:
        handle.close()


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
    for handle in joined:
        handle.close()
    for outcome in outcomes:
        assert outcome.values is None
        assert "did not meet in 8 s: members [2] never came" in outcome.reason, outcome.reason
