"""verification.replication: how many replicas a shard still needs, what decided results earn."""

from __future__ import annotations

import pytest

from idlegrid.verification.replication import ShardCounts, Shortfall, decision_verdicts, shortfall


def _shard(
    *,
    target: int = 3,
    quorum: int = 2,
    live: int = 0,
    results: int = 0,
    attempts: int = 0,
    max_attempts: int = 10,
) -> ShardCounts:
    return ShardCounts(target, quorum, live, results, attempts, max_attempts)


SHORTFALL = [
    # (shard, expected, why)
    (_shard(), Shortfall(3, False), "a new shard gets its target"),
    (_shard(live=1, attempts=1), Shortfall(2, False), "one task out: two more"),
    (_shard(live=2, results=1, attempts=3), Shortfall(0, False), "all pending: nothing"),
    (_shard(live=1, results=2, attempts=3), Shortfall(0, False), "the last one still runs"),
    (_shard(results=3, attempts=3), Shortfall(1, False), "all in, no decision: one more"),
    (_shard(results=4, target=4, attempts=4), Shortfall(1, False), "raised target, undecided"),
    (_shard(results=1, quorum=2, attempts=3), Shortfall(2, False), "two failed: replace them"),
    (_shard(attempts=10), Shortfall(0, True), "nothing pending and out of attempts: fail"),
    (_shard(results=3, attempts=10), Shortfall(0, True), "undecided and out of attempts: fail"),
    (_shard(live=1, attempts=10), Shortfall(0, False), "out of attempts, one still runs"),
    (_shard(results=1, attempts=10), Shortfall(0, True), "out of attempts, short of a quorum"),
    (_shard(results=2, attempts=10), Shortfall(0, False), "out of attempts, a quorum may agree"),
    (_shard(attempts=9), Shortfall(1, False), "within attempts: as many as are left"),
    (_shard(target=1, quorum=1), Shortfall(1, False), "replication 1"),
    (_shard(target=1, quorum=1, results=1, attempts=1), Shortfall(0, False), "quorum 1: decided"),
]


@pytest.mark.parametrize(("shard", "expected", "why"), SHORTFALL, ids=[w for *_, w in SHORTFALL])
def test_shortfall(shard: ShardCounts, expected: Shortfall, why: str) -> None:
    assert shortfall(shard) == expected, why


VERDICTS = [
    ([7, 8], [9], [(7, "valid"), (8, "valid"), (9, "invalid")], "agreement checks both"),
    ([7], [], [(7, "unchecked")], "a lone result is not checked"),
    ([7], [8, 9], [(7, "unchecked"), (8, "invalid"), (9, "invalid")], "outvoted dissenters"),
    ([], [8], [(8, "invalid")], "a failed shard's invalid results"),
    ([], [], [], "nothing to judge"),
]


@pytest.mark.parametrize(("valid", "invalid", "expected", "why"), VERDICTS)
def test_decision_verdicts(
    valid: list[int], invalid: list[int], expected: list[tuple[int, str]], why: str
) -> None:
    assert decision_verdicts(valid, invalid) == expected, why
