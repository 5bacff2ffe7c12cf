"""Quorum over the results of one shard. Pure: it gets outputs and a compare function."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from idlegrid.kinds.base import Verdict


@dataclass(frozen=True)
class Decision:
    canonical: int | None
    valid: tuple[int, ...]
    invalid: tuple[int, ...]
    fail_reason: str | None = None
    # Undecided for a dispute: the results outnumbered by the largest group. Their nodes
    # run nothing alone until the dispute is settled (they may be lying right now).
    suspects: tuple[int, ...] = ()
    # Decided: invalid results that agree with each other (two or more). Independent
    # wrong answers differ; the same wrong answer from several nodes was arranged.
    colluding: tuple[tuple[int, ...], ...] = ()
    # Decided (kinds verified by checks): the valid checks that passed the output, paid
    # only once a known-answer check confirms their node's word (`verification.probes`).
    held: tuple[int, ...] = ()
    # Undecided (kinds verified by checks): an output set aside, and the passes of it that
    # decided nothing, judged neither way ("moot": no trust change, no credit).
    moot: tuple[int, ...] = ()


def decide(
    results: Sequence[tuple[int, bytes]],
    compare: Callable[[bytes, bytes], Verdict],
    *,
    min_quorum: int,
    credibility: Mapping[int, float] | None = None,
    min_credibility: float = 0.0,
    dispute_margin: int = 0,
    dispute_credibility: float = 1.0,
) -> Decision:
    """Pick a canonical result once enough results, and enough credibility, agree.

    `results` are (task_id, output) in arrival order. Results are grouped by agreement
    with a representative; the largest group (ties: the most credible, then the
    earliest) wins if it has at least `min_quorum` members and, when `credibility` (per
    task, the probability its node answers right) is given, if the probability that its
    answer is the right one is at least `min_credibility` (Sarmenta 2002). Votes alone
    let two colluders outvote one honest node; credibility makes new or caught nodes
    count for little. The winner's earliest member is canonical; results that disagree
    with it are invalid; inconclusive ones are neither.

    A result whose credibility is 0 (its node is suspended) is left out of the vote: it
    neither counts towards a quorum nor weighs on the posterior (a factor of 0 would
    sink every group it agrees with); it is invalid if it disagrees with the winner.
    `dispute_margin`: when voters disagree, the winner must outnumber the largest
    group outside it by this much (0: the largest group wins, ties as above), and every
    voter's credibility counts for at most `dispute_credibility`. Credibility assumes
    nodes err independently; trusted colluders are not independent, and a dispute
    among trusted nodes shows that some trust was misplaced: then only the number of
    nodes, which colluders cannot choose, settles it.
    """
    if min_quorum < 1:
        raise ValueError("min_quorum must be at least 1")
    cred, voters = _voters(results, credibility)
    if not voters:
        return Decision(canonical=None, valid=(), invalid=())
    found = groups(voters, compare)
    disputed = _disputed(voters, found, compare)
    if disputed:
        cred = {task: min(c, dispute_credibility) for task, c in cred.items()}
    best, rival, best_posterior = _leader(voters, found, cred)
    if (
        len(best) < min_quorum
        or (rival and len(best) - rival < dispute_margin)
        or (credibility is not None and best_posterior < min_credibility)
    ):
        suspects = _suspects(voters, best, compare) if disputed and len(best) > rival else ()
        return Decision(canonical=None, valid=(), invalid=(), suspects=suspects)
    return decided(results, voters, best, compare)


def _voters(
    results: Sequence[tuple[int, bytes]], credibility: Mapping[int, float] | None
) -> tuple[dict[int, float], list[tuple[int, bytes]]]:
    """Each result's credibility (1 when none is given), and the results that vote: those
    whose credibility is above 0."""
    cred = {task_id: (credibility or {}).get(task_id, 1.0) for task_id, _ in results}
    voters = [(task_id, output) for task_id, output in results if cred[task_id] > 0.0]
    return cred, voters


def _disputed(
    voters: Sequence[tuple[int, bytes]],
    found: Sequence[Sequence[int]],
    compare: Callable[[bytes, bytes], Verdict],
) -> bool:
    """Whether two groups of voters disagree (not merely fail to agree)."""
    return any(
        compare(voters[g[0]][1], voters[h[0]][1]) == Verdict.DISAGREE
        for g in found
        for h in found
        if g is not h
    )


def _leader(
    voters: Sequence[tuple[int, bytes]],
    found: Sequence[Sequence[int]],
    cred: Mapping[int, float],
) -> tuple[Sequence[int], int, float]:
    """The leading group (the largest; ties: the most credible, then the earliest), the
    voters of the largest group outside it, and the probability that its answer is right."""
    posterior = group_posteriors([[voters[i][0] for i in g] for g in found], cred)
    ranked = sorted(range(len(found)), key=lambda g: (-len(found[g]), -posterior[g], found[g][0]))
    best = found[ranked[0]]
    rival = max((len(set(found[g]) - set(best)) for g in ranked[1:]), default=0)
    return best, rival, posterior[ranked[0]]


def _suspects(
    voters: Sequence[tuple[int, bytes]],
    best: Sequence[int],
    compare: Callable[[bytes, bytes], Verdict],
) -> tuple[int, ...]:
    """The voters that disagree with the leading group of an undecided dispute."""
    leader = voters[best[0]][1]
    return tuple(
        task_id for task_id, output in voters if compare(leader, output) == Verdict.DISAGREE
    )


def decided(
    results: Sequence[tuple[int, bytes]],
    voters: Sequence[tuple[int, bytes]],
    best: Sequence[int],
    compare: Callable[[bytes, bytes], Verdict],
) -> Decision:
    """The decision where the group `best` (indices into `voters`) won: its earliest
    member canonical, its members valid, results that disagree with it invalid."""
    canonical_task, canonical_output = voters[best[0]]
    winners = {voters[j][0] for j in best}
    # A non-voter that agrees is neither: it checked nobody (judged later as late).
    invalid = tuple(
        task_id
        for task_id, output in results
        if task_id not in winners and compare(canonical_output, output) == Verdict.DISAGREE
    )
    valid = tuple(task_id for task_id, _ in results if task_id in winners)
    wrong = [(task_id, output) for task_id, output in results if task_id in invalid]
    colluding = tuple(
        tuple(wrong[i][0] for i in group) for group in groups(wrong, compare) if len(group) > 1
    )
    return Decision(canonical=canonical_task, valid=valid, invalid=invalid, colluding=colluding)


def groups(
    results: Sequence[tuple[int, bytes]], compare: Callable[[bytes, bytes], Verdict]
) -> list[list[int]]:
    """Groups of agreeing results: the indices of the results agreeing with each result,
    deduplicated, members sorted."""
    seen: set[tuple[int, ...]] = set()
    found = []
    for i, (_, output) in enumerate(results):
        members = [i] + [
            j
            for j, (_, other) in enumerate(results)
            if j != i and compare(output, other) == Verdict.AGREE
        ]
        key = tuple(sorted(members))
        if key not in seen:
            seen.add(key)
            found.append(list(key))
    return found


def group_posteriors(
    groups: Sequence[Sequence[int]], credibility: Mapping[int, float]
) -> list[float]:
    """Probability that each group's answer is the right one, given who voted for what.

    Each task is right independently with its credibility; at most one answer is right.
    P(group a right) is proportional to prod(c, members of a) * prod(1 - c, others); the
    hypothesis that no answer is right, prod(1 - c, everyone), takes the rest.
    """
    everyone = {task for group in groups for task in group}
    weights = []
    for group in groups:
        members = set(group)
        weight = 1.0
        for task in everyone:
            c = min(max(credibility.get(task, 1.0), 0.0), 1.0)
            weight *= c if task in members else 1.0 - c
        weights.append(weight)
    none_right = 1.0
    for task in everyone:
        none_right *= 1.0 - min(max(credibility.get(task, 1.0), 0.0), 1.0)
    total = sum(weights) + none_right
    return [w / total if total > 0 else 0.0 for w in weights]
