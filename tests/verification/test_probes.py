"""Known-answer checks of checkers (verification.probes, kinds/llm_generate/defects) and
what their answers change in trust and credit (verification.ledger), by table."""

from __future__ import annotations

import dataclasses

import pytest

from idlegrid.kinds.llm_generate import defects
from idlegrid.kinds.llm_generate.check import CROSS
from idlegrid.kinds.llm_generate.shard import Completion, Output
from idlegrid.verification import ledger, probes
from idlegrid.verification.credit import credit_for
from idlegrid.verification.ledger import JudgedResult
from idlegrid.verification.trust import Trust, TrustSettings

SETTINGS = TrustSettings()
PRICE = credit_for(1e12)


@pytest.mark.parametrize(
    ("passed", "rate", "established"),
    [(0, 0.5, False), (1, 0.35, False), (2, 0.245, True), (3, 0.1715, True), (20, 0.05, True)],
)
def test_new_checkers_get_the_most_known_answer_checks(
    passed: int, rate: float, established: bool
) -> None:
    trust = Trust(probes_passed=passed)
    assert probes.rate(trust) == pytest.approx(rate)
    assert probes.established(trust) is established
    assert probes.sends_probe(trust, draw=rate - 1e-9)
    assert not probes.sends_probe(trust, draw=rate)


def test_a_suspended_checker_is_never_established() -> None:
    assert not probes.established(Trust(probes_passed=50, suspended=True))


@pytest.mark.parametrize(
    ("verdict", "right"),
    [
        (("p" * 64, False), True),  # failed the planted claim
        (("p" * 64, True), False),  # passed it: a lazy or lying checker
        (("o" * 64, False), False),  # a verdict about another claim
        (None, False),  # no verdict at all
    ],
)
def test_a_known_answer_is_right_only_when_it_fails_the_planted_claim(
    verdict: tuple[str, bool] | None, right: bool
) -> None:
    assert probes.answered_right("fail", "p" * 64, verdict) is right


def test_a_right_answer_counts_for_the_record_and_a_wrong_one_resets_it() -> None:
    trust = Trust(probes_passed=2, consecutive_valid=5)
    right = ledger.step(trust, "answered", SETTINGS)
    assert right.probes_passed == 3 and right.consecutive_valid == 6
    wrong = ledger.step(right, "invalid", SETTINGS)
    assert wrong.probes_passed == 0 and wrong.consecutive_valid == 0
    held = ledger.step(trust, "held", SETTINGS)  # a pass counts for trust at once
    assert held.consecutive_valid == 6 and held.probes_passed == 2


def result(task_id: int, *, node: int = 1, credit: float | None = None) -> JudgedResult:
    return JudgedResult(
        task_id=task_id,
        node_id=node,
        account_id=10 + node,
        kind="llm-generate",
        backend="cpu",
        cost_flops=1e12,
        mode=None,
        credit=credit,
        finished_at=100.0,
    )


def test_a_pass_is_paid_only_once_a_known_answer_confirms_it() -> None:
    passes = [result(1), result(2)]
    held = ledger.credit_delta(passes, {1: "held", 2: "held"})
    assert held.grants == ()
    answer = result(3)
    delta = ledger.credit_delta([answer], {3: "answered"}, confirmed=passes)
    paid = {g.task_id: (g.amount, g.reason) for g in delta.grants}
    assert paid == {3: (PRICE, "valid"), 1: (PRICE, "confirmed"), 2: (PRICE, "confirmed")}
    # Paid once: a pass that was paid before is not paid again.
    again = ledger.credit_delta(
        [answer], {3: "answered"}, confirmed=[dataclasses.replace(passes[0], credit=PRICE)]
    )
    assert {g.task_id for g in again.grants} == {3}


def test_a_held_pass_vouches_for_nothing_and_a_right_answer_does() -> None:
    found = [result(1, node=5), result(2, node=6)]
    horizons = ledger.vouch_horizons(found, {1: "held", 2: "answered"})
    assert horizons == {6: 100.0}
    assert ledger.confirming({1: "held", 2: "answered"}, {1: 5, 2: 6}) == [6]


def _output(logprobs: list[list[float]], tokens: list[list[int]]) -> Output:
    return Output(
        completions=[
            Completion(index=i, text=f"t{i}", tokens=t, logprobs=lp, finish="length")
            for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))
        ],
        backend="cpu",
        build="b",
    )


@pytest.mark.parametrize("draw", [0.0, 0.3, 0.6, 0.99])
def test_a_planted_defect_is_beyond_every_margin_and_keeps_the_shape(draw: float) -> None:
    tokens = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    logprobs = [[-0.1 * (j + 1) for j in range(8)], [-0.2 * (j + 1) for j in range(8)]]
    honest = _output(logprobs, tokens)
    planted = defects.plant(honest, draw)
    assert [c.index for c in planted.completions] == [0, 1]
    assert [len(c.tokens) for c in planted.completions] == [8, 8]
    assert planted.build == honest.build
    if [c.tokens for c in planted.completions] != tokens:  # a replay: another context's
        assert planted.completions[0].tokens == tokens[1]
        return
    moved = [
        abs(a - b)
        for before, after in zip(honest.completions, planted.completions, strict=True)
        for a, b in zip(before.logprobs, after.logprobs, strict=True)
        if a != b
    ]
    assert len(moved) >= defects.MIN_SHIFTED
    assert min(moved) > CROSS.logprob and all(
        lp <= 0 for c in planted.completions for lp in c.logprobs
    )


def test_a_one_prompt_shard_gets_shifted_log_probabilities() -> None:
    honest = _output([[-0.5, -0.25]], [[3, 4]])
    planted = defects.plant(honest, 0.1)
    assert planted.completions[0].tokens == [3, 4]
    assert planted.completions[0].logprobs != [-0.5, -0.25]
