"""verification.ledger: verdicts in, trust changes and credit out. Tables, no store.

The cases of the store's tests (tests/store, tests/verification/test_verification.py) as
rows: quorum outcomes, late results, results run alone then vouched for or disputed,
credit for validated work only and once, trust up and down, streaks, quota, suspension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from idlegrid.verification import ledger
from idlegrid.verification.credit import credit_for
from idlegrid.verification.ledger import CreditDelta, Grant, JudgedResult, TrustChange
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import Trust, TrustSettings

SETTINGS = TrustSettings()
FLOPS = 1e12
PRICE = credit_for(FLOPS)
NEW = Trust(daily_quota=SETTINGS.initial_daily_quota)


def result(
    task_id: int,
    *,
    node: int = 1,
    account: int = 10,
    backend: str = "cpu",
    mode: str | None = None,
    credit: float | None = None,
    finished_at: float = 100.0,
    suspected: bool = False,
) -> JudgedResult:
    return JudgedResult(
        task_id=task_id,
        node_id=node,
        account_id=account,
        kind="sleep",
        backend=backend,
        cost_flops=FLOPS,
        mode=mode,
        credit=credit,
        finished_at=finished_at,
        suspected=suspected,
    )


def settle(
    results: Sequence[JudgedResult],
    verdicts: Mapping[int, ResultVerdict],
    *,
    before: Mapping[int, Trust] | None = None,
    vouched: Sequence[JudgedResult] = (),
    credit: bool = True,
    trust_counted: Sequence[int] = (),
) -> tuple[list[TrustChange], CreditDelta]:
    """The delta of these verdicts, as the store asks for it: trust, then credit."""
    changes = [
        ledger.trust_change(group, (before or {}).get(group.node_id, NEW), SETTINGS)
        for group in ledger.trust_groups(results, verdicts, trust_counted)
    ]
    return changes, ledger.credit_delta(results, verdicts, vouched, credit=credit)


def paid(delta: CreditDelta) -> dict[int, tuple[float, str]]:
    return {g.task_id: (g.amount, g.reason) for g in delta.grants}


# -- credit: who is paid, how much, why -------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "mode", "credit", "expected", "why"),
    [
        ("valid", None, None, {1: (PRICE, "valid")}, "agreed with another node: paid"),
        ("valid", "spot", None, {1: (PRICE, "valid")}, "a spot check that agreed: paid"),
        ("unchecked", None, None, {1: (PRICE, "unchecked")}, "replication 1: paid"),
        ("unchecked", "alone", None, {}, "run alone: pending until vouched for"),
        ("invalid", None, None, {}, "outvoted: nothing"),
        ("error", None, None, {}, "failed or expired: nothing"),
        ("valid", None, 0.0, {}, "paid once already (or taken back): never again"),
        ("valid", None, PRICE, {}, "paid already: never twice"),
    ],
)
def test_credit_for_validated_work_only_and_once(
    verdict: ResultVerdict,
    mode: str | None,
    credit: float | None,
    expected: dict[int, tuple[float, str]],
    why: str,
) -> None:
    delta = ledger.credit_delta([result(1, mode=mode, credit=credit)], {1: verdict})
    assert paid(delta) == expected, why
    assert delta.taken_back == ()


def test_a_quorum_pays_the_agreeing_and_not_the_outvoted() -> None:
    found = [result(1, node=1, account=10), result(2, node=2, account=20), result(3, node=3)]
    _, delta = settle(found, {1: "valid", 2: "valid", 3: "invalid"})
    assert paid(delta) == {1: (PRICE, "valid"), 2: (PRICE, "valid")}
    assert ledger.per_node(delta.grants) == {1: PRICE, 2: PRICE}
    assert ledger.per_account(delta.grants) == {10: PRICE, 20: PRICE}


def test_a_late_result_counts_for_trust_but_earns_nothing() -> None:
    changes, delta = settle([result(1)], {1: "valid"}, credit=False)
    assert delta == CreditDelta()
    assert [c.after.consecutive_valid for c in changes] == [1]


def test_a_late_valid_result_still_vouches_for_its_nodes_lone_results() -> None:
    late = result(1, finished_at=200.0)
    lone = result(7, mode="alone", finished_at=150.0)
    assert ledger.vouch_horizons([late], {1: "valid"}) == {1: 200.0}
    delta = ledger.credit_delta([late], {1: "valid"}, [lone], credit=False)
    assert paid(delta) == {7: (PRICE, "vouched")}


def test_a_result_vouched_for_in_its_own_late_verdict_is_not_paid() -> None:
    late = result(1, mode="alone")
    assert paid(ledger.credit_delta([late], {1: "valid"}, [late], credit=False)) == {}


@pytest.mark.parametrize(
    ("verdicts", "horizons"),
    [
        ({1: "valid", 2: "valid"}, {1: 300.0}),  # the latest check of the node
        ({1: "valid", 2: "invalid"}, {1: 100.0}),  # outvoted: no check passed
        ({1: "unchecked", 2: "unchecked"}, {}),  # accepted alone: no check either
        ({1: "error", 2: "valid"}, {1: 300.0}),
    ],
)
def test_a_passed_check_vouches_for_the_lone_results_before_it(
    verdicts: dict[int, ResultVerdict], horizons: dict[int, float]
) -> None:
    found = [result(1, finished_at=100.0), result(2, finished_at=300.0)]
    assert ledger.vouch_horizons(found, verdicts) == horizons


def test_vouch_horizons_are_per_node_in_node_order() -> None:
    found = [result(1, node=5, finished_at=10.0), result(2, node=3, finished_at=20.0)]
    assert list(ledger.vouch_horizons(found, {1: "valid", 2: "valid"})) == [3, 5]


@pytest.mark.parametrize(
    ("candidate", "paid_too", "why"),
    [
        (result(7, mode="alone", finished_at=100.0), True, "decided alone by the check's end"),
        (result(7, mode="alone", finished_at=101.0), False, "decided after the check"),
        (result(7, mode="alone", node=2, finished_at=50.0), False, "another node's"),
        (result(7, mode="spot", finished_at=50.0), False, "not decided alone"),
    ],
)
def test_a_check_vouches_only_for_its_nodes_lone_results_before_it(
    candidate: JudgedResult, paid_too: bool, why: str
) -> None:
    delta = ledger.credit_delta([result(1, finished_at=100.0)], {1: "valid"}, [candidate])
    assert (7 in paid(delta)) == paid_too, why


@pytest.mark.parametrize(
    ("outcome", "candidate", "vouched", "why"),
    [
        ("valid", result(7, mode="alone", finished_at=100.0), True, "accepted, by the horizon"),
        ("valid", result(7, mode="alone", finished_at=50.0), True, "accepted, long before"),
        ("valid", result(7, mode="alone", finished_at=101.0), False, "after the horizon"),
        ("invalid", result(7, mode="alone", finished_at=50.0), False, "found wrong"),
        ("error", result(7, mode="alone", finished_at=50.0), False, "failed"),
        (None, result(7, mode="alone", finished_at=50.0), False, "not judged"),
        ("valid", result(7, mode="alone", credit=PRICE), False, "paid already"),
        ("valid", result(7, mode="alone", credit=0.0), False, "paid once (or taken back)"),
        ("valid", result(7, mode="spot", finished_at=50.0), False, "not decided alone"),
        ("valid", result(7, mode=None, finished_at=50.0), False, "replicated"),
        ("valid", result(7, mode="alone", node=2), False, "a node without a horizon"),
    ],
)
def test_a_nodes_accepted_unpaid_lone_results_up_to_its_horizon_are_vouched_for(
    outcome: str | None, candidate: JudgedResult, vouched: bool, why: str
) -> None:
    lone = [ledger.LoneResult(result=candidate, outcome=outcome)]
    assert ledger.vouched_results(lone, {1: 100.0}) == ([candidate] if vouched else []), why


def test_vouched_results_keep_their_order_and_skip_those_never_finished() -> None:
    unfinished = dataclasses.replace(result(6, mode="alone"), finished_at=None)
    lone = [
        ledger.LoneResult(result=result(9, mode="alone", finished_at=90.0), outcome="valid"),
        ledger.LoneResult(result=unfinished, outcome="valid"),
        ledger.LoneResult(result=result(8, mode="alone", finished_at=80.0), outcome="valid"),
    ]
    found = ledger.vouched_results(lone, {1: 100.0})
    assert [r.task_id for r in found] == [9, 8]
    delta = ledger.credit_delta([result(1, finished_at=100.0)], {1: "valid"}, found)
    assert paid(delta) == {1: (PRICE, "valid"), 9: (PRICE, "vouched"), 8: (PRICE, "vouched")}


def test_run_alone_then_vouched_for_is_paid_once() -> None:
    lone = result(7, mode="alone", finished_at=50.0)
    check = result(1, finished_at=100.0)
    first = ledger.credit_delta([check], {1: "valid"}, [lone])
    assert paid(first) == {1: (PRICE, "valid"), 7: (PRICE, "vouched")}
    again = dataclasses.replace(lone, credit=PRICE)  # the store wrote its credit
    assert paid(ledger.credit_delta([check], {1: "valid"}, [again])) == {1: (PRICE, "valid")}


def test_a_lone_result_decided_after_its_nodes_later_check_is_vouched_for() -> None:
    """Judged out of order: the check the node passed before this decision speaks for it."""
    lone = result(7, mode="alone", finished_at=50.0)
    assert ledger.accepted_alone([lone, result(8, node=2)], {7: "unchecked", 8: "unchecked"}) == {
        1: 50.0
    }
    on_record = {1: 100.0}  # the store's read: its check finished at 100
    assert ledger.vouch_horizons([lone], {7: "unchecked"}, on_record) == {1: 100.0}
    delta = ledger.credit_delta([lone], {7: "unchecked"}, [lone], checks_on_record=on_record)
    assert paid(delta) == {7: (PRICE, "vouched")}
    # Without one, it waits (the audit checks it before its job is released).
    assert paid(ledger.credit_delta([lone], {7: "unchecked"}, [lone])) == {}


def test_run_alone_paid_then_disputed_has_its_credit_taken_back() -> None:
    lone = result(7, node=4, account=40, mode="alone", credit=PRICE)
    changes, delta = settle([lone], {7: "invalid"})
    assert delta.grants == ()
    assert delta.taken_back == (
        Grant(
            task_id=7,
            node_id=4,
            account_id=40,
            cost_flops=FLOPS,
            amount=-PRICE,
            reason="taken back",
        ),
    )
    assert [c.caught for c in changes] == [True]  # its lone shards are rechecked


def test_a_disputed_result_never_paid_has_nothing_taken_back() -> None:
    for credit in (None, 0.0):
        delta = ledger.credit_delta([result(7, mode="alone", credit=credit)], {7: "invalid"})
        assert delta == CreditDelta()


# -- trust: up, down, streaks, quota, suspension ---------------------------------------


@pytest.mark.parametrize(
    ("before", "events", "after", "caught"),
    [
        (NEW, ("valid",), Trust(consecutive_valid=1, valid_total=1, daily_quota=51), False),
        (NEW, ("unchecked",), Trust(valid_total=1, daily_quota=51), False),
        (
            Trust(consecutive_valid=5, valid_total=5, daily_quota=55),
            ("invalid",),
            Trust(valid_total=5, invalid_total=1, recent_invalid=1, daily_quota=27),
            True,
        ),
        (
            Trust(consecutive_valid=5, valid_total=5, daily_quota=55),
            ("error",),
            Trust(consecutive_valid=5, valid_total=5, error_total=1, daily_quota=55),
            False,
        ),
        (
            Trust(error_total=1),
            ("error withdrawn", "error withdrawn"),
            Trust(error_total=0),
            False,
        ),
        (
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected",),
            Trust(valid_total=90, daily_quota=140, suspicions=1, held_streak=90),
            False,
        ),
        (  # a colluder's check disagreed; the quorum found the node right
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected", "valid", "valid", "cleared"),
            Trust(consecutive_valid=92, valid_total=92, daily_quota=142),
            False,
        ),
        (  # two suspected results: the streak comes back when both are cleared
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected", "suspected", "valid", "cleared"),
            Trust(
                consecutive_valid=1, valid_total=91, daily_quota=141, suspicions=1, held_streak=90
            ),
            False,
        ),
        (  # suspected again after a check passed: every check in the row comes back
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected", "valid", "suspected", "valid", "cleared", "cleared"),
            Trust(consecutive_valid=92, valid_total=92, daily_quota=142),
            False,
        ),
        (  # the suspected result was a lie: nothing held comes back
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected", "invalid", "upheld"),
            Trust(valid_total=90, invalid_total=1, recent_invalid=1, daily_quota=70),
            True,
        ),
        (  # a lie meanwhile: the one cleared later gives back nothing
            Trust(consecutive_valid=90, valid_total=90, daily_quota=140),
            ("suspected", "invalid", "valid", "cleared"),
            Trust(
                valid_total=91,
                invalid_total=1,
                recent_invalid=1,
                daily_quota=71,
                consecutive_valid=1,
            ),
            True,
        ),
        (
            NEW,
            ("valid", "valid", "invalid", "valid"),
            Trust(
                consecutive_valid=1,
                valid_total=3,
                invalid_total=1,
                recent_invalid=1,
                daily_quota=27,
            ),
            True,
        ),
    ],
    ids=[
        "valid",
        "unchecked",
        "invalid",
        "error",
        "withdrawn",
        "suspected",
        "cleared",
        "cleared twice",
        "suspected again",
        "upheld",
        "lie meanwhile",
        "in order",
    ],
)
def test_trust_steps_through_a_nodes_events_in_order(
    before: Trust, events: tuple[ledger.TrustEvent, ...], after: Trust, caught: bool
) -> None:
    group = ledger.TrustGroup(node_id=1, kind="sleep", backend="cpu", events=events)
    change = ledger.trust_change(group, before, SETTINGS)
    assert (change.after, change.caught, change.before) == (after, caught, before)


@pytest.mark.parametrize(
    ("recent_invalid", "suspended", "after", "suspended_now"),
    [
        (0, False, False, False),
        (1, False, False, False),
        (2, False, True, True),  # the third within the window
        (5, True, True, False),  # suspended before: for good, once
    ],
)
def test_repeated_invalids_suspend_once(
    recent_invalid: int, suspended: bool, after: bool, suspended_now: bool
) -> None:
    before = Trust(recent_invalid=recent_invalid, suspended=suspended)
    group = ledger.TrustGroup(node_id=1, kind="sleep", backend="cpu", events=("invalid",))
    change = ledger.trust_change(group, before, SETTINGS)
    assert (change.after.suspended, change.suspended_now) == (after, suspended_now)


def test_one_trust_group_per_node_kind_and_backend_in_result_order() -> None:
    found = [
        result(1, node=2, account=20),
        result(2, node=2, account=20),
        result(3, node=2, account=20, backend="cuda"),
        result(4, node=1, account=10),
    ]
    groups = ledger.trust_groups(found, {1: "valid", 2: "error", 3: "invalid", 4: "unchecked"})
    assert [(g.node_id, g.backend, g.events, g.account_id) for g in groups] == [
        (2, "cpu", ("valid", "error"), 20),
        (2, "cuda", ("invalid",), 20),
        (1, "cpu", ("unchecked",), 10),
    ]


def test_a_shard_reopened_for_a_check_counts_only_what_changed() -> None:
    """Its earlier results vote again: accepted unchecked before, one found valid now
    passed a check (its streak grows, its results do not), one found invalid counts so."""
    found = [result(1, node=1), result(2, node=2), result(3, node=3)]
    verdicts: dict[int, ResultVerdict] = {1: "valid", 2: "invalid", 3: "valid"}
    changes, delta = settle(found, verdicts, trust_counted=[1, 2])
    assert [(c.node_id, c.caught) for c in changes] == [(1, False), (2, True), (3, False)]
    checked = changes[0]
    assert checked.after.consecutive_valid == checked.before.consecutive_valid + 1
    assert checked.after.valid_total == checked.before.valid_total
    assert set(paid(delta)) == {1, 3}  # credit is once per task anyway (credit None here)


def test_a_suspected_result_s_verdict_settles_its_suspicion() -> None:
    """After its verdict event: cleared when valid (also when its shard was reopened and
    voted again), upheld otherwise; a result not suspected adds nothing."""
    found = [
        result(1, node=1, suspected=True),
        result(2, node=2, suspected=True),
        result(3, node=3, suspected=True),
        result(4, node=4),
    ]
    verdicts: dict[int, ResultVerdict] = {1: "valid", 2: "invalid", 3: "valid", 4: "valid"}
    groups = ledger.trust_groups(found, verdicts, trust_counted=[3])
    assert [(g.node_id, g.events) for g in groups] == [
        (1, ("valid", "cleared")),
        (2, ("invalid", "upheld")),
        (3, ("checked", "cleared")),
        (4, ("valid",)),
    ]


def test_quota_moves_with_the_verdicts_within_its_bounds() -> None:
    top = Trust(daily_quota=SETTINGS.max_daily_quota, consecutive_valid=3, valid_total=3)
    low = Trust(daily_quota=1)
    found = [result(1, node=1), result(2, node=2)]
    changes, _ = settle(found, {1: "valid", 2: "invalid"}, before={1: top, 2: low})
    assert [c.after.daily_quota for c in changes] == [SETTINGS.max_daily_quota, 1]


# -- credit held while a lone result's dispute is open ------------------------------------


@pytest.mark.parametrize(
    ("credit", "held", "why"),
    [
        (PRICE, -PRICE, "paid (vouched for): the payment comes off while it is disputed"),
        (None, None, "never paid: nothing to hold"),
        (0.0, None, "paid once and taken back, or paid nothing: nothing to hold"),
    ],
)
def test_a_disputed_lone_result_holds_what_it_was_paid(
    credit: float | None, held: float | None, why: str
) -> None:
    found = ledger.held(result(1, mode="alone", credit=credit))
    assert (found.amount if found else None) == held, why
    if found:
        assert (found.task_id, found.node_id, found.account_id, found.reason) == (1, 1, 10, "held")


# -- late results: trust, and whether they are paid ---------------------------------------


@pytest.mark.parametrize(
    ("agrees", "made_late", "outcome", "verdict", "is_paid"),
    [
        (True, False, "valid", "valid", False),  # a slow node: its shard's work was paid
        (True, True, "valid", "valid", True),  # a coordinator start made it late
        (False, True, "invalid", "invalid", False),  # a lie is never paid
        (False, False, "invalid", "invalid", False),
        (None, True, "moot", None, False),  # nothing to judge it by: no trust, no credit
        (None, False, "moot", None, False),
    ],
)
def test_a_late_result_counts_for_trust_and_is_paid_only_when_we_made_it_late(
    agrees: bool | None, made_late: bool, outcome: str, verdict: str | None, is_paid: bool
) -> None:
    judgement = ledger.late_judgement(agrees, made_late=made_late)
    assert (judgement.outcome, judgement.verdict, judgement.paid) == (outcome, verdict, is_paid)


# -- checks on record: what a node passed before, vouching for its lone results ---------


@pytest.mark.parametrize(
    ("outcome", "agreeing", "checked_output", "paid", "on_record", "why"),
    [
        ("valid", 2, False, False, True, "agreed with another node's result"),
        ("valid", 3, False, True, True, "agreed, and paid"),
        ("valid", 1, False, False, False, "valid alone: no second opinion"),
        ("invalid", 2, False, False, False, "outvoted"),
        ("error", 0, False, False, False, "failed"),
        (None, 2, False, False, False, "not judged"),
        ("valid", 2, True, False, False, "a check's pass no known answer confirmed yet"),
        ("valid", 2, True, True, True, "a check's pass a known answer confirmed (paid)"),
    ],
)
def test_a_check_on_record_agreed_with_another_node(
    outcome: str | None, agreeing: int, checked_output: bool, paid: bool, on_record: bool, why: str
) -> None:
    found = ledger.FinishedResult(
        finished_at=100.0,
        outcome=outcome,
        agreeing=agreeing,
        checked_output=checked_output,
        paid=paid,
    )
    assert ledger.on_record(found) is on_record, why


def test_the_latest_check_on_record_is_the_horizon() -> None:
    def finished(at: float, outcome: str) -> ledger.FinishedResult:
        return ledger.FinishedResult(
            finished_at=at, outcome=outcome, agreeing=2, checked_output=False, paid=False
        )

    assert ledger.latest_on_record([]) is None
    assert ledger.latest_on_record([finished(100.0, "invalid")]) is None
    found = [finished(100.0, "valid"), finished(300.0, "invalid"), finished(200.0, "valid")]
    assert ledger.latest_on_record(found) == 200.0


# -- confirmed passes: a check's pass paid once a right answer confirms it ----------------


@pytest.mark.parametrize(
    ("outcome", "job_completed", "credit", "finished_at", "last_lie", "answered", "why", "paid"),
    [
        ("valid", True, None, 100.0, None, 150.0, "a pass, then a right answer", True),
        ("valid", True, None, 150.0, None, 150.0, "answered as it finished", True),
        ("valid", True, None, 160.0, None, 150.0, "finished after the answer", False),
        ("valid", True, None, 100.0, None, None, "its node answered nothing right", False),
        ("valid", False, None, 100.0, None, 150.0, "its job did not complete", False),
        ("invalid", True, None, 100.0, None, 150.0, "it was a lie itself", False),
        (None, True, None, 100.0, None, 150.0, "not judged yet", False),
        ("error", True, None, 100.0, None, 150.0, "it failed", False),
        ("valid", True, PRICE, 100.0, None, 150.0, "paid already", False),
        ("valid", True, 0.0, 100.0, None, 150.0, "paid once (or taken back)", False),
        ("valid", True, None, 100.0, 90.0, 150.0, "after the node's latest lie", True),
        ("valid", True, None, 100.0, 100.0, 150.0, "as the node lied: not after", False),
        ("valid", True, None, 100.0, 120.0, 150.0, "before the node's latest lie", False),
        ("valid", True, None, None, None, 150.0, "never finished", False),
    ],
)
def test_a_right_answer_confirms_the_nodes_passes_since_its_last_lie(
    outcome: str | None,
    job_completed: bool,
    credit: float | None,
    finished_at: float | None,
    last_lie: float | None,
    answered: float | None,
    why: str,
    paid: bool,
) -> None:
    check = dataclasses.replace(result(1, credit=credit), finished_at=finished_at)
    passes = [ledger.CheckPass(result=check, outcome=outcome, job_completed=job_completed)]
    confirmed = ledger.confirmed_passes(
        passes,
        last_lie={} if last_lie is None else {1: last_lie},
        answered_until={} if answered is None else {1: answered},
    )
    assert confirmed == ([check] if paid else []), why


def test_confirmed_passes_are_judged_by_their_own_nodes_lies_and_answers() -> None:
    passes = [
        ledger.CheckPass(result=result(task, node=node), outcome="valid", job_completed=True)
        for task, node in ((1, 1), (2, 2), (3, 3))
    ]
    confirmed = ledger.confirmed_passes(
        passes, last_lie={2: 150.0}, answered_until={1: 200.0, 2: 200.0}
    )
    assert [r.task_id for r in confirmed] == [1]  # 2 lied since, 3 answered nothing
    delta = ledger.credit_delta([], {}, confirmed=confirmed)
    assert {g.task_id: (g.amount, g.reason) for g in delta.grants} == {1: (PRICE, "confirmed")}


# -- an admin lifts a suspension ------------------------------------------------------------


def test_a_lifted_suspension_starts_the_node_again_on_probation() -> None:
    caught = Trust(
        consecutive_valid=4,
        valid_total=30,
        invalid_total=3,
        error_total=2,
        recent_invalid=3,
        daily_quota=2,
        suspended=True,
        suspicions=1,
        held_streak=5,
        probes_passed=1,
    )
    after = ledger.lifted(caught)
    assert (after.suspended, after.recent_invalid, after.consecutive_valid) == (False, 0, 0)
    # Its record stays: totals, quota, open suspicions.
    assert (
        dataclasses.replace(after, suspended=True, recent_invalid=3, consecutive_valid=4) == caught
    )
