"""The stalemate pass (`coordinator/stalemate.py`) over a real store and fleet snapshot:
which nodes a stalled shard may still wait for. A node that cannot meet the job's
requirements is none; a spot check that only untrusted nodes could take is opened to
them (else it would wait for ever: nobody earns trust from it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from helpers import fake_node
from store_helpers import OUT_A, _account, _job, _node

from idlegrid import protocol
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.plans import JobPlan
from idlegrid.coordinator.stalemate import Stalemates
from idlegrid.kinds import get_kind
from idlegrid.kinds.base import Requirements
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import (
    Assignment,
    Claimer,
    ClaimMiss,
    NodeRecord,
    ShardReplica,
    StalledShard,
)
from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings

GPU = Requirements(backends=frozenset({"cuda"}), accelerator=True)
T0 = 1_000_000.0


class _OnePlan:
    """Plans: every job is this one (the pass reads only its requirements)."""

    def __init__(self, requirements: Requirements) -> None:
        kind = get_kind("sleep")
        self.plan = JobPlan(
            kind=kind,
            params=kind.parse_params({"tasks": 1}),
            requirements=requirements,
            replication=2,
            min_quorum=2,
        )

    async def get(self, job_id: int) -> JobPlan:
        return self.plan


class _NoDecisions:
    """The verifier: these tests expect the pass to decide nothing."""

    async def record(self, decided: Sequence[Any]) -> None:
        assert not decided


def _stalemates(store: SqlStore, tmp_path: Path, requirements: Requirements) -> Stalemates:
    ctx = SimpleNamespace(
        store=store,
        settings=CoordinatorSettings(data_dir=tmp_path),
        counters=SimpleNamespace(alone=Counter[str](), verified=Counter[str]()),
        clock=lambda: T0,
    )
    fleet = Fleet(store, clock=lambda: T0, ttl_s=10.0)
    return Stalemates(
        ctx,  # type: ignore[arg-type]
        fleet=fleet,
        plans=_OnePlan(requirements),  # type: ignore[arg-type]
        verifier=_NoDecisions(),  # type: ignore[arg-type]
    )


async def test_a_stalled_shard_waits_for_no_node_that_cannot_run_it(
    store: SqlStore, tmp_path: Path
) -> None:
    """A node that meets the claim's replica rules but not the job's requirements (no GPU)
    is no reason to wait: with no other node left, the shard is settled on its evidence."""
    alice = (await _account(store)).id
    bob = (await _account(store, "bob")).id
    hardware = protocol.HardwareProfile(
        memory_mb=8000, gpus=[protocol.Gpu(backend="cuda", name="gpu", memory_mb=8000)]
    )  # type: ignore[arg-type]
    ran = await fake_node(store, alice, "ran-it", now=T0, hardware=hardware)
    cpu_only = await fake_node(store, bob, "cpu-only", now=T0)
    replica = ShardReplica(ran.session.node_id, alice, "", ran=True)
    shard = StalledShard(1, 1, 0, "sleep", [replica])
    assert (await _stalemates(store, tmp_path, Requirements()).candidates(shard))[0] == [
        cpu_only.session.node_id
    ]
    assert (await _stalemates(store, tmp_path, GPU).candidates(shard))[0] == []


async def _claim(store: SqlStore, task_id: int, node: NodeRecord) -> Assignment | ClaimMiss:
    claimer = Claimer(node_id=node.id, account_id=node.account_id, network="", backend="cpu")
    return await store.claims.claim_task(
        task_id, claimer, kind="sleep", lease_deadline=T0 + 100, now=T0, distinct=None
    )


async def test_a_spot_check_no_trusted_node_can_take_is_opened_to_the_others(
    store: SqlStore, tmp_path: Path
) -> None:
    store.trust = TrustSettings(adaptive_after=0)  # the lone node counts as trusted...
    lone = await _node(store, await _account(store), "lone")
    fresh = await _node(store, await _account(store, "bob"), "fresh")
    _, [first, check] = await store.jobs.create_job(
        _job(await _account(store, "carol"), replication=2, min_quorum=2), now=T0
    )
    assert isinstance(await _claim(store, first.task_id, lone), Assignment)
    await store.claims.run_alone(first.shard_id, first.task_id, spot_check=True)
    await store.results.accept_result(
        first.task_id, lone.id, output_hash=OUT_A, output_size=3, elapsed_s=1, now=T0 + 1
    )
    store.trust = TrustSettings(adaptive_after=5)  # ...and the only other node is not
    assert await _claim(store, check.task_id, fresh) is ClaimMiss.CONFLICT
    [stalled] = await store.verification.stalled_shards(limit=10)
    assert stalled.checks_only
    assert await _stalemates(store, tmp_path, Requirements()).settle() == 0
    # Its check is anyone's now: the node not yet trusted takes it.
    assert isinstance(await _claim(store, check.task_id, fresh), Assignment)


class _Decisions:
    """The verifier: keeps what the pass decided."""

    def __init__(self) -> None:
        self.decided: list[Any] = []

    async def record(self, decided: Sequence[Any]) -> None:
        self.decided.extend(decided)


async def test_a_shard_waits_one_more_lease_for_the_late_results_of_slow_nodes(
    store: SqlStore, tmp_path: Path
) -> None:
    """Three nodes, replication 3: one result in, the two other leases ran out while those
    nodes still compute. Their late results may still come, so the shard is not settled
    (failed, on one result) until one more lease length has passed."""
    nodes = [await _node(store, await _account(store, n), n) for n in ("ann", "ben", "cat")]
    _, tasks = await store.jobs.create_job(
        _job(await _account(store, "dora"), replication=3, min_quorum=2), now=T0
    )
    for task, node in zip(tasks, nodes, strict=True):
        assert isinstance(await _claim(store, task.task_id, node), Assignment)  # lease T0+100
    await store.results.accept_result(
        tasks[0].task_id, nodes[0].id, output_hash=OUT_A, output_size=3, elapsed_s=1, now=T0 + 50
    )
    assert len(await store.results.expire_overdue(now=T0 + 101)) == 2
    await store.scheduling.replenish(now=T0 + 101)  # their replacements, for nobody
    [stalled] = await store.verification.stalled_shards(limit=10)
    assert sorted(r.late_until or 0 for r in stalled.replicas) == [0, T0 + 200, T0 + 200]

    def at(now: float) -> tuple[Stalemates, _Decisions]:
        stalemates = _stalemates(store, tmp_path, Requirements())
        stalemates._ctx.clock = lambda: now  # type: ignore[attr-defined]
        stalemates._ctx.blobs = SimpleNamespace(read=lambda digest: b"{}")  # type: ignore[attr-defined]
        decisions = _Decisions()
        stalemates._verifier = decisions  # type: ignore[assignment]
        return stalemates, decisions

    waiting, decisions = at(T0 + 150)
    assert await waiting.settle() == 0 and not decisions.decided
    given_up, decisions = at(T0 + 201)
    assert await given_up.settle() == 1
    [(_, _, decision)] = decisions.decided
    assert decision.fail_reason.startswith("undecidable: it has only one result")
    assert f"(ran it: nodes {nodes[0].id})" in decision.fail_reason
