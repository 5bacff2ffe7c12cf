"""What the Redis broker does beyond the contract: presence written in batches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from idlegrid.broker.redis import RedisBroker


@pytest.fixture
async def redis_broker(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisBroker]:
    broker = RedisBroker(redis_url, prefix=redis_prefix)
    try:
        yield broker
    finally:
        await broker.close()


async def test_heartbeats_arriving_together_share_writes(redis_broker: RedisBroker) -> None:
    writes: list[int] = []
    write = redis_broker._write_presence

    async def counted(seen: dict[int, float], owners: dict[int, str]) -> None:
        writes.append(len(seen))
        await write(seen, owners)

    redis_broker._presence._write = counted
    await redis_broker.node_seen(1, 1.0, owner="a")  # alone: written at once
    assert writes == [1]
    await asyncio.gather(*(redis_broker.node_seen(n, 2.0, owner="a") for n in range(1000)))
    assert sum(writes) == 1 + 1000
    assert len(writes) <= 3  # the first call's write, then what gathered meanwhile
    assert len(await redis_broker.presence()) == 1000


async def test_a_failed_write_fails_every_call_in_it_and_the_next_one_writes() -> None:
    broker = RedisBroker("redis://127.0.0.1:1/0")  # nothing listens there
    try:
        outcomes = await asyncio.gather(
            *(broker.node_seen(n, 1.0, owner="a") for n in range(5)), return_exceptions=True
        )
        assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes)
        with pytest.raises(RedisConnectionError):
            await broker.node_seen(9, 2.0)
    finally:
        await broker.close()


async def test_a_disconnect_after_a_heartbeat_lands_after_its_write(
    redis_broker: RedisBroker,
) -> None:
    """The reader was cancelled mid-heartbeat (its connection closed): the write still
    lands before the release, so the node is not left connected to this process."""
    heartbeat = asyncio.create_task(redis_broker.node_seen(4, 5.0, owner="a"))
    # One turn of the loop: the write is under way, not done (nothing to wait on between).
    await asyncio.sleep(0)
    heartbeat.cancel()
    await redis_broker.node_disconnected(4, "a")
    assert await redis_broker.connections() == {}
    assert await redis_broker.presence() == {4: 5.0}


async def test_more_calls_at_once_than_pooled_connections_wait_for_one(
    redis_broker: RedisBroker,
) -> None:
    """Thousands of nodes dropping at once: each release waits for a connection."""
    await redis_broker.node_seen(1, 1.0, owner="a")
    await asyncio.gather(*(redis_broker.node_disconnected(n, "a") for n in range(1, 501)))
    assert await redis_broker.connections() == {}
