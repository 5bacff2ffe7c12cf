"""The rule that closes a peer-to-peer round from its members' reports, as a table; the
group and the exact mean that every member of a group reads back."""

from __future__ import annotations

import pytest

from idlegrid.kinds.diloco.agreement import Decision, Report, decide
from idlegrid.p2p.group import Group, GroupError, group_key, reporter


def p2p(shard: int, mean: str = "m", after: str = "w", published: bool = False) -> Report:
    return Report(shard, "p2p", mean, after, published)


def fell_back(shard: int) -> Report:
    return Report(shard, "fallback")


CASES = [
    # every member agrees: the group is the round's
    ([p2p(0, published=True), p2p(1), p2p(2), p2p(3)], Decision("p2p", (0, 1, 2, 3), 0, ())),
    # a member that joined late (no outer state: no next digest) still counts
    ([p2p(0, published=True), p2p(1, after="")], Decision("p2p", (0, 1), 0, ())),
    # a member whose next weights differ from the reporter's is left out
    ([p2p(0, published=True), p2p(1), p2p(2, after="x")], Decision("p2p", (0, 1), 0, (2,))),
    # a retry group of three; the fourth fell back and is left out
    ([p2p(0, published=True), p2p(1), p2p(2), fell_back(3)], Decision("p2p", (0, 1, 2), 0, (3,))),
    # more members fell back than averaged: coordinator mode on their own updates
    ([p2p(0, published=True), fell_back(1), fell_back(2)],
     Decision("coordinator", (1, 2), None, (0,))),
    # a group whose reporter never delivered does not count
    ([p2p(0), p2p(1), fell_back(2)], Decision("coordinator", (2,), None, (0, 1))),
    # two digests (one retry group a round: cannot happen, but decided all the same): the larger
    ([p2p(0, "a", published=True), p2p(1, "b", published=True), p2p(2, "b")],
     Decision("p2p", (1, 2), 1, (0,))),
    # nothing usable: the round closes empty
    ([p2p(0), p2p(1)], Decision("empty", (), None, (0, 1))),
    ([], Decision("empty", (), None, ())),
]  # fmt: skip


@pytest.mark.parametrize(("reports", "expected"), CASES)
def test_decide(reports: list[Report], expected: Decision) -> None:
    decided = decide(reports)
    assert (decided.mode, decided.taken, decided.reporter, decided.dropped) == (
        expected.mode, expected.taken, expected.reporter, expected.dropped,
    )  # fmt: skip
    assert bool(decided.reason) == (decided.mode != "p2p" or bool(decided.dropped))


def test_the_reporter_is_the_lowest_shard_holding_the_outer_state() -> None:
    assert reporter({3: True, 1: False, 2: True}) == 2
    assert reporter({0: False, 1: False}) is None


def test_group_keys_are_per_job_and_round_and_groups_are_checked() -> None:
    keys = {group_key(job, t, "job-7/x") for job in (1, 2) for t in (0, 1)}
    assert len(keys) == 4 and all("." not in key and "/" not in key for key in keys)
    good = Group("idlegrid-x-job1-round0", (0, 1, 2), 2, 10.0, ("/ip4/127.0.0.1/tcp/1",))
    assert Group.from_json(good.to_json()) == good
    for bad in ({"min_size": 4}, {"members": (0, 0)}, {"peers": ()}, {"key": "a.b"}):
        with pytest.raises(GroupError):
            Group(**{**good.__dict__, **bad})
