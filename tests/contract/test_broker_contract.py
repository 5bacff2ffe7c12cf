"""The broker contract: every test runs on the in-process broker and on Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from idlegrid.broker import Broker
from idlegrid.store.base import ReadyTask


def _entry(task_id: int, *, job_id: int = 1, priority: int = 0, urgent: bool = False) -> ReadyTask:
    return ReadyTask(
        task_id=task_id,
        shard_id=100 + task_id,
        job_id=job_id,
        kind="sleep",
        priority=priority,
        created_at=1000.5 + task_id,
        items=3,
        cost_flops=2e9,
        urgent=urgent,
    )


async def _next(messages: AsyncIterator[dict[str, object]]) -> dict[str, object]:
    return await asyncio.wait_for(anext(messages), 5)


# -- ready queue --------------------------------------------------------------------------


async def test_ready_queue_is_oldest_first_and_idempotent(broker: Broker) -> None:
    assert await broker.ready_candidates(limit=10) == []
    await broker.push_ready([_entry(5), _entry(2, priority=3)])
    await broker.push_ready([_entry(9), _entry(2, priority=3)])
    assert await broker.ready_count() == 3
    assert await broker.ready_candidates(limit=10) == [_entry(2, priority=3), _entry(5), _entry(9)]
    assert [e.task_id for e in await broker.ready_candidates(limit=2)] == [2, 5]


async def test_urgent_entries_come_first_oldest_first(broker: Broker) -> None:
    await broker.push_ready([_entry(i) for i in range(1, 5)])
    await broker.push_ready([_entry(12, urgent=True), _entry(10, urgent=True)])
    await broker.push_ready([_entry(11, urgent=True), _entry(5)])
    ids = [e.task_id for e in await broker.ready_candidates(limit=10)]
    assert ids == [10, 11, 12, 1, 2, 3, 4, 5]
    assert [e.task_id for e in await broker.ready_candidates(limit=2)] == [10, 11]
    assert (await broker.ready_candidates(limit=1))[0].urgent
    await broker.discard([10, 3])
    assert await broker.ready_count() == 6
    await broker.replace_ready([_entry(9, urgent=True)])  # a rebuild keeps the lanes
    ids = [e.task_id for e in await broker.ready_candidates(limit=10)]
    assert ids == [9, 11, 12, 1, 2, 4, 5]


async def test_discard_removes_entries(broker: Broker) -> None:
    await broker.push_ready([_entry(i) for i in range(1, 6)])
    await broker.discard([2, 4, 77])
    await broker.discard([])
    assert [e.task_id for e in await broker.ready_candidates(limit=10)] == [1, 3, 5]
    assert await broker.ready_count() == 3


async def test_rebuild_marks_the_queue_and_keeps_newer_pushes(broker: Broker) -> None:
    assert await broker.needs_rebuild()
    await broker.push_ready([_entry(8)])  # pushed by another process during the rebuild
    await broker.replace_ready([_entry(3), _entry(1)])
    assert not await broker.needs_rebuild()
    assert [e.task_id for e in await broker.ready_candidates(limit=10)] == [1, 3, 8]
    await broker.replace_ready([])  # a second rebuild at once is harmless
    assert await broker.ready_count() == 3


async def test_many_entries(broker: Broker) -> None:
    await broker.push_ready([_entry(i) for i in range(1, 12_001)])
    assert await broker.ready_count() == 12_000
    assert [e.task_id for e in await broker.ready_candidates(limit=3)] == [1, 2, 3]


# -- nodes --------------------------------------------------------------------------------


async def test_presence_only_moves_forward(broker: Broker) -> None:
    await broker.node_seen(1, 10.0)
    await broker.node_seen(1, 30.25)
    await broker.node_seen(1, 20.0)
    await broker.node_seen(2, 5.0)
    assert await broker.presence() == {1: 30.25, 2: 5.0}
    await broker.forget_node(1)
    assert await broker.presence() == {2: 5.0}


async def test_connections_belong_to_the_process_that_heard_the_node(broker: Broker) -> None:
    await broker.node_seen(1, 1.0, owner="proc-a")
    await broker.node_seen(2, 1.0, owner="proc-a")
    await broker.node_seen(3, 1.0)  # presence alone (a grace period) is no connection
    await broker.node_seen(1, 2.0, owner="proc-b")  # node 1 reconnected to another process
    await broker.node_disconnected(1, "proc-a")  # the old process lets go: changes nothing
    assert await broker.connections() == {1: "proc-b", 2: "proc-a"}
    await broker.node_disconnected(1, "proc-b")
    await broker.forget_node(2)
    assert await broker.connections() == {}
    assert await broker.presence() == {1: 2.0, 3: 1.0}


async def test_silent_nodes_are_those_last_heard_before_the_bound(broker: Broker) -> None:
    assert await broker.silent_nodes(before=100.0) == []
    await broker.node_seen(1, 10.0)
    await broker.node_seen(2, 20.0, owner="proc-a")
    await broker.node_seen(3, 30.5)
    assert await broker.silent_nodes(before=20.0) == [1]  # heard at the bound: not silent
    assert sorted(await broker.silent_nodes(before=30.75)) == [1, 2, 3]
    await broker.node_seen(1, 40.0)
    await broker.forget_node(3)
    assert await broker.silent_nodes(before=30.75) == [2]


async def test_presence_of_many_concurrent_callers_is_each_ones_latest(broker: Broker) -> None:
    """As a fleet's heartbeats arrive: many calls at once, several for one node."""
    calls = [
        broker.node_seen(node, at, owner=f"proc-{node % 3}")
        for at in (3.0, 1.0, 2.0)
        for node in range(1, 301)
    ]
    await asyncio.gather(*calls)
    await broker.node_seen(7, 0.5, owner="proc-x")  # older news, from another process
    presence = await broker.presence()
    assert presence == {node: 3.0 for node in range(1, 301)}
    connections = await broker.connections()
    assert connections == {node: "proc-x" if node == 7 else f"proc-{node % 3}" for node in presence}


# -- messages -----------------------------------------------------------------------------


async def test_publish_reaches_every_subscriber_of_the_channel(broker: Broker) -> None:
    async with (
        broker.subscribe("nodes") as first,
        broker.subscribe("nodes") as second,
        broker.subscribe("other") as other,
    ):
        await broker.publish("nodes", {"type": "cancel", "node_id": 3, "task_id": 9})
        await broker.publish("nodes", {"type": "work"})
        for messages in (first, second):
            assert await _next(messages) == {"type": "cancel", "node_id": 3, "task_id": 9}
            assert await _next(messages) == {"type": "work"}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(other), 0.2)


async def test_messages_before_subscribing_are_not_delivered(broker: Broker) -> None:
    await broker.publish("nodes", {"n": 1})
    async with broker.subscribe("nodes") as messages:
        await broker.publish("nodes", {"n": 2})
        assert await _next(messages) == {"n": 2}


async def test_a_lease_has_one_holder_until_it_runs_out(broker: Broker) -> None:
    assert await broker.hold_lease("monitor", "a", ttl_s=0.3)
    assert not await broker.hold_lease("monitor", "b", ttl_s=0.3)
    assert await broker.hold_lease("monitor", "a", ttl_s=0.3)  # renewed by its holder
    assert await broker.hold_lease("other", "b", ttl_s=0.3)  # leases are by name
    await asyncio.sleep(0.5)  # a lease runs out on the clock: its time must pass
    assert await broker.hold_lease("monitor", "b", ttl_s=5)  # a's ran out
    assert not await broker.hold_lease("monitor", "a", ttl_s=5)


async def test_a_released_lease_is_free_at_once_and_only_its_holder_releases_it(
    broker: Broker,
) -> None:
    assert await broker.hold_lease("monitor", "a", ttl_s=30)
    await broker.release_lease("monitor", "b")  # not b's
    assert not await broker.hold_lease("monitor", "b", ttl_s=30)
    await broker.release_lease("monitor", "a")
    assert await broker.hold_lease("monitor", "b", ttl_s=30)
