"""Collusion: accounts whose nodes are wrong together, the same way, are flagged.

Independent cheaters return different wrong answers; the same wrong answer from nodes
of several accounts was arranged. The quorum names such groups in a decided shard
(`Decision.colluding`); each pair of their accounts is counted over every shard where
both were found wrong, and a pair at `TrustSettings.collusion_flag_after` or more is
flagged (a flagged account registers no new nodes; an admin sees the reason). Pure: the
store reads the accounts and counts, and writes the flags.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence


def account_pairs(
    groups: Sequence[Sequence[int]], account_of: Mapping[int, int | None]
) -> list[tuple[int, int]]:
    """The pairs of distinct accounts whose results were wrong together, sorted."""
    pairs = {
        (min(first, second), max(first, second))
        for group in groups
        for first, second in itertools.combinations(
            {account_of[t] for t in group if account_of.get(t) is not None}, 2
        )
        if first is not None and second is not None
    }
    return sorted(pairs)


def colluding(wrong_together: int, *, flag_after: int) -> bool:
    """Whether two accounts wrong together in this many shards are colluders (honest
    nodes are almost never outvoted at all, let alone together)."""
    return wrong_together >= flag_after


def flag_reason(partner: int, wrong_together: int) -> str:
    """What an admin reads on an account flagged as a colluder."""
    return (
        f"its nodes and those of account {partner} returned the same wrong "
        f"results in {wrong_together} shards (collusion)"
    )
