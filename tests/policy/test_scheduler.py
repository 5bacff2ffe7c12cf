"""Scheduling policy by tables: hard filters, unmet needs, score terms, fair share, backups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from idlegrid.kinds.base import Requirements
from idlegrid.policy import fairshare, scheduler
from idlegrid.policy.scheduler import Candidate, NodeView, RunningShard, Weights

NOW = 1_000_000.0


def _node(node_id: int = 1, **fields: object) -> NodeView:
    base = NodeView(
        node_id=node_id,
        kinds=frozenset({"sleep", "onnx-infer"}),
        backends=frozenset({"cpu"}),
        memory_mb=8000,
        gflops=100.0,
        disk_free_mb=10_000,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


LAPTOP = _node(gflops=20.0)
RTX = _node(backends=frozenset({"cpu", "cuda"}), accelerator_memory_mb=24_000, gflops=5000.0)
MAC = _node(backends=frozenset({"cpu", "mps"}), accelerator_memory_mb=16_000)
ONNX_CUDA = _node(onnx_providers=frozenset({"CUDAExecutionProvider", "CPUExecutionProvider"}))


def _task(
    task_id: int = 1,
    *,
    kind: str = "sleep",
    account_id: int = 1,
    items: int = 1,
    cost_flops: float = 1e9,
    age_s: float = 0.0,
    replication: int = 1,
    inputs: frozenset[str] = frozenset(),
    fair_share: float = 1.0,
    priority: int = 0,
    **needs: object,
) -> Candidate:
    return Candidate(
        task_id=task_id,
        job_id=task_id,
        kind=kind,
        priority=priority,
        created_at=NOW - age_s,
        requirements=Requirements(**needs),  # type: ignore[arg-type]
        account_id=account_id,
        items=items,
        cost_flops=cost_flops,
        replication=replication,
        input_hashes=inputs,
        fair_share=fair_share,
    )


# -- hard filters --------------------------------------------------------------------------

# (name, node, requirements, the reasons it cannot run them; [] when it can)
NEEDS = [
    ("nothing-needed", LAPTOP, {}, []),
    ("gpu-needed-cpu-node", LAPTOP, {"accelerator": True}, ["has no GPU"]),
    ("gpu-needed-cuda-node", RTX, {"accelerator": True}, []),
    ("gpu-needed-mac", MAC, {"accelerator": True}, []),
    (
        "cuda-gpu-needed-mac",
        MAC,
        {"accelerator": True, "backends": frozenset({"cuda"})},
        ["has no backend of cuda", "has no GPU"],
    ),
    ("cpu-or-cuda-on-mac-cpu", MAC, {"backends": frozenset({"cpu", "cuda"})}, []),
    ("gpu-memory-enough", RTX, {"accelerator": True, "min_accelerator_memory_mb": 24_000}, []),
    (
        "gpu-memory-short",
        MAC,
        {"min_accelerator_memory_mb": 20_000},
        ["has under 20000 MB of GPU memory"],
    ),
    ("memory-short", LAPTOP, {"min_memory_mb": 16_000}, ["has under 16000 MB of memory"]),
    ("gflops-short", LAPTOP, {"min_gflops": 50.0}, ["benchmarks under 50 GFLOPS"]),
    ("kind-rate-unmeasured", LAPTOP, {"min_kind_rate": 10.0}, ["runs sleep under 10 items/s"]),
    ("kind-rate-enough", _node(kind_rates={"sleep": 12.0}), {"min_kind_rate": 10.0}, []),
    ("disk-enough", LAPTOP, {"min_disk_mb": 10_000}, []),
    ("disk-short", LAPTOP, {"min_disk_mb": 10_001}, ["has under 10001 MB of free disk"]),
    (
        "disk-unreported",
        _node(disk_free_mb=None),
        {"min_disk_mb": 1},
        ["has under 1 MB of free disk"],
    ),
    (
        "onnx-provider-present",
        ONNX_CUDA,
        {"onnx_providers": frozenset({"CUDAExecutionProvider"})},
        [],
    ),
    (
        "onnx-provider-absent",
        LAPTOP,
        {"onnx_providers": frozenset({"CUDAExecutionProvider"})},
        ["has no ONNX execution provider of CUDAExecutionProvider"],
    ),
    ("onnx-opset-loaded", _node(onnx_opset=21), {"min_onnx_opset": 21}, []),
    (
        "onnx-opset-too-new",
        _node(onnx_opset=17),
        {"min_onnx_opset": 21},
        ["has no ONNX Runtime that loads opset 21"],
    ),
    (
        "onnx-opset-unreported",
        LAPTOP,
        {"min_onnx_opset": 7},
        ["has no ONNX Runtime that loads opset 7"],
    ),
    (
        "several-missed",
        LAPTOP,
        {"accelerator": True, "min_memory_mb": 9000},
        ["has no GPU", "has under 9000 MB of memory"],
    ),
]


@pytest.mark.parametrize(
    ("node", "needs", "reasons"), [row[1:] for row in NEEDS], ids=[row[0] for row in NEEDS]
)
def test_unmet_needs(node: NodeView, needs: dict[str, object], reasons: list[str]) -> None:
    assert scheduler.unmet_needs(node, "sleep", Requirements(**needs)) == reasons  # type: ignore[arg-type]
    assert scheduler.can_run(node, _task(**needs)) is (not reasons)


def test_kind_not_offered_is_a_reason() -> None:
    assert scheduler.unmet_needs(LAPTOP, "embed-text", Requirements()) == [
        "does not offer kind embed-text"
    ]


# (name, nodes, requirements, expected reason or None)
UNMET = [
    ("no-nodes", [], {}, "no node is registered yet"),
    ("one-node-fits", [LAPTOP, RTX], {"accelerator": True}, None),
    (
        "none-has-gpu",
        [LAPTOP, _node(2)],
        {"accelerator": True},
        "no registered node can run it: of 2 node(s), 2 has no GPU",
    ),
    (
        "mixed-reasons",
        [LAPTOP, RTX],
        {"accelerator": True, "min_memory_mb": 9000},
        "no registered node can run it: of 2 node(s), 2 has under 9000 MB of memory; 1 has no GPU",
    ),
]


@pytest.mark.parametrize(
    ("nodes", "needs", "reason"), [row[1:] for row in UNMET], ids=[row[0] for row in UNMET]
)
def test_unmet(nodes: list[NodeView], needs: dict[str, object], reason: str | None) -> None:
    assert scheduler.unmet(Requirements(**needs), "sleep", nodes) == reason  # type: ignore[arg-type]


def test_a_node_without_a_gpu_never_gets_a_gpu_task() -> None:
    queue = [_task(i, priority=100 if i % 2 else 0, accelerator=bool(i % 2)) for i in range(1, 61)]
    for node in (LAPTOP, _node(gflops=1e6, memory_mb=10**6), ONNX_CUDA):
        ranked = scheduler.rank(node, queue, now=NOW)
        assert len(ranked) == 30
        assert not any(c.requirements.accelerator for c in ranked)
    assert len(scheduler.rank(RTX, queue, now=NOW)) == 60


# -- expected time and score terms -----------------------------------------------------------

# (name, node, items, cost_flops, seconds)
EXPECTED = [
    ("by-gflops", LAPTOP, 1, 40e9, 2.0),
    ("by-kind-rate", _node(kind_rates={"sleep": 4.0}), 10, 40e9, 2.5),
    ("zero-rate-falls-back", _node(kind_rates={"sleep": 0.0}, gflops=10.0), 10, 40e9, 4.0),
    ("unbenchmarked-is-1-gflops", _node(gflops=0.0), 1, 3e9, 3.0),
]


@pytest.mark.parametrize(
    ("node", "items", "flops", "seconds"),
    [row[1:] for row in EXPECTED],
    ids=[row[0] for row in EXPECTED],
)
def test_expected_seconds(node: NodeView, items: int, flops: float, seconds: float) -> None:
    assert scheduler.expected_seconds(node, "sleep", items=items, cost_flops=flops) == (
        pytest.approx(seconds)
    )


W = Weights(
    priority=1.0,
    age=2.0,
    age_scale_s=100.0,
    fair_share=4.0,
    speed=3.0,
    speed_scale_s=10.0,
    locality=5.0,
    affinity=3.0,
    reliability=0.5,
    on_time=2.0,
)

# (name, node, candidate, the terms that differ from the baseline's)
BASE_TERMS = {
    "priority": 0.0,
    "age": 0.0,
    "fair_share": 4.0,
    "speed": 3.0 / (1 + 0.005),
    "locality": 0.0,
    "affinity": 0.0,
    "reliability": 0.25,
    "on_time": 1.0,
}
TERMS = [
    ("baseline", _node(gflops=20.0), _task(cost_flops=1e9), {}),
    ("priority", _node(gflops=20.0), _task(priority=-3), {"priority": -3.0}),
    ("age-half-scale", _node(gflops=20.0), _task(age_s=100.0), {"age": 1.0}),
    ("fair-share-used-up", _node(gflops=20.0), _task(fair_share=0.25), {"fair_share": 1.0}),
    (
        "slow-node-long-task",
        _node(gflops=1.0),
        _task(cost_flops=30e9),
        {"speed": 3.0 / (1 + 3.0), "on_time": 2.0 * 0.5**3},
    ),
    (
        "holds-one-of-two-inputs",
        _node(gflops=20.0, held_blobs=frozenset({"a", "z"})),
        _task(inputs=frozenset({"a", "b"})),
        {"locality": 2.5},
    ),
    (
        "preferred-node",
        _node(node_id=7, gflops=20.0),
        replace(_task(), preferred_node=7),
        {"affinity": 3.0},
    ),
    (
        "another-node-preferred",
        _node(node_id=7, gflops=20.0),
        replace(_task(), preferred_node=8),
        {},
    ),
    ("trusted-unreplicated", _node(gflops=20.0, reliability=1.0), _task(), {"reliability": 0.5}),
    (
        "trusted-replicated",
        _node(gflops=20.0, reliability=1.0),
        _task(replication=2),
        {"reliability": 0.25},
    ),
    ("reliable-returner", _node(gflops=20.0, on_time=0.9), _task(), {"on_time": 1.8}),
]


@pytest.mark.parametrize(
    ("node", "candidate", "changed"), [row[1:] for row in TERMS], ids=[row[0] for row in TERMS]
)
def test_score_terms(node: NodeView, candidate: Candidate, changed: dict[str, float]) -> None:
    expected = {**BASE_TERMS, **changed}
    terms = scheduler.score_terms(node, candidate, now=NOW, weights=W)
    assert terms == pytest.approx(expected)
    assert scheduler.score(node, candidate, now=NOW, weights=W) == pytest.approx(
        sum(expected.values())
    )


# (name, node, candidates, expected order)
ORDERS = [
    ("light-account-first", LAPTOP, [_task(1, fair_share=0.25), _task(2, fair_share=1.0)], [2, 1]),
    (
        "priority-beats-fair-share",
        LAPTOP,
        [_task(1, fair_share=1.0), _task(2, fair_share=0.25, priority=4)],
        [2, 1],
    ),
    (
        "fair-share-beats-age",
        LAPTOP,
        [_task(1, fair_share=0.25, age_s=10 * 3600), _task(2, fair_share=1.0)],
        [2, 1],
    ),
    ("older-first-same-account", LAPTOP, [_task(1, age_s=5), _task(2, age_s=50)], [2, 1]),
    (
        "held-model-first",
        _node(held_blobs=frozenset({"model"})),
        [_task(1), _task(2, inputs=frozenset({"model"}))],
        [2, 1],
    ),
    (
        "short-task-first-on-slow-node",
        _node(gflops=1.0),
        [_task(1, cost_flops=600e9), _task(2, cost_flops=1e9)],
        [2, 1],
    ),
    (
        "unreliable-node-prefers-replicated",
        _node(reliability=0.0, on_time=0.5),
        [_task(1), _task(2, replication=2)],
        [1, 2],
    ),
    (
        "trusted-node-prefers-unreplicated",
        _node(reliability=1.0),
        [_task(1, replication=3), _task(2)],
        [2, 1],
    ),
    ("gpu-task-dropped-on-cpu", LAPTOP, [_task(1, accelerator=True, priority=50), _task(2)], [2]),
]


@pytest.mark.parametrize(
    ("node", "candidates", "order"), [row[1:] for row in ORDERS], ids=[row[0] for row in ORDERS]
)
def test_rank(node: NodeView, candidates: list[Candidate], order: list[int]) -> None:
    assert [c.task_id for c in scheduler.rank(node, candidates, now=NOW)] == order


# -- fair share ------------------------------------------------------------------------------

# (name, usage by account, shares, account, factor)
FACTORS = [
    ("nothing-used", {}, {}, 1, 1.0),
    ("idle-account", {1: 100.0}, {}, 2, 1.0),
    ("sole-user", {1: 100.0}, {}, 1, 0.5),
    ("equal-use-equal-share", {1: 50.0, 2: 50.0}, {}, 1, 0.5),
    ("over-share", {1: 90.0, 2: 10.0}, {}, 1, 2**-1.8),
    ("under-share", {1: 90.0, 2: 10.0}, {}, 2, 2**-0.2),
    ("bigger-share-forgives", {1: 75.0, 2: 25.0}, {1: 3.0}, 1, 0.5),
    ("smaller-share-pays", {1: 75.0, 2: 25.0}, {1: 3.0}, 2, 0.5),
    ("asker-counts-in-shares", {1: 100.0}, {2: 3.0}, 2, 1.0),
    ("three-accounts", {1: 60.0, 2: 30.0, 3: 10.0}, {}, 2, 2**-0.9),
]


@pytest.mark.parametrize(
    ("usage", "shares", "account", "expected"),
    [row[1:] for row in FACTORS],
    ids=[row[0] for row in FACTORS],
)
def test_fair_share_factor(
    usage: dict[int, float], shares: dict[int, float], account: int, expected: float
) -> None:
    assert fairshare.factor(usage, shares, account) == pytest.approx(expected)


# (elapsed, half-life, remaining fraction)
DECAYS = [
    (0.0, 60.0, 1.0),
    (60.0, 60.0, 0.5),
    (180.0, 60.0, 0.125),
    (-5.0, 60.0, 1.0),
    (10.0, 0.0, 0.0),
]


@pytest.mark.parametrize(("elapsed", "half_life", "fraction"), DECAYS)
def test_decay(elapsed: float, half_life: float, fraction: float) -> None:
    assert fairshare.decay(8.0, elapsed, half_life) == pytest.approx(8.0 * fraction)


def test_ledger_decays_and_accumulates() -> None:
    ledger = fairshare.UsageLedger(half_life_s=100.0)
    ledger.add(1, 800.0, now=0.0)
    ledger.add(2, 100.0, now=100.0)
    ledger.add(1, 100.0, now=100.0)
    assert ledger.snapshot(now=200.0) == pytest.approx({1: 250.0, 2: 50.0})
    assert ledger.usage(3, now=200.0) == 0.0


def test_a_big_job_does_not_starve_a_small_one() -> None:
    """Dispatch by rank with the ledger: the small job's tasks come next, not last."""
    ledger = fairshare.UsageLedger(half_life_s=3600.0)
    big = [_task(i, account_id=1, age_s=3600.0) for i in range(1, 101)]
    handed: list[int] = []
    for step in range(20):
        now = NOW + step
        queue = [
            replace(c, fair_share=fairshare.factor(ledger.snapshot(now=now), {}, c.account_id))
            for c in big
        ]
        if step == 5:  # a second researcher submits a small job of three shards
            big += [_task(1000 + i, account_id=2) for i in range(3)]
            continue
        best = scheduler.rank(LAPTOP, queue, now=now)[0]
        handed.append(best.account_id)
        ledger.add(best.account_id, best.cost_flops, now=now)
        big = [c for c in big if c.task_id != best.task_id]
    assert handed[:5] == [1] * 5
    assert handed[5:8] == [2, 2, 2]  # right after submission, ahead of 95 older shards


# -- speculative backups ---------------------------------------------------------------------


def _running(
    shard_id: int,
    *,
    started_s_ago: float,
    holder_s: float,
    cost_flops: float = 1e9,
    **needs: object,
) -> RunningShard:
    return RunningShard(
        shard_id=shard_id,
        job_id=1,
        kind="sleep",
        items=1,
        cost_flops=cost_flops,
        requirements=Requirements(**needs),  # type: ignore[arg-type]
        holder_finish_at=NOW - started_s_ago + holder_s,
    )


FAST = _node(gflops=100.0)  # 1e9 FLOPs: 0.01 s; 1e12: 10 s

# (name, idle node, running shards, expected shard or None)
BACKUPS = [
    ("nothing-running", FAST, [], None),
    ("straggler-copied", FAST, [_running(7, started_s_ago=1, holder_s=100)], 7),
    ("holder-nearly-done", FAST, [_running(7, started_s_ago=96, holder_s=100)], None),
    ("not-fast-enough", FAST, [_running(7, started_s_ago=0, holder_s=19, cost_flops=1e12)], None),
    ("fast-enough", FAST, [_running(7, started_s_ago=0, holder_s=40, cost_flops=1e12)], 7),
    (
        "biggest-gain-wins",
        FAST,
        [
            _running(1, started_s_ago=0, holder_s=30),
            _running(2, started_s_ago=0, holder_s=300),
            _running(3, started_s_ago=0, holder_s=60),
        ],
        2,
    ),
    ("cannot-run-it", FAST, [_running(7, started_s_ago=0, holder_s=100, accelerator=True)], None),
]


@pytest.mark.parametrize(
    ("node", "running", "expected"), [row[1:] for row in BACKUPS], ids=[row[0] for row in BACKUPS]
)
def test_pick_backup(node: NodeView, running: list[RunningShard], expected: int | None) -> None:
    pick = scheduler.pick_backup(node, running, now=NOW, factor=2.0, min_gain_s=5.0)
    assert (pick.shard_id if pick else None) == expected


# (name, assigned s ago, expected s, progress, finish in s from now)
FINISH = [
    ("on-schedule", 10.0, 30.0, None, 20.0),
    ("overdue-as-long-again", 40.0, 30.0, None, 40.0),
    ("progress-rate", 10.0, 30.0, 0.25, 30.0),
    ("progress-done-ignored", 10.0, 30.0, 1.0, 20.0),
    ("progress-zero-ignored", 10.0, 30.0, 0.0, 20.0),
]


@pytest.mark.parametrize(
    ("ago", "expected_s", "progress", "left"),
    [row[1:] for row in FINISH],
    ids=[row[0] for row in FINISH],
)
def test_holder_finish_at(
    ago: float, expected_s: float, progress: float | None, left: float
) -> None:
    finish = scheduler.holder_finish_at(NOW - ago, expected_s, now=NOW, progress=progress)
    assert math.isclose(finish - NOW, left)


# -- settings --------------------------------------------------------------------------------


def test_shares_and_weights_come_from_the_environment() -> None:
    from idlegrid.coordinator.matching import weights_from
    from idlegrid.settings import CoordinatorSettings

    settings = CoordinatorSettings.from_env(
        {
            "IDLEGRID_ACCOUNT_SHARES": "alice=3, bob=0.5",
            "IDLEGRID_SCHED_LOCALITY_WEIGHT": "7",
            "IDLEGRID_BACKUP_FACTOR": "3",
        }
    )
    assert settings.shares == {"alice": 3.0, "bob": 0.5}
    assert weights_from(settings).locality == 7.0 and settings.backup_factor == 3.0
    with pytest.raises(ValueError, match="name=positive number"):
        _ = CoordinatorSettings(account_shares=("alice:3",)).shares
