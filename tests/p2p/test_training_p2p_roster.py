"""Where members meet before they all-reduce (p2p/roster.py) and how the coordinator
names a retry group (p2p/namer.py): the rules of the first attempt's and the retry's
meetings over a DHT in memory, and three real averagers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import require_p2p

from idlegrid.p2p import averaging, namer, roster
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
    """The DHT's store and read of plain and subkeyed entries, in memory; `arrive`:
    entries that other members write once the meeting was read `after` times."""

    def __init__(self, arrive: dict[int, list[tuple[int, Any]]] | None = None) -> None:
        self.entries: dict[str, dict[Any, Any]] = {}
        self.plain: dict[str, Any] = {}
        self.reads = 0
        self.arrive = arrive or {}
        self.lock = threading.Lock()  # the namer reads and writes from its own thread

    def store(self, key: str, value: Any, expiration: float, *, subkey: Any = None) -> bool:
        with self.lock:
            if subkey is None:
                self.plain[key] = value
            else:
                self.entries.setdefault(key, {})[subkey] = value
        return True

    def get(self, key: str, *, latest: bool) -> Found | None:
        with self.lock:
            if key in self.plain:
                return Found(self.plain[key])
            self.reads += 1
            for sub, value in self.arrive.pop(self.reads, []):
                self.entries.setdefault(key, {})[sub] = value
            return _found(dict(self.entries[key])) if key in self.entries else None


def entry(shard: int, blamed: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"shard": shard, "peer": f"peer{shard}", "blamed": list(blamed)}


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roster, "POLL_S", 0.01)
    monkeypatch.setattr(namer, "QUIET_S", 0.2)
    monkeypatch.setattr(namer, "POLL_S", 0.01)


def test_the_first_attempt_meets_when_every_named_member_wrote(quick: None) -> None:
    dht = FakeDHT({3: [(1, entry(1))], 5: [(2, entry(2)), (9, entry(9))]})
    found, reason, missing = roster.meet(dht, "k", (0, 1, 2), 0, entry(0), 5.0)
    assert reason == "" and missing == []
    assert [e["shard"] for e in found or []] == [0, 1, 2]  # a stranger's entry left out


def test_a_named_member_that_never_writes_is_named(quick: None) -> None:
    dht = FakeDHT({2: [(1, entry(1))]})
    found, reason, missing = roster.meet(dht, "k", (0, 1, 2), 0, entry(0), 0.3)
    assert found is None and missing == [2] and "members [2] never came" in reason


@pytest.fixture
def named(quick: None) -> Iterator[FakeDHT]:
    """A DHT in memory with the coordinator's namer passing over it in a thread."""
    dht = FakeDHT()
    done = threading.Event()
    thread = threading.Thread(target=namer.Namer(dht).run, args=(done.is_set,), daemon=True)
    thread.start()
    yield dht
    done.set()
    thread.join(5)


def others(dht: FakeDHT, key: str, *entries: dict[str, Any]) -> None:
    for found in entries:
        dht.store(f"{key}-meet", found, 0.0, subkey=found["shard"])


def test_the_coordinator_names_every_member_left_at_once(named: FakeDHT) -> None:
    # The first attempt blamed member 3 (dead); the others wrote: no quiet wait needed.
    others(named, "k", entry(1, (3,)), entry(2, (3,)))
    started = time.monotonic()
    found, reason = roster.gather(named, "k", (0, 1, 2), 0, entry(0, (3,)), 2, 5.0)
    assert reason == "" and sorted(found or {}) == [0, 1, 2]
    assert (found or {})[1] == entry(1, (3,))  # the entries the namer read, by shard
    assert time.monotonic() - started < namer.QUIET_S


def test_the_coordinator_names_those_present_after_a_quiet_spell(named: FakeDHT) -> None:
    others(named, "k", entry(1))
    started = time.monotonic()
    found, reason = roster.gather(named, "k", (0, 1, 2), 0, entry(0), 2, 5.0)
    assert reason == "" and sorted(found or {}) == [0, 1]
    assert time.monotonic() - started >= namer.QUIET_S


def test_fewer_than_the_minimum_left_fall_back_at_once_and_say_why(named: FakeDHT) -> None:
    others(named, "k", entry(1, (2,)))  # member 1 blames 2: two left of a minimum of three
    started = time.monotonic()
    found, reason = roster.gather(named, "k", (0, 1, 2), 0, entry(0), 3, 5.0)
    assert found is None and time.monotonic() - started < 2.0
    assert "named no retry group under k: 2 member(s) left [0, 1], fewer than the job's " \
           "minimum 3" in reason  # fmt: skip


def test_a_member_blamed_by_another_is_left_out_of_the_retry(named: FakeDHT) -> None:
    # Member 1 says member 2's part did not decode: 0 and 1 go on without it; 2 learns it.
    others(named, "k", entry(1, (2,)), entry(0))
    found, reason = roster.gather(named, "k", (0, 1, 2), 2, entry(2), 2, 5.0)
    assert found is None and "left out of the retry group named under k" in reason
    found, reason = roster.gather(named, "k", (0, 1, 2), 0, entry(0), 2, 5.0)
    assert reason == "" and sorted(found or {}) == [0, 1]


def test_without_the_coordinators_namer_the_retry_waits_out_its_timeout(quick: None) -> None:
    dht = FakeDHT()
    others(dht, "k", entry(1), entry(2))
    found, reason = roster.gather(dht, "k", (0, 1, 2), 0, entry(0), 2, 0.3)
    assert found is None and "named no retry group under k in 0.3 s" in reason
    # It asked: the request is there for a namer to read.
    assert namer.Request.from_json(dht.entries[namer.REQUESTS]["k"]) == namer.Request(
        (0, 1, 2), 2, 0.3, "k"
    )


@pytest.mark.parametrize(
    ("present", "candidates", "min_size", "quiet_for_s", "expected"),
    [
        ({0: (), 1: (), 2: ()}, (0, 1, 2), 2, 0.0, (0, 1, 2)),  # everyone: at once
        ({0: (), 1: ()}, (0, 1, 2), 2, 0.0, None),  # one missing: too early
        ({0: (), 1: ()}, (0, 1, 2), 2, 3.0, (0, 1)),  # ... until a quiet spell
        ({0: ()}, (0, 1, 2), 2, 60.0, None),  # under the minimum: never by quiet
        ({0: (), 1: (2,)}, (0, 1, 2), 2, 0.0, (0, 1)),  # 2 blamed: everyone left, at once
        ({0: (), 1: (2,), 2: ()}, (0, 1, 2), 2, 0.0, (0, 1)),  # blamed though present
        ({0: (), 1: (0,)}, (0, 1), 2, 0.0, "1 member(s) left [1], fewer than the job's minimum 2"),
        ({0: (), 1: (), 7: ()}, (0, 1), 2, 0.0, (0, 1)),  # a stranger is not a member
    ],
)
def test_the_retry_rule(
    present: dict[int, tuple[int, ...]], candidates: tuple[int, ...], min_size: int,
    quiet_for_s: float, expected: object,
) -> None:  # fmt: skip
    entries = {shard: entry(shard, blamed) for shard, blamed in present.items()}
    assert namer.decide(entries, candidates, min_size, quiet_for_s) == expected


@pytest.mark.parametrize(
    "raw",
    [None, "k", {"candidates": [0, 1], "min_size": 3, "timeout_s": 5},
     {"candidates": [], "min_size": 1, "timeout_s": 5},
     {"candidates": [0, 1], "min_size": 2, "timeout_s": -1},
     {"candidates": ["x"], "min_size": 1, "timeout_s": 5},
     {"candidates": list(range(65)), "min_size": 2, "timeout_s": 5}],
)  # fmt: skip
def test_a_malformed_request_is_not_named(quick: None, raw: object) -> None:
    dht = FakeDHT()
    dht.store(namer.REQUESTS, raw, 0.0, subkey="k")
    others(dht, "k", entry(0), entry(1))
    assert namer.Namer(dht).step() == [] and "k-named" not in dht.plain


def test_a_decision_that_does_not_match_its_entries_is_not_read() -> None:
    good = namer.Decision((0, 1), "", (entry(0), entry(1)))
    assert namer.Decision.from_json(good.to_json()) == good
    assert namer.Decision.from_json({**good.to_json(), "members": [0, 2]}) is None
    assert namer.Decision.from_json({"members": "x"}) is None


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
    done = threading.Event()
    names = threading.Thread(target=namer.Namer(dht).run, args=(done.is_set,), daemon=True)
    names.start()  # it names retry groups, as the coordinator's peer does
    try:
        yield dht
    finally:
        done.set()
        names.join(5)
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
