"""The store's side of untrusted nodes: Sybil limits, distinct replicas, quotas, running
alone. Every test runs on SQLite and on PostgreSQL (the `store` fixture)."""

from __future__ import annotations

import pytest
from store_helpers import LEASE, T0, _account, _hash, _job

from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    Claimer,
    ClaimMiss,
    Distinct,
    NodeRecord,
    RegistrationLimits,
    RegistrationRefused,
)
from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings

LIMITS = RegistrationLimits(max_nodes_per_account=3, per_account_per_hour=2, per_address_per_hour=3)


async def _register(
    store: SqlStore,
    account: AccountRecord,
    key: str,
    *,
    address: str = "",
    network: str = "",
    now: float = T0,
    limits: RegistrationLimits | None = LIMITS,
) -> NodeRecord:
    return await store.nodes.register_node(
        account.id,
        key,
        name=key,
        worker_version="0",
        hardware={},
        benchmark={},
        kinds=["sleep"],
        slots=1,
        address=address,
        network=network,
        limits=limits,
        now=now,
    )


async def _claim(
    store: SqlStore,
    task_id: int,
    node: NodeRecord,
    *,
    now: float = T0,
    distinct: Distinct | None = None,
) -> Assignment | ClaimMiss:
    claimer = Claimer(
        node_id=node.id, account_id=node.account_id, network=node.network, backend="cpu"
    )
    return await store.claims.claim_task(
        task_id, claimer, kind="sleep", lease_deadline=now + LEASE, now=now, distinct=distinct
    )


async def test_sybil_limits_on_new_nodes(store: SqlStore) -> None:
    alice = await _account(store)
    await _register(store, alice, "node-key-1", address="10.0.0.1")
    await _register(store, alice, "node-key-2", address="10.0.0.1")
    with pytest.raises(RegistrationRefused, match="registered 2 nodes in the last hour"):
        await _register(store, alice, "node-key-3")
    # A node that reconnects is not a new one.
    await _register(store, alice, "node-key-1", address="10.0.0.1", now=T0 + 60)
    # An hour later the rate allows another; the cap of three stops the fourth.
    await _register(store, alice, "node-key-3", now=T0 + 3601)
    with pytest.raises(RegistrationRefused, match="has 3 nodes, the most allowed"):
        await _register(store, alice, "node-key-4", now=T0 + 9000)
    # Per address, across accounts.
    for i in range(2):
        other = await _account(store, f"sybil-{i}")
        for j in range(2):
            if i == 1 and j == 1:
                with pytest.raises(RegistrationRefused, match="from 10.0.0.9"):
                    await _register(store, other, f"node-key-s{i}{j}", address="10.0.0.9")
            else:
                await _register(store, other, f"node-key-s{i}{j}", address="10.0.0.9")
    # Another account's key is refused whatever the limits.
    bob = await _account(store, "bob")
    with pytest.raises(RegistrationRefused, match="another account"):
        await _register(store, bob, "node-key-1", limits=None)


async def test_replicas_go_to_distinct_nodes_accounts_and_networks(store: SqlStore) -> None:
    alice, bob, carol = [await _account(store, n) for n in ("alice", "bob", "carol")]
    a1 = await _register(store, alice, "node-key-a1", network="10.0.0.0/24", limits=None)
    a2 = await _register(store, alice, "node-key-a2", network="10.0.1.0/24", limits=None)
    b1 = await _register(store, bob, "node-key-b1", network="10.0.0.0/24", limits=None)
    c1 = await _register(store, carol, "node-key-c1", network="10.0.2.0/24", limits=None)
    _, ready = await store.jobs.create_job(_job(alice, replication=3, min_quorum=2), now=T0)
    rule = Distinct(accounts=True, networks=True)
    assert isinstance(await _claim(store, ready[0].task_id, a1, distinct=rule), Assignment)
    assert await _claim(store, ready[1].task_id, a2, distinct=rule) is ClaimMiss.CONFLICT
    assert await _claim(store, ready[1].task_id, b1, distinct=rule) is ClaimMiss.CONFLICT
    assert isinstance(await _claim(store, ready[1].task_id, c1, distinct=rule), Assignment)
    # With the account rule off, alice's other node (another network) may take one.
    only_networks = Distinct(accounts=False, networks=True)
    assert isinstance(await _claim(store, ready[2].task_id, a2, distinct=only_networks), Assignment)


async def test_daily_quota_stops_claims_until_the_next_day(store: SqlStore) -> None:
    store.trust = TrustSettings(initial_daily_quota=2)
    alice = await _account(store)
    node = await _register(store, alice, "node-key-1", limits=None)
    _, ready = await store.jobs.create_job(_job(alice, shards=4), now=T0)
    for entry in ready[:2]:
        assert isinstance(await _claim(store, entry.task_id, node), Assignment)
    assert await _claim(store, ready[2].task_id, node) is ClaimMiss.QUOTA
    tomorrow = T0 + 86_400
    assert isinstance(await _claim(store, ready[2].task_id, node, now=tomorrow), Assignment)
    [row] = await store.nodes.node_trust(node.id)
    assert row.trust.daily_quota == 2


async def test_running_alone_withdraws_the_other_replicas(store: SqlStore) -> None:
    alice, bob = await _account(store), await _account(store, "bob")
    trusted = await _register(store, alice, "node-key-1", limits=None)
    other = await _register(store, bob, "node-key-2", limits=None)
    job, ready = await store.jobs.create_job(_job(alice, replication=3, min_quorum=2), now=T0)
    claim = await _claim(store, ready[0].task_id, trusted)
    assert isinstance(claim, Assignment) and claim.first_replica
    dropped = await store.claims.run_alone(claim.shard_id, claim.task_id, spot_check=False)
    assert sorted(dropped) == sorted(r.task_id for r in ready[1:])
    assert await _claim(store, ready[1].task_id, other) is ClaimMiss.GONE
    [shard] = await store.jobs.list_shards(job.id)
    assert (shard.target, shard.quorum, shard.mode, shard.attempts) == (1, 1, "alone", 1)
    # Only once, and never after another replica went out.
    assert await store.claims.run_alone(claim.shard_id, claim.task_id, spot_check=False) == []


async def test_a_spot_check_replica_is_for_trusted_nodes_only(store: SqlStore) -> None:
    store.trust = TrustSettings(adaptive_after=0)  # every node counts as trusted here...
    alice, bob = await _account(store), await _account(store, "bob")
    first = await _register(store, alice, "node-key-1", limits=None)
    second = await _register(store, bob, "node-key-2", limits=None)
    _, ready = await store.jobs.create_job(_job(alice, replication=3, min_quorum=2), now=T0)
    claim = await _claim(store, ready[0].task_id, first)
    assert isinstance(claim, Assignment)
    [kept, dropped] = ready[1:]
    assert await store.claims.run_alone(claim.shard_id, claim.task_id, spot_check=True) == [
        dropped.task_id
    ]
    store.trust = TrustSettings(adaptive_after=5)  # ...and now none is
    assert await _claim(store, kept.task_id, second) is ClaimMiss.CONFLICT
    # Escalated (the check disagreed), the replica is anyone's again.
    assert await store.claims.escalate(claim.shard_id, target=3, quorum=2, now=T0 + 2)
    assert isinstance(await _claim(store, kept.task_id, second), Assignment)


async def test_a_suspended_node_claims_nothing(store: SqlStore) -> None:
    store.trust = TrustSettings(suspend_after_invalids=1)
    alice, bob = await _account(store), await _account(store, "bob")
    liar = await _register(store, alice, "node-key-1", limits=None)
    _, ready = await store.jobs.create_job(_job(bob, shards=2), now=T0)
    claim = await _claim(store, ready[0].task_id, liar)
    assert isinstance(claim, Assignment)
    await store.results.accept_result(
        claim.task_id, liar.id, output_hash=_hash("x"), output_size=1, elapsed_s=1.0, now=T0 + 1
    )
    await store.verification.decide_shard(
        claim.shard_id,
        canonical_task_id=None,
        valid=(),
        invalid=(claim.task_id,),
        fail_reason=None,
        now=T0 + 2,
    )
    assert await _claim(store, ready[1].task_id, liar) is ClaimMiss.SUSPENDED
    account = await store.accounts.account_by_id(alice.id)
    assert account is not None and account.flagged_at == T0 + 2
    with pytest.raises(RegistrationRefused, match="flagged"):
        await _register(store, alice, "node-key-2")


async def test_raise_target_adds_one_replica_once_per_verdict(store: SqlStore) -> None:
    alice = await _account(store)
    node = await _register(store, alice, "node-key-1", limits=None)
    _, [ready] = await store.jobs.create_job(_job(alice), now=T0)
    claim = await _claim(store, ready.task_id, node)
    assert isinstance(claim, Assignment)
    await store.results.accept_result(
        claim.task_id, node.id, output_hash=_hash("x"), output_size=1, elapsed_s=1.0, now=T0 + 1
    )
    # A quorum-1 shard's result waiting for its verdict never makes replenish add tasks.
    assert (await store.scheduling.replenish(now=T0 + 2))[0] == []
    assert await store.claims.raise_target(claim.shard_id, results_seen=1)
    assert not await store.claims.raise_target(claim.shard_id, results_seen=1)  # raced: once
    [more], _, _ = await store.scheduling.replenish(now=T0 + 3)
    assert more.shard_id == claim.shard_id


async def test_a_task_of_a_shard_with_a_result_goes_ahead_of_new_work(store: SqlStore) -> None:
    """A dispute's next replica finishes a begun shard: urgent, as it is made, as the
    queue is rebuilt from the database, and as each job's head is read."""
    alice = await _account(store)
    node = await _register(store, alice, "node-key-1", limits=None)
    _, [first] = await store.jobs.create_job(_job(alice), now=T0)
    assert not first.urgent
    claim = await _claim(store, first.task_id, node)
    assert isinstance(claim, Assignment)
    await store.results.accept_result(
        claim.task_id, node.id, output_hash=_hash("x"), output_size=1, elapsed_s=1.0, now=T0 + 1
    )
    _, [other] = await store.jobs.create_job(_job(alice), now=T0 + 2)  # newer work
    assert not other.urgent
    assert await store.claims.raise_target(claim.shard_id, results_seen=1)
    [more], _, _ = await store.scheduling.replenish(now=T0 + 3)
    assert more.urgent
    rebuilt = {t.task_id: t.urgent for t in await store.claims.ready_tasks(limit=10)}
    assert rebuilt == {other.task_id: False, more.task_id: True}
    heads = {t.task_id: t.urgent for t in await store.scheduling.ready_heads(per_job=5)}
    assert heads == rebuilt


async def test_an_admin_who_lifts_a_suspension_puts_the_node_on_probation(store: SqlStore) -> None:
    from sqlalchemy import select, update
    from store_helpers import _node

    from idlegrid.store import ledger, web
    from idlegrid.store.schema import node_trust, nodes

    node = await _node(store, await _account(store))
    async with store.db.tx() as conn:
        await ledger.load_trust(conn, node.id, "sleep", "cpu", settings=store.trust, now=T0)
        await conn.execute(
            update(node_trust)
            .where(node_trust.c.node_id == node.id)
            .values(suspended=True, recent_invalid=3, consecutive_valid=2, valid_total=7)
        )
    assert await store.web.web_write(web.set_suspended, node.id, suspended=True, now=T0 + 1)
    assert await store.web.web_write(web.set_suspended, node.id, suspended=False, now=T0 + 2)
    async with store.engine.connect() as conn:
        trust = (await conn.execute(select(node_trust))).one()
        suspended_at = (await conn.execute(select(nodes.c.suspended_at))).scalar_one()
    assert suspended_at is None
    assert (trust.suspended, trust.recent_invalid, trust.consecutive_valid) == (False, 0, 0)
    assert (trust.valid_total, trust.updated_at) == (7, T0 + 2)  # its record stays
    assert not await store.web.web_write(web.set_suspended, 10_000, suspended=False, now=T0)
