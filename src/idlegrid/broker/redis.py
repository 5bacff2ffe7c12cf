"""Redis broker: one ready queue, presence and messages shared by several coordinators.

Keys (all under one prefix, so grids or test runs can share a Redis server):

    {prefix}ready           sorted set of ready task ids, scored by id (oldest first;
                            urgent entries below every id, so they come first)
    {prefix}ready:entries   hash: task id -> the ReadyTask as JSON
    {prefix}ready:built     marker: the queue was filled from the SQL store
    {prefix}presence        sorted set of node ids, scored by the last time each was heard from
    {prefix}owners          hash: node id -> the coordinator process holding its connection
    {prefix}ch:{channel}    pub/sub channels between coordinator processes

Redis may keep nothing on disk: after a restart or a flush the marker is gone, and the
coordinators refill the queue from SQL (`needs_rebuild`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from idlegrid.store.base import ReadyTask

log = logging.getLogger(__name__)

_CHUNK = 5000
_POOL_CONNECTIONS = 100
_POOL_WAIT_S = 10.0
_RESUBSCRIBE_S = 1.0

# An urgent entry's score is its id less this: below every plain entry, still in id order
# among urgent ones, and exact in a double (ids stay far below 2^52).
_URGENT_OFFSET = float(2**52)


def _score(entry: ReadyTask) -> float:
    return entry.task_id - _URGENT_OFFSET if entry.urgent else float(entry.task_id)


# Oldest `limit` entries in one round trip.
_CANDIDATES = """
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[2], unpack(ids))
"""
# A process forgets a connection only if it still holds it (the node may have moved on).
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# Take a free lease, or renew one's own; the key expires with the lease (milliseconds).
_HOLD = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBroker:
    """The broker in Redis (`redis://` URL), for several coordinator processes."""

    def __init__(self, url: str, *, prefix: str = "idlegrid:") -> None:
        self.url = url
        self.prefix = prefix
        # A few quick retries: while Redis is away a caller should fail in about a second
        # (the SQL store carries on), not wait out the client's default ten. Calls beyond
        # the pool's connections wait for one: thousands of nodes connecting or dropping
        # at once would otherwise fail where the default pool is full.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=2,
            health_check_interval=30,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
            max_connections=_POOL_CONNECTIONS,
            timeout=_POOL_WAIT_S,
        )
        self.client: redis.Redis = redis.Redis.from_pool(pool)
        self._ready = prefix + "ready"
        self._entries = prefix + "ready:entries"
        self._built = prefix + "ready:built"
        self._seen = prefix + "presence"
        self._owners = prefix + "owners"
        self._candidates = self.client.register_script(_CANDIDATES)
        self._presence = _PresenceWriter(self._write_presence)
        self._release = self.client.register_script(_RELEASE)
        self._hold = self.client.register_script(_HOLD)
        self._let_go = self.client.register_script(_LET_GO)

    # -- ready queue --------------------------------------------------------------------------

    async def push_ready(self, entries: Sequence[ReadyTask]) -> None:
        for start in range(0, len(entries), _CHUNK):
            chunk = entries[start : start + _CHUNK]
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(
                    self._entries,
                    mapping={str(e.task_id): json.dumps(dataclasses.asdict(e)) for e in chunk},
                )
                pipe.zadd(self._ready, {str(e.task_id): _score(e) for e in chunk})
                await pipe.execute()

    async def ready_candidates(self, *, limit: int) -> list[ReadyTask]:
        found = await self._candidates(keys=[self._ready, self._entries], args=[limit])
        return [ReadyTask(**json.loads(raw)) for raw in found if raw is not None]

    async def discard(self, task_ids: Iterable[int]) -> None:
        ids = [str(task_id) for task_id in task_ids]
        if ids:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zrem(self._ready, *ids)
                pipe.hdel(self._entries, *ids)
                await pipe.execute()

    async def ready_count(self) -> int:
        return int(await self.client.zcard(self._ready))

    async def replace_ready(self, entries: Sequence[ReadyTask]) -> None:
        await self.push_ready(entries)
        await self.client.set(self._built, "1")

    async def needs_rebuild(self) -> bool:
        return not await self.client.exists(self._built)

    # -- nodes --------------------------------------------------------------------------------

    async def node_seen(self, node_id: int, at: float, *, owner: str = "") -> None:
        await self._presence.add(node_id, at, owner)

    async def _write_presence(self, seen: dict[int, float], owners: dict[int, str]) -> None:
        """One batch of `node_seen`: last-seen times only move forward (ZADD GT), whichever
        process writes last; a connection belongs to the process that heard from the node
        last (heartbeats rebuild both after a flush)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zadd(self._seen, {str(node_id): at for node_id, at in seen.items()}, gt=True)
            if owners:
                pipe.hset(self._owners, mapping={str(n): owner for n, owner in owners.items()})
            await pipe.execute()

    async def presence(self) -> dict[int, float]:
        # redis-py types its replies as any a command may give.
        seen: list[Any] = await self.client.zrange(self._seen, 0, -1, withscores=True)
        return {int(node_id): float(at) for node_id, at in seen}

    async def silent_nodes(self, *, before: float) -> list[int]:
        silent: list[Any] = await self.client.zrangebyscore(self._seen, "-inf", f"({before!r}")
        return [int(node_id) for node_id in silent]

    async def forget_node(self, node_id: int) -> None:
        await self._presence.settled()  # a heartbeat's write under way lands first
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(self._seen, str(node_id))
            pipe.hdel(self._owners, str(node_id))
            await pipe.execute()

    async def node_disconnected(self, node_id: int, owner: str) -> None:
        await self._presence.settled()
        await self._release(keys=[self._owners], args=[node_id, owner])

    async def connections(self) -> dict[int, str]:
        owners: dict[Any, Any] = await self.client.hgetall(self._owners)  # type: ignore[misc]
        return {int(node_id): str(owner) for node_id, owner in owners.items()}

    # -- leadership ---------------------------------------------------------------------------

    async def hold_lease(self, name: str, holder: str, *, ttl_s: float) -> bool:
        key = self.prefix + "lease:" + name
        return bool(await self._hold(keys=[key], args=[holder, max(1, int(ttl_s * 1000))]))

    async def release_lease(self, name: str, holder: str) -> None:
        await self._let_go(keys=[self.prefix + "lease:" + name], args=[holder])

    # -- messages -----------------------------------------------------------------------------

    async def publish(self, channel: str, payload: Mapping[str, Any]) -> None:
        await self.client.publish(self._channel(channel), json.dumps(payload))

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        subscription = _Subscription(self.client, self._channel(channel))
        await subscription.open()
        try:
            yield subscription.messages()
        finally:
            await subscription.close()

    def _channel(self, channel: str) -> str:
        return f"{self.prefix}ch:{channel}"

    async def close(self) -> None:
        await self._presence.settled()
        await self.client.aclose()


class _PresenceWriter:
    """The `node_seen` calls of this process, written to Redis together.

    A fleet sends each process hundreds of heartbeats a second, each one a `node_seen`;
    a round trip apiece would be most of what a heartbeat costs the coordinator. A call
    made while a write is under way joins the next batch, written as soon as that write
    returns; a call made while none is under way is written at once (no wait at low
    rates). Either way `add` returns once its update is in Redis, or raises the batch's
    error, as a write of its own would.
    """

    def __init__(self, write: Callable[[dict[int, float], dict[int, str]], Awaitable[None]]):
        self._write = write
        self._seen: dict[int, float] = {}
        self._owners: dict[int, str] = {}
        self._written: asyncio.Future[None] | None = None  # of the batch being gathered
        self._task: asyncio.Task[None] | None = None

    async def add(self, node_id: int, at: float, owner: str) -> None:
        self._seen[node_id] = max(at, self._seen.get(node_id, at))
        if owner:
            self._owners[node_id] = owner
        if self._written is None:
            self._written = asyncio.get_running_loop().create_future()
        written = self._written
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name="presence-writer")
        # Shielded: a caller that goes away (its connection closed) leaves the batch to
        # the others.
        await asyncio.shield(written)

    async def settled(self) -> None:
        """Wait until the writes under way are done (whatever their outcome)."""
        while self._task is not None:
            await asyncio.wait([self._task])

    async def _drain(self) -> None:
        try:
            while self._written is not None:
                seen, owners, written = self._seen, self._owners, self._written
                self._seen, self._owners, self._written = {}, {}, None
                try:
                    await self._write(seen, owners)
                except Exception as exc:
                    written.set_exception(exc)
                    written.exception()  # retrieved: its callers may all have gone
                except BaseException:
                    written.cancel()
                    raise
                else:
                    written.set_result(None)
        finally:
            self._task = None
            if self._written is not None:  # cancelled (shutdown): nobody will write these
                self._written.cancel()
                self._written = None
                self._seen, self._owners = {}, {}


class _Subscription:
    """One channel's messages; subscribes again after Redis went away and came back."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self.pubsub: Any = None

    async def open(self) -> None:
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=False)
        await self.pubsub.subscribe(self.channel)
        # Wait for the confirmation: a message published after open() returns is ours.
        while True:
            message = await self.pubsub.get_message(timeout=10.0)
            if message is None:
                raise RedisTimeoutError(f"no confirmation of SUBSCRIBE {self.channel}")
            if message["type"] == "subscribe":
                return

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            try:
                message = await self.pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=None
                )
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("subscription to %s lost (%s); subscribing again", self.channel, exc)
                await self._reopen()
                continue
            if message is not None and message["type"] == "message":
                yield json.loads(message["data"])

    async def _reopen(self) -> None:
        while True:
            await self.close()
            await asyncio.sleep(_RESUBSCRIBE_S)
            try:
                await self.open()
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.info("Redis still away (%s)", exc)

    async def close(self) -> None:
        if self.pubsub is not None:
            with contextlib.suppress(Exception):
                await self.pubsub.aclose()
            self.pubsub = None
