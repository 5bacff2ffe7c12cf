"""Two coordinator processes' grids in one event loop, sharing a store and a broker.

Every test runs on each store (SQLite shared by both grids; PostgreSQL through two
engines, as two processes would) and each broker (one in-process broker shared by both;
two Redis clients on one key prefix). The nodes are fake sessions that record what the
coordinator sends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Database
from grids import grid_in_process
from helpers import FakeNode, eventually, fake_node

from idlegrid.broker import Broker, MemoryBroker
from idlegrid.coordinator import monitor, peers
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.monitor import Monitor
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import AccountRecord
from idlegrid.store.sql import SqlStore


@dataclass
class Pair:
    a: Grid
    b: Grid
    account: AccountRecord
    broker_kind: str


async def _second_broker(broker: Broker) -> Broker:
    if isinstance(broker, MemoryBroker):
        return broker
    from idlegrid.broker.redis import RedisBroker

    assert isinstance(broker, RedisBroker)
    return RedisBroker(broker.url, prefix=broker.prefix)


@pytest.fixture
async def pair(
    db: Database, store: SqlStore, broker: Broker, tmp_path: Path
) -> AsyncIterator[Pair]:
    second_store = store if store.is_sqlite else db.store()
    if second_store is not store:
        await second_store.open()
    second_broker = await _second_broker(broker)
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        monitor_interval_s=3600.0,
        default_replication=1,
        distinct_accounts=False,  # the pair's nodes share one account and address
        distinct_networks=False,
    )
    grids = [
        grid_in_process(s, tmp_path, settings, broker=b)
        for s, b in ((store, broker), (second_store, second_broker))
    ]
    monitors = [Monitor(grid) for grid in grids]
    for m in monitors:
        await m.start()
    # Each monitor listens for the other process's messages; one published before its
    # subscription is up would be lost.
    await eventually(lambda: _subscriptions(broker, len(monitors)), "both monitors to subscribe")
    account = await store.accounts.create_account("volunteer", is_admin=False, now=1.0)
    try:
        yield Pair(grids[0], grids[1], account, "memory" if second_broker is broker else "redis")
    finally:
        for m in monitors:
            await m.stop()
        for grid in grids:
            await grid.aclose()
        if second_broker is not broker:
            await second_broker.close()
        if second_store is not store:
            await second_store.close()


async def _subscriptions(broker: Broker, expected: int) -> bool:
    """Whether the broker holds `expected` subscriptions, over all of its channels."""
    if isinstance(broker, MemoryBroker):
        return sum(len(queues) for queues in broker._subscribers.values()) == expected
    from idlegrid.broker.redis import RedisBroker

    assert isinstance(broker, RedisBroker)
    channels = await broker.client.pubsub_channels(broker.prefix + "*")
    counts = await broker.client.pubsub_numsub(*channels) if channels else []
    return sum(count for _, count in counts) == expected


async def _node(pair: Pair, grid: Grid, key: str, *, slots: int = 1) -> FakeNode:
    node = await fake_node(grid.store, pair.account.id, key, now=grid.clock(), slots=slots)
    await peers.attach(grid.context, node.session)
    return node


async def _submit(pair: Pair, grid: Grid, tasks: int, *, replication: int = 1) -> int:
    job = await grid.submit_job(
        account_id=pair.account.id,
        kind_name="sleep",
        inputs={},
        params={"tasks": tasks, "seconds": 0},
        replication=replication,
        priority=0,
    )
    return job.id


async def test_a_cancel_reaches_a_node_connected_to_the_other_process(pair: Pair) -> None:
    node = await _node(pair, pair.b, "node-b")
    job_id = await _submit(pair, pair.a, 1)
    node.session.requested = 1
    assert await pair.b.fill(node.session) == 1
    [assign] = node.of_type("assign")
    await pair.a.cancel_job(job_id)  # the API call lands on the other process
    await eventually(lambda: node.of_type("cancel"), "the cancel")
    assert node.of_type("cancel")[0]["task_id"] == assign["task_id"]
    assert node.session.live == set()


async def test_new_work_wakes_idle_nodes_of_every_process(pair: Pair) -> None:
    idle = await _node(pair, pair.b, "idle-on-b")
    idle.session.requested = 1
    await _submit(pair, pair.a, 1)  # submitted through A; only B has a node
    await eventually(lambda: idle.of_type("assign"), "an assignment on B")


async def test_a_node_that_moved_is_let_go_by_its_old_process(pair: Pair) -> None:
    first = await _node(pair, pair.a, "mover")
    second = await _node(pair, pair.b, "mover")  # the same node key: the same node
    assert first.session.node_id == second.session.node_id
    await eventually(lambda: first.closed, "the old session to close")
    assert pair.a.hub.get(first.session.node_id) is None
    assert (await pair.a.broker.connections()) == {second.session.node_id: pair.b.process_id}
    # Its socket ending changes nothing.
    assert not await peers.detach(pair.a.context, first.session)


async def test_no_shard_gets_more_replicas_than_it_needs(pair: Pair) -> None:
    nodes = [
        await _node(pair, grid, f"n{i}-{g}", slots=4)
        for g, grid in enumerate((pair.a, pair.b))
        for i in range(4)
    ]
    job_id = await _submit(pair, pair.a, 12, replication=2)
    for _ in range(2):  # all at once, then a second round for what the races left over
        for node in nodes:
            node.session.requested = 4
        await asyncio.gather(
            *((pair.a if i < 4 else pair.b).fill(node.session) for i, node in enumerate(nodes))
        )
    assigned = [(node.session.node_id, m) for node in nodes for m in node.of_type("assign")]
    assert len(assigned) == 24 == len({m["task_id"] for _, m in assigned})
    shards = {}
    for node_id, message in assigned:
        shards.setdefault(message["shard_index"], []).append(node_id)
    assert sorted(shards) == list(range(12))
    # Two replicas per shard, on two distinct nodes, whichever process gave them out.
    assert all(len(set(holders)) == 2 for holders in shards.values())
    listed = await pair.a.store.jobs.list_shards(job_id)
    assert all(s.attempts == 2 and s.live_tasks == 2 for s in listed)


async def test_concurrent_top_ups_from_both_processes_create_each_task_once(pair: Pair) -> None:
    job_id = await _submit(pair, pair.a, 10)
    node = await _node(pair, pair.a, "taker", slots=10)
    node.session.requested = 10
    assert await pair.a.fill(node.session) == 10
    expired = await pair.a.store.results.expire_node_tasks(node.session.node_id, now=pair.a.clock())
    assert len(expired) == 10
    await asyncio.gather(*(grid.replenish() for grid in (pair.a, pair.b, pair.a, pair.b)))
    listed = await pair.a.store.jobs.list_shards(job_id)
    assert [(s.attempts, s.live_tasks) for s in listed] == [(2, 1)] * 10


async def test_a_broker_that_lost_everything_is_rebuilt_from_the_store(pair: Pair) -> None:
    node = await _node(pair, pair.a, "keeps-working")
    await _submit(pair, pair.b, 3)
    await _lose_contents(pair.a.broker)
    assert await pair.b.broker.ready_count() == 0
    assert await monitor.check_broker(pair.a)
    assert not await monitor.check_broker(pair.b)  # one process rebuilt it for both
    assert await pair.b.broker.ready_count() == 3
    assert await pair.b.broker.connections() == {node.session.node_id: pair.a.process_id}
    assert node.session.node_id in await pair.b.broker.presence()


async def _lose_contents(broker: Broker) -> None:
    """What a Redis restart without persistence does."""
    if isinstance(broker, MemoryBroker):
        broker._ready.clear()
        broker._seen.clear()
        broker._owners.clear()
        broker._built = False
        return
    from idlegrid.broker.redis import RedisBroker

    assert isinstance(broker, RedisBroker)
    keys = [key async for key in broker.client.scan_iter(match=broker.prefix + "*")]
    await broker.client.delete(*keys)


async def test_one_node_registering_through_both_processes_at_once(pair: Pair) -> None:
    records = await asyncio.gather(
        *(
            grid.store.nodes.register_node(
                pair.account.id,
                "racer",
                name="racer",
                worker_version="0",
                hardware={},
                benchmark={},
                kinds=["sleep"],
                slots=1,
                address="",
                now=5.0,
            )
            for grid in (pair.a, pair.b, pair.a, pair.b)
        )
    )
    assert len({r.id for r in records}) == 1


async def test_the_last_two_shards_decided_at_once_finish_the_job(pair: Pair) -> None:
    job_id = await _submit(pair, pair.a, 2)
    node = await _node(pair, pair.a, "worker", slots=2)
    node.session.requested = 2
    await pair.a.fill(node.session)
    store_a, store_b = pair.a.store, pair.b.store
    for message in node.of_type("assign"):
        receipt = await store_a.results.accept_result(
            message["task_id"],
            node.session.node_id,
            output_hash="a" * 64,
            output_size=1,
            elapsed_s=0.1,
            now=6.0,
        )
        assert receipt.status == "accepted"
    decisions = await asyncio.gather(
        *(
            store.verification.decide_shard(
                shard.id,
                canonical_task_id=task_id,
                valid=[task_id],
                invalid=[],
                fail_reason=None,
                now=7.0,
            )
            for store, shard, task_id in zip(
                (store_a, store_b),
                await store_a.jobs.list_shards(job_id),
                sorted(m["task_id"] for m in node.of_type("assign")),
                strict=True,
            )
        )
    )
    assert all(d.decided for d in decisions)
    assert any(d.job_done for d in decisions)  # whichever committed last sees both
