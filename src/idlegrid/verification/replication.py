"""How many replicas a shard still needs, and what a decided shard's results earn.

Pure functions of counts the store reads; the store applies their answers in the same
transaction as its reads. BOINC's transitioner and validator make these two decisions:
when a workunit is short of results it creates more, up to its error limit; when a quorum
is reached the agreeing results are valid and the rest invalid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# What the verifier's outcome means for a result's node (its trust and its credit):
# valid (agreed with another node's result), unchecked (accepted alone, no second
# opinion), invalid (disagreed with the canonical result), error (failed or expired).
# "held": a valid check that passed an output, counted for trust, paid once a known-answer
# check confirms its node's word; "answered": a known-answer check answered right.
ResultVerdict = Literal["valid", "unchecked", "invalid", "error", "held", "answered"]


@dataclass(frozen=True)
class ShardCounts:
    """What one open shard has and may still have."""

    target: int  # results it asks for before the verifier decides
    quorum: int  # agreeing results that make one canonical
    live: int  # tasks ready or held by a node
    results: int  # completed results not found invalid
    attempts: int  # tasks made for it so far
    max_attempts: int  # tasks it may ever have

    @property
    def pending(self) -> int:
        """Results it has or may still get from the tasks it has."""
        return self.live + self.results


@dataclass(frozen=True)
class Shortfall:
    new_tasks: int  # tasks to create now
    exhausted: bool  # out of attempts with nothing that could still decide it: fail it


def undecided(shard: ShardCounts) -> bool:
    """All the results it asked for are in, nothing is live, and still no decision.

    They disagree, or agree without enough credibility. Such a shard needs one more
    result (BOINC raises such a workunit's target), or it would wait forever. A quorum
    of 1 is decided by any result at once (the grid raises its target itself when a lone
    result is not enough), so counting it here would race the verifier.
    """
    return (
        shard.quorum > 1
        and shard.results >= shard.quorum
        and shard.results >= shard.target
        and shard.live == 0
    )


def shortfall(shard: ShardCounts) -> Shortfall:
    """The tasks an open shard needs now, within its attempts."""
    stuck = undecided(shard)
    short = max(shard.target - shard.pending, 1 if stuck else 0)
    wanted = min(short, shard.max_attempts - shard.attempts)
    if wanted > 0:
        return Shortfall(new_tasks=wanted, exhausted=False)
    # Out of attempts. Nothing live and too few results for a quorum (none at all, or
    # fewer than the quorum) can never decide it; neither can an undecided one.
    cannot_decide = shard.live == 0 and (shard.results < shard.quorum or stuck)
    return Shortfall(new_tasks=0, exhausted=short > 0 and cannot_decide)


def decision_verdicts(
    valid: Sequence[int], invalid: Sequence[int]
) -> list[tuple[int, ResultVerdict]]:
    """The verdicts of a decided shard's results, by task id.

    A valid result that agreed with another node's passed a check; a lone one (a shard
    run alone, or decided by quorum 1) did not, and earns `unchecked`.
    """
    checked: ResultVerdict = "valid" if len(valid) > 1 else "unchecked"
    return [(task, checked) for task in valid] + [(task, "invalid") for task in invalid]
