"""Pure policy: the verifier's quorum and the scheduler's filter and ranking, by tables."""

from __future__ import annotations

import pytest

from idlegrid.kinds.base import Requirements, Verdict
from idlegrid.policy import scheduler
from idlegrid.policy.scheduler import Candidate, NodeView, Weights
from idlegrid.verification import quorum as verifier

# -- verifier -------------------------------------------------------------------------------


def _compare(a: bytes, b: bytes) -> Verdict:
    """Equal outputs agree; "?" (a noisy output) is inconclusive with anything."""
    if a == b"?" or b == b"?":
        return Verdict.INCONCLUSIVE
    return Verdict.AGREE if a == b else Verdict.DISAGREE


def _results(*outputs: tuple[int, str]) -> list[tuple[int, bytes]]:
    return [(task_id, output.encode()) for task_id, output in outputs]


# (results in arrival order, min_quorum, canonical, valid, invalid)
DECISIONS = [
    ("single-result-quorum-1", _results((1, "a")), 1, 1, (1,), ()),
    ("single-result-quorum-2", _results((1, "a")), 2, None, (), ()),
    ("no-results", [], 1, None, (), ()),
    ("two-agree", _results((1, "a"), (2, "a")), 2, 1, (1, 2), ()),
    ("two-disagree", _results((1, "a"), (2, "b")), 2, None, (), ()),
    ("2-of-3", _results((1, "a"), (2, "b"), (3, "a")), 2, 1, (1, 3), (2,)),
    ("2-of-3-dissenter-first", _results((5, "b"), (6, "a"), (7, "a")), 2, 6, (6, 7), (5,)),
    ("three-disagree", _results((1, "a"), (2, "b"), (3, "c")), 2, None, (), ()),
    ("quorum-3-of-4", _results((1, "a"), (2, "a"), (3, "b"), (4, "a")), 3, 1, (1, 2, 4), (3,)),
    ("quorum-3-short", _results((1, "a"), (2, "a"), (3, "b")), 3, None, (), ()),
    ("inconclusive-not-invalid", _results((1, "a"), (2, "?"), (3, "a")), 2, 1, (1, 3), ()),
    ("inconclusive-alone", _results((1, "?"), (2, "?")), 2, None, (), ()),
    ("quorum-1-first-wins", _results((4, "a"), (3, "b")), 1, 4, (4,), (3,)),
    (
        "biggest-group-wins",
        _results((1, "b"), (2, "a"), (3, "a"), (4, "b"), (5, "a")),
        2,
        2,
        (2, 3, 5),
        (1, 4),
    ),
]


@pytest.mark.parametrize(
    ("results", "min_quorum", "canonical", "valid", "invalid"),
    [row[1:] for row in DECISIONS],
    ids=[row[0] for row in DECISIONS],
)
def test_decide(
    results: list[tuple[int, bytes]],
    min_quorum: int,
    canonical: int | None,
    valid: tuple[int, ...],
    invalid: tuple[int, ...],
) -> None:
    decision = verifier.decide(results, _compare, min_quorum=min_quorum)
    assert decision.canonical == canonical
    assert decision.valid == valid
    assert decision.invalid == invalid
    assert decision.fail_reason is None


def test_decide_refuses_a_quorum_below_one() -> None:
    with pytest.raises(ValueError, match="min_quorum"):
        verifier.decide(_results((1, "a")), _compare, min_quorum=0)


def test_decide_does_not_depend_on_compare_call_order() -> None:
    calls: list[tuple[bytes, bytes]] = []

    def recording(a: bytes, b: bytes) -> Verdict:
        calls.append((a, b))
        return _compare(a, b)

    decision = verifier.decide(_results((1, "a"), (2, "a")), recording, min_quorum=2)
    assert decision.canonical == 1
    assert calls  # it really used the kind's compare


# -- scheduler ------------------------------------------------------------------------------

NOW = 10_000.0


def _node(
    *,
    kinds: tuple[str, ...] = ("sleep", "embed-text"),
    backends: tuple[str, ...] = ("cpu",),
    memory_mb: int = 8000,
    gflops: float = 100.0,
) -> NodeView:
    return NodeView(
        node_id=1,
        kinds=frozenset(kinds),
        backends=frozenset(backends),
        memory_mb=memory_mb,
        gflops=gflops,
    )


def _task(
    task_id: int,
    *,
    kind: str = "sleep",
    priority: int = 0,
    age_s: float = 0.0,
    backends: tuple[str, ...] = (),
    min_memory_mb: int = 0,
    min_gflops: float = 0.0,
) -> Candidate:
    return Candidate(
        task_id=task_id,
        job_id=1,
        kind=kind,
        priority=priority,
        created_at=NOW - age_s,
        requirements=Requirements(
            backends=frozenset(backends), min_memory_mb=min_memory_mb, min_gflops=min_gflops
        ),
    )


CPU_ONLY = _node()
CUDA_NODE = _node(backends=("cpu", "cuda"))
MAC = _node(backends=("cpu", "mps"))

# (name, node, candidate, can run)
FILTERS = [
    ("kind-offered", CPU_ONLY, _task(1), True),
    ("kind-not-offered", _node(kinds=("embed-text",)), _task(1), False),
    ("no-kinds", _node(kinds=()), _task(1), False),
    ("any-backend", CPU_ONLY, _task(1, backends=()), True),
    ("cpu-only-never-gets-cuda", CPU_ONLY, _task(1, backends=("cuda",)), False),
    ("cuda-node-gets-cuda", CUDA_NODE, _task(1, backends=("cuda",)), True),
    ("mps-node-no-cuda", MAC, _task(1, backends=("cuda",)), False),
    ("one-of-several-backends", MAC, _task(1, backends=("cuda", "mps")), True),
    ("cpu-task-on-gpu-node", CUDA_NODE, _task(1, backends=("cpu",)), True),
    ("memory-enough", _node(memory_mb=8000), _task(1, min_memory_mb=8000), True),
    ("memory-short", _node(memory_mb=7999), _task(1, min_memory_mb=8000), False),
    ("gflops-enough", _node(gflops=50.0), _task(1, min_gflops=50.0), True),
    ("gflops-short", _node(gflops=49.9), _task(1, min_gflops=50.0), False),
    ("unbenchmarked-no-need", _node(gflops=0.0), _task(1), True),
    ("unbenchmarked-with-need", _node(gflops=0.0), _task(1, min_gflops=1.0), False),
    (
        "all-needs-met",
        CUDA_NODE,
        _task(1, backends=("cuda",), min_memory_mb=4000, min_gflops=10.0),
        True,
    ),
    ("one-need-missed", CUDA_NODE, _task(1, backends=("cuda",), min_memory_mb=9000), False),
]


@pytest.mark.parametrize(
    ("node", "candidate", "expected"), [row[1:] for row in FILTERS], ids=[row[0] for row in FILTERS]
)
def test_can_run(node: NodeView, candidate: Candidate, expected: bool) -> None:
    assert scheduler.can_run(node, candidate) is expected
    ranked = scheduler.rank(node, [candidate], now=NOW)
    assert [c.task_id for c in ranked] == ([candidate.task_id] if expected else [])


# (name, candidates, expected order of task ids)
ORDERS = [
    (
        "priority-first",
        [_task(1, priority=0), _task(2, priority=5), _task(3, priority=-1)],
        [2, 1, 3],
    ),
    ("older-first", [_task(1, age_s=10), _task(2, age_s=100), _task(3, age_s=50)], [2, 3, 1]),
    ("ties-by-task-id", [_task(3), _task(1), _task(2)], [1, 2, 3]),
    # Age saturates below one priority step (so it cannot outweigh fair share either).
    ("priority-beats-minutes", [_task(1, age_s=300), _task(2, priority=1)], [2, 1]),
    ("priority-beats-hours", [_task(1, age_s=3 * 3600), _task(2, priority=1)], [2, 1]),
    ("future-created-counts-as-new", [_task(1, age_s=-100), _task(2, age_s=0)], [1, 2]),
    (
        "unrunnable-dropped",
        [_task(1, backends=("cuda",), priority=99), _task(2, kind="x"), _task(3)],
        [3],
    ),
]


@pytest.mark.parametrize(
    ("candidates", "order"), [row[1:] for row in ORDERS], ids=[row[0] for row in ORDERS]
)
def test_rank(candidates: list[Candidate], order: list[int]) -> None:
    assert [c.task_id for c in scheduler.rank(CPU_ONLY, candidates, now=NOW)] == order


def test_rank_follows_the_weights() -> None:
    old, urgent = _task(1, age_s=300), _task(2, priority=1)
    age_heavy = Weights(priority=1.0, age=5.0)
    assert [
        c.task_id for c in scheduler.rank(CPU_ONLY, [old, urgent], now=NOW, weights=age_heavy)
    ] == [1, 2]


def test_cpu_only_node_never_gets_a_cuda_task_from_a_mixed_queue() -> None:
    queue = [_task(i, backends=("cuda",) if i % 2 else (), priority=i) for i in range(1, 41)]
    ranked = scheduler.rank(CPU_ONLY, queue, now=NOW)
    assert ranked and all(not c.requirements.backends for c in ranked)
    assert len(scheduler.rank(CUDA_NODE, queue, now=NOW)) == 40


def test_score_sums_priority_and_saturating_age() -> None:
    weights = Weights(priority=2.0, age=0.5, age_scale_s=10.0)
    terms = scheduler.score_terms(
        CPU_ONLY, _task(1, priority=3, age_s=10), now=NOW, weights=weights
    )
    assert terms["priority"] == pytest.approx(2.0 * 3)
    assert terms["age"] == pytest.approx(0.5 * 10 / (10 + 10))
    assert scheduler.score(
        CPU_ONLY, _task(1, priority=3, age_s=10), now=NOW, weights=weights
    ) == pytest.approx(sum(terms.values()))


# -- the verifier with suspended nodes and colluders -----------------------------------------

TRUSTED = 1 - 0.2 / 81  # a node that passed 80 checks in a row
NEW = 0.8


# (results, credibility, min_credibility, dispute_margin, canonical, valid, invalid)
CREDIBLE_DECISIONS = [
    (
        # A suspended node's agreeing result used to multiply its 0 into the only group.
        "suspended-agreeing-node-left-out",
        _results((1, "a"), (2, "a"), (3, "a"), (4, "a")),
        {1: 0.0, 2: 0.9975, 3: 0.9975, 4: 0.9975},
        0.95,
        1,
        2,
        (2, 3, 4),
        (),
    ),
    (
        "suspended-dissenter-is-invalid",
        _results((1, "b"), (2, "a"), (3, "a"), (4, "a")),
        {1: 0.0, 2: 0.9975, 3: 0.9975, 4: 0.9975},
        0.95,
        1,
        2,
        (2, 3, 4),
        (1,),
    ),
    (
        "quorum-not-reachable-without-the-suspended-node",
        _results((1, "a"), (2, "a")),
        {1: 0.0, 2: 0.9975},
        0.95,
        1,
        None,
        (),
        (),
    ),
    (
        "only-suspended-nodes",
        _results((1, "a"), (2, "a")),
        {1: 0.0, 2: 0.0},
        0.95,
        1,
        None,
        (),
        (),
    ),
    (
        "caught-node-still-votes-with-little-weight",
        _results((1, "a"), (2, "a"), (3, "a")),
        {1: 0.4, 2: NEW, 3: NEW},
        0.95,
        1,
        None,  # 0.4 * 0.8 * 0.8 against the rest: below 0.95
        (),
        (),
    ),
    (
        "two-trusted-colluders-against-one-trusted-honest-no-margin",
        _results((1, "x"), (2, "x"), (3, "a")),
        {1: TRUSTED, 2: TRUSTED, 3: TRUSTED},
        0.95,
        0,
        1,  # credibility alone believes the pair
        (1, 2),
        (3,),
    ),
    (
        "two-trusted-colluders-need-a-margin-of-2",
        _results((1, "x"), (2, "x"), (3, "a")),
        {1: TRUSTED, 2: TRUSTED, 3: TRUSTED},
        0.95,
        2,
        None,
        (),
        (),
    ),
    (
        "honest-replicas-settle-the-dispute",
        _results((1, "x"), (2, "x"), (3, "a"), (4, "a"), (5, "a"), (6, "a"), (7, "a")),
        {1: TRUSTED, 2: TRUSTED, 3: TRUSTED, 4: NEW, 5: NEW, 6: NEW, 7: NEW},
        0.95,
        2,
        3,
        (3, 4, 5, 6, 7),
        (1, 2),
    ),
    (
        # With trust capped at a new node's in a dispute, 4 against 2 gives 0.94.
        "four-against-two-is-not-yet-enough",
        _results((1, "x"), (2, "x"), (3, "a"), (4, "a"), (5, "a"), (6, "a")),
        {1: TRUSTED, 2: TRUSTED, 3: TRUSTED, 4: NEW, 5: NEW, 6: NEW},
        0.95,
        2,
        None,
        (),
        (),
    ),
    (
        "an-honest-majority-of-two-over-a-random-liar",
        _results((1, "a"), (2, "z"), (3, "a"), (4, "a"), (5, "a")),
        {1: NEW, 2: NEW, 3: NEW, 4: NEW, 5: NEW},
        0.95,
        2,
        1,
        (1, 3, 4, 5),
        (2,),
    ),
    (
        "no-dispute-no-margin",
        _results((1, "a"), (2, "a")),
        {1: TRUSTED, 2: TRUSTED},
        0.95,
        2,
        1,
        (1, 2),
        (),
    ),
]


@pytest.mark.parametrize(
    ("results", "credibility", "min_credibility", "margin", "canonical", "valid", "invalid"),
    [row[1:] for row in CREDIBLE_DECISIONS],
    ids=[row[0] for row in CREDIBLE_DECISIONS],
)
def test_decide_with_credibility(
    results: list[tuple[int, bytes]],
    credibility: dict[int, float],
    min_credibility: float,
    margin: int,
    canonical: int | None,
    valid: tuple[int, ...],
    invalid: tuple[int, ...],
) -> None:
    decision = verifier.decide(
        results,
        _compare,
        min_quorum=2,
        credibility=credibility,
        min_credibility=min_credibility,
        dispute_margin=margin,
        dispute_credibility=NEW if margin else 1.0,
    )
    assert (decision.canonical, decision.valid, decision.invalid) == (canonical, valid, invalid)


def test_an_undecided_dispute_names_the_outnumbered_as_suspects() -> None:
    results = _results((1, "a"), (2, "z"), (3, "a"))
    cred = {1: TRUSTED, 2: TRUSTED, 3: TRUSTED}
    decision = verifier.decide(
        results,
        _compare,
        min_quorum=2,
        credibility=cred,
        min_credibility=0.95,
        dispute_margin=2,
        dispute_credibility=NEW,
    )
    assert decision.canonical is None and decision.suspects == (2,)
    tie = verifier.decide(
        _results((1, "a"), (2, "z")),
        _compare,
        min_quorum=2,
        credibility=cred,
        min_credibility=0.95,
        dispute_margin=2,
        dispute_credibility=NEW,
    )
    assert tie.canonical is None and tie.suspects == ()  # a tie names nobody


def test_invalid_results_that_agree_are_named_colluding() -> None:
    results = _results((1, "x"), (2, "x"), (3, "a"), (4, "a"), (5, "a"), (6, "a"), (7, "z"))
    decision = verifier.decide(results, _compare, min_quorum=2, dispute_margin=2)
    assert decision.canonical == 3 and decision.invalid == (1, 2, 7)
    assert decision.colluding == ((1, 2),)  # 7 is wrong on its own
