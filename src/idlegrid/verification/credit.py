"""Credit: granted for validated work only, priced from the kind's FLOP estimate.

One credit unit follows BOINC's cobblestone: a machine sustaining 1 GFLOPS for one day
earns 200. What a node claims about its work is never used: the coordinator prices a
shard from the kind's `cost_flops`, which it computed itself when splitting the job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

COBBLESTONES_PER_GFLOPS_DAY = 200.0
SECONDS_PER_DAY = 86_400.0
WEEK_S = 7 * SECONDS_PER_DAY


def credit_for(cost_flops: float) -> float:
    """Credit for one validated result of a shard estimated at `cost_flops`."""
    return max(0.0, cost_flops) / 1e9 / SECONDS_PER_DAY * COBBLESTONES_PER_GFLOPS_DAY


def late_result_paid(
    *,
    assigned_at: float | None,
    finished_at: float | None,
    lease_deadline: float | None,
    starts: Sequence[tuple[float, float]],
) -> bool:
    """Whether a valid result stored after its shard was decided is paid (the late rule).

    The work of a shard is paid with its decision, once per agreeing replica. A result
    that comes after that is paid too when its lateness was the coordinator's doing: a
    coordinator (re)started while the task was leased (`starts`: (started_at, grace_s) of
    each start), and the result came within the task's lease plus that start's grace.
    A volunteer cannot tell a restart of ours from a fault of theirs (BOINC pays a valid
    late result). Any other late result (a slow node, a backup copy that lost the race,
    a lease that ran out) is judged for trust and paid nothing: its shard's work was paid.
    """
    if assigned_at is None or finished_at is None or lease_deadline is None:
        return False
    return any(
        assigned_at < started <= finished_at and finished_at <= lease_deadline + grace_s
        for started, grace_s in starts
    )


@dataclass(frozen=True)
class CreditTotals:
    total: float = 0.0
    # Exponentially decayed sum of credit (half-life `half_life_s`) as of `updated_at`.
    decayed: float = 0.0
    updated_at: float = 0.0


def grant(
    totals: CreditTotals, amount: float, *, now: float, half_life_s: float = WEEK_S
) -> CreditTotals:
    """Add `amount` of credit at time `now`."""
    decayed = _decay(totals, now, half_life_s) + amount
    return CreditTotals(
        total=totals.total + amount, decayed=decayed, updated_at=max(now, totals.updated_at)
    )


def recent_average(totals: CreditTotals, *, now: float, half_life_s: float = WEEK_S) -> float:
    """Recent average credit per day (BOINC's RAC), with a one-week half-life.

    The decayed sum divided by the mean life of the decay (half-life / ln 2) is the
    average daily rate that would sustain it: a node earning c per day for many weeks
    converges to c.
    """
    mean_life_days = half_life_s / math.log(2) / SECONDS_PER_DAY
    return _decay(totals, now, half_life_s) / mean_life_days


def _decay(totals: CreditTotals, now: float, half_life_s: float) -> float:
    elapsed = max(0.0, now - totals.updated_at)
    return totals.decayed * 0.5 ** (elapsed / half_life_s)


NO_RANK = -1e18  # rank_key of no credit at all (the column default)


def rank_key(totals: CreditTotals, *, half_life_s: float = WEEK_S) -> float:
    """A number that orders totals by recent average credit, the same at every moment.

    Every row's decayed sum shrinks by the same factor as time passes, so ln(decayed at
    now) = ln(decayed) - (now - updated_at) ln 2 / half_life orders rows as ln(decayed) +
    updated_at ln 2 / half_life does, without `now`: a leaderboard by recent average is
    an index scan, however long ago each row last earned credit.
    """
    if totals.decayed <= 0.0:
        return NO_RANK
    return math.log(totals.decayed) + totals.updated_at * math.log(2) / half_life_s
