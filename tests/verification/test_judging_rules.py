"""verification.judging, .recheck and .collusion: one shard's decision and what follows.

Tables, no store: when a shard waits, with what credibility it is decided, escalation
and one more replica for an undecided one, the rechecks of a node caught lying, and the
accounts flagged as colluders.
"""

from __future__ import annotations

import pytest

from idlegrid.kinds.base import Verdict
from idlegrid.verification import collusion, judging
from idlegrid.verification.quorum import Decision
from idlegrid.verification.recheck import (
    LoneShard,
    OutputCheck,
    Rechecked,
    recheck,
    rested_alone,
    rested_on_liars,
)
from idlegrid.verification.trust import Trust, TrustSettings

SETTINGS = TrustSettings()
NEW = Trust()
TRUSTED = Trust(consecutive_valid=SETTINGS.adaptive_after, valid_total=SETTINGS.adaptive_after)
CAUGHT = Trust(consecutive_valid=SETTINGS.adaptive_after, recent_invalid=1)


def terms(
    mode: str | None = None,
    *,
    target: int = 3,
    quorum: int = 2,
    live: int = 0,
    replication: int = 3,
) -> judging.ShardTerms:
    return judging.ShardTerms(
        mode=mode,
        target=target,
        quorum=quorum,
        live_tasks=live,
        replication=replication,
        min_quorum=min(2, replication),
    )


def same(a: bytes, b: bytes) -> Verdict:
    return Verdict.AGREE if a == b else Verdict.DISAGREE


def votes(*cast: tuple[bytes, Trust]) -> list[judging.Vote]:
    return [judging.Vote(task, output, trust) for task, (output, trust) in enumerate(cast, 1)]


@pytest.mark.parametrize(
    ("shard", "results", "waits"),
    [
        (terms(target=3, live=1), 2, True),  # replicated: waits for the node it asked for
        (terms(target=3, live=0), 2, False),  # nothing live: decide on what there is
        (terms(target=3, live=1), 3, False),  # all in (a backup copy stands in)
        (terms("spot", target=2, live=1), 1, True),  # the spot check is awaited
        (terms("alone", target=1, quorum=1, live=1), 0, False),  # alone never waits
    ],
)
def test_a_replicated_shard_waits_for_the_results_it_asked_for(
    shard: judging.ShardTerms, results: int, waits: bool
) -> None:
    assert judging.waits(shard, results) == waits


def test_two_first_colluders_do_not_decide_a_shard_still_waiting() -> None:
    decision = judging.decide(
        terms(target=3, live=1), votes((b"x", TRUSTED), (b"x", TRUSTED)), same, SETTINGS
    )
    assert decision == Decision(canonical=None, valid=(), invalid=())


@pytest.mark.parametrize(
    ("shard", "cast", "canonical", "valid", "invalid"),
    [
        # Three new nodes that agree reach the quorum's credibility.
        (terms(), ((b"x", NEW), (b"x", NEW), (b"x", NEW)), 1, (1, 2, 3), ()),
        # Four of five agree, the fifth is outvoted (by the dispute's margin).
        (
            terms(target=5),
            ((b"x", TRUSTED), (b"x", NEW), (b"x", NEW), (b"x", NEW), (b"y", TRUSTED)),
            1,
            (1, 2, 3, 4),
            (5,),
        ),
        # Two against one is too narrow a margin in a dispute, however trusted the two.
        (terms(), ((b"x", TRUSTED), (b"x", TRUSTED), (b"y", NEW)), None, (), ()),
        # All disagree: nothing decided.
        (terms(), ((b"x", NEW), (b"y", NEW), (b"z", NEW)), None, (), ()),
        # A trusted node alone stands; one caught since does not.
        (terms("alone", target=1, quorum=1), ((b"x", TRUSTED),), 1, (1,), ()),
        (terms("alone", target=1, quorum=1), ((b"x", CAUGHT),), None, (), ()),
        # Replication 2: two new nodes that agree are enough (what two can give).
        (terms(target=2, replication=2), ((b"x", NEW), (b"x", NEW)), 1, (1, 2), ()),
    ],
    ids=[
        "three new agree",
        "outvoted",
        "narrow dispute",
        "all disagree",
        "alone",
        "alone caught",
        "two of two",
    ],
)
def test_decide_weighs_each_vote_by_its_nodes_trust(
    shard: judging.ShardTerms,
    cast: tuple[tuple[bytes, Trust], ...],
    canonical: int | None,
    valid: tuple[int, ...],
    invalid: tuple[int, ...],
) -> None:
    decision = judging.decide(shard, votes(*cast), same, SETTINGS)
    assert (decision.canonical, decision.valid, decision.invalid) == (canonical, valid, invalid)


def test_a_result_alone_needs_what_its_node_had_when_let_alone() -> None:
    alone = judging.required_credibility(terms("alone"), SETTINGS)
    replicated = judging.required_credibility(terms(replication=2), SETTINGS)
    assert alone <= SETTINGS.min_credibility
    assert replicated < alone  # two new nodes agreeing is the most two replicas give


@pytest.mark.parametrize(
    ("shard", "results", "escalate", "raise_target"),
    [
        # The spot check disagreed: back to full replication.
        (terms("spot", target=2, quorum=2), 2, True, False),
        # A lone result without the credibility to stand: escalated, else one more.
        (terms("alone", target=1, quorum=1), 1, True, True),
        # Quorum 1 replicated (replication 1): one more replica.
        (terms(target=1, quorum=1, replication=1), 1, False, True),
        # A replicated shard that did not decide: the replenisher's (undecided) business.
        (terms(target=3, quorum=2), 3, False, False),
        (terms("escalated", target=3, quorum=2), 3, False, False),
        # Results still missing: nothing yet.
        (terms("spot", target=2, quorum=2), 1, False, False),
    ],
    ids=[
        "spot disagreed",
        "alone lost credibility",
        "quorum 1",
        "replicated",
        "escalated",
        "incomplete",
    ],
)
def test_what_an_undecided_shard_needs_next(
    shard: judging.ShardTerms, results: int, escalate: bool, raise_target: bool
) -> None:
    then = judging.follow_up(shard, results, Decision(None, (), ()))
    assert (then.escalate, then.raise_target) == (escalate, raise_target)


def test_the_outnumbered_in_a_dispute_are_suspects() -> None:
    decision = Decision(None, (), (), suspects=(3,))
    assert judging.follow_up(terms(), 3, decision).suspects == (3,)


@pytest.mark.parametrize(
    ("verdict", "agrees"),
    [(Verdict.AGREE, True), (Verdict.DISAGREE, False), (Verdict.INCONCLUSIVE, False)],
)
def test_a_late_result_is_valid_only_if_it_agrees(verdict: Verdict, agrees: bool) -> None:
    assert judging.agrees(verdict) == agrees


# -- recheck: a node caught lying ------------------------------------------------------

NOW = 1_000_000.0
WINDOW = 86_400.0


def lone(
    shard_id: int,
    *,
    open: bool = False,
    canonical: int | None = 7,
    finished_at: float | None = NOW - 10,
    job_open: bool = True,
    task_id: int = 7,
) -> LoneShard:
    return LoneShard(
        shard_id=shard_id,
        open=open,
        task_id=task_id,
        canonical_task_id=canonical,
        finished_at=finished_at,
        job_open=job_open,
    )


@pytest.mark.parametrize(
    ("shard", "expected"),
    [
        (lone(1, open=True, canonical=None, finished_at=None), Rechecked(escalated=[1])),
        (lone(1), Rechecked(reopened=[1])),
        (lone(1, job_open=False), Rechecked(released=[1])),
        (lone(1, canonical=8), Rechecked()),  # another node's result decided it
        (lone(1, finished_at=NOW - WINDOW - 1), Rechecked()),  # long ago
    ],
    ids=["open", "decided, job open", "job ended", "not its result", "long ago"],
)
def test_a_caught_nodes_lone_shards_go_back_to_replication(
    shard: LoneShard, expected: Rechecked
) -> None:
    assert recheck([shard], now=NOW, window_s=WINDOW) == expected


def test_recheck_takes_each_shard_once_as_its_last_row_says() -> None:
    rows = [lone(2, open=True), lone(1, task_id=6), lone(1, task_id=7), lone(3)]
    found = recheck(rows, now=NOW, window_s=WINDOW)
    assert found == Rechecked(escalated=[2], reopened=[1, 3])
    assert found.to_replicate == [2, 1, 3]


# -- what rested on a liar's word: a decided output one check alone passed ---------------


def output_check(
    task_id: int,
    *,
    index: int = 0,
    node: int | None = 1,
    finished_at: float | None = 100.0,
    outcome: str | None = "valid",
    known_answer: bool = False,
) -> OutputCheck:
    return OutputCheck(
        shard_index=index,
        task_id=task_id,
        node_id=node,
        finished_at=finished_at,
        outcome=outcome,
        known_answer=known_answer,
    )


@pytest.mark.parametrize(
    ("checks", "alone"),
    [
        ([output_check(5)], [5]),
        ([output_check(5), output_check(6, node=2)], []),  # two passes: not one word
        ([output_check(5), output_check(6, node=2, outcome="invalid")], [5]),
        ([output_check(5), output_check(6, node=2, outcome="error")], [5]),
        ([output_check(5), output_check(6, node=2, outcome=None)], [5]),
        ([output_check(5, outcome="invalid")], []),  # failed it: rested on nothing
        ([output_check(5, known_answer=True)], []),  # a probe is no one's word
        ([output_check(5), output_check(6, known_answer=True)], []),  # a probe's pass counts
        ([output_check(5, node=None)], []),
        ([output_check(5, index=0), output_check(6, index=1, node=2)], [5, 6]),
    ],
    ids=[
        "one pass",
        "two passes",
        "the other failed it",
        "the other erred",
        "the other unjudged",
        "no pass",
        "a probe's pass only",
        "a probe's pass too",
        "no node",
        "per shard",
    ],
)
def test_an_output_rests_on_a_check_that_alone_passed_it(
    checks: list[OutputCheck], alone: list[int]
) -> None:
    assert [c.task_id for c in rested_alone(checks)] == alone


@pytest.mark.parametrize(
    ("last_lie", "doubted", "why"),
    [
        ({}, False, "never lied"),
        ({1: (90.0, 9)}, False, "lied before the pass"),
        ({1: (110.0, 1)}, True, "lied after the pass"),
        ({1: (100.0, 4)}, False, "lied as it passed, an earlier task"),
        ({1: (100.0, 5)}, False, "the pass itself"),
        ({1: (100.0, 6)}, True, "lied as it passed, a later task"),
        ({2: (110.0, 1)}, False, "another node lied"),
    ],
)
def test_a_pass_is_doubted_when_its_node_lied_since(
    last_lie: dict[int, tuple[float, int]], doubted: bool, why: str
) -> None:
    found = rested_on_liars([output_check(5, index=3)], last_lie)
    assert found == ([(3, 1)] if doubted else []), why


def test_a_pass_never_finished_is_not_doubted() -> None:
    assert rested_on_liars([output_check(5, finished_at=None)], {1: (110.0, 9)}) == []


def test_outputs_resting_on_liars_in_shard_order() -> None:
    checks = [
        output_check(7, index=2, node=1),
        output_check(5, index=0, node=2),
        output_check(6, index=1, node=3),  # its node never lied
        output_check(8, index=3, node=1),
        output_check(9, index=3, node=2),  # two passes of shard 3
    ]
    last_lie = {1: (200.0, 20), 2: (200.0, 21)}
    assert rested_on_liars(checks, last_lie) == [(0, 2), (2, 1)]


# -- collusion ---------------------------------------------------------------------------


def test_colluding_accounts_are_paired_once_each() -> None:
    account_of: dict[int, int | None] = {1: 10, 2: 20, 3: 10, 4: 30, 5: None, 6: 20}
    groups = [(1, 2, 3), (4, 5), (6, 1), (2, 6)]
    assert collusion.account_pairs(groups, account_of) == [(10, 20)]
    assert collusion.account_pairs([(1, 2, 4)], account_of) == [(10, 20), (10, 30), (20, 30)]


@pytest.mark.parametrize(("together", "flagged"), [(1, False), (2, True), (5, True)])
def test_accounts_wrong_together_often_enough_are_colluders(together: int, flagged: bool) -> None:
    assert collusion.colluding(together, flag_after=SETTINGS.collusion_flag_after) == flagged
    assert f"account 9 returned the same wrong results in {together}" in collusion.flag_reason(
        9, together
    )
