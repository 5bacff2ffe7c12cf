"""Quorum over the results of one shard. Pure: it gets outputs and a compare function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from idlegrid.kinds.base import Verdict


@dataclass(frozen=True)
class Decision:
    canonical: int | None
    valid: tuple[int, ...]
    invalid: tuple[int, ...]
    fail_reason: str | None = None


def decide(
    results: Sequence[tuple[int, bytes]],
    compare: Callable[[bytes, bytes], Verdict],
    *,
    min_quorum: int,
) -> Decision:
    """Pick a canonical result once `min_quorum` results agree.

    `results` are (task_id, output) in arrival order. The largest group of results that
    agree with one representative wins if it reaches the quorum; its earliest member is
    canonical, the ones that disagree with it are invalid, inconclusive ones are neither.
    """
    if min_quorum < 1:
        raise ValueError("min_quorum must be at least 1")
    best: list[int] = []
    for i, (_, output) in enumerate(results):
        group = [i] + [
            j
            for j, (_, other) in enumerate(results)
            if j != i and compare(output, other) == Verdict.AGREE
        ]
        if len(group) > len(best):
            best = sorted(group)
    if len(best) < min_quorum:
        return Decision(canonical=None, valid=(), invalid=())
    canonical_output = results[best[0]][1]
    invalid = tuple(
        task_id
        for j, (task_id, output) in enumerate(results)
        if j not in best and compare(canonical_output, output) == Verdict.DISAGREE
    )
    return Decision(
        canonical=results[best[0]][0],
        valid=tuple(results[j][0] for j in best),
        invalid=invalid,
    )
