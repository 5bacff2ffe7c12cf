"""The store's contract, role by role: every role of `SqlStore` on a temporary SQLite file
and in its own PostgreSQL schema, migrated by Alembic (the `store` fixture runs every
test on both)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Database
from sqlalchemy import event, insert, inspect, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from store_helpers import (
    LEASE,
    OUT_A,
    OUT_B,
    OUT_C,
    T0,
    _account,
    _claim,
    _claimer,
    _hash,
    _job,
    _node,
    _result,
    _task_row,
    _try_claim,
)

from idlegrid.states import JobState, NodeState, ShardState, TaskState, TrainingRoundState
from idlegrid.store import web
from idlegrid.store.base import (
    AccountExists,
    Assignment,
    ClaimMiss,
    DueRound,
    NewRound,
    NewShard,
    RoundAdvance,
    RoundTraffic,
)
from idlegrid.store.schema import accounts, tasks
from idlegrid.store.sql import SqlStore
from idlegrid.store.usage import BlobUsage

# -- store.accounts -----------------------------------------------------------------------


async def test_accounts_and_tokens(store: SqlStore) -> None:
    assert await store.accounts.count_accounts() == 0
    alice = await _account(store)
    admin = await store.accounts.create_account("root", is_admin=True, now=T0)
    assert await store.accounts.count_accounts() == 2
    assert await store.accounts.get_account("alice") == alice
    assert await store.accounts.get_account("nobody") is None
    with pytest.raises(AccountExists):
        await _account(store, "alice")

    token_id = await store.accounts.add_token(
        alice.id, kind="node", token_hash=_hash("secret"), prefix="ign_abc", label="laptop", now=T0
    )
    found = await store.accounts.find_token(_hash("secret"))
    assert found is not None
    assert (found.token_id, found.account_id, found.account_name, found.kind, found.is_admin) == (
        token_id,
        alice.id,
        "alice",
        "node",
        False,
    )
    assert await store.accounts.find_token(_hash("guess")) is None
    await store.accounts.add_token(
        admin.id, kind="api", token_hash=_hash("root"), prefix="igr_", label="", now=T0
    )
    root = await store.accounts.find_token(_hash("root"))
    assert root is not None and root.is_admin and root.kind == "api"


async def test_live_token_hashes_page_through_live_tokens_in_id_order(store: SqlStore) -> None:
    alice = await _account(store)
    ids = [
        await store.accounts.add_token(
            alice.id, kind="api", token_hash=_hash(f"t{i}"), prefix="igr_", label="", now=T0
        )
        for i in range(5)
    ]
    await store.accounts.revoke_token(ids[1], account_id=None, now=T0 + 1)
    first = await store.accounts.live_token_hashes(after_id=0, limit=2)
    assert first == [(ids[0], _hash("t0")), (ids[2], _hash("t2"))]  # the revoked one skipped
    rest = await store.accounts.live_token_hashes(after_id=ids[2], limit=10)
    assert rest == [(ids[3], _hash("t3")), (ids[4], _hash("t4"))]
    assert await store.accounts.live_token_hashes(after_id=ids[4], limit=10) == []


# -- store.nodes --------------------------------------------------------------------------


async def test_register_node_is_an_upsert_per_node_key(store: SqlStore) -> None:
    alice, bob = await _account(store), await _account(store, "bob")
    first = await _node(store, alice)
    assert first.state == NodeState.ONLINE
    assert first.kinds == ["sleep"] and first.hardware == {"cpu_cores": 4}
    await store.nodes.set_node_offline(first.id, now=T0 + 5)
    again = await store.nodes.register_node(
        alice.id,
        "node-key-1",
        name="renamed",
        worker_version="0.2.0",
        hardware={},
        benchmark={},
        kinds=["sleep", "embed-text"],
        slots=4,
        address="10.0.0.2",
        now=T0 + 10,
    )
    assert again.id == first.id
    assert (again.name, again.worker_version, again.slots, again.state) == (
        "renamed",
        "0.2.0",
        4,
        NodeState.ONLINE,
    )
    assert again.created_at == T0 and again.last_seen_at == T0 + 10
    with pytest.raises(PermissionError):
        await _node(store, bob)  # bob cannot take over alice's node key
    bobs = await _node(store, bob, "bobs-node-1")
    assert [n.id for n in await store.nodes.list_nodes()] == [first.id, bobs.id]
    assert [n.id for n in await store.nodes.list_nodes(alice.id)] == [first.id]
    assert [n.id for n in await store.nodes.list_nodes(bob.id)] == [bobs.id]


async def test_set_node_offline_and_touch(store: SqlStore) -> None:
    node = await _node(store, await _account(store))
    await store.nodes.touch_nodes({node.id: T0 + 20})
    await store.nodes.touch_nodes({node.id: T0 + 30})
    await store.nodes.touch_nodes({node.id: T0 + 25})  # older news changes nothing
    await store.nodes.touch_nodes({node.id: T0 + 1000})  # a long gap is time away, not uptime
    [seen] = await store.nodes.list_nodes()
    assert seen.last_seen_at == T0 + 1000
    assert seen.connected_seconds == pytest.approx(30.0)
    await store.nodes.set_node_offline(node.id, now=T0 + 1001)
    [offline] = await store.nodes.list_nodes()
    assert offline.state == NodeState.OFFLINE


# -- store.jobs ---------------------------------------------------------------------------


@pytest.mark.parametrize(("shards", "replication"), [(1, 1), (3, 1), (4, 2), (2, 3)])
async def test_create_job_makes_shards_and_ready_tasks(
    store: SqlStore, shards: int, replication: int
) -> None:
    alice = await _account(store)
    job, ready = await store.jobs.create_job(
        _job(alice, shards=shards, replication=replication, priority=7), now=T0
    )
    assert job.state == JobState.QUEUED
    assert (job.shards_total, job.items_total, job.replication) == (shards, 2 * shards, replication)
    assert job.shard_counts == {"open": shards}
    assert job.tasks_run == 0 and job.started_at is None and job.result_hash is None
    assert len(ready) == shards * replication
    assert len({r.task_id for r in ready}) == len(ready)
    assert all(
        r.job_id == job.id
        and r.kind == "sleep"
        and r.priority == 7
        and r.items == 2
        and r.created_at == T0
        for r in ready
    )
    listed = await store.jobs.list_shards(job.id)
    assert [s.index for s in listed] == list(range(shards))
    assert all(
        s.state == ShardState.OPEN and s.attempts == replication and s.live_tasks == replication
        for s in listed
    )
    for shard in listed:
        assert sum(r.shard_id == shard.id for r in ready) == replication
    assert [r.task_id for r in await store.claims.ready_tasks(limit=100)] == sorted(
        r.task_id for r in ready
    )
    assert len(await store.claims.ready_tasks(limit=2)) == min(2, len(ready))
    assert await store.jobs.get_job(job.id) == job


async def test_get_unknown_job(store: SqlStore) -> None:
    assert await store.jobs.get_job(12345) is None
    assert await store.jobs.list_shards(12345) == []


async def test_list_jobs_by_account_newest_first(store: SqlStore) -> None:
    alice, bob = await _account(store), await _account(store, "bob")
    a1, _ = await store.jobs.create_job(_job(alice), now=T0)
    b1, _ = await store.jobs.create_job(_job(bob), now=T0)
    a2, _ = await store.jobs.create_job(_job(alice), now=T0)
    assert [j.id for j in await store.jobs.list_jobs(alice.id, limit=10, offset=0)] == [
        a2.id,
        a1.id,
    ]
    assert [j.id for j in await store.jobs.list_jobs(bob.id, limit=10, offset=0)] == [b1.id]
    assert [j.id for j in await store.jobs.list_jobs(None, limit=10, offset=0)] == [
        a2.id,
        b1.id,
        a1.id,
    ]
    assert [j.id for j in await store.jobs.list_jobs(alice.id, limit=1, offset=1)] == [a1.id]
    assert await store.jobs.list_jobs(alice.id, limit=10, offset=5) == []


async def test_cancel_job_cancels_live_tasks_and_returns_held_ones(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, ready = await store.jobs.create_job(_job(alice, shards=3), now=T0)
    held = await _claim(store, ready[0].task_id, node)
    await _claim(store, ready[1].task_id, node)
    await _result(store, ready[1].task_id, node)
    await _decide(store, ready[1].shard_id, ready[1].task_id, valid=(ready[1].task_id,))

    to_tell = await store.jobs.cancel_job(job.id, now=T0 + 7)
    assert [(t.task_id, t.node_id, t.state) for t in to_tell] == [
        (held.task_id, node.id, TaskState.ASSIGNED)
    ]
    assert (await _task_row(store, ready[0].task_id)).state == TaskState.CANCELLED.value
    assert (await _task_row(store, ready[2].task_id)).state == TaskState.CANCELLED.value
    assert (await _task_row(store, ready[1].task_id)).state == TaskState.COMPLETED.value
    cancelled = await store.jobs.get_job(job.id)
    assert cancelled is not None
    assert cancelled.state == JobState.CANCELLED and cancelled.finished_at == T0 + 7
    assert cancelled.shard_counts == {"done": 1, "cancelled": 2}
    assert await store.claims.ready_tasks(limit=10) == []
    assert await store.nodes.node_tasks(node.id) == []
    # Terminal: a second cancel, a completion or a late result change nothing.
    assert await store.jobs.cancel_job(job.id, now=T0 + 8) == []
    assert not await store.jobs.complete_job(job.id, result_hash=OUT_A, result_size=1, now=T0)
    assert (await _result(store, held.task_id, node)).status == "late"
    assert await store.scheduling.replenish(now=T0 + 9) == ([], [], [])
    assert await store.jobs.jobs_to_assemble() == []


# -- store.claims -------------------------------------------------------------------------


async def test_claim_assigns_and_starts_the_job(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    claim = await _claim(store, ready.task_id, node, now=T0 + 3)
    assert (claim.task_id, claim.job_id, claim.shard_index, claim.kind) == (
        ready.task_id,
        job.id,
        0,
        "sleep",
    )
    assert claim.input_hash == _hash("input 0") and claim.input_size == 10
    assert claim.params == {"tasks": 1}
    assert claim.lease_deadline == T0 + 3 + LEASE
    started = await store.jobs.get_job(job.id)
    assert started is not None and started.state == JobState.RUNNING
    assert started.started_at == T0 + 3
    row = await _task_row(store, ready.task_id)
    assert (row.state, row.node_id) == (TaskState.ASSIGNED.value, node.id)
    assert await store.claims.ready_tasks(limit=10) == []
    assert [t.task_id for t in await store.nodes.node_tasks(node.id)] == [ready.task_id]
    # Claiming it again, or a task that does not exist, misses.
    assert await _try_claim(store, ready.task_id, node, lease_deadline=T0, now=T0) is ClaimMiss.GONE
    assert await _try_claim(store, 999, node, lease_deadline=T0, now=T0) is ClaimMiss.GONE


async def test_claim_is_atomic_under_concurrency(store: SqlStore) -> None:
    alice = await _account(store)
    nodes = [await _node(store, alice, f"node-key-{i:02d}") for i in range(50)]
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    claims = await asyncio.gather(
        *(
            _try_claim(store, ready.task_id, node, lease_deadline=T0 + LEASE, now=T0)
            for node in nodes
        )
    )
    winners = [c for c in claims if isinstance(c, Assignment)]
    assert len(winners) == 1
    # The others miss: the task is gone, or (PostgreSQL) it was being claimed, and the
    # claim skipped it rather than wait for that transaction.
    misses = [c for c in claims if not isinstance(c, Assignment)]
    assert len(misses) == 49 and set(misses) <= {ClaimMiss.GONE, ClaimMiss.CONFLICT}
    winner_node = nodes[claims.index(winners[0])]
    assert (await _task_row(store, ready.task_id)).node_id == winner_node.id


async def test_concurrent_claims_of_many_tasks_never_double_assign(store: SqlStore) -> None:
    alice = await _account(store)
    nodes = [await _node(store, alice, f"node-key-{i:02d}") for i in range(10)]
    _, ready = await store.jobs.create_job(_job(alice, shards=5), now=T0)
    claims = await asyncio.gather(
        *(
            _try_claim(store, entry.task_id, node, lease_deadline=T0 + LEASE, now=T0)
            for node in nodes
            for entry in ready
        )
    )
    won = [c for c in claims if isinstance(c, Assignment)]
    assert sorted(c.task_id for c in won) == sorted(r.task_id for r in ready)


async def test_distinct_nodes_keeps_one_replica_per_node(store: SqlStore) -> None:
    alice = await _account(store)
    first, second = await _node(store, alice), await _node(store, alice, "node-key-2")
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    one, two = (r.task_id for r in ready)
    await _claim(store, one, first, distinct=True)
    assert (
        await _try_claim(store, two, first, lease_deadline=T0 + LEASE, now=T0, distinct=True)
        is ClaimMiss.CONFLICT
    )
    assert (await _task_row(store, two)).state == TaskState.READY.value
    await _claim(store, two, second, distinct=True)


async def test_distinct_nodes_also_counts_finished_replicas(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    await _claim(store, ready[0].task_id, node, distinct=True)
    assert (await _result(store, ready[0].task_id, node)).status == "accepted"
    assert (
        await _try_claim(
            store, ready[1].task_id, node, lease_deadline=T0 + LEASE, now=T0, distinct=True
        )
        is ClaimMiss.CONFLICT
    )


async def test_a_claim_released_unheard_does_not_bar_its_node(store: SqlStore) -> None:
    # Two nodes, two replicas: the coordinator claimed one for `first` and died before
    # sending it. Released on reconnection, it must not keep `first` off the shard, or
    # the shard's second replica would have no node left to run it.
    alice = await _account(store)
    first, second = await _node(store, alice), await _node(store, alice, "node-key-2")
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    one, two = (r.task_id for r in ready)
    await _claim(store, one, first, distinct=True)
    assert await store.claims.release_claims([one], first.id, now=T0) == [one]
    await _claim(store, two, second, distinct=True)
    [again] = (await store.scheduling.replenish(now=T0)).ready
    await _claim(store, again.task_id, first, distinct=True)


async def test_a_failed_replica_still_bars_its_node(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    await _claim(store, ready[0].task_id, node, distinct=True)
    assert await store.results.record_failure(ready[0].task_id, node.id, reason="it broke", now=T0)
    assert (
        await _try_claim(
            store, ready[1].task_id, node, lease_deadline=T0 + LEASE, now=T0, distinct=True
        )
        is ClaimMiss.CONFLICT
    )


async def test_without_distinct_nodes_one_node_may_take_both_replicas(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    for entry in ready:
        await _claim(store, entry.task_id, node, distinct=False)


# -- store.results ------------------------------------------------------------------------


async def test_accept_result_once_then_duplicate_or_rejected(store: SqlStore) -> None:
    alice = await _account(store)
    node, other = await _node(store, alice), await _node(store, alice, "node-key-2")
    job, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    task_id = ready.task_id
    await _claim(store, task_id, node)

    stranger = await _result(store, task_id, other)
    assert stranger.status == "rejected" and "not held" in stranger.reason
    assert (await _task_row(store, task_id)).state == TaskState.ASSIGNED.value

    receipt = await _result(store, task_id, node, OUT_A, now=T0 + 2)
    assert (receipt.status, receipt.shard_id, receipt.job_id) == (
        "accepted",
        ready.shard_id,
        job.id,
    )
    row = await _task_row(store, task_id)
    assert (row.state, row.output_hash, row.output_size, row.finished_at, row.outcome) == (
        TaskState.COMPLETED.value,
        OUT_A,
        5,
        T0 + 2,
        None,
    )

    again = await _result(store, task_id, node, OUT_A, now=T0 + 3)
    assert again.status == "duplicate"
    changed = await _result(store, task_id, node, OUT_B)
    assert changed.status == "rejected" and "another output" in changed.reason
    assert (await _result(store, task_id, other)).status == "rejected"
    unknown = await _result(store, 424242, node)
    assert unknown.status == "rejected" and "unknown task" in unknown.reason
    row = await _task_row(store, task_id)
    assert (row.output_hash, row.finished_at) == (OUT_A, T0 + 2)
    counted = await store.jobs.get_job(job.id)
    assert counted is not None and counted.tasks_run == 1


async def test_result_for_a_ready_task_is_rejected(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    assert (await _result(store, ready.task_id, node)).status == "rejected"
    assert (await _task_row(store, ready.task_id)).state == TaskState.READY.value


async def test_late_result_of_expired_task_counts_while_the_shard_is_open(
    store: SqlStore,
) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node)
    await store.results.expire_overdue(now=T0 + LEASE + 1)
    [replacement], _, _ = await store.scheduling.replenish(now=T0 + LEASE + 1)
    receipt = await _result(store, ready.task_id, node, OUT_A, now=T0 + LEASE + 5)
    assert receipt.status == "accepted"
    row = await _task_row(store, ready.task_id)
    assert (row.state, row.outcome) == (TaskState.COMPLETED.value, None)
    assert await store.verification.shards_to_verify(limit=10) == [ready.shard_id]
    outcome = await _decide(store, ready.shard_id, ready.task_id, valid=(ready.task_id,))
    assert outcome.decided and outcome.job_done
    assert (await _task_row(store, replacement.task_id)).state == TaskState.CANCELLED.value


async def test_expire_node_tasks_and_expire_task(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, shards=3), now=T0)
    for entry in ready:
        await _claim(store, entry.task_id, node)
    [one] = await store.results.expire_task(ready[0].task_id, now=T0)
    assert one.task_id == ready[0].task_id
    assert await store.results.expire_task(ready[0].task_id, now=T0) == []
    rest = await store.results.expire_node_tasks(node.id, now=T0)
    assert sorted(t.task_id for t in rest) == [ready[1].task_id, ready[2].task_id]
    assert await store.results.expire_node_tasks(node.id, now=T0) == []


async def test_record_failure_then_retry(store: SqlStore) -> None:
    alice = await _account(store)
    node, other = await _node(store, alice), await _node(store, alice, "node-key-2")
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node)
    assert not await store.results.record_failure(
        ready.task_id, other.id, reason="not mine", now=T0
    )
    assert await store.results.record_failure(ready.task_id, node.id, reason="x" * 5000, now=T0)
    assert not await store.results.record_failure(ready.task_id, node.id, reason="again", now=T0)
    row = await _task_row(store, ready.task_id)
    assert row.state == TaskState.FAILED.value and len(row.failure_reason) == 2000
    assert (await _result(store, ready.task_id, node)).status == "rejected"
    [retry], _, _ = await store.scheduling.replenish(now=T0 + 1)
    assert retry.shard_id == ready.shard_id


# -- store.scheduling: the top-up after expiries, failures and disagreements --------------


async def test_expire_overdue_then_replenish_creates_a_replacement(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node)
    assert await store.results.expire_overdue(now=T0 + LEASE - 1) == []  # not yet due
    assert await store.scheduling.replenish(now=T0 + 1) == ([], [], [])  # nothing short of replicas
    expired = await store.results.expire_overdue(now=T0 + LEASE + 1)
    assert [(t.task_id, t.node_id) for t in expired] == [(ready.task_id, node.id)]
    assert await store.results.expire_overdue(now=T0 + LEASE + 2) == []  # idempotent
    assert (await _task_row(store, ready.task_id)).state == TaskState.EXPIRED.value
    assert await store.nodes.node_tasks(node.id) != []  # still held: a late result counts

    new, failed, _ = await store.scheduling.replenish(now=T0 + LEASE + 1)
    assert failed == []
    assert len(new) == 1 and new[0].shard_id == ready.shard_id and new[0].task_id != ready.task_id
    assert await store.scheduling.replenish(now=T0 + LEASE + 2) == ([], [], [])  # idempotent
    [shard] = await store.jobs.list_shards(job.id)
    assert (shard.attempts, shard.live_tasks) == (2, 1)


async def test_exhausted_attempts_fail_the_shard_and_the_job(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, [ready, _] = await store.jobs.create_job(_job(alice, shards=2, max_attempts=2), now=T0)
    task_id = ready.task_id
    for attempt in range(2):
        await _claim(store, task_id, node)
        assert await store.results.record_failure(task_id, node.id, reason="boom", now=T0)
        new, failed, _ = await store.scheduling.replenish(now=T0 + attempt)
        if attempt == 0:
            assert [t.shard_id for t in new] == [ready.shard_id] and failed == []
            task_id = new[0].task_id
        else:
            assert new == [] and failed == [job.id]
    ended = await store.jobs.get_job(job.id)
    assert ended is not None and ended.state == JobState.FAILED
    assert ended.error is not None
    assert "2 attempts" in ended.error and "max_attempts=2" in ended.error
    shards = await store.jobs.list_shards(job.id)
    assert shards[0].state == ShardState.FAILED and shards[0].error == ended.error
    # The other shard is failed with the job, and its ready task cancelled.
    assert shards[1].state == ShardState.FAILED and shards[1].live_tasks == 0
    assert await store.claims.ready_tasks(limit=10) == []
    assert await store.scheduling.replenish(now=T0 + 9) == ([], [], [])


async def test_a_shard_without_quorum_gets_another_task(store: SqlStore) -> None:
    # Two results that disagree leave a 2-of-2 shard open with no live task: it needs a
    # third result (BOINC raises the target of such a workunit), not to wait forever.
    alice = await _account(store)
    nodes = [await _node(store, alice, f"node-key-{i}") for i in range(3)]
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    for entry, node, output in zip(ready, nodes[:2], (OUT_A, OUT_B), strict=True):
        await _claim(store, entry.task_id, node, distinct=True)
        await _result(store, entry.task_id, node, output)
    assert not (await _decide(store, ready[0].shard_id, None)).decided
    [third], failed, _ = await store.scheduling.replenish(now=T0 + 2)
    assert third.shard_id == ready[0].shard_id and failed == []
    assert await store.scheduling.replenish(now=T0 + 3) == ([], [], [])  # one at a time
    await _claim(store, third.task_id, nodes[2], distinct=True)
    await _result(store, third.task_id, nodes[2], OUT_A)
    found = await store.verification.shard_for_verify(ready[0].shard_id)
    assert found is not None and len(found.results) == 3


async def test_a_shard_with_one_result_of_two_waits_for_its_live_replica(
    store: SqlStore,
) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    await _claim(store, ready[0].task_id, node)
    await _result(store, ready[0].task_id, node)
    assert await store.scheduling.replenish(now=T0 + 1) == ([], [], [])


async def test_a_shard_that_never_reaches_quorum_fails_when_out_of_attempts(
    store: SqlStore,
) -> None:
    alice = await _account(store)
    nodes = [await _node(store, alice, f"node-key-{i}") for i in range(3)]
    job, ready = await store.jobs.create_job(
        _job(alice, replication=2, min_quorum=2, max_attempts=3), now=T0
    )
    entries = list(ready)
    for node, output in zip(nodes, (OUT_A, OUT_B, OUT_C), strict=True):
        if not entries:
            entries, failed, _ = await store.scheduling.replenish(now=T0 + 1)
            assert failed == []
        entry = entries.pop(0)
        await _claim(store, entry.task_id, node, distinct=True)
        await _result(store, entry.task_id, node, output)
        assert not (await _decide(store, entry.shard_id, None)).decided
    assert (await store.scheduling.replenish(now=T0 + 2))[:2] == ([], [job.id])
    ended = await store.jobs.get_job(job.id)
    assert ended is not None and ended.state == JobState.FAILED
    assert ended.error is not None and "3 attempts" in ended.error


# -- store.rounds --------------------------------------------------------------------------


def _round(number: int, *, first_shard: int, train_shards: int, deadline: float) -> NewRound:
    return NewRound(
        round=number,
        final=False,
        weights_digest=f"weights {number}",
        checkpoint_hash=_hash(f"checkpoint {number}"),
        momentum_hash=_hash(f"momentum {number}"),
        update_hash=None,
        first_shard=first_shard,
        train_shards=train_shards,
        eval_shard=None,
        deadline=deadline,
    )


def _shards(*indexes: int) -> list[NewShard]:
    return [
        NewShard(
            index=i, input_hash=_hash(f"input {i}"), input_size=10 + i, items=2, cost_flops=1e6
        )
        for i in indexes
    ]


async def test_a_round_opens_falls_due_advances_once_and_finishes(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, [head] = await store.jobs.create_job(_job(alice), now=T0)
    first = _round(0, first_shard=0, train_shards=3, deadline=T0 + 10)
    ready = await store.rounds.start_training(job.id, first, _shards(1, 2), now=T0)
    assert len(ready) == 2  # the new shards' tasks; shard 0 has its own already
    [opened] = await store.rounds.training_rounds(job.id)
    assert opened.state == TrainingRoundState.OPEN and opened.holds(2) and not opened.holds(3)
    await _claim(store, head.task_id, node)
    await _result(store, head.task_id, node)
    assert await store.rounds.round_traffic(job.id, [0]) == RoundTraffic(10, 5, (node.id,))
    assert await store.rounds.due_rounds(now=T0 + 10) == [DueRound(job.id, 0)]
    await store.rounds.extend_round(job.id, 0, deadline=T0 + 20)
    assert await store.rounds.due_rounds(now=T0 + 10) == []
    await store.rounds.update_round_metrics(job.id, 0, {"loss": 1.5})

    async def advance() -> RoundAdvance:
        return await store.rounds.advance_round(
            job.id,
            0,
            metrics={"eval": 2.0},
            cancel_shards=[1],
            next_round=_round(1, first_shard=3, train_shards=1, deadline=T0 + 40),
            shards=_shards(3),
            now=T0 + 21,
        )

    advanced = await advance()
    assert advanced.won and len(advanced.ready) == 1 and advanced.to_cancel == []
    assert not (await advance()).won  # closed already: the loser creates nothing
    closed, second = await store.rounds.training_rounds(job.id)
    assert closed.state == TrainingRoundState.CLOSED and closed.metrics == {
        "loss": 1.5,
        "eval": 2.0,
    }
    assert second.state == TrainingRoundState.OPEN and second.round == 1
    finish = await store.rounds.finish_training(
        job.id, 1, metrics={}, result_hash=OUT_B, result_size=3, now=T0 + 30
    )
    assert finish.won
    done = await store.jobs.get_job(job.id)
    assert done is not None and done.state == JobState.COMPLETED and done.result_hash == OUT_B


# -- store.blob_owners and store.usage -----------------------------------------------------


async def test_blob_owners_and_usage(store: SqlStore) -> None:
    alice, bob = await _account(store), await _account(store, "bob")
    await store.blob_owners.add_blob_owner(OUT_A, alice.id, size=7, now=T0)
    await store.blob_owners.add_blob_owner(OUT_A, alice.id, size=7, now=T0 + 1)  # again: no change
    await store.blob_owners.add_blob_owner(OUT_B, alice.id, size=3, now=T0)
    assert await store.usage.blob_usage(alice.id) == BlobUsage(blobs=2, bytes=10)
    assert await store.usage.blob_usage(bob.id) == BlobUsage(blobs=0, bytes=0)
    assert await store.blob_owners.owns_or_produced(alice.id, OUT_A)
    assert not await store.blob_owners.owns_or_produced(bob.id, OUT_A)
    assert not await store.blob_owners.holds_tasks(alice.id, since=T0)


# -- store.web -----------------------------------------------------------------------------


async def _insert_account(conn: AsyncConnection, name: str) -> None:
    await conn.execute(
        insert(accounts).values(name=name, is_admin=False, created_at=T0, role="volunteer")
    )


async def test_web_runs_a_function_in_a_read_or_a_write_transaction(store: SqlStore) -> None:
    await store.web.web_write(_insert_account, "carol")
    found = await store.web.web_read(web.account_by_name, "carol")
    assert found is not None and found.role == "volunteer"
    with pytest.raises(web.Conflict):  # a unique name taken: rolled back, said so
        await store.web.web_write(_insert_account, "carol")


# -- the database under the roles: one transaction an operation, or the batch's -----------


def _count_begins(store: SqlStore) -> list[int]:
    begins: list[int] = []
    event.listen(store.engine.sync_engine, "begin", lambda _conn: begins.append(1))
    return begins


async def test_an_operation_with_nothing_to_do_opens_no_transaction(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    begins = _count_begins(store)
    assert await store.claims.claim_tasks({}, _claimer(node), kind="sleep", now=T0) == []
    assert await store.claims.release_claims([], node.id, now=T0) == []
    assert await store.results.accept_results(node.id, [], now=T0) == []
    await store.nodes.touch_nodes({})
    assert begins == []
    await store.nodes.touch_nodes({node.id: T0 + 1})
    assert len(begins) == 1


async def test_operations_inside_a_batch_share_its_one_transaction(store: SqlStore) -> None:
    alice = await _account(store)
    begins = _count_begins(store)
    async with store.batch():
        job, [ready] = await store.jobs.create_job(_job(alice), now=T0)
        node = await _node(store, alice)
        await _claim(store, ready.task_id, node)
        await _result(store, ready.task_id, node)
    assert len(begins) == 1
    assert (await _task_row(store, ready.task_id)).state == TaskState.COMPLETED.value


# -- the verifier's operations (on SqlStore for now) --------------------------------------


async def _decide(
    store: SqlStore,
    shard_id: int,
    canonical: int | None,
    *,
    valid: tuple[int, ...] = (),
    invalid: tuple[int, ...] = (),
    fail_reason: str | None = None,
    now: float = T0 + 5,
):  # type: ignore[no-untyped-def]
    return await store.verification.decide_shard(
        shard_id,
        canonical_task_id=canonical,
        valid=list(valid),
        invalid=list(invalid),
        fail_reason=fail_reason,
        now=now,
    )


async def test_verify_decide_and_assemble_path(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    job, ready = await store.jobs.create_job(_job(alice, shards=2), now=T0)
    for entry, output in zip(ready, (OUT_A, OUT_B), strict=True):
        await _claim(store, entry.task_id, node)
        await _result(store, entry.task_id, node, output)
    assert sorted(await store.verification.shards_to_verify(limit=10)) == sorted(
        r.shard_id for r in ready
    )
    found = await store.verification.shard_for_verify(ready[0].shard_id)
    assert found is not None and found.job.id == job.id and found.shard.index == 0
    assert [(r.task_id, r.node_id, r.output_hash) for r in found.results] == [
        (ready[0].task_id, node.id, OUT_A)
    ]
    assert await store.verification.shard_for_verify(9999) is None

    first = await _decide(store, ready[0].shard_id, ready[0].task_id, valid=(ready[0].task_id,))
    assert first.decided and not first.job_done
    assert await store.jobs.jobs_to_assemble() == []
    with pytest.raises(RuntimeError):
        await store.jobs.canonical_outputs(job.id)
    last = await _decide(store, ready[1].shard_id, ready[1].task_id, valid=(ready[1].task_id,))
    assert last.decided and last.job_done
    assert await store.verification.shards_to_verify(limit=10) == []
    assert await store.jobs.jobs_to_assemble() == [job.id]
    assert await store.jobs.canonical_outputs(job.id) == [OUT_A, OUT_B]
    assert (await _task_row(store, ready[0].task_id)).outcome == "valid"

    assert await store.jobs.complete_job(job.id, result_hash=OUT_C, result_size=9, now=T0 + 9)
    assert not await store.jobs.complete_job(job.id, result_hash=OUT_A, result_size=1, now=T0 + 10)
    done = await store.jobs.get_job(job.id)
    assert done is not None
    assert (done.state, done.result_hash, done.result_size, done.finished_at) == (
        JobState.COMPLETED,
        OUT_C,
        9,
        T0 + 9,
    )
    assert done.shard_counts == {"done": 2} and done.tasks_run == 2
    assert await store.jobs.jobs_to_assemble() == []


async def test_decide_shard_happens_exactly_once(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node)
    await _result(store, ready.task_id, node)
    outcomes = await asyncio.gather(
        *(_decide(store, ready.shard_id, ready.task_id, valid=(ready.task_id,)) for _ in range(5))
    )
    assert [o.decided for o in outcomes].count(True) == 1
    assert [o.job_done for o in outcomes].count(True) == 1
    again = await _decide(store, ready.shard_id, ready.task_id, valid=(ready.task_id,))
    assert not again.decided and not again.job_done and again.to_cancel == []
    failed = await _decide(store, ready.shard_id, None, fail_reason="too late to fail")
    assert not failed.decided
    [shard] = await store.jobs.list_shards(ready.job_id)
    assert shard.state == ShardState.DONE and shard.output_hash == OUT_A and shard.error is None


async def test_undecided_shard_stays_open(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _node(store, alice)
    _, ready = await store.jobs.create_job(_job(alice, replication=2, min_quorum=2), now=T0)
    await _claim(store, ready[0].task_id, node)
    await _result(store, ready[0].task_id, node)
    outcome = await _decide(store, ready[0].shard_id, None)
    assert not outcome.decided
    [shard] = await store.jobs.list_shards(ready[0].job_id)
    assert shard.state == ShardState.OPEN and shard.live_tasks == 1


async def test_decision_cancels_live_replicas_and_returns_held_ones(store: SqlStore) -> None:
    alice = await _account(store)
    nodes = [await _node(store, alice, f"node-key-{i}") for i in range(3)]
    _, ready = await store.jobs.create_job(_job(alice, replication=3, min_quorum=1), now=T0)
    await _claim(store, ready[0].task_id, nodes[0])
    await _claim(store, ready[1].task_id, nodes[1])
    await _result(store, ready[0].task_id, nodes[0])
    outcome = await _decide(store, ready[0].shard_id, ready[0].task_id, valid=(ready[0].task_id,))
    assert outcome.decided and outcome.job_done
    # The held replica is returned (its node is told); the ready one is cancelled quietly.
    assert [(t.task_id, t.node_id) for t in outcome.to_cancel] == [(ready[1].task_id, nodes[1].id)]
    for entry in ready[1:]:
        assert (await _task_row(store, entry.task_id)).state == TaskState.CANCELLED.value


async def test_late_result_after_decision_changes_nothing(store: SqlStore) -> None:
    alice = await _account(store)
    slow, fast = await _node(store, alice), await _node(store, alice, "node-key-2")
    job, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    first = ready.task_id
    await _claim(store, first, slow)
    expired = await store.results.expire_overdue(now=T0 + LEASE + 1)
    assert [(t.task_id, t.state) for t in expired] == [(first, TaskState.EXPIRED)]
    [replacement], failed, _ = await store.scheduling.replenish(now=T0 + LEASE + 1)
    assert failed == []
    await _claim(store, replacement.task_id, fast, now=T0 + LEASE + 2)
    await _result(store, replacement.task_id, fast, OUT_A)
    outcome = await _decide(
        store, ready.shard_id, replacement.task_id, valid=(replacement.task_id,)
    )
    assert outcome.decided
    # The expired task is to be stopped with the decision; its node is not connected to hear.
    assert [t.task_id for t in outcome.to_cancel] == [first]

    late = await _result(store, first, slow, OUT_B, now=T0 + 500)
    assert late.status == "late"
    # Stored all the same, to be checked against the canonical result (Grid.judge_late).
    row = await _task_row(store, first)
    assert (row.state, row.output_hash, row.outcome) == (TaskState.COMPLETED.value, OUT_B, "late")
    [pending] = await store.verification.late_results(limit=10)
    assert (pending.task_id, pending.canonical_hash) == (first, OUT_A)
    await store.verification.judge_late(first, agrees=False, now=T0 + 501)
    assert (await _task_row(store, first)).outcome == "invalid"
    assert await store.verification.late_results(limit=10) == []
    [shard] = await store.jobs.list_shards(job.id)
    assert (shard.state, shard.output_hash) == (ShardState.DONE, OUT_A)
    assert await store.verification.shards_to_verify(limit=10) == []


# -- the database: migrations and schema --------------------------------------------------


async def test_migrations_run_twice_are_a_no_op(store: SqlStore, db: Database) -> None:
    alice = await _account(store)
    job, _ = await store.jobs.create_job(_job(alice, shards=2), now=T0)
    await store.open()  # the same store again
    second = db.store()
    await second.open()
    try:
        assert await second.accounts.get_account("alice") == alice
        again = await second.jobs.get_job(job.id)
        assert again is not None and again.shards_total == 2
        async with second.engine.connect() as conn:
            version = (await conn.exec_driver_sql("SELECT version_num FROM alembic_version")).all()
        assert version == [(_head_revision(),)]
    finally:
        await second.close()


def _head_revision() -> str:
    from alembic.script import ScriptDirectory

    from idlegrid.store.migrate import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


async def test_a_fresh_database_has_every_table(store: SqlStore) -> None:
    async with store.engine.connect() as conn:
        names = set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
    assert {"accounts", "tokens", "nodes", "jobs", "shards", "tasks", "alembic_version"} <= names


async def test_task_states_in_the_database_are_enum_values(store: SqlStore) -> None:
    # A guard for conditional updates written with raw strings.
    alice = await _account(store)
    await store.jobs.create_job(_job(alice, shards=2), now=T0)
    async with store.engine.begin() as conn:
        await conn.execute(update(tasks).values(created_at=T0))
        states = {row[0] for row in (await conn.execute(select(tasks.c.state))).all()}
    assert states == {TaskState.READY.value}


# -- store.node_control --------------------------------------------------------------------


async def test_node_settings_keep_the_later_edit_per_setting(store: SqlStore) -> None:
    from idlegrid.store.node_control import SettingRow

    alice = await _account(store)
    node = await _node(store, alice)

    def row(name: str, value: object, source: str, at: float) -> SettingRow:
        return SettingRow(name=name, value=value, source=source, by="alice", at=at)

    put = store.node_control.put_settings
    assert await put(node.id, [row("cpu_percent", 50.0, "web", T0), row("windows", "", "web", T0)])
    # An older local edit loses; a newer one wins; at the same time the web wins.
    assert await put(node.id, [row("cpu_percent", 80.0, "local", T0 - 1)]) == []
    assert await put(node.id, [row("windows", "18:00-08:00", "local", T0 + 1)]) == ["windows"]
    assert await put(node.id, [row("windows", "09:00-17:00", "web", T0 + 1)]) == ["windows"]
    assert await put(node.id, [row("windows", "00:00-24:00", "local", T0 + 1)]) == []
    # A node's configuration (never changed) comes at 0: its latest report is kept.
    assert await put(node.id, [row("cpu_mode", "idle", "local", 0.0)]) == ["cpu_mode"]
    assert await put(node.id, [row("cpu_mode", "always", "local", 0.0)]) == ["cpu_mode"]
    stored = (await store.node_control.settings_of([node.id]))[node.id]
    assert stored["cpu_percent"].value == 50.0 and stored["cpu_percent"].source == "web"
    assert stored["windows"].value == "09:00-17:00" and stored["windows"].at == T0 + 1
    assert stored["cpu_mode"].value == "always"
    assert (await store.node_control.settings_of([])) == {}

    await store.node_control.record_activity(node.id, now=T0, state="paused", reason="busy")
    await store.node_control.record_activity(node.id, now=T0 + 1, settings_error="no")
    activity = (await store.node_control.activity_of([node.id]))[node.id]
    assert (activity.state, activity.reason, activity.settings_error) == ("paused", "busy", "no")
    assert (await store.node_control.node(node.id)) == node
    assert await store.node_control.node(node.id + 1000) is None


async def test_held_back_nodes_are_the_paused_and_throttled_ones(store: SqlStore) -> None:
    from idlegrid.store.node_control import HeldBack

    alice = await _account(store)
    nodes = [await _node(store, alice, key=f"n{i}") for i in range(4)]
    said = [("paused", "paused: busy"), ("running", "running: idle"), ("throttled", "in use")]
    for node, (state, reason) in zip(nodes, said, strict=False):
        await store.node_control.record_activity(node.id, now=T0, state=state, reason=reason)
    await store.node_control.record_activity(nodes[3].id, now=T0, settings_error="no")
    assert await store.node_control.held_back() == [
        HeldBack(nodes[0].id, "n0", "paused", "paused: busy"),
        HeldBack(nodes[2].id, "n2", "throttled", "in use"),
    ]
    many = [node.id for node in nodes] + list(range(10_000, 11_000))  # over one statement
    assert sorted(await store.node_control.activity_of(many)) == [node.id for node in nodes]
