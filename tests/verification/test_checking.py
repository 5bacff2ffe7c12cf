"""The rule that judges shards verified by check tasks (verification.checking), by table."""

from __future__ import annotations

import pytest

from idlegrid.verification.checking import CheckedVote, decide, settle

G1, G2 = "a" * 64, "b" * 64


def gen(task_id: int, output: str = G1) -> CheckedVote:
    return CheckedVote(task_id=task_id, output_hash=output, checks=None, verdict=None)


def check(
    task_id: int,
    of: str,
    passed: bool,
    *,
    says: str | None = None,
    cred: float = 1.0,
    est: bool = True,
) -> CheckedVote:
    """A check of `of`; `est`: by an established checker (`verification.probes`)."""
    claimed = of if says is None else says
    return CheckedVote(
        task_id=task_id,
        output_hash=f"{task_id:064d}",
        checks=of,
        verdict=(claimed, passed),
        credibility=cred,
        established=est,
    )


CASES = [
    # votes, canonical, valid, invalid, more
    ("output alone waits for its check", [gen(1)], None, (), (), True),
    ("an established checker's pass decides", [gen(1), check(2, G1, True)], 1, (1, 2), (), False),
    (
        "a new checker's pass waits for a second",
        [gen(1), check(2, G1, True, est=False)],
        None,
        (),
        (),
        True,
    ),
    (
        "two new checkers' passes decide",
        [gen(1), check(2, G1, True, est=False), check(3, G1, True, est=False)],
        1,
        (1, 2, 3),
        (),
        False,
    ),
    (
        "the same output made again by another node backs it as a pass does",
        [gen(1), gen(2), check(3, G1, True, est=False)],
        1,
        (1, 2, 3),
        (),
        False,
    ),
    (
        "a twin alone is one backing, not two",
        [gen(1), gen(2)],
        None,
        (),
        (),
        True,
    ),
    (
        "a new checker's pass against a failed check: another check",
        [gen(1), check(2, G1, True, est=False), check(3, G1, False), check(4, G1, True)],
        1,
        (1, 2, 4),
        (3,),
        False,
    ),
    ("one failed check waits for a second", [gen(1), check(2, G1, False)], None, (), (), True),
    (
        "two failed checks make the output a lie",
        [gen(1), check(2, G1, False), check(3, G1, False)],
        None,
        (),
        (1,),
        True,
    ),
    (
        "a lying checker is outvoted",
        [gen(1), check(2, G1, False), check(3, G1, True), check(4, G1, True)],
        1,
        (1, 3, 4),
        (2,),
        False,
    ),
    (
        "a tie asks for another check",
        [gen(1), check(2, G1, False), check(3, G1, True)],
        None,
        (),
        (),
        True,
    ),
    (
        "a check that passed a lie is invalid with it",
        [gen(1), check(2, G1, True), check(3, G1, False), check(4, G1, False), check(5, G1, False)],
        None,
        (),
        (1, 2),
        True,
    ),
    (
        "a check of another output is misplaced",
        [gen(1), check(2, G1, True, says=G2)],
        None,
        (),
        (2,),
        True,
    ),
    (
        "a generation task that answered with a verdict is misplaced",
        [CheckedVote(task_id=1, output_hash=G1, checks=None, verdict=(G2, True))],
        None,
        (),
        (1,),
        True,
    ),
    (
        "a check task that answered with an output is misplaced",
        [gen(1), CheckedVote(task_id=2, output_hash=G2, checks=G1, verdict=None)],
        None,
        (),
        (2,),
        True,
    ),
    (
        "a suspended checker does not count",
        [gen(1), check(2, G1, True, cred=0.0)],
        None,
        (),
        (),
        True,
    ),
    (
        "a new output after a lie is checked on its own; the lie's checks are valid",
        [check(2, G1, False), check(3, G1, False), gen(4, G2), check(5, G2, True)],
        4,
        (2, 3, 4, 5),
        (),
        False,
    ),
    (
        "the checks that caught a lie are valid with the decision",
        [gen(1), check(2, G1, False), check(3, G1, False), gen(4, G2), check(5, G2, True)],
        4,
        (2, 3, 4, 5),
        (1,),
        False,
    ),
]


def built(task_id: int, build: str, *, names: str | None = None, output: str = G1) -> CheckedVote:
    """A generation of a kind that names builds: its node reported `build`, its output
    names `names` (default the same)."""
    return CheckedVote(
        task_id=task_id,
        output_hash=output,
        checks=None,
        verdict=None,
        build=build,
        claimed_build=build if names is None else names,
    )


def check_on(
    task_id: int, of: str, passed: bool, build: str, *, est: bool = True, decides: bool = True
) -> CheckedVote:
    return CheckedVote(
        task_id=task_id,
        output_hash=f"{task_id:064d}",
        checks=of,
        verdict=(of, passed),
        build=build,
        established=est,
        decides=decides,
    )


BUILD_CASES = [
    # votes, canonical, valid, invalid, more
    ("a pass on the output's build decides", [built(1, "A"), check_on(2, G1, True, "A")],
     1, (1, 2), (), False),
    ("an established pass from another build decides too",
     [built(1, "A"), check_on(2, G1, True, "B")], 1, (1, 2), (), False),
    ("a new checker's pass from another build waits for a second",
     [built(1, "A"), check_on(2, G1, True, "B", est=False)], None, (), (), True),
    ("two new checkers' passes from other builds decide",
     [built(1, "X"), check_on(2, G1, True, "B", est=False), check_on(3, G1, True, "C", est=False)],
     1, (1, 2, 3), (), False),
    ("failed checks count from any build",
     [built(1, "A"), check_on(2, G1, False, "B"), check_on(3, G1, False, "C")],
     None, (), (1,), True),
    ("a lie: the passes of it are invalid with it, from any build",
     [built(1, "A"), check_on(2, G1, True, "B", est=False), check_on(3, G1, False, "A"),
      check_on(4, G1, False, "C")],
     None, (), (1, 2), True),
    ("an output naming another build than its node reported is invalid",
     [built(1, "A", names="B"), check_on(2, G1, True, "B")], None, (), (1,), True),
    ("a pass that decides nothing does not count",
     [built(1, "X"), check_on(2, G1, True, "B", decides=False)], None, (), (), True),
    ("a failed check over few tokens still counts",
     [built(1, "X"), check_on(2, G1, False, "B", decides=False),
      check_on(3, G1, False, "C", decides=False)], None, (), (1,), True),
]  # fmt: skip


def test_an_output_only_undecisive_passes_judged_is_set_aside() -> None:
    one = [built(1, "X"), check_on(2, G1, True, "B", decides=False)]
    assert decide(one).decision.moot == ()
    two = [*one, check_on(3, G1, True, "C", decides=False)]
    outcome = decide(two)
    assert outcome.more and outcome.decision.moot == (1, 2, 3)
    assert outcome.decision.invalid == ()  # a rare build is no lie
    judged = [*two, check_on(4, G1, True, "X")]  # a decisive pass came meanwhile
    assert decide(judged).decision.canonical == 1


def test_the_passes_of_a_decision_are_held_for_a_known_answer() -> None:
    votes = [gen(1), check(2, G1, True, est=False), check(3, G1, True, est=False)]
    assert decide(votes).decision.held == (2, 3)
    caught = [gen(1), check(2, G1, False), check(3, G1, False), gen(4, G2), check(5, G2, True)]
    assert decide(caught).decision.held == (5,)  # the checks that caught a lie are paid now


def test_a_stalled_checked_shard_is_decided_by_its_own_rule_or_fails() -> None:
    node_of = {1: 11, 2: 12, 3: 13, 4: 14}
    # Two identical failed verdicts are no quorum: a verdict is never the result.
    lie = [gen(1), check(2, G1, False), check(3, G1, False)]
    decision = settle(lie, node_of=node_of)
    assert decision.canonical is None and decision.invalid == (1,)
    assert decision.fail_reason is not None and "a new output" in decision.fail_reason
    waiting = [gen(1), check(2, G1, True, est=False)]
    decision = settle(waiting, node_of=node_of)
    assert decision.canonical is None
    assert decision.fail_reason is not None and "one more check" in decision.fail_reason
    assert "node 11" in decision.fail_reason
    decided = settle([gen(1), check(2, G1, True)], node_of=node_of)
    assert decided.canonical == 1 and decided.fail_reason is None


@pytest.mark.parametrize(
    ("votes", "canonical", "valid", "invalid", "more"),
    [case[1:] for case in CASES + BUILD_CASES],
    ids=[case[0] for case in CASES + BUILD_CASES],
)
def test_decide(votes, canonical, valid, invalid, more) -> None:
    outcome = decide(votes)
    assert outcome.decision.canonical == canonical
    assert outcome.decision.valid == valid
    assert outcome.decision.invalid == invalid
    assert outcome.more is more


def test_an_undecided_shard_names_the_passes_awaiting_confirmation() -> None:
    new_pass = check(2, G1, True, est=False)
    assert decide([gen(1), new_pass]).awaiting == (new_pass,)
    against = [gen(1), new_pass, check(3, G1, False)]
    assert decide(against).awaiting == ()  # a fail outweighs it: one more check, not a wait
    shrug = check_on(2, G1, True, "B", decides=False)
    assert decide([built(1, "X"), shrug]).awaiting == ()  # a pass that decides nothing
