"""The ledger's rules: what a set of verdicts changes in trust and credit. Pure.

The store reads the results that got a verdict (`JudgedResult`) and their nodes' trust;
`trust_change` says what each node's trust becomes, and the store writes it (a node
caught lying sends its lone shards back to replication: `verification.recheck`). Then
it reads the lone results a passed check vouches for (`vouch_horizons`), and
`credit_delta` says who is paid how much and why; the store writes exactly that. All
in the transaction of the verdicts: a verdict, the trust it changes and the credit it
grants commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from idlegrid.verification import credit as credit_rules
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.replication import ResultVerdict
from idlegrid.verification.trust import Trust, TrustSettings

# What changes a node's trust: a verdict on one of its results, an error charged at
# expiry taken back (the task delivered after all), or a spot check of a result it ran
# alone that disagreed (suspected until the quorum says who lied), or a result accepted
# unchecked (run alone) that a later check of its shard found valid; and after the
# verdict on a suspected result, whether the suspicion was cleared or upheld.
TrustEvent = ResultVerdict | Literal["error withdrawn", "suspected", "checked", "cleared", "upheld"]

# Why a task is paid: it agreed with another node's result ("valid"); it was accepted
# without a second opinion in a shard not run alone ("unchecked": replication 1); it was
# decided alone and a later check of its node vouches for it ("vouched").
# A check that passed an output is paid when a known-answer check its node answered right
# after it confirms its word ("confirmed").
# Credit is taken back from a result found invalid ("taken back"), or held back from one
# run alone whose dispute is open ("held": it may be paid again by its shard's decision).
GrantReason = Literal["valid", "unchecked", "vouched", "confirmed", "taken back", "held"]


@dataclass(frozen=True, kw_only=True)
class JudgedResult:
    """A result that got a verdict (or may be vouched for), as the ledger reads it."""

    task_id: int
    node_id: int
    account_id: int
    kind: str
    backend: str
    cost_flops: float  # the shard's estimate, made by the coordinator: the price
    mode: str | None  # its shard's: "alone" had no second opinion
    credit: float | None  # granted so far (None: never paid; 0: paid once, or taken back)
    finished_at: float | None
    suspected: bool = False  # a spot check of it disagreed (`trust.after_suspected`)


@dataclass(frozen=True, kw_only=True)
class TrustGroup:
    """What happened to one node on one kind and backend, in task order."""

    node_id: int
    kind: str
    backend: str
    events: tuple[TrustEvent, ...]
    account_id: int | None = None


@dataclass(frozen=True, kw_only=True)
class TrustChange:
    """A node's trust before and after its events, and what follows from them."""

    node_id: int
    kind: str
    backend: str
    account_id: int | None
    before: Trust
    after: Trust
    # Caught once (an invalid verdict): whatever it ran or decided alone is replicated
    # again, now (`verification.recheck`).
    caught: bool

    @property
    def suspended_now(self) -> bool:
        """Suspended by these events: the node gets no tasks, its account is flagged
        (suspension is for good: `trust.after_invalid`)."""
        return self.after.suspended and not self.before.suspended


@dataclass(frozen=True, kw_only=True)
class Grant:
    """Credit to (or, negative, from) a task's node and account."""

    task_id: int
    node_id: int
    account_id: int
    cost_flops: float
    amount: float
    reason: GrantReason


@dataclass(frozen=True)
class CreditDelta:
    """Credit taken back from results found wrong since, and credit granted."""

    taken_back: tuple[Grant, ...] = ()
    grants: tuple[Grant, ...] = ()


def trust_groups(
    results: Sequence[JudgedResult],
    verdict_of: Mapping[int, ResultVerdict],
    trust_counted: Collection[int] = (),
) -> list[TrustGroup]:
    """The verdicts each node's trust counts, one group per node, kind and backend.

    One trust read and write per group however many verdicts it got (a batch of results
    from one node is the common case); the events keep the results' order. A result in
    `trust_counted` (a shard decided alone, reopened for a check, voted again) was
    counted as accepted unchecked: found valid now, it passed a check, which lengthens
    its node's streak ("checked") but is not a second result; found invalid, it counts so.
    """
    events: dict[tuple[int, str, str], list[TrustEvent]] = {}
    account_of: dict[tuple[int, str, str], int] = {}
    for result in results:
        verdict = verdict_of[result.task_id]
        happened: list[TrustEvent] = [verdict]
        if result.task_id in trust_counted and verdict != "invalid":
            happened = ["checked"] if verdict in ("valid", "held") else []
        if result.suspected:
            happened.append("cleared" if verdict == "valid" else "upheld")
        if not happened:
            continue
        key = (result.node_id, result.kind, result.backend)
        events.setdefault(key, []).extend(happened)
        account_of.setdefault(key, result.account_id)
    return [
        TrustGroup(
            node_id=node_id,
            kind=kind,
            backend=backend,
            events=tuple(found),
            account_id=account_of[(node_id, kind, backend)],
        )
        for (node_id, kind, backend), found in events.items()
    ]


def step(trust: Trust, event: TrustEvent, settings: TrustSettings) -> Trust:
    """A node's trust after one event (`verification.trust` says how each one counts)."""
    match event:
        case "valid" | "held":
            return trust_rules.after_valid(trust, settings)
        case "answered":
            return trust_rules.after_answered(trust, settings)
        case "unchecked":
            return trust_rules.after_unchecked(trust, settings)
        case "invalid":
            return trust_rules.after_invalid(trust, settings)
        case "error":
            return trust_rules.after_error(trust)
        case "error withdrawn":
            return trust_rules.after_error_withdrawn(trust)
        case "suspected":
            return trust_rules.after_suspected(trust)
        case "checked":
            return trust_rules.after_checked_later(trust)
        case "cleared":
            return trust_rules.after_cleared(trust)
        case "upheld":
            return trust_rules.after_upheld(trust)


def lifted(before: Trust) -> Trust:
    """A node's trust on one kind and backend once an admin lifted its suspension."""
    return trust_rules.after_suspension_lifted(before)


def trust_change(group: TrustGroup, before: Trust, settings: TrustSettings) -> TrustChange:
    """The group's events stepped through one by one, from the node's trust `before`."""
    after = before
    for event in group.events:
        after = step(after, event, settings)
    return TrustChange(
        node_id=group.node_id,
        kind=group.kind,
        backend=group.backend,
        account_id=group.account_id,
        before=before,
        after=after,
        caught="invalid" in group.events,
    )


def confirming(verdict_of: Mapping[int, ResultVerdict], node_of: Mapping[int, int]) -> list[int]:
    """The nodes whose earlier passes these verdicts confirm: those that answered a
    known-answer check right here, in node order."""
    return sorted({node_of[t] for t, verdict in verdict_of.items() if verdict == "answered"})


@dataclass(frozen=True, kw_only=True)
class CheckPass:
    """A check of another node's output (not a known-answer probe), unpaid, as the rule
    of confirmed passes reads it."""

    result: JudgedResult
    outcome: str | None  # its verdict as stored: "valid" passed the output it checked
    job_completed: bool  # its job completed with the output it passed


def confirmed_passes(
    passes: Iterable[CheckPass],
    *,
    last_lie: Mapping[int, float],
    answered_until: Mapping[int, float],
) -> list[JudgedResult]:
    """The passes that a right answer to a known-answer check confirms, to be paid
    ("confirmed" in `credit_delta`): a check that passed an output, unpaid, of a job that
    completed, finished after its node's latest lie (`last_lie`: node -> when its latest
    invalid result finished) and no later than the right answer that confirms it
    (`answered_until`: node -> when that answer finished; a node absent has none)."""
    confirmed = []
    for check in passes:
        result = check.result
        until = answered_until.get(result.node_id)
        if (
            check.outcome == "valid"
            and check.job_completed
            and result.credit is None
            and until is not None
            and result.finished_at is not None
            and last_lie.get(result.node_id, 0.0) < result.finished_at <= until
        ):
            confirmed.append(result)
    return confirmed


@dataclass(frozen=True, kw_only=True)
class FinishedResult:
    """A node's finished result, as the rule of checks on record reads it."""

    finished_at: float
    outcome: str | None  # its verdict as stored
    agreeing: int  # the valid results of its shard, itself included
    checked_output: bool  # a check of another node's output: its pass is paid once confirmed
    paid: bool  # credit was granted to it (or taken back since)


def on_record(result: FinishedResult) -> bool:
    """Whether a result counts as a check its node passed (`vouch_horizons`'
    `checks_on_record`): it agreed with another node's (valid, in a shard with two valid
    results or more), and a check's pass only once a known answer confirmed it (paid)."""
    return (
        result.outcome == "valid"
        and result.agreeing >= 2
        and (not result.checked_output or result.paid)
    )


def latest_on_record(results: Iterable[FinishedResult]) -> float | None:
    """When the latest of these results that is a check on record finished (None: none is)."""
    return max((r.finished_at for r in results if on_record(r)), default=None)


def vouch_horizons(
    results: Sequence[JudgedResult],
    verdict_of: Mapping[int, ResultVerdict],
    checks_on_record: Mapping[int, float] | None = None,
) -> dict[int, float]:
    """Per node that passed a check here (a valid verdict), or that has a lone result
    accepted here and passed a check before (`checks_on_record`: node -> when its latest
    recorded check finished), when its latest check finished: the results it decided
    alone up to then are vouched for, in node order.

    The node cannot tell which of its shards run alone, nor which result will be checked,
    so a check it passes speaks for its lone results before it (as in BOINC), whichever
    of the two was judged first: a lone result decided after a later check of its node
    (results are judged out of order after a coordinator's restart, or by two
    coordinators at once) is vouched for by that check too.
    """
    last_check: dict[int, float] = {}
    for result in results:
        # A pass not yet confirmed ("held") vouches for nothing: it may be a lazy one.
        if verdict_of[result.task_id] in ("valid", "answered"):
            finished = result.finished_at or 0.0
            last_check[result.node_id] = max(last_check.get(result.node_id, 0.0), finished)
    for node_id, finished in (checks_on_record or {}).items():
        last_check[node_id] = max(last_check.get(node_id, finished), finished)
    return dict(sorted(last_check.items()))


def accepted_alone(
    results: Iterable[JudgedResult], verdict_of: Mapping[int, ResultVerdict]
) -> dict[int, float]:
    """Per node with a result decided alone here (pending until a check vouches for it),
    when its earliest such result finished, in node order: the store reads the checks
    each node passed since (`vouch_horizons`' `checks_on_record`)."""
    since: dict[int, float] = {}
    for r in results:
        if r.mode == "alone" and verdict_of[r.task_id] in ("valid", "unchecked"):
            finished = r.finished_at or 0.0
            since[r.node_id] = min(since.get(r.node_id, finished), finished)
    return dict(sorted(since.items()))


def vouched_for(result: JudgedResult, horizons: Mapping[int, float]) -> bool:
    """A result decided alone that its node's later check vouches for."""
    until = horizons.get(result.node_id)
    return (
        result.mode == "alone"
        and until is not None
        and result.finished_at is not None
        and result.finished_at <= until
    )


@dataclass(frozen=True, kw_only=True)
class LoneResult:
    """A node's result in a shard decided alone, as the rule of vouched results reads it."""

    result: JudgedResult
    outcome: str | None  # its verdict as stored: "valid" accepted it


def vouched_results(
    lone: Iterable[LoneResult], horizons: Mapping[int, float]
) -> list[JudgedResult]:
    """The lone results a check of their node may pay (`credit_delta`'s `vouched`), in the
    order given: accepted (stored valid), unpaid, decided alone by a node with a horizon
    and finished no later than it (`vouched_for`)."""
    return [
        lone_result.result
        for lone_result in lone
        if lone_result.outcome == "valid"
        and lone_result.result.credit is None
        and vouched_for(lone_result.result, horizons)
    ]


def credit_delta(
    results: Sequence[JudgedResult],
    verdict_of: Mapping[int, ResultVerdict],
    vouched: Iterable[JudgedResult] = (),
    *,
    credit: bool = True,
    checks_on_record: Mapping[int, float] | None = None,
    confirmed: Iterable[JudgedResult] = (),
) -> CreditDelta:
    """The payment rule: who is paid how much, and whose credit is taken back.

    Credit is for validated work only, priced from the shard's cost estimate (never from
    anything the node said), once per task: a result paid before (`credit` not None) is
    never paid again. A valid result is paid; so is one accepted unchecked in a shard not
    run alone (replication 1). A result decided alone is pending until its node passes
    a check after it (`vouched`: the node's accepted, unpaid lone results up to
    `vouch_horizons`, as `vouched_results` names them, with the checks its nodes passed
    before, `checks_on_record`; those `vouched_for` are paid). `credit` False: a result
    that came after its shard was decided and credited is paid for nothing (the work is
    paid once), though it still vouches for its node's earlier lone results. A result
    found invalid that was paid (accepted alone, then rechecked) has its credit taken back.
    A check that passed an output ("held") is paid only when a known-answer check its
    node answered right ("answered", paid as valid) confirms it: `confirmed`, the node's
    unpaid passes since its last lie, which the store reads for each such node.
    """
    taken_back = tuple(
        _grant(result, -result.credit, "taken back")
        for result in results
        if verdict_of[result.task_id] == "invalid" and result.credit
    )
    paying: dict[int, tuple[JudgedResult, GrantReason]] = {}
    for result in results if credit else ():
        verdict = verdict_of[result.task_id]
        if verdict in ("valid", "answered"):
            paying[result.task_id] = (result, "valid")
        elif verdict == "unchecked" and result.mode != "alone":
            paying[result.task_id] = (result, verdict)
    for result in confirmed:
        if verdict_of.get(result.task_id) not in ("invalid", "held"):
            paying.setdefault(result.task_id, (result, "confirmed"))
    horizons = vouch_horizons(results, verdict_of, checks_on_record)
    for result in vouched:
        if vouched_for(result, horizons) and (credit or result.task_id not in verdict_of):
            paying.setdefault(result.task_id, (result, "vouched"))
    grants = tuple(
        _grant(result, credit_rules.credit_for(result.cost_flops), reason)
        for result, reason in paying.values()
        if result.credit is None
    )
    return CreditDelta(taken_back=taken_back, grants=grants)


def held(result: JudgedResult) -> Grant | None:
    """A result run alone and now disputed is paid nothing while its dispute is open: the
    credit it was paid (vouched for since) is taken back, and it is unpaid again, so its
    shard's decision pays it if it is found valid. None: it was paid nothing to hold."""
    if not result.credit or result.credit <= 0.0:
        return None
    return _grant(result, -result.credit, "held")


@dataclass(frozen=True)
class LateJudgement:
    """What a result stored after its shard was decided comes to."""

    outcome: Literal["valid", "invalid", "moot"]
    verdict: ResultVerdict | None  # for its node's trust; None: no trust change
    paid: bool  # whether it earns credit (`credit.late_result_paid`)


def late_judgement(agrees: bool | None, *, made_late: bool) -> LateJudgement:
    """A late result judged against its shard's canonical one (`agrees` None: nothing to
    judge it by, "moot"). It counts for its node's trust as any check does; the shard's
    work was credited with its decision, and is paid again only when it agrees and a
    coordinator start made it late (`made_late`)."""
    if agrees is None:
        return LateJudgement("moot", None, paid=False)
    if not agrees:
        return LateJudgement("invalid", "invalid", paid=False)
    return LateJudgement("valid", "valid", paid=made_late)


def per_node(grants: Iterable[Grant]) -> dict[int, float]:
    """Credit per node, in the order the grants name them."""
    return _sum((g.node_id, g.amount) for g in grants)


def per_account(grants: Iterable[Grant]) -> dict[int, float]:
    """Credit per account, in the order the grants name them."""
    return _sum((g.account_id, g.amount) for g in grants)


def _sum(amounts: Iterable[tuple[int, float]]) -> dict[int, float]:
    total: dict[int, float] = {}
    for owner, amount in amounts:
        total[owner] = total.get(owner, 0.0) + amount
    return total


def _grant(result: JudgedResult, amount: float, reason: GrantReason) -> Grant:
    return Grant(
        task_id=result.task_id,
        node_id=result.node_id,
        account_id=result.account_id,
        cost_flops=result.cost_flops,
        amount=amount,
        reason=reason,
    )
