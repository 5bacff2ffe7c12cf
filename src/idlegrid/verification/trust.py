"""Trust in a node, per kind and backend: earned by valid results, lost by invalid ones.

Pure functions over a frozen `Trust` record. A node is trusted separately on each
(kind, backend) pair: a node can be reliable on its CPU and broken on its GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class TrustSettings:
    # Fraction of nodes assumed faulty or malicious before they prove otherwise
    # (Sarmenta's f); a new node's credibility is 1 - f.
    prior_bad_fraction: float = 0.2
    # Consecutive checked valid results before a node may run a shard alone (BOINC's N).
    # BOINC uses 10; against a node that cheats on 10% of its tasks that lets most of
    # its wrong answers through (it reaches 10 in a row 35% of the time, then runs
    # alone); 80 keeps them near 0.2% (docs/verification.md, benchmarks/adversarial.py).
    adaptive_after: int = 80
    # Share of unreplicated results checked by a second, trusted node anyway; never 0
    # for a node however long its streak (docs/verification.md has the bound).
    spot_check_rate: float = 0.08
    # Share of spot checks made by two trusted nodes, not one: a colluder drawn as the
    # only checker of its partner's shard cannot tell whether an honest one comes too.
    double_check_rate: float = 0.5
    # The credibility a quorum needs (Sarmenta 2002): 0.95 takes three new nodes that
    # agree, or two that have each passed a check; two new colluders (0.94) are not
    # enough. Jobs with less replication need at most what their replicas can give.
    min_credibility: float = 0.95
    # Daily task quota: starts here, +1 per valid result, halves on an invalid one.
    initial_daily_quota: int = 50
    max_daily_quota: int = 10_000
    # Invalid results within `invalid_window` results that suspend the node.
    suspend_after_invalids: int = 3
    invalid_window: int = 50
    # When results of a shard disagree, the winner must outnumber the rest by this
    # many nodes, each counted as a new node whatever its trust (verification.quorum).
    dispute_margin: int = 2
    # A node caught lying: the shards it decided alone this long before are replicated
    # again (and open ones at once), unless their job's result was already released.
    recheck_window_s: float = 86_400.0
    # Two accounts whose nodes were wrong together, the same way, in this many shards
    # are flagged as colluders (honest nodes are almost never outvoted at all).
    collusion_flag_after: int = 2


@dataclass(frozen=True, kw_only=True)
class Trust:
    consecutive_valid: int = 0
    valid_total: int = 0
    invalid_total: int = 0
    error_total: int = 0
    # Invalid results among the last `invalid_window` validated results (decays).
    recent_invalid: int = 0
    daily_quota: int = TrustSettings().initial_daily_quota
    suspended: bool = False
    # Suspected results of this node whose shard is not yet decided (a spot check of a
    # result it ran alone disagreed), and the checks it had passed in a row before its
    # latest suspicion: given back when all are found valid (`after_cleared`).
    suspicions: int = 0
    held_streak: int = 0
    # Known-answer checks it answered right since its last lie (`verification.probes`).
    probes_passed: int = 0

    @property
    def results_total(self) -> int:
        return self.valid_total + self.invalid_total + self.error_total

    @property
    def error_rate(self) -> float:
        """Share of this node's results that were invalid or errors."""
        total = self.results_total
        return (self.invalid_total + self.error_total) / total if total else 0.0


def new_trust(settings: TrustSettings) -> Trust:
    return Trust(daily_quota=settings.initial_daily_quota)


def after_valid(trust: Trust, settings: TrustSettings) -> Trust:
    """A result of this node was validated."""
    # One old invalid result is forgiven per `invalid_window` valid ones.
    window_passed = (trust.valid_total + 1) % settings.invalid_window == 0
    decay = 1 if trust.recent_invalid and window_passed else 0
    return dataclasses.replace(
        trust,
        consecutive_valid=trust.consecutive_valid + 1,
        valid_total=trust.valid_total + 1,
        recent_invalid=max(0, trust.recent_invalid - decay),
        daily_quota=min(settings.max_daily_quota, trust.daily_quota + 1),
    )


def after_answered(trust: Trust, settings: TrustSettings) -> Trust:
    """A known-answer check of this node was answered right: a valid result, and one
    more for its record as a checker (`verification.probes`)."""
    valid = after_valid(trust, settings)
    return dataclasses.replace(valid, probes_passed=trust.probes_passed + 1)


def after_invalid(trust: Trust, settings: TrustSettings) -> Trust:
    """A result of this node was outvoted or failed a spot check: reset, halve, maybe
    suspend; a streak held while suspected is lost."""
    recent = trust.recent_invalid + 1
    return dataclasses.replace(
        trust,
        consecutive_valid=0,
        held_streak=0,
        probes_passed=0,
        invalid_total=trust.invalid_total + 1,
        recent_invalid=recent,
        daily_quota=max(1, trust.daily_quota // 2),
        suspended=trust.suspended or recent >= settings.suspend_after_invalids,
    )


def after_suspected(trust: Trust) -> Trust:
    """A spot check of a result this node ran alone disagreed: until the quorum says who
    lied, the node runs nothing alone (its streak is held, and counts again from 0; one
    held before, by a suspicion still open, grows by the checks passed since)."""
    return dataclasses.replace(
        trust,
        consecutive_valid=0,
        suspicions=trust.suspicions + 1,
        held_streak=trust.held_streak + trust.consecutive_valid,
    )


def after_cleared(trust: Trust) -> Trust:
    """A suspected result was found valid (the checker that disagreed lied, or erred),
    or its shard ended with no verdict (its job ended first). Once no suspicion is left,
    the streak held is given back, added to the checks passed since: a colluder's
    disagreeing check costs an honest node nothing. A lie found meanwhile has already
    lost it (`after_invalid`)."""
    left = max(0, trust.suspicions - 1)
    if left:
        return dataclasses.replace(trust, suspicions=left)
    return dataclasses.replace(
        trust,
        suspicions=0,
        held_streak=0,
        consecutive_valid=trust.consecutive_valid + trust.held_streak,
    )


def after_upheld(trust: Trust) -> Trust:
    """A suspected result was not found valid (its `after_invalid` counts the lie): one
    suspicion fewer, and nothing held is given back."""
    left = max(0, trust.suspicions - 1)
    return dataclasses.replace(trust, suspicions=left, held_streak=trust.held_streak if left else 0)


def after_unchecked(trust: Trust, settings: TrustSettings) -> Trust:
    """A result was accepted without a second opinion (run alone, or replication 1).

    It earns quota like a valid result but does not lengthen the streak: only results
    compared with another node's are checks the node could have failed (Sarmenta).
    """
    return dataclasses.replace(
        trust,
        valid_total=trust.valid_total + 1,
        daily_quota=min(settings.max_daily_quota, trust.daily_quota + 1),
    )


def after_checked_later(trust: Trust) -> Trust:
    """A result accepted unchecked (run alone) passed a check since (its shard was
    reopened and another node agreed): one more check passed, not one more result."""
    return dataclasses.replace(trust, consecutive_valid=trust.consecutive_valid + 1)


def after_error(trust: Trust) -> Trust:
    """The node reported a failure, returned a structurally wrong output, or missed its
    deadline. That is unreliability, counted in the error rate (which the scheduler
    weighs), not a lie: the streak of checks passed stays."""
    return dataclasses.replace(trust, error_total=trust.error_total + 1)


def after_error_withdrawn(trust: Trust) -> Trust:
    """A task charged as an error (its lease ran out) delivered after all: the error is
    taken back, and its result is judged like any other."""
    return dataclasses.replace(trust, error_total=max(0, trust.error_total - 1))


def after_suspension_lifted(trust: Trust) -> Trust:
    """An admin lifted the node's suspension: it starts again on probation, its recent
    invalid results and its streak of checks passed cleared; its totals stay."""
    return dataclasses.replace(trust, suspended=False, recent_invalid=0, consecutive_valid=0)


def credibility(trust: Trust, settings: TrustSettings) -> float:
    """Probability that this node's next result is right (Sarmenta 2002, spot-checking).

    A node that has passed k checks in a row is bad with probability at most f / (k + 1):
    every valid result it returned was a check it could have failed. Each invalid result
    among its recent ones halves that: a node caught cheating counts for less than a
    new one, so a caught colluder cannot reach a quorum again at once.
    """
    if trust.suspended:
        return 0.0
    clean = 1.0 - settings.prior_bad_fraction / (trust.consecutive_valid + 1)
    return clean * 0.5**trust.recent_invalid


def claim_refused(
    trust: Trust, *, node_suspended: bool, used_today: int
) -> Literal["suspended", "quota"] | None:
    """Why a node may claim no task of a kind now (None: it may): it or its trust on the
    kind is suspended, or it claimed its daily quota of the kind today."""
    if node_suspended or trust.suspended:
        return "suspended"
    if used_today >= trust.daily_quota:
        return "quota"
    return None


def claims_left(trust: Trust, *, node_suspended: bool, used_today: int) -> int:
    """How many more tasks of a kind the node may claim today: none while it or its trust
    on the kind is suspended, else what its daily quota leaves (BOINC's daily quota)."""
    if node_suspended or trust.suspended:
        return 0
    return max(0, trust.daily_quota - used_today)


def is_trusted(trust: Trust, settings: TrustSettings) -> bool:
    """May run shards alone, and spot-check others' (BOINC's "reliable host")."""
    return not trust.suspended and trust.consecutive_valid >= settings.adaptive_after


def required_credibility_alone(settings: TrustSettings) -> float:
    """What a result run alone needs: what the node had when it was let run alone (with
    the default N it is above `min_credibility`; a node caught since falls below)."""
    trusted = 1.0 - settings.prior_bad_fraction / (settings.adaptive_after + 1)
    return min(settings.min_credibility, trusted - 1e-9)


def required_credibility(settings: TrustSettings, replication: int) -> float:
    """The credibility a job's quorum needs: the setting, or less when `replication` new
    nodes that all agree could not reach it (a researcher who asks for two replicas gets
    two new nodes' worth of assurance, not a job that never finishes)."""
    f = settings.prior_bad_fraction
    all_agree = (1 - f) ** replication / ((1 - f) ** replication + f**replication)
    return min(settings.min_credibility, all_agree - 1e-9)


def may_run_alone(trust: Trust, settings: TrustSettings, *, draw: float) -> bool:
    """BOINC's adaptive replication: after N valid in a row, alone with p = 1 - 1/N_valid.

    `draw` is a uniform random number in [0, 1) supplied by the caller (pure function).
    """
    n = trust.consecutive_valid
    if trust.suspended or n < settings.adaptive_after:
        return False
    return draw < 1.0 - 1.0 / n


def needs_spot_check(settings: TrustSettings, *, draw: float) -> bool:
    """Whether an unreplicated result is checked by a second, trusted node."""
    return draw < settings.spot_check_rate


def spot_checkers(settings: TrustSettings, *, draw: float) -> int:
    """How many trusted nodes check a spot-checked shard: one, or two."""
    return 2 if draw < settings.double_check_rate else 1
