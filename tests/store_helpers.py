"""Small builders for store tests: an account, a node, a job, a claim, a result (the
contract suite tests/contract/test_store_roles.py and the tests in tests/store)."""

from __future__ import annotations

import hashlib

from sqlalchemy import select

from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    Claimer,
    ClaimMiss,
    Distinct,
    NewJob,
    NewShard,
    NodeRecord,
)
from idlegrid.store.schema import tasks
from idlegrid.store.sql import SqlStore

T0 = 1_000_000.0
LEASE = 100.0


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


OUT_A, OUT_B, OUT_C = _hash("a"), _hash("b"), _hash("c")


async def _account(store: SqlStore, name: str = "alice") -> AccountRecord:
    return await store.accounts.create_account(name, is_admin=False, now=T0)


async def _node(store: SqlStore, account: AccountRecord, key: str = "node-key-1") -> NodeRecord:
    return await store.nodes.register_node(
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


def _job(
    account: AccountRecord,
    *,
    shards: int = 1,
    replication: int = 1,
    min_quorum: int = 1,
    max_attempts: int = 5,
    priority: int = 0,
    kind: str = "sleep",
) -> NewJob:
    return NewJob(
        account_id=account.id,
        kind=kind,
        params={"tasks": shards},
        inputs={},
        replication=replication,
        min_quorum=min_quorum,
        max_attempts=max_attempts,
        priority=priority,
        shards=[
            NewShard(
                index=i, input_hash=_hash(f"input {i}"), input_size=10 + i, items=2, cost_flops=1e6
            )
            for i in range(shards)
        ],
    )


async def _claim(
    store: SqlStore, task_id: int, node: NodeRecord, *, now: float = T0, distinct: bool = False
) -> Assignment:
    claim = await _try_claim(
        store, task_id, node, lease_deadline=now + LEASE, now=now, distinct=distinct
    )
    assert isinstance(claim, Assignment), claim
    return claim


NODES = Distinct(accounts=False, networks=False)  # these tests' nodes share an account


def _claimer(node: NodeRecord) -> Claimer:
    return Claimer(node_id=node.id, account_id=node.account_id, network=node.network, backend="cpu")


async def _try_claim(
    store: SqlStore,
    task_id: int,
    node: NodeRecord,
    *,
    lease_deadline: float,
    now: float,
    distinct: bool = False,
) -> Assignment | ClaimMiss:
    return await store.claims.claim_task(
        task_id,
        _claimer(node),
        kind="sleep",
        lease_deadline=lease_deadline,
        now=now,
        distinct=NODES if distinct else None,
    )


async def _task_row(store: SqlStore, task_id: int):  # type: ignore[no-untyped-def]
    async with store.engine.connect() as conn:
        return (await conn.execute(select(tasks).where(tasks.c.id == task_id))).one()


async def _result(
    store: SqlStore, task_id: int, node: NodeRecord, output: str = OUT_A, *, now: float = T0 + 1
):  # type: ignore[no-untyped-def]
    return await store.results.accept_result(
        task_id, node.id, output_hash=output, output_size=5, elapsed_s=1.0, now=now
    )
