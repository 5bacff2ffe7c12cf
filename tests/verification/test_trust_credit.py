"""Table tests of the pure trust, credit and credibility-voting policy."""

from __future__ import annotations

import math

import pytest

from idlegrid.kinds.base import Verdict
from idlegrid.verification import credit, trust
from idlegrid.verification import quorum as verifier

S = trust.TrustSettings()


def _after(valid: int, invalid: int = 0) -> trust.Trust:
    record = trust.new_trust(S)
    for _ in range(valid):
        record = trust.after_valid(record, S)
    for _ in range(invalid):
        record = trust.after_invalid(record, S)
    return record


# -- trust -------------------------------------------------------------------------------


def test_valid_results_build_trust_and_quota() -> None:
    record = _after(12)
    assert (record.consecutive_valid, record.valid_total) == (12, 12)
    assert record.daily_quota == S.initial_daily_quota + 12
    assert record.error_rate == 0.0


def test_invalid_resets_trust_and_halves_quota() -> None:
    record = trust.after_invalid(_after(30), S)
    assert record.consecutive_valid == 0
    assert record.daily_quota == (S.initial_daily_quota + 30) // 2
    assert record.invalid_total == 1 and not record.suspended


def test_repeated_invalids_suspend() -> None:
    record = _after(5, invalid=S.suspend_after_invalids)
    assert record.suspended
    assert trust.credibility(record, S) == 0.0
    assert not trust.may_run_alone(record, S, draw=0.0)


def test_quota_never_below_one_nor_above_max() -> None:
    record = _after(0, invalid=20)
    assert record.daily_quota == 1
    big = trust.Trust(daily_quota=S.max_daily_quota)
    assert trust.after_valid(big, S).daily_quota == S.max_daily_quota


def test_old_invalids_are_forgiven_slowly() -> None:
    record = _after(0, invalid=1)
    for _ in range(S.invalid_window):
        record = trust.after_valid(record, S)
    assert record.recent_invalid == 0


def test_errors_count_in_the_error_rate_but_are_not_lies() -> None:
    record = trust.after_error(_after(3))
    assert record.consecutive_valid == 3  # a crash or a missed deadline is no failed check
    assert math.isclose(record.error_rate, 1 / 4)
    assert record.daily_quota == _after(3).daily_quota


@pytest.mark.parametrize(
    ("valid", "expected"),
    [(0, 0.8), (1, 0.9), (4, 0.96), (99, 0.998)],
)
def test_credibility_grows_with_the_streak(valid: int, expected: float) -> None:
    assert math.isclose(trust.credibility(_after(valid), S), expected)


@pytest.mark.parametrize(
    ("valid", "draw", "alone"),
    [
        (9, 0.0, False),  # below N: never alone
        (10, 0.89, True),  # p = 1 - 1/10 = 0.9
        (10, 0.91, False),
        (100, 0.985, True),  # p = 0.99
        (100, 0.995, False),
    ],
)
def test_adaptive_replication_follows_boincs_rule(valid: int, draw: float, alone: bool) -> None:
    boinc = trust.TrustSettings(adaptive_after=10)
    assert trust.may_run_alone(_after(valid), boinc, draw=draw) is alone


def test_default_streak_before_running_alone() -> None:
    n = S.adaptive_after
    assert not trust.may_run_alone(_after(n - 1), S, draw=0.0)
    assert trust.may_run_alone(_after(n), S, draw=0.0)
    assert trust.is_trusted(_after(n), S) and not trust.is_trusted(_after(n - 1), S)


def test_unchecked_results_earn_quota_but_not_streak() -> None:
    record = trust.after_unchecked(_after(5), S)
    assert (record.consecutive_valid, record.valid_total) == (5, 6)
    assert record.daily_quota == S.initial_daily_quota + 6


@pytest.mark.parametrize(
    ("invalid", "expected"),
    [(0, 1 - 0.2 / 6), (1, (1 - 0.2 / 6) / 2), (2, (1 - 0.2 / 6) / 4)],
)
def test_caught_nodes_count_for_less_than_new_ones(invalid: int, expected: float) -> None:
    record = _after(0, invalid)
    for _ in range(5):
        record = trust.after_valid(record, S)
    assert math.isclose(trust.credibility(record, S), expected)


@pytest.mark.parametrize(
    ("replication", "expected"),
    [
        (1, 0.8 - 1e-9),  # one new node: 0.8, so a replication-1 job is never stuck
        (2, 0.64 / 0.68 - 1e-9),  # two new nodes agreeing: 0.941
        (3, 0.95),  # three new nodes reach 0.985: the setting applies
        (5, 0.95),
    ],
)
def test_required_credibility(replication: int, expected: float) -> None:
    assert math.isclose(trust.required_credibility(S, replication), expected)


def test_a_result_run_alone_needs_what_its_node_had_when_let_alone() -> None:
    assert trust.required_credibility_alone(S) == S.min_credibility  # N = 80: 0.9975
    short = trust.TrustSettings(adaptive_after=2)
    needed = trust.required_credibility_alone(short)
    assert needed < trust.credibility(_after(2), short) < S.min_credibility
    assert trust.credibility(_after(2, invalid=1), short) < needed


def test_two_new_colluders_do_not_reach_the_quorum_three_new_honest_nodes_do() -> None:
    need = trust.required_credibility(S, 3)
    new = trust.credibility(trust.new_trust(S), S)
    two = verifier.group_posteriors([[1, 2]], {1: new, 2: new})[0]
    three = verifier.group_posteriors([[1, 2, 3]], {1: new, 2: new, 3: new})[0]
    assert two < need <= three


def test_spot_check_rate() -> None:
    assert trust.needs_spot_check(S, draw=S.spot_check_rate - 1e-9)
    assert not trust.needs_spot_check(S, draw=S.spot_check_rate)


# -- credit ------------------------------------------------------------------------------


def test_credit_is_priced_from_flops() -> None:
    one_gflops_day = 1e9 * credit.SECONDS_PER_DAY
    assert math.isclose(credit.credit_for(one_gflops_day), 200.0)
    assert credit.credit_for(-5) == 0.0


def test_recent_average_halves_in_a_week() -> None:
    totals = credit.grant(credit.CreditTotals(), 100.0, now=0.0)
    now_rate = credit.recent_average(totals, now=0.0)
    week_later = credit.recent_average(totals, now=credit.WEEK_S)
    assert math.isclose(week_later, now_rate / 2)
    assert totals.total == 100.0


def test_recent_average_converges_to_the_daily_rate() -> None:
    totals = credit.CreditTotals()
    for day in range(200):
        totals = credit.grant(totals, 50.0, now=day * credit.SECONDS_PER_DAY)
    rate = credit.recent_average(totals, now=199 * credit.SECONDS_PER_DAY)
    assert 48 < rate < 55  # ~50 per day (daily lumps: within one day's decay)


# -- credibility voting ---------------------------------------------------------------------


def _same(a: bytes, b: bytes) -> Verdict:
    return Verdict.AGREE if a == b else Verdict.DISAGREE


def test_two_new_colluders_do_not_outvote_one_trusted_node() -> None:
    results = [(1, b"wrong"), (2, b"wrong"), (3, b"right")]
    cred = {1: 0.8, 2: 0.8, 3: 1 - 0.2 / 51}
    decision = verifier.decide(
        results, _same, min_quorum=2, credibility=cred, min_credibility=0.999
    )
    assert decision.canonical is None  # more replicas needed, nothing accepted


def test_credible_majority_is_accepted() -> None:
    results = [(1, b"right"), (2, b"right"), (3, b"wrong")]
    cred = {1: 0.99, 2: 0.995, 3: 0.8}
    decision = verifier.decide(
        results, _same, min_quorum=2, credibility=cred, min_credibility=0.999
    )
    assert decision.canonical == 1
    assert decision.valid == (1, 2) and decision.invalid == (3,)


def test_two_new_nodes_agreeing_need_more_evidence() -> None:
    results = [(1, b"x"), (2, b"x")]
    cred = {1: 0.8, 2: 0.8}
    posterior = verifier.group_posteriors([[1, 2]], cred)[0]
    assert math.isclose(posterior, 0.64 / (0.64 + 0.04))
    assert (
        verifier.decide(
            results, _same, min_quorum=2, credibility=cred, min_credibility=0.999
        ).canonical
        is None
    )
    assert (
        verifier.decide(
            results + [(3, b"x")],
            _same,
            min_quorum=2,
            credibility={**cred, 3: 0.8},
            min_credibility=0.98,
        ).canonical
        == 1
    )


def test_without_credibility_votes_decide() -> None:
    results = [(1, b"a"), (2, b"b"), (3, b"b")]
    decision = verifier.decide(results, _same, min_quorum=2)
    assert decision.canonical == 2 and decision.invalid == (1,)


def test_all_disagree_decides_nothing() -> None:
    results = [(1, b"a"), (2, b"b"), (3, b"c")]
    assert verifier.decide(results, _same, min_quorum=2).canonical is None


def test_same_result_twice_from_one_task_counts_once() -> None:
    # The store records one result per task; a duplicate send never reaches the verifier.
    results = [(1, b"a")]
    assert verifier.decide(results, _same, min_quorum=2).canonical is None


@pytest.mark.parametrize(
    ("assigned", "finished", "deadline", "starts", "paid"),
    [
        (0.0, 120.0, 100.0, [(50.0, 30.0)], True),  # a start during the lease; within grace
        (0.0, 131.0, 100.0, [(50.0, 30.0)], False),  # past lease + grace
        (0.0, 90.0, 100.0, [], False),  # no start: late for its own reasons
        (60.0, 90.0, 100.0, [(50.0, 30.0)], False),  # leased after the start
        (0.0, 40.0, 100.0, [(50.0, 30.0)], False),  # returned before the start
        (None, 40.0, 100.0, [(20.0, 30.0)], False),  # never leased
    ],
)
def test_a_late_result_is_paid_when_a_coordinator_start_made_it_late(
    assigned: float | None,
    finished: float,
    deadline: float,
    starts: list[tuple[float, float]],
    paid: bool,
) -> None:
    assert (
        credit.late_result_paid(
            assigned_at=assigned, finished_at=finished, lease_deadline=deadline, starts=starts
        )
        == paid
    )


@pytest.mark.parametrize(
    ("node_suspended", "trust_suspended", "quota", "used", "refused", "left"),
    [
        (False, False, 10, 0, None, 10),
        (False, False, 10, 9, None, 1),
        (False, False, 10, 10, "quota", 0),  # its daily quota claimed
        (False, False, 10, 12, "quota", 0),  # over it (a smaller quota since): none, not less
        (True, False, 10, 0, "suspended", 0),  # an admin suspended the node
        (False, True, 10, 0, "suspended", 0),  # its trust on the kind is suspended
        (True, True, 10, 10, "suspended", 0),  # suspended says why before the quota
    ],
)
def test_who_may_claim_and_how_many(
    node_suspended: bool,
    trust_suspended: bool,
    quota: int,
    used: int,
    refused: str | None,
    left: int,
) -> None:
    found = trust.Trust(daily_quota=quota, suspended=trust_suspended)
    assert trust.claim_refused(found, node_suspended=node_suspended, used_today=used) == refused
    assert trust.claims_left(found, node_suspended=node_suspended, used_today=used) == left
