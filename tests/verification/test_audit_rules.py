"""verification.audit: which of a job's lone shards are spot-checked before it completes.

Tables, no store: per node, its latest shard decided alone whose result no check has
vouched for (unpaid); the store's side is in tests/store/test_exactly_once.py and
tests/verification/test_verification.py.
"""

from __future__ import annotations

import pytest

from idlegrid.verification.audit import DecidedAlone, to_audit


def decided(
    shard_id: int, *, node: int | None = 1, finished_at: float | None = 100.0, paid: bool = False
) -> DecidedAlone:
    return DecidedAlone(shard_id=shard_id, node_id=node, finished_at=finished_at, paid=paid)


@pytest.mark.parametrize(
    ("shards", "audited", "why"),
    [
        ([], [], "nothing decided alone"),
        ([decided(1)], [1], "one unpaid lone result"),
        ([decided(1, paid=True)], [], "vouched for (paid) already"),
        ([decided(1, finished_at=100.0), decided(2, finished_at=200.0)], [2], "the latest"),
        ([decided(1, finished_at=200.0), decided(2, finished_at=100.0)], [1], "by time, not id"),
        ([decided(3), decided(2)], [2], "finished at once: the earliest shard"),
        (
            [decided(1, finished_at=100.0), decided(2, finished_at=200.0, paid=True)],
            [1],
            "a paid later one is no reason to skip the unpaid",
        ),
        ([decided(1, node=1), decided(2, node=2)], [1, 2], "one per node"),
        ([decided(5, node=2), decided(4, node=1)], [4, 5], "sorted"),
        ([decided(1, finished_at=None), decided(2, finished_at=100.0)], [2], "finished first"),
        ([decided(3, finished_at=None), decided(2, finished_at=None)], [2], "none finished"),
        ([decided(1, node=None), decided(2, node=None)], [1], "no node: one group"),
    ],
)
def test_each_nodes_latest_unvouched_lone_shard_is_audited(
    shards: list[DecidedAlone], audited: list[int], why: str
) -> None:
    assert to_audit(shards) == audited, why
