"""verification.stalemate: a shard no node can add a result to. Tables, no store.

Which nodes may still take a replica, and the rule that decides (or fails) a shard when
none may: a strict majority of at least two, against at most one untrusted dissenter.
"""

from __future__ import annotations

import pytest

from idlegrid.kinds.base import Verdict
from idlegrid.verification import judging, stalemate
from idlegrid.verification.stalemate import Member, Replica
from idlegrid.verification.trust import Trust, TrustSettings

SETTINGS = TrustSettings()
NEW = Trust()
TRUSTED = Trust(consecutive_valid=SETTINGS.adaptive_after, valid_total=SETTINGS.adaptive_after)
SUSPENDED = Trust(suspended=True, invalid_total=3, recent_invalid=3)


def same(a: bytes, b: bytes) -> Verdict:
    if b"?" in a or b"?" in b:
        return Verdict.INCONCLUSIVE
    return Verdict.AGREE if a == b else Verdict.DISAGREE


def votes(*cast: bytes | tuple[bytes, Trust]) -> list[judging.Vote]:
    out = []
    for task, vote in enumerate(cast, 1):
        output, trust = vote if isinstance(vote, tuple) else (vote, NEW)
        out.append(judging.Vote(task, output, trust))
    return out


def settle(*cast: bytes | tuple[bytes, Trust], min_quorum: int = 2) -> stalemate.quorum.Decision:
    found = votes(*cast)
    node_of = {v.task_id: 10 + v.task_id for v in found}
    return stalemate.settle(found, same, SETTINGS, min_quorum=min_quorum, node_of=node_of)


@pytest.mark.parametrize(
    ("cast", "canonical", "valid", "invalid"),
    [
        ((b"a", b"a", b"a", b"x"), 1, (1, 2, 3), (4,)),  # 3 against 1: 4 nodes, 1 liar
        ((b"x", b"a", b"a"), 2, (2, 3), (1,)),  # 2 against 1: 3 nodes, 1 liar (first)
        ((b"a", b"a"), 1, (1, 2), ()),  # two agree, the third node is suspended
        ((b"a", b"a", (b"x", SUSPENDED)), 1, (1, 2), (3,)),  # a suspended node's dissent
        ((b"a", b"a", b"a?"), 1, (1, 2), ()),  # inconclusive: neither
    ],
)
def test_a_majority_against_one_untrusted_dissenter_decides(
    cast: tuple[bytes | tuple[bytes, Trust], ...],
    canonical: int,
    valid: tuple[int, ...],
    invalid: tuple[int, ...],
) -> None:
    decision = settle(*cast)
    assert (decision.canonical, decision.valid, decision.invalid) == (canonical, valid, invalid)
    assert decision.fail_reason is None


@pytest.mark.parametrize(
    ("cast", "why"),
    [
        ((b"a", b"x"), "(1 against 1)"),  # no majority
        ((b"a", b"x", b"y"), "(1 against 1 against 1)"),  # three answers
        ((b"a", b"a", b"x", b"y"), "(2 against 1 against 1)"),  # two dissenters
        ((b"a", b"a", (b"x", TRUSTED)), "(2 against 1)"),  # a trusted node outvoted
        ((b"a",), "it has only one result"),  # one result is no quorum
        (((b"a", SUSPENDED), (b"a", SUSPENDED)), "(no result of a node in standing)"),
    ],
)
def test_anything_else_fails_the_shard_naming_its_split_and_nodes(
    cast: tuple[bytes | tuple[bytes, Trust], ...], why: str
) -> None:
    decision = settle(*cast)
    assert decision.canonical is None and decision.valid == () and decision.invalid == ()
    assert decision.fail_reason is not None
    assert why in decision.fail_reason
    nodes = ", ".join(str(10 + task) for task in range(1, len(cast) + 1))
    assert f"ran it: nodes {nodes}" in decision.fail_reason


def test_a_larger_job_quorum_is_needed_too() -> None:
    assert settle(b"a", b"a", b"x", min_quorum=3).fail_reason is not None


A, B = Member(1, 100, "n1"), Member(2, 200, "n2")
C, D = Member(3, 300, "n3"), Member(4, 300, "n4")


@pytest.mark.parametrize(
    ("replicas", "accounts", "networks", "eligible"),
    [
        ((), True, True, [1, 2, 3, 4]),
        ((Replica(A, ran=True), Replica(B, ran=True)), True, True, [3, 4]),
        # Node 3 ran it: node 4 shares its account.
        ((Replica(C, ran=True),), True, True, [1, 2]),
        ((Replica(C, ran=True),), False, True, [1, 2, 4]),
        # A replica that failed or expired bars its node only.
        ((Replica(C, ran=False),), True, True, [1, 2, 4]),
        ((Replica(Member(9, 900, "n1"), ran=True),), True, True, [2, 3, 4]),  # same network
        ((Replica(Member(9, 900, "n1"), ran=True),), True, False, [1, 2, 3, 4]),
    ],
)
def test_eligible_nodes_follow_the_replica_rules(
    replicas: tuple[Replica, ...], accounts: bool, networks: bool, eligible: list[int]
) -> None:
    found = stalemate.eligible([A, B, C, D], list(replicas), accounts=accounts, networks=networks)
    assert found == eligible


def test_a_shard_only_the_network_rule_holds_back_names_the_nodes_it_bars() -> None:
    lab = [Member(1, 100, "lab"), Member(2, 200, "lab"), Member(3, 300, "lab")]
    ran = [Replica(lab[0], ran=True)]
    assert stalemate.network_bound(lab, ran, accounts=True, networks=True) == [2, 3]
    assert stalemate.network_bound(lab, ran, accounts=True, networks=False) == []
    # Some node elsewhere may take it: the shard is not held back.
    away = [*lab, Member(4, 400, "home")]
    assert stalemate.network_bound(away, ran, accounts=True, networks=True) == []
    # Every node ran it: no setting lets the shard go on, so the stalemate rule applies.
    everyone = [Replica(m, ran=True) for m in lab]
    assert stalemate.network_bound(lab, everyone, accounts=True, networks=True) == []
    reason = stalemate.network_reason(4, [3, 2])
    assert reason.startswith("shard 4 waits for one more result from a node on another network")
    assert "nodes 2, 3" in reason and "--replica-networks shared" in reason


def test_a_waiting_shard_names_the_nodes_it_waits_for() -> None:
    assert stalemate.waiting_reason(7, [5, 3, 5]) == (
        "shard 7 waits for one more result, which only nodes 3, 5 can give "
        "(none of them is connected)"
    )


@pytest.mark.parametrize(
    ("assigned_at", "lease_deadline", "until"),
    [(100.0, 160.0, 220.0), (100.0, 100.0, 100.0), (None, 160.0, None), (100.0, None, None)],
)
def test_a_late_result_is_waited_for_one_more_lease(
    assigned_at: float | None, lease_deadline: float | None, until: float | None
) -> None:
    assert stalemate.late_until(assigned_at, lease_deadline) == until


def test_only_an_expired_replica_within_its_late_window_holds_the_shard() -> None:
    slow = Replica(C, ran=True, late_until=220.0)
    assert stalemate.awaits_late([Replica(A, ran=True), slow], now=219.0)
    assert not stalemate.awaits_late([Replica(A, ran=True), slow], now=220.0)
    assert not stalemate.awaits_late([Replica(A, ran=True), Replica(B, ran=False)], now=0.0)
