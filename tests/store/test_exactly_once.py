"""Exactly once in the store: each task is an error, a check or a credit of its node once,
however many processes act on it, and a shard's work is credited once.

Trust counters follow the tasks' final states: a node's errors are its tasks that failed
or expired for good, its valid and invalid results those judged so. These tests run on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path

from helpers import fake_node
from sqlalchemy import select
from store_helpers import _job as _sharded_job
from store_helpers import _node

from idlegrid.coordinator import peers
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.monitor import Monitor
from idlegrid.settings import CoordinatorSettings
from idlegrid.states import TaskState
from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    Claimer,
    NewJob,
    NewShard,
    NodeRecord,
    ReadyTask,
    ShardDecision,
)
from idlegrid.store.schema import node_quota, shards, tasks
from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings

T0 = 1_000_000.0
LEASE = 100.0
OUT = hashlib.sha256(b"out").hexdigest()


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
    claim = await store.claims.claim_task(
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
    [row] = await store.nodes.node_trust(node.id)
    return row.trust.valid_total, row.trust.invalid_total, row.trust.error_total


async def _credit(store: SqlStore, node: NodeRecord) -> float:
    [found] = [n for n in await store.nodes.list_nodes() if n.id == node.id]
    return found.credit.total


async def _task(store: SqlStore, task_id: int):  # type: ignore[no-untyped-def]
    async with store.engine.connect() as conn:
        return (await conn.execute(select(tasks).where(tasks.c.id == task_id))).one()


async def test_two_expiries_of_one_task_charge_its_node_once(store: SqlStore) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await _node(store, alice, "n1")
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node, now=T0)
    # Two processes' passes both select the overdue task; the second changes nothing.
    first = await store.results.expire_overdue(now=T0 + LEASE + 1)
    second = await store.results.expire_node_tasks(node.id, now=T0 + LEASE + 2)
    assert [t.task_id for t in first] == [ready.task_id] and second == []
    assert await _trust(store, node) == (0, 0, 1)
    # A failure it reports after that is the same error, not a second one.
    assert await store.results.record_failure(
        ready.task_id, node.id, reason="gave up", now=T0 + 200
    )
    assert (await _task(store, ready.task_id)).state == TaskState.FAILED.value
    assert await _trust(store, node) == (0, 0, 1)


async def test_an_expired_task_that_delivers_is_no_error_and_a_late_copy_earns_no_credit(
    store: SqlStore,
) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    slow, fast = await _node(store, alice, "slow"), await _node(store, alice, "fast")
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, slow, now=T0)
    await store.results.expire_overdue(now=T0 + LEASE + 1)
    [replacement], _, _ = await store.scheduling.replenish(now=T0 + LEASE + 1)
    await _claim(store, replacement.task_id, fast, now=T0 + LEASE + 2)
    await store.results.accept_result(
        replacement.task_id, fast.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 150
    )
    [outcome] = await store.verification.decide_shards(
        [ShardDecision(ready.shard_id, replacement.task_id, [replacement.task_id], [], None)],
        now=T0 + 151,
    )
    assert outcome.decided
    # The expired task stays expired (its node is told to stop), an error for now.
    assert [t.task_id for t in outcome.to_cancel] == [ready.task_id]
    assert (await _task(store, ready.task_id)).state == TaskState.EXPIRED.value
    assert await _trust(store, slow) == (0, 0, 1)
    # It delivers after all: the error is withdrawn; the result is checked, and agrees.
    receipt = await store.results.accept_result(
        ready.task_id, slow.id, output_hash=OUT, output_size=3, elapsed_s=9, now=T0 + 300
    )
    assert receipt.status == "late"
    assert await _trust(store, slow) == (0, 0, 0)
    await store.verification.judge_late(ready.task_id, agrees=True, now=T0 + 301)
    assert await _trust(store, slow) == (1, 0, 0)
    # The shard's work was credited once, to the result that decided it.
    late, canonical = await _task(store, ready.task_id), await _task(store, replacement.task_id)
    assert (late.outcome, late.credit) == ("valid", None)
    assert canonical.outcome == "valid" and canonical.credit > 0
    assert await _credit(store, slow) == 0 and await _credit(store, fast) == canonical.credit


async def test_a_result_a_coordinator_restart_made_late_is_paid(store: SqlStore) -> None:
    """Leased before a coordinator start, returned within its lease plus that start's
    grace: paid though its shard was decided (the late rule). A late copy outside that
    window is not (the test above)."""
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    slow, fast = await _node(store, alice, "slow"), await _node(store, alice, "fast")
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, slow, now=T0)
    await store.verification.record_start("restarted", now=T0 + 50, grace_s=30.0)
    await store.results.expire_overdue(now=T0 + LEASE + 1)
    [replacement], _, _ = await store.scheduling.replenish(now=T0 + LEASE + 1)
    await _claim(store, replacement.task_id, fast, now=T0 + LEASE + 2)
    await store.results.accept_result(
        replacement.task_id, fast.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 110
    )
    await store.verification.decide_shards(
        [ShardDecision(ready.shard_id, replacement.task_id, [replacement.task_id], [], None)],
        now=T0 + 111,
    )
    # Its lease ended at T0 + 100; with the start's 30 s of grace it may come until 130.
    receipt = await store.results.accept_result(
        ready.task_id, slow.id, output_hash=OUT, output_size=3, elapsed_s=9, now=T0 + 125
    )
    assert receipt.status == "late"
    await store.verification.judge_late(ready.task_id, agrees=True, now=T0 + 126)
    late = await _task(store, ready.task_id)
    assert late.outcome == "valid" and late.credit > 0
    assert await _credit(store, slow) == late.credit
    # Judged again (another process's pass), it is not paid twice.
    await store.verification.judge_late(ready.task_id, agrees=True, now=T0 + 127)
    assert await _credit(store, slow) == late.credit


async def test_a_disputed_result_is_paid_nothing_while_its_dispute_is_open(
    store: SqlStore,
) -> None:
    """Paid (here: accepted unchecked), then disputed by a check: its credit is taken back
    and it is unpaid again, so the decision pays it if it is found valid."""
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await _node(store, alice, "lone")
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    await _claim(store, ready.task_id, node, now=T0)
    await store.results.accept_result(
        ready.task_id, node.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 10
    )
    await store.verification.decide_shards(
        [ShardDecision(ready.shard_id, ready.task_id, [ready.task_id], [], None)], now=T0 + 11
    )
    paid = (await _task(store, ready.task_id)).credit
    assert paid > 0 and await _credit(store, node) == paid
    await store.verification.suspect([ready.task_id], now=T0 + 20)
    assert (await _task(store, ready.task_id)).credit is None
    assert await _credit(store, node) == 0.0
    account = await store.accounts.get_account("alice")
    assert account is not None and account.credit.total == 0.0


async def test_a_lone_result_decided_after_a_later_check_of_its_node_is_paid(
    store: SqlStore,
) -> None:
    """Results judged out of order (a coordinator restarted, or two decide at once): a
    shard a node ran alone, decided after a check the node passed later, is paid by that
    check, and the job's audit, which reads the payment, has nothing left to check."""
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    bob = await store.accounts.create_account("bob", is_admin=False, now=T0)
    lone, other = await _node(store, alice, "lone"), await _node(store, bob, "other")
    job, ready = await store.jobs.create_job(
        _sharded_job(alice, shards=2, replication=2, min_quorum=2), now=T0
    )
    first, second = sorted({r.shard_id for r in ready})
    [alone, dropped] = [r for r in ready if r.shard_id == first]
    checked = [r for r in ready if r.shard_id == second]
    await _claim(store, alone.task_id, lone, now=T0)
    assert await store.claims.run_alone(first, alone.task_id, spot_check=False) == [dropped.task_id]
    for replica, node in zip(checked, (lone, other), strict=True):
        await _claim(store, replica.task_id, node, now=T0 + 1)
    results = [(alone.task_id, lone), (checked[0].task_id, lone), (checked[1].task_id, other)]
    for at, (task_id, node) in enumerate(results):
        await store.results.accept_result(
            task_id, node.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 10 + at
        )
    # The check (finished after the lone result) is decided first...
    check = [r.task_id for r in checked]
    await store.verification.decide_shards(
        [ShardDecision(second, check[0], check, [], None)], now=T0 + 20
    )
    assert (await _task(store, alone.task_id)).credit is None  # not decided yet
    # ...then the lone result: the check vouches for it.
    await store.verification.decide_shards(
        [ShardDecision(first, alone.task_id, [alone.task_id], [], None)], now=T0 + 21
    )
    paid = (await _task(store, alone.task_id)).credit
    assert paid is not None and paid > 0
    assert await store.verification.unvouched_alone(job.id) == []
    earned = sum([(await _task(store, t)).credit for t in (alone.task_id, check[0])])
    assert await _credit(store, lone) == earned


async def test_a_lone_result_no_check_vouched_for_holds_its_job_for_an_audit(
    store: SqlStore,
) -> None:
    """Unpaid, a lone result is what the job's audit checks before the job is released."""
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    lone = await _node(store, alice, "lone")
    job, ready = await store.jobs.create_job(
        _sharded_job(alice, shards=1, replication=2, min_quorum=2), now=T0
    )
    await _claim(store, ready[0].task_id, lone, now=T0)
    await store.claims.run_alone(ready[0].shard_id, ready[0].task_id, spot_check=False)
    await store.results.accept_result(
        ready[0].task_id, lone.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 10
    )
    await store.verification.decide_shards(
        [ShardDecision(ready[0].shard_id, ready[0].task_id, [ready[0].task_id], [], None)],
        now=T0 + 11,
    )
    assert (await _task(store, ready[0].task_id)).credit is None
    assert await store.verification.unvouched_alone(job.id) == [ready[0].shard_id]


async def test_a_backup_copy_is_a_claim_in_its_nodes_daily_quota(store: SqlStore) -> None:
    store.trust = TrustSettings(initial_daily_quota=1)
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    holders = [await _node(store, alice, f"holder-{i}") for i in range(2)]
    idle = await _node(store, alice, "idle")
    _, ready = await store.jobs.create_job(_sharded_job(alice, shards=2), now=T0)
    for task, holder in zip(ready, holders, strict=True):
        await _claim(store, task.task_id, holder, now=T0)
    backup = await store.scheduling.add_backup_task(
        ready[0].shard_id, idle.id, lease_deadline=T0 + LEASE, now=T0 + 1, backend="cpu"
    )
    assert backup is not None
    assert ((await _task(store, backup.task_id)).backend, await _used(store, idle)) == ("cpu", 1)
    # Its quota used up, the node gets no copy of the other straggler.
    assert (
        await store.scheduling.add_backup_task(
            ready[1].shard_id, idle.id, lease_deadline=T0 + LEASE, now=T0 + 2, backend="cpu"
        )
        is None
    )
    assert await _used(store, idle) == 1


async def _used(store: SqlStore, node: NodeRecord) -> int:
    """The node's count in its daily quota of sleep on the CPU (the day of T0)."""
    async with store.engine.connect() as conn:
        found = await conn.execute(
            select(node_quota.c.used).where(
                node_quota.c.node_id == node.id,
                node_quota.c.kind == "sleep",
                node_quota.c.backend == "cpu",
            )
        )
        return int(found.scalar_one_or_none() or 0)


async def test_run_alone_gives_back_the_attempts_of_the_replicas_it_cancelled(
    store: SqlStore,
) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await _node(store, alice, "n1")
    _, ready = await store.jobs.create_job(_job(alice, replication=3), now=T0)
    first = ready[0]
    await _claim(store, first.task_id, node, now=T0)
    cancelled = await store.claims.run_alone(first.shard_id, first.task_id, spot_check=False)
    assert cancelled == sorted(r.task_id for r in ready[1:])
    async with store.engine.connect() as conn:
        shard = (await conn.execute(select(shards).where(shards.c.id == first.shard_id))).one()
    assert (shard.mode, shard.target, shard.attempts) == ("alone", 1, 1)
    # Asked again (another process, say), it changes and cancels nothing.
    assert await store.claims.run_alone(first.shard_id, first.task_id, spot_check=False) == []


# -- a restarted coordinator waits for its workers -----------------------------------------


async def test_a_restarted_coordinator_expires_nothing_before_its_workers_can_be_back(
    store: SqlStore, tmp_path: Path, in_process_grid: Callable[..., Grid]
) -> None:
    now = [T0]
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        monitor_interval_s=3600.0,  # the test runs the passes
        heartbeat_interval_s=2.0,
        node_timeout_s=6.0,
        worker_backoff_max_s=10.0,
        min_lease_s=5.0,
        default_replication=1,
    )
    assert settings.restart_grace_s == 16.0  # the longest backoff, then a node timeout
    grid = in_process_grid(settings, clock=lambda: now[0])
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    away = await fake_node(store, alice.id, "away", now=T0)
    back = await fake_node(store, alice.id, "back", now=T0)
    await grid.submit_job(
        account_id=alice.id, kind_name="sleep", inputs={}, params={"tasks": 2, "seconds": 0},
        replication=1, priority=0,
    )  # fmt: skip
    for node in (away, back):
        await peers.attach(grid.context, node.session)
        node.session.requested = 1
        assert await grid.fill(node.session) == 1
    [away_task], [back_task] = away.session.live, back.session.live
    for node in (away, back):
        await peers.detach(grid.context, node.session)
    # The coordinator restarts after an outage longer than the leases and the timeout.
    now[0] += 60.0
    monitor = Monitor(grid)
    await monitor.start()
    try:
        await monitor._pass(grid)
        # One worker reconnects within the grace, holding its task; the other does not.
        now[0] += settings.restart_grace_s - 1
        await peers.heard_from(grid.context, back.session)
        await monitor._pass(grid)
        assert {(await _task(store, t)).state for t in (away_task, back_task)} == {"assigned"}
        # After the grace: the one that stayed away goes offline, and its task expires.
        now[0] += 2
        await monitor._pass(grid)
        assert (await _task(store, away_task)).state == TaskState.EXPIRED.value
        [away_row] = [n for n in await store.nodes.list_nodes() if n.id == away.session.node_id]
        assert away_row.state == "offline"
    finally:
        await monitor.stop()
        await grid.aclose()


# -- claims for a connection that is gone --------------------------------------------------


def _settings(tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(data_dir=tmp_path, monitor_interval_s=3600.0, default_replication=1)


async def _shard_tasks(store: SqlStore) -> list[tuple[str, int | None]]:
    async with store.engine.connect() as conn:
        found = await conn.execute(select(tasks.c.state, tasks.c.node_id).order_by(tasks.c.id))
        return [(row.state, row.node_id) for row in found]


async def test_claims_made_while_the_connection_closed_are_released_at_once(
    store: SqlStore, tmp_path: Path, in_process_grid: Callable[..., Grid]
) -> None:
    grid = in_process_grid(_settings(tmp_path))
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await fake_node(store, alice.id, "leaving", now=T0)
    await grid.submit_job(
        account_id=alice.id, kind_name="sleep", inputs={}, params={"tasks": 1, "seconds": 0},
        replication=1, priority=0,
    )  # fmt: skip
    await peers.attach(grid.context, node.session)
    node.session.requested = 1
    claim = grid.dispatcher._claim

    async def claim_then_leave(session, **options):  # type: ignore[no-untyped-def]
        claimed = await claim(session, **options)
        grid.hub.remove(session)  # e.g. it moved to another coordinator meanwhile
        return claimed

    grid.dispatcher._claim = claim_then_leave  # type: ignore[method-assign]
    try:
        assert await grid.fill(node.session) == 0
    finally:
        await grid.aclose()
    # The claim was cancelled and its shard got a new task at once, not after a lease;
    # the node was told nothing and is charged nothing.
    node_id = node.session.node_id
    assert await _shard_tasks(store) == [("cancelled", node_id), ("ready", None)]
    assert node.assigned() == [] and node.session.live == set()
    assert await _trust(store, await _record(store, node_id)) == (0, 0, 0)
    [row] = await store.nodes.node_trust(node_id)
    assert row.quota_used_today == 0
    async with store.engine.connect() as conn:
        [attempts] = (await conn.execute(select(shards.c.attempts))).scalars().all()
    assert attempts == 1


async def test_claims_that_cannot_be_sent_are_released_at_once(
    store: SqlStore, tmp_path: Path, in_process_grid: Callable[..., Grid]
) -> None:
    grid = in_process_grid(_settings(tmp_path))
    alice = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await fake_node(store, alice.id, "broken", now=T0, slots=2)

    async def broken(text: str) -> None:
        raise ConnectionResetError("gone")

    node.session.send_text = broken
    await grid.submit_job(
        account_id=alice.id, kind_name="sleep", inputs={}, params={"tasks": 2, "seconds": 0},
        replication=1, priority=0,
    )  # fmt: skip
    await peers.attach(grid.context, node.session)
    node.session.requested = 2
    try:
        assert await grid.fill(node.session) == 0
    finally:
        await grid.aclose()
    states = await _shard_tasks(store)
    assert sorted(state for state, _ in states) == ["cancelled"] * 2 + ["ready"] * 2
    assert node.session.live == set()


async def _record(store: SqlStore, node_id: int) -> NodeRecord:
    [found] = [n for n in await store.nodes.list_nodes() if n.id == node_id]
    return found


Streak = Callable[[], Awaitable[tuple[int, int, int]]]


async def _suspected_after_one_check(
    store: SqlStore,
) -> tuple[Streak, ReadyTask, list[NodeRecord]]:
    """A node passes one check (streak 1), then a result it ran alone is escalated and
    suspected twice (held once). Returns how to read its trust (streak, suspicions,
    held), the suspected task and the three nodes (the suspect first)."""
    accounts = [
        await store.accounts.create_account(name, is_admin=False, now=T0)
        for name in ("alice", "bob", "carol")
    ]
    lone, second, third = [
        await _node(store, account, key) for account, key in zip(accounts, "abc", strict=True)
    ]

    async def streak() -> tuple[int, int, int]:
        [row] = await store.nodes.node_trust(lone.id)
        return row.trust.consecutive_valid, row.trust.suspicions, row.trust.held_streak

    _, earned = await store.jobs.create_job(
        _sharded_job(accounts[0], replication=2, min_quorum=2), now=T0
    )
    for replica, node in zip(earned, (lone, second), strict=True):
        await _claim(store, replica.task_id, node, now=T0)
        await store.results.accept_result(
            replica.task_id, node.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 1
        )
    ids = [r.task_id for r in earned]
    await store.verification.decide_shards(
        [ShardDecision(earned[0].shard_id, ids[0], ids, [], None)], now=T0 + 2
    )
    assert await streak() == (1, 0, 0)

    _, ready = await store.jobs.create_job(
        _sharded_job(accounts[0], replication=3, min_quorum=2), now=T0 + 3
    )
    alone = ready[0]
    await _claim(store, alone.task_id, lone, now=T0 + 3)
    await store.claims.run_alone(alone.shard_id, alone.task_id, spot_check=False)
    await store.results.accept_result(
        alone.task_id, lone.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 4
    )
    assert await store.claims.escalate(alone.shard_id, target=3, quorum=2, now=T0 + 5)
    await store.verification.suspect([alone.task_id], now=T0 + 6)  # the dispute, again
    assert await streak() == (0, 1, 1)
    return streak, alone, [lone, second, third]


async def test_a_suspect_found_right_gets_its_streak_back(store: SqlStore) -> None:
    """A spot check disagreed with a result its node ran alone (a colluder's lie, say):
    the node's streak is held, once however often the result is suspected, and given
    back, with the check it just passed, when the quorum finds the result valid."""
    streak, alone, (_, second, third) = await _suspected_after_one_check(store)
    more, _, _ = await store.scheduling.replenish(now=T0 + 7)
    for replica, node in zip(more, (second, third), strict=True):
        await _claim(store, replica.task_id, node, now=T0 + 7)
        await store.results.accept_result(
            replica.task_id, node.id, output_hash=OUT, output_size=3, elapsed_s=1, now=T0 + 8
        )
    agreeing = [alone.task_id, *(r.task_id for r in more)]
    await store.verification.decide_shards(
        [ShardDecision(alone.shard_id, alone.task_id, agreeing, [], None)], now=T0 + 9
    )
    assert await streak() == (2, 0, 0)


async def test_a_suspicion_its_job_ended_before_a_verdict_is_dropped(
    store: SqlStore, tmp_path: Path, in_process_grid: Callable[..., Grid]
) -> None:
    """The suspected result's job is cancelled before the quorum says who lied: nothing
    will judge it, so the suspicion is dropped (once) and the held streak comes back."""
    grid = in_process_grid(_settings(tmp_path))
    streak, alone, _ = await _suspected_after_one_check(store)
    assert await store.verification.drop_undecided_suspicions(alone.job_id, now=T0 + 7) == 0
    assert await streak() == (0, 1, 1)  # its shard is still open: the dispute goes on
    await grid.cancel_job(alone.job_id)  # as the dashboard and the API do
    assert await streak() == (1, 0, 0)
    assert await store.verification.drop_undecided_suspicions(alone.job_id, now=T0 + 9) == 0
    assert await streak() == (1, 0, 0)
