"""Property: claims stay atomic under hundreds of concurrent requesters.

Randomized jobs (seeded) and 200 asyncio requesters that claim ready tasks, let some
leases run out (expiry, then replenish) and, in one variant, add speculative backups, all
at once; on PostgreSQL through three `SqlStore` instances (three engines: three
coordinator processes), on SQLite through one. A checker reads the database throughout.
At every snapshot and at the end:

- no shard has more live replicas (ready or assigned tasks) than its replication, plus
  one when backups are on;
- no node holds two live tasks of one shard, and with replication > 1 no node ever got two
  tasks of one shard;
- no task was handed out twice (each successful claim has its own task id).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import Database
from sqlalchemy import text

from idlegrid.store.base import Assignment, Claimer, Distinct, NewJob, NewShard
from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings

REQUESTERS = 200
NODES = 40
EXPIRIES = 15
BACKUP_TRIES = 30
CLAIMS_EACH = 3
# Transactions in flight per store: a coordinator process's connection pool.
PER_PROCESS = 8


@dataclass
class Run:
    stores: list[SqlStore]
    gates: list[asyncio.Semaphore]
    node_ids: list[int]
    account_id: int
    replication: dict[int, int] = field(default_factory=dict)  # shard -> replicas needed
    handed: list[int] = field(default_factory=list)  # task ids of successful claims
    misses: int = 0  # claims that lost a race or met the node's own replica
    expiries_left: int = EXPIRIES
    backups_left: int = 0
    violations: list[str] = field(default_factory=list)

    async def call(self, which: int, operation: str, *args: Any, **kwargs: Any) -> Any:
        """`operation` ("role.method") on store `which`, within its pool's size."""
        role, method = operation.split(".")
        async with self.gates[which]:
            return await getattr(getattr(self.stores[which], role), method)(*args, **kwargs)


async def _setup(stores: list[SqlStore], rng: random.Random, *, backups: bool) -> Run:
    store = stores[0]
    for each in stores:  # claims are what is tested here, not the daily quota
        each.trust = TrustSettings(initial_daily_quota=1_000_000)
    account = await store.accounts.create_account("researcher", is_admin=False, now=1.0)
    node_ids = []
    for n in range(NODES):
        node = await store.nodes.register_node(
            account.id,
            f"node-key-{n:04d}",
            name=f"n{n}",
            worker_version="t",
            hardware={},
            benchmark={},
            kinds=["sleep"],
            slots=4,
            address="",
            now=1.0,
        )
        node_ids.append(node.id)
    run = Run(
        stores=stores,
        gates=[asyncio.Semaphore(PER_PROCESS) for _ in stores],
        node_ids=node_ids,
        account_id=account.id,
        backups_left=BACKUP_TRIES if backups else 0,
    )
    for job_index in range(rng.randint(2, 4)):
        replication = rng.randint(1, 3)
        shards = [
            NewShard(
                index=i,
                input_hash=f"{job_index:032x}{i:032x}",
                input_size=1,
                items=1,
                cost_flops=1e9,
            )
            for i in range(rng.randint(1, 12))
        ]
        record, _ = await store.jobs.create_job(
            NewJob(
                account_id=account.id,
                kind="sleep",
                params={},
                inputs={},
                replication=replication,
                min_quorum=min(replication, 2),
                max_attempts=replication + 6,
                priority=0,
                shards=shards,
            ),
            now=2.0,
        )
        for shard in await store.jobs.list_shards(record.id):
            run.replication[shard.id] = replication
    return run


async def _requester(run: Run, rng: random.Random, which: int) -> None:
    """One node asking for work: one (soon stale) look at the queue, a few claims from it."""
    node_id = rng.choice(run.node_ids)
    await asyncio.sleep(rng.random() * 0.05)  # a random start: the interleaving under test
    ready = await run.call(which, "claims.ready_tasks", limit=40)
    held: list[Assignment] = []
    for task in rng.sample(ready, min(CLAIMS_EACH, len(ready))):
        claimer = Claimer(node_id=node_id, account_id=run.account_id, network="", backend="cpu")
        # One account for all: "distinct replicas" here means distinct nodes.
        distinct = Distinct(accounts=False, networks=False)
        claim = await run.call(
            which,
            "claims.claim_task",
            task.task_id,
            claimer,
            kind="sleep",
            lease_deadline=1e12,
            now=3.0,
            distinct=distinct if run.replication[task.shard_id] > 1 else None,
        )
        if isinstance(claim, Assignment):
            run.handed.append(claim.task_id)
            held.append(claim)
        else:
            run.misses += 1
    if held and run.expiries_left > 0 and rng.random() < 0.3:
        run.expiries_left -= 1
        lost = held.pop(rng.randrange(len(held)))
        await run.call(which, "results.expire_task", lost.task_id, now=4.0)
        await run.call(which, "scheduling.replenish", now=4.0)
    if run.backups_left > 0 and rng.random() < 0.3:
        run.backups_left -= 1
        await run.call(
            which,
            "scheduling.add_backup_task",
            rng.choice(list(run.replication)),
            rng.choice(run.node_ids),
            lease_deadline=1e12,
            now=3.0,
        )


LIVE_PER_SHARD = """
SELECT shard_id, COUNT(*) FROM tasks WHERE state IN ('ready', 'assigned') GROUP BY shard_id
"""
LIVE_PER_NODE_SHARD = """
SELECT shard_id, node_id, COUNT(*) FROM tasks
WHERE state = 'assigned' GROUP BY shard_id, node_id HAVING COUNT(*) > 1
"""
EVER_PER_NODE_SHARD = """
SELECT t.shard_id, t.node_id, COUNT(*) FROM tasks t JOIN jobs j ON j.id = t.job_id
WHERE t.node_id IS NOT NULL AND j.replication > 1
GROUP BY t.shard_id, t.node_id HAVING COUNT(*) > 1
"""


async def _check(run: Run, *, extra: int) -> None:
    """One snapshot of the invariants (each query is one consistent statement)."""
    async with run.stores[-1].engine.connect() as conn:
        for shard_id, live in (await conn.execute(text(LIVE_PER_SHARD))).all():
            if live > run.replication[shard_id] + extra:
                run.violations.append(f"shard {shard_id}: {live} live replicas")
        for row in (await conn.execute(text(LIVE_PER_NODE_SHARD))).all():
            run.violations.append(f"shard {row[0]}: node {row[1]} holds {row[2]} live tasks")
        for row in (await conn.execute(text(EVER_PER_NODE_SHARD))).all():
            run.violations.append(f"shard {row[0]}: node {row[1]} got {row[2]} replicas")


async def _checker(run: Run, done: asyncio.Event, *, extra: int) -> int:
    checks = 0
    while not done.is_set():
        await _check(run, extra=extra)
        checks += 1
        await asyncio.sleep(0.02)  # pacing: the checker looks again and again, not in a spin
    return checks


async def _run(stores: list[SqlStore], seed: int, *, backups: bool) -> Run:
    rng = random.Random(seed)
    run = await _setup(stores, rng, backups=backups)
    done = asyncio.Event()
    extra = 1 if backups else 0
    checker = asyncio.create_task(_checker(run, done, extra=extra))
    try:
        await asyncio.gather(
            *(
                _requester(run, random.Random(rng.random()), i % len(stores))
                for i in range(REQUESTERS)
            )
        )
    finally:
        done.set()
        checks = await checker
    await _check(run, extra=extra)
    assert checks >= 1
    return run


def _assert_sound(run: Run) -> None:
    assert run.violations == []
    assert len(run.handed) == len(set(run.handed)), "a task was handed out twice"
    # The requesters did contend: most claims lost a race (or met their own replica).
    assert run.misses > len(run.handed) > 0


async def _open(db: Database, processes: int) -> list[SqlStore]:
    stores = [db.store() for _ in range(processes)]
    for store in stores:
        await store.open()
    return stores


@pytest.mark.parametrize(
    ("seed", "backups"),
    [(11, False), (23, False), (47, False), (5, True)],
    ids=["seed11", "seed23", "seed47", "seed5-backups"],
)
async def test_concurrent_claims_never_over_replicate(
    db: Database, seed: int, backups: bool
) -> None:
    processes = 1 if db.url.startswith("sqlite") else 3
    stores = await _open(db, processes)
    try:
        run = await _run(stores, seed, backups=backups)
    finally:
        for store in stores:
            await store.close()
    _assert_sound(run)
    if backups:
        assert run.backups_left < BACKUP_TRIES
