"""`SqlStore.batch`: many calls, one transaction, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from helpers import eventually
from sqlalchemy import select, text
from store_helpers import T0, _account, _claim, _claimer, _job, _node, _result, _task_row

from idlegrid.states import NodeState, TaskState
from idlegrid.store import totals
from idlegrid.store.base import Assignment, ClaimMiss, StoreConflict
from idlegrid.store.schema import accounts
from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings


class Boom(Exception):
    pass


async def test_claims_and_results_in_a_batch_are_all_stored(store: SqlStore) -> None:
    account = await _account(store)
    node = await _node(store, account)
    _, ready = await store.jobs.create_job(_job(account, shards=3), now=T0)
    async with store.batch():
        for entry in ready:
            await _claim(store, entry.task_id, node)
        # Reads inside the batch see its writes.
        assert {t.task_id for t in await store.nodes.node_tasks(node.id)} == {
            e.task_id for e in ready
        }
    async with store.batch():
        receipts = [await _result(store, entry.task_id, node) for entry in ready]
    assert [r.status for r in receipts] == ["accepted"] * 3
    for entry in ready:
        assert (await _task_row(store, entry.task_id)).state == TaskState.COMPLETED.value


async def test_a_failed_batch_stores_nothing(store: SqlStore) -> None:
    account = await _account(store)
    node = await _node(store, account)
    _, ready = await store.jobs.create_job(_job(account, shards=2), now=T0)
    with pytest.raises(Boom):
        async with store.batch():
            await _claim(store, ready[0].task_id, node)
            await _claim(store, ready[1].task_id, node)
            raise Boom()
    for entry in ready:
        assert (await _task_row(store, entry.task_id)).state == TaskState.READY.value
    # The write lock was released: the store takes writes again.
    await _claim(store, ready[0].task_id, node)


async def test_a_batch_with_only_reads_takes_no_write_lock(store: SqlStore) -> None:
    account = await _account(store)
    async with store.batch():
        assert await store.accounts.get_account(account.name) == account
        if store.db.write_lock is not None:
            assert not store.db.write_lock.locked()


async def test_nested_batches_share_the_outer_transaction(store: SqlStore) -> None:
    account = await _account(store)
    node = await _node(store, account)
    _, ready = await store.jobs.create_job(_job(account, shards=1), now=T0)
    with pytest.raises(Boom):
        async with store.batch():
            async with store.batch():
                await _claim(store, ready[0].task_id, node)
            raise Boom()  # the inner batch did not commit on its own
    assert (await _task_row(store, ready[0].task_id)).state == TaskState.READY.value


async def test_claim_tasks_takes_those_still_ready_in_one_go(store: SqlStore) -> None:
    store.trust = TrustSettings(initial_daily_quota=3)
    account = await _account(store)
    node, other = await _node(store, account), await _node(store, account, "node-key-2")
    job, ready = await store.jobs.create_job(_job(account, shards=3), now=T0)
    taken = await _claim(store, ready[1].task_id, other)
    deadlines = {entry.task_id: T0 + 50 + i for i, entry in enumerate(ready)}
    claimed = await store.claims.claim_tasks(deadlines, _claimer(node), kind="sleep", now=T0)
    assert not isinstance(claimed, ClaimMiss)
    assert [a.task_id for a in claimed] == [ready[0].task_id, ready[2].task_id]
    assert [a.shard_index for a in claimed] == [0, 2]
    for assignment in claimed:
        assert assignment.lease_deadline == deadlines[assignment.task_id]
        row = await _task_row(store, assignment.task_id)
        assert row.state == TaskState.ASSIGNED.value and row.node_id == node.id
        assert row.lease_deadline == deadlines[assignment.task_id]
    assert (await _task_row(store, taken.task_id)).node_id == other.id  # not taken over
    assert (await store.jobs.get_job(job.id)).state == "running"  # type: ignore[union-attr]
    assert await store.claims.claim_tasks(deadlines, _claimer(node), kind="sleep", now=T0) == []
    assert await store.claims.claim_tasks({}, _claimer(node), kind="sleep", now=T0) == []
    # The daily quota (3 here) caps a batch, as it caps single claims.
    _, more = await store.jobs.create_job(_job(account, shards=3), now=T0)
    rest = await store.claims.claim_tasks(
        {e.task_id: T0 + 50 for e in more}, _claimer(node), kind="sleep", now=T0
    )
    assert not isinstance(rest, ClaimMiss) and len(rest) == 1  # 2 of its 3 used above
    assert (
        await store.claims.claim_tasks(
            {more[1].task_id: T0 + 50}, _claimer(node), kind="sleep", now=T0
        )
        is ClaimMiss.QUOTA
    )


async def test_touch_nodes_writes_every_node_across_chunks(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idlegrid.store import nodes as store_nodes

    monkeypatch.setattr(store_nodes, "TOUCH_CHUNK", 2)
    account = await _account(store)
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(5)]
    await store.nodes.touch_nodes({node.id: T0 + 10 + i for i, node in enumerate(nodes)})
    listed = {node.id: node for node in await store.nodes.list_nodes()}
    for i, node in enumerate(nodes):
        assert listed[node.id].last_seen_at == T0 + 10 + i
        assert listed[node.id].connected_seconds == pytest.approx(10 + i)


async def test_after_commit_runs_once_the_batch_committed_and_never_after_a_rollback(
    store: SqlStore,
) -> None:
    account = await _account(store)
    node = await _node(store, account)
    _, ready = await store.jobs.create_job(_job(account, shards=2), now=T0)
    seen: list[str] = []

    async def note(what: str) -> None:
        # What the action sees is committed: a fresh read outside the batch.
        states = [(await _task_row(store, r.task_id)).state for r in ready]
        seen.append(f"{what}: {states}")

    async with store.batch():
        await _claim(store, ready[0].task_id, node)
        async with store.batch():  # nested: still the outer batch's commit
            await store.after_commit(lambda: note("kept"))
        await store.after_commit(lambda: note("kept again"))
        if store.is_sqlite:
            assert seen == []  # not yet: nothing is committed
    assert seen == [
        "kept: ['assigned', 'ready']",
        "kept again: ['assigned', 'ready']",
    ]
    with pytest.raises(Boom):
        async with store.batch():
            await _claim(store, ready[1].task_id, node)
            await store.after_commit(lambda: note("rolled back"))
            raise Boom()
    if store.is_sqlite:
        assert len(seen) == 2  # dropped with the batch
    await store.after_commit(lambda: note("outside"))  # no batch: at once
    assert seen[-1].startswith("outside")


async def test_a_deadlocked_batch_raises_a_conflict_and_runs_again(store: SqlStore) -> None:
    """Two batches write two nodes' rows in opposite orders: PostgreSQL aborts one."""
    if store.is_sqlite:
        pytest.skip("SQLite has one writer at a time: its batches cannot deadlock")
    account = await _account(store)
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(2)]
    first_writes = [asyncio.Event(), asyncio.Event()]
    attempts = [0, 0]

    async def both_offline(side: int) -> None:
        attempts[side] += 1
        await store.nodes.set_node_offline(nodes[side].id, now=T0)
        first_writes[side].set()
        await first_writes[1 - side].wait()  # each holds its first row when it asks for more
        await store.nodes.set_node_offline(nodes[1 - side].id, now=T0)

    await asyncio.wait_for(
        asyncio.gather(*(store.run_batch(lambda s=side: both_offline(s)) for side in (0, 1))),
        timeout=30,
    )
    assert sorted(attempts) == [1, 2]  # one batch was aborted and ran again
    assert {n.state for n in await store.nodes.list_nodes()} == {NodeState.OFFLINE}


async def test_a_batch_that_meets_a_deadlock_raises_store_conflict(store: SqlStore) -> None:
    if store.is_sqlite:
        pytest.skip("SQLite has one writer at a time: its batches cannot deadlock")
    account = await _account(store)
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(2)]
    held = [asyncio.Event(), asyncio.Event()]

    async def both_offline(side: int) -> None:
        async with store.batch():
            await store.nodes.set_node_offline(nodes[side].id, now=T0)
            held[side].set()
            await held[1 - side].wait()
            await store.nodes.set_node_offline(nodes[1 - side].id, now=T0)

    results = await asyncio.wait_for(
        asyncio.gather(both_offline(0), both_offline(1), return_exceptions=True), timeout=30
    )
    assert sum(isinstance(r, StoreConflict) for r in results) == 1, results
    assert sum(r is None for r in results) == 1, results


async def test_a_claim_skips_a_task_another_batch_is_claiming(store: SqlStore) -> None:
    """One task's claim does not wait for another open transaction's claim of it: it
    misses (CONFLICT) at once, and its caller tries the next candidate."""
    if store.is_sqlite:
        pytest.skip("SQLite has one writer at a time: a second batch waits for the first")
    account = await _account(store)
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(2)]
    _, ready = await store.jobs.create_job(_job(account, shards=3), now=T0)
    await _try(store, ready.pop().task_id, nodes[0])  # the job runs: no job-row write below
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold_first() -> None:
        async with store.batch():
            await _try(store, ready[0].task_id, nodes[0])
            holding.set()
            await done.wait()

    holder = asyncio.create_task(hold_first())
    await holding.wait()
    try:
        missed = await asyncio.wait_for(_try(store, ready[0].task_id, nodes[1]), timeout=10)
        other = await asyncio.wait_for(_try(store, ready[1].task_id, nodes[1]), timeout=10)
    finally:
        done.set()
        await holder
    assert missed is ClaimMiss.CONFLICT
    assert isinstance(other, Assignment)
    assert (await _task_row(store, ready[0].task_id)).node_id == nodes[0].id
    # Once the holder committed, the task is gone for everyone else.
    assert await _try(store, ready[0].task_id, nodes[1]) is ClaimMiss.GONE


async def _try(store: SqlStore, task_id: int, node: object) -> Assignment | ClaimMiss:
    from store_helpers import _try_claim

    return await _try_claim(store, task_id, node, lease_deadline=T0 + 100, now=T0)  # type: ignore[arg-type]


async def test_claims_skip_tasks_another_batch_is_claiming(store: SqlStore) -> None:
    """A claim does not wait for a task another open transaction holds (PostgreSQL)."""
    if store.is_sqlite:
        pytest.skip("SQLite has one writer at a time: a second batch waits for the first")
    account = await _account(store)
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(2)]
    _, ready = await store.jobs.create_job(_job(account, shards=3), now=T0)
    await _try(store, ready.pop().task_id, nodes[0])  # the job runs: no job-row write below
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold_first() -> None:
        async with store.batch():
            await _try(store, ready[0].task_id, nodes[0])
            holding.set()
            await done.wait()

    holder = asyncio.create_task(hold_first())
    await holding.wait()
    try:
        claimed = await asyncio.wait_for(
            store.claims.claim_tasks(
                {e.task_id: T0 + 100 for e in ready}, _claimer(nodes[1]), kind="sleep", now=T0
            ),
            timeout=10,
        )
    finally:
        done.set()
        await holder
    assert not isinstance(claimed, ClaimMiss)
    assert [c.task_id for c in claimed] == [ready[1].task_id]


async def _credit_total(store: SqlStore, account_id: int) -> float:
    async with store.engine.connect() as conn:
        query = select(accounts.c.credit_total).where(accounts.c.id == account_id)
        return float((await conn.execute(query)).scalar_one())


async def test_credit_totals_are_written_at_the_end_of_a_batch(store: SqlStore) -> None:
    """Shared total rows (an account's credit) are written just before the commit: while
    the batch runs, another transaction writes the same row without waiting for it, and
    neither grant is lost."""
    account = await _account(store)
    async with store.batch():
        async with store.db.tx() as conn:
            await totals.grant(conn, "accounts", account.id, 5.0, now=T0)
        if not store.is_sqlite:  # SQLite: one writer at a time, the batch holds it
            async with store.engine.begin() as other:
                await asyncio.wait_for(
                    totals.grant_now(other, accounts, account.id, 1.0, now=T0), timeout=5
                )
            assert await _credit_total(store, account.id) == 1.0  # ours is not written yet
    assert await _credit_total(store, account.id) == (5.0 if store.is_sqlite else 6.0)


async def test_credit_totals_of_a_rolled_back_batch_are_not_written(store: SqlStore) -> None:
    account = await _account(store)
    with pytest.raises(Boom):
        async with store.batch():
            async with store.db.tx() as conn:
                await totals.grant(conn, "accounts", account.id, 5.0, now=T0)
            raise Boom()
    assert await _credit_total(store, account.id) == 0.0
    # Outside a batch, one call's transaction writes them at its own end.
    async with store.db.tx() as conn:
        await totals.grant(conn, "accounts", account.id, 2.0, now=T0)
    assert await _credit_total(store, account.id) == 2.0


async def test_a_jobs_last_two_shards_decided_at_once_end_the_job(store: SqlStore) -> None:
    """Two batches each decide one of a job's last two shards: each counts the other's as
    open until that one committed, so the one counting last must wait for it and end
    the job (PostgreSQL's row lock; SQLite has one writer at a time)."""
    if store.is_sqlite:
        pytest.skip("SQLite has one writer at a time: a second batch waits for the first")
    from idlegrid.store.base import ShardDecision

    account = await _account(store)
    # Two nodes: one node's trust row, written by both decisions, would order them.
    nodes = [await _node(store, account, f"node-key-{i}") for i in range(2)]
    job, ready = await store.jobs.create_job(_job(account, shards=2), now=T0)
    for entry, node in zip(ready, nodes, strict=True):
        await _claim(store, entry.task_id, node)
        await _result(store, entry.task_id, node)
    task_of = {r.shard_id: r.task_id for r in ready}
    shards = sorted(task_of)

    def decision(index: int) -> ShardDecision:
        task = task_of[shards[index]]
        return ShardDecision(shards[index], task, [task], [], None)

    decided_first, go_on = asyncio.Event(), asyncio.Event()
    holder: list[int] = []

    async def first() -> bool:
        async with store.batch():
            [outcome] = await store.verification.decide_shards([decision(0)], now=T0 + 2)
            async with store.db.read() as conn:  # the batch's own connection
                holder.append((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            decided_first.set()
            await go_on.wait()
        return outcome.job_done

    async def second() -> bool:
        async with store.batch():
            [outcome] = await store.verification.decide_shards([decision(1)], now=T0 + 2)
        return outcome.job_done

    held = asyncio.create_task(first())
    await decided_first.wait()
    other = asyncio.create_task(second())

    async def blocked_by_the_first() -> bool:
        # The second decides while the first has not committed: PostgreSQL shows its
        # backend waiting on a lock the first one's holds.
        async with store.db.engine.connect() as conn:
            waiting = await conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                ),
                {"pid": holder[0]},
            )
            return bool(waiting.scalar_one())

    await eventually(blocked_by_the_first, "the second decision to wait for the first's lock")
    go_on.set()
    done = await asyncio.wait_for(asyncio.gather(held, other), timeout=30)
    assert done == [False, True]
