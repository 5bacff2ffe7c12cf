"""Exactly once in the store: each task is an error, a check or a credit of its node once,
however many processes act on it, and a shard's work is credited once.

Trust counters follow the tasks' final states: a node's errors are its tasks that failed
or expired for good, its valid and invalid results those judged so. These tests run on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import select

from idlegrid.states import TaskState
from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    Claimer,
    NewJob,
    NewShard,
    NodeRecord,
    ShardDecision,
)
from idlegrid.store.schema import shards, tasks
from idlegrid.store.sql import SqlStore

T0 = 1_000_000.0
LEASE = 100.0
OUT = hashlib.sha256(b"out").hexdigest()


async def _node(store: SqlStore, account: AccountRecord, key: str) -> NodeRecord:
    return await store.register_node(
        account.id,
        key,
        name=key,
        worker_version="0.1.0",
        hardware={"cpu_cores": 4},
        benchmark={"matmul_gflops": 10.0},
        kinds=["sleep"],
        slots=2,
        address="127.0.0.1",
        now=T0,
    )


def _job(account: AccountRecord, *, replication: int = 1) -> NewJob:
    return NewJob(
        account_id=account.id,
        kind="sleep",
        params={"tasks": 1},
        inputs={},
        replication=replication,
        min_quorum=min(2, replication),
        max_attempts=10,
        priority=0,
        shards=[NewShard(index=0, input_hash=OUT, input_size=3, items=1, cost_flops=1e9)],
    )


async def _claim(store: SqlStore, task_id: int, node: NodeRecord, *, now: float) -> Assignment:
    claim = await store.claim_task(
        task_id,
        Claimer(node_id=node.id, account_id=node.account_id, network="", backend="cpu"),
        kind="sleep",
        lease_deadline=now + LEASE,
        now=now,
        distinct=None,
    )
    assert isinstance(claim, Assignment), claim
    return claim


async def _trust(store: SqlStore, node: NodeRecord) -> tuple[int, int, int]:
    [row] = await store.node_trust(node.id)
    return row.trust.valid_total, row.trust.invalid_total, row.trust.error_total


async def _credit(store: SqlStore, node: NodeRecord) -> float:
    [found] = [n for n in await store.list_nodes() if n.id == node.id]
    return found.credit.total


async def _task(store: SqlStore, task_id: int):  # type: ignore[no-untyped-def]
    async with store.engine.connect() as conn:
        return (await conn.execute(select(tasks).where(tasks.c.id == task_id))).one()


async def test_two_expiries_of_one_task_charge_its_node_once(store: SqlStore) -> None:
    alice = await store.create_account("alice", is_admin=False, now=T0)
    node = await _node(store, alice, "n1")
    _, [ready] = await store.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node, now=T0)
    # Two processes' passes both select the overdue task; the second changes nothing.
    first = await store.expire_overdue(now=T0 + LEASE + 1)
    second = await store.expire_node_tasks(node.id, now=T0 + LEASE + 2)
    assert [t.task_id for t in first] == [ready.task_id] and second == []
    assert await _trust(store, node) == (0, 0, 1)
    # A failure it reports after that is the same error, not a second one.
    assert await store.record_failure(ready.task_id, node.id, reason="gave up", now=T0 + 200)
    assert (await _task(store, ready.task_id)).state == TaskState.FAILED.value
    assert await _trust(store, node) == (0, 0, 1)


async def test_an_expired_task_that_delivers_is_no_error_and_a_late_copy_earns_no_credit(
    store: SqlStore,
) -> None:
    alice = await store.create_account("alice", is_admin=False, now=T0)
    slow, fast = await _node(store, alice, "slow"), await _node(store, alice, "fast")
    _, [ready] = await store.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, slow, now=T0)
    await store.expire_overdue(now=T0 + LEASE + 1)
    [replacement], _, _ = await store.replenish(now=T0 + LEASE + 1)
    await _claim(store, replacement.task_id, fast, now=T0 + LEASE + 2)
    await store.accept_result(
        replacement.task_id, fast.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 150
    )
    [outcome] = await store.decide_shards(
        [ShardDecision(ready.shard_id, replacement.task_id, [replacement.task_id], [], None)],
        now=T0 + 151,
    )
    assert outcome.decided
    # The expired task stays expired (its node is told to stop), an error for now.
    assert [t.task_id for t in outcome.to_cancel] == [ready.task_id]
    assert (await _task(store, ready.task_id)).state == TaskState.EXPIRED.value
    assert await _trust(store, slow) == (0, 0, 1)
    # It delivers after all: the error is withdrawn; the result is checked, and agrees.
    receipt = await store.accept_result(
        ready.task_id, slow.id, output_hash=OUT, output_size=3, elapsed_s=9, now=T0 + 300
    )
    assert receipt.status == "late"
    assert await _trust(store, slow) == (0, 0, 0)
    await store.judge_late(ready.task_id, agrees=True, now=T0 + 301)
    assert await _trust(store, slow) == (1, 0, 0)
    # The shard's work was credited once, to the result that decided it.
    late, canonical = await _task(store, ready.task_id), await _task(store, replacement.task_id)
    assert (late.outcome, late.credit) == ("valid", None)
    assert canonical.outcome == "valid" and canonical.credit > 0
    assert await _credit(store, slow) == 0 and await _credit(store, fast) == canonical.credit


async def test_run_alone_gives_back_the_attempts_of_the_replicas_it_cancelled(
    store: SqlStore,
) -> None:
    alice = await store.create_account("alice", is_admin=False, now=T0)
    node = await _node(store, alice, "n1")
    _, ready = await store.create_job(_job(alice, replication=3), now=T0)
    first = ready[0]
    await _claim(store, first.task_id, node, now=T0)
    cancelled = await store.run_alone(first.shard_id, first.task_id, spot_check=False)
    assert cancelled == sorted(r.task_id for r in ready[1:])
    async with store.engine.connect() as conn:
        shard = (await conn.execute(select(shards).where(shards.c.id == first.shard_id))).one()
    assert (shard.mode, shard.target, shard.attempts) == ("alone", 1, 1)
    # Asked again (another process, say), it changes and cancels nothing.
    assert await store.run_alone(first.shard_id, first.task_id, spot_check=False) == []
