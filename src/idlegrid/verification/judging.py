"""Judging one shard: when it may be decided, by what quorum, and what follows if not.

The quorum (`verification.quorum`) compares results; this module says with what
credibility each result votes, what credibility the winner needs (a shard run alone
needs what its node had when it was let run alone; a replicated one, what its job's
replicas can give), and what an undecided shard needs next. Pure: the coordinator
reads the outputs and runs the comparison (in a thread when the outputs are large).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from idlegrid.kinds.base import Verdict
from idlegrid.verification import quorum
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.trust import Trust, TrustSettings


@dataclass(frozen=True, kw_only=True)
class ShardTerms:
    """What a shard asks of its results (its row), and what its job asked for."""

    mode: str | None  # None: replicated; "alone", "spot" or "escalated"
    target: int  # results it asks for before it is decided
    quorum: int  # agreeing results that make one canonical
    live_tasks: int  # replicas ready or held by a node
    replication: int  # the job's replicas (full replication)
    min_quorum: int  # the job's quorum


@dataclass(frozen=True)
class Vote:
    """A result of the shard: its task, its output, its node's trust on the kind."""

    task_id: int
    output: bytes
    trust: Trust


@dataclass(frozen=True)
class FollowUp:
    """What an undecided shard needs next."""

    # Outnumbered in a dispute: their nodes run nothing alone until it is settled.
    suspects: tuple[int, ...] = ()
    # A shard run alone or spot-checked whose check disagreed (or whose lone node lost
    # its credibility): back to full replication; the quorum then says who was wrong.
    escalate: bool = False
    # A lone result without the credibility to stand (its node was caught or suspended
    # meanwhile): one more replica, as BOINC raises a target (if it is not escalated).
    raise_target: bool = False


def waits(shard: ShardTerms, results: int) -> bool:
    """A replicated or spot-checked shard waits for all the results it asked for (a
    backup copy of a straggler may stand in for one): two colluders that answer first
    must not decide it before the node they could not choose."""
    return shard.mode != "alone" and shard.live_tasks > 0 and results < shard.target


def required_credibility(shard: ShardTerms, settings: TrustSettings) -> float:
    """The credibility the winning group of this shard needs."""
    if shard.mode == "alone":
        return trust_rules.required_credibility_alone(settings)
    return trust_rules.required_credibility(settings, shard.replication)


def decide(
    shard: ShardTerms,
    votes: Sequence[Vote],
    compare: Callable[[bytes, bytes], Verdict],
    settings: TrustSettings,
) -> quorum.Decision:
    """The shard's decision from its results (in arrival order) and their nodes' trust."""
    if waits(shard, len(votes)):
        return quorum.Decision(canonical=None, valid=(), invalid=())
    return quorum.decide(
        [(vote.task_id, vote.output) for vote in votes],
        compare,
        min_quorum=shard.quorum,
        credibility={vote.task_id: trust_rules.credibility(vote.trust, settings) for vote in votes},
        min_credibility=required_credibility(shard, settings),
        dispute_margin=settings.dispute_margin,
        dispute_credibility=1.0 - settings.prior_bad_fraction,
    )


def follow_up(shard: ShardTerms, results: int, decision: quorum.Decision) -> FollowUp:
    """What a shard its `results` did not decide needs next."""
    complete = results >= shard.target
    return FollowUp(
        suspects=decision.suspects,
        escalate=shard.mode in ("alone", "spot") and complete,
        raise_target=shard.quorum == 1 and complete,
    )


def agrees(verdict: Verdict) -> bool:
    """A late result (its shard decided before it came) counts as valid only if it
    agrees with the canonical one; an inconclusive comparison is no check passed."""
    return verdict == Verdict.AGREE
