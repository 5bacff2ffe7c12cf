"""A round's records in the open DHT are sealed with the round's secret (p2p/seal.py):
members and the coordinator's namer read only records sealed for their place, so a
stranger can neither join a meeting as a member nor name a retry group."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_training_p2p_roster import FakeDHT, entry, quick  # noqa: F401 (a fixture)

from idlegrid.kinds.base import Swarm
from idlegrid.p2p import namer, roster, seal
from idlegrid.p2p.group import Group, GroupError

KEY = bytes(range(32))
SECRET = seal.round_secret(KEY, "k")


def test_a_seal_holds_for_its_record_and_place_only() -> None:
    record = {"shard": 1, "peer": "peer1", "blamed": []}
    sealed = seal.seal(record, SECRET, "k-meet/1")
    assert seal.opened(sealed, SECRET, "k-meet/1") == record
    assert seal.opened(sealed, SECRET, "k-meet/2") is None  # moved to another shard
    assert seal.opened({**sealed, "peer": "peerX"}, SECRET, "k-meet/1") is None  # changed
    assert seal.opened(record, SECRET, "k-meet/1") is None  # not sealed
    assert seal.opened(sealed, seal.round_secret(KEY, "other"), "k-meet/1") is None
    assert seal.opened({**sealed, "mac": 7}, SECRET, "k-meet/1") is None
    assert seal.opened("x", SECRET, "k-meet/1") is None
    assert seal.opened(sealed, "", "k-meet/1") == record  # no secret: taken as it is
    assert seal.round_secret(b"", "k") == "" and seal.seal(record, "", "w") == record


def test_round_secrets_differ_by_round_and_by_key() -> None:
    assert len(SECRET) == 64 and seal.round_secret(KEY, "k") == SECRET
    assert seal.round_secret(KEY, "k2") != SECRET
    assert seal.round_secret(bytes(32), "k") != SECRET


def test_the_coordinators_key_is_made_once_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "data" / "p2p-round.key"
    key = seal.load_key(path)
    assert len(key) == seal.KEY_BYTES and path.stat().st_mode & 0o777 == 0o600
    assert seal.load_key(path) == key  # a restart keeps it
    path.write_bytes(b"short")
    assert len(seal.load_key(path)) == seal.KEY_BYTES


def test_a_group_carries_its_secret_to_its_members_and_not_into_logs() -> None:
    group = Group("k", (0, 1), 2, 5.0, ("/ip4/127.0.0.1/tcp/1",), secret=SECRET)
    assert Group.from_json(group.to_json()) == group
    assert SECRET not in repr(group)
    assert "secret" not in Group("k", (0, 1), 2, 5.0, ("/ip4/1.2.3.4/tcp/1",)).to_json()
    with pytest.raises(GroupError, match="secret"):
        Group("k", (0, 1), 2, 5.0, ("/ip4/127.0.0.1/tcp/1",), secret="not hex")


def sealed(meeting: str, shard: int, record: dict[str, Any], secret: str = SECRET) -> Any:
    return seal.seal(record, secret, f"{meeting}/{shard}")


def test_a_strangers_entry_under_a_members_shard_is_not_read(quick: None) -> None:  # noqa: F811
    forged = {"shard": 1, "peer": "peerX", "blamed": []}
    dht = FakeDHT({
        2: [(1, forged), (2, sealed("k-meet", 2, entry(2)))],
        4: [(1, sealed("k-meet", 1, forged, seal.round_secret(KEY, "elsewhere")))],
        6: [(1, sealed("k-meet", 1, entry(1)))],
    })  # fmt: skip
    found, reason, _ = roster.meet(dht, "k", (0, 1, 2), 0, entry(0), 5.0, SECRET)
    assert reason == "" and [e["peer"] for e in found or []] == ["peer0", "peer1", "peer2"]
    assert dht.reads >= 6  # it waited for member 1's own entry


def test_the_namer_reads_sealed_requests_and_seals_its_decision(quick: None) -> None:  # noqa: F811
    dht = FakeDHT()
    for shard in (1, 2):
        dht.store("k-retry-meet", sealed("k-retry-meet", shard, entry(shard)), 0.0, subkey=shard)
    dht.store("k-retry-meet", {"shard": 3, "peer": "peerX", "blamed": []}, 0.0, subkey=3)
    done = threading.Event()
    names = threading.Thread(target=namer.Namer(dht, KEY).run, args=(done.is_set,), daemon=True)
    names.start()
    try:
        found, reason = roster.gather(dht, "k-retry", (0, 1, 2, 3), 0, entry(0), 3, 5.0,
                                      SECRET, "k")  # fmt: skip
    finally:
        done.set()
        names.join()
    assert reason == "" and sorted(found or {}) == [0, 1, 2]  # the stranger's 3 not named
    decision = dht.plain["k-retry-named"]
    assert seal.opened(decision, SECRET, "k-retry-named") is not None


def test_a_member_takes_no_decision_the_coordinator_did_not_seal(quick: None) -> None:  # noqa: F811
    dht = FakeDHT()
    forged = namer.Decision((0, 9), "", (entry(0), {"shard": 9, "peer": "peerX"}))
    dht.store("k-retry-named", forged.to_json(), 0.0)
    found, reason = roster.gather(dht, "k-retry", (0, 1, 2), 0, entry(0), 2, 0.3, SECRET, "k")
    assert found is None and "named no retry group" in reason


def test_the_namer_leaves_forged_and_misplaced_requests_alone(quick: None) -> None:  # noqa: F811
    dht = FakeDHT()
    asked = namer.Request((0, 1), 2, 5.0, "k").to_json()
    dht.store(namer.REQUESTS, asked, 0.0, subkey="k-retry")  # not sealed
    other = namer.Request((0, 1), 2, 5.0, "j").to_json()  # sealed for "j", asks about "k"
    dht.store(namer.REQUESTS, seal.seal(other, seal.round_secret(KEY, "j"),
                                        f"{namer.REQUESTS}/k-x"), 0.0, subkey="k-x")  # fmt: skip
    for shard in (0, 1):
        dht.store("k-retry-meet", sealed("k-retry-meet", shard, entry(shard)), 0.0, subkey=shard)
    assert namer.Namer(dht, KEY).step() == []
    assert not any(key.endswith("-named") for key in dht.plain)


def test_a_rounds_group_carries_the_secret_of_the_coordinators_key() -> None:
    import hashlib

    from idlegrid.kinds.diloco import tasks
    from idlegrid.kinds.diloco.dataset import corpus_dataset_blob
    from idlegrid.kinds.diloco.params import DilocoParams
    from idlegrid.kinds.diloco.rounds import DilocoRounds

    params = DilocoParams.model_validate({
        "model": {"width": 16, "layers": 1, "heads": 2, "context": 16},
        "inner": {"steps": 1, "batch_size": 2, "seq_len": 16}, "workers": 2, "rounds": 1,
        "averaging": "p2p", "pool": {"accounts": ["lab"]},
    })  # fmt: skip
    swarm = Swarm(1, ("/ip4/127.0.0.1/tcp/1",), KEY)
    job = DilocoRounds().job(params, {"dataset": corpus_dataset_blob()}, swarm=swarm)
    start = job.initial()
    specs = job.first_shards(start, keyframe=hashlib.sha256(start.checkpoint).hexdigest())
    groups = {tasks.decode_task(s.payload).group for s in specs} - {None}
    assert [g.secret == seal.round_secret(KEY, g.key) != "" for g in groups] == [True]
