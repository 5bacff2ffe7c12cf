"""Ready queue, presence and messages between processes behind the `Broker` interface."""

from __future__ import annotations

from idlegrid.broker.base import Broker
from idlegrid.broker.memory import MemoryBroker


def open_broker(url: str = "", *, prefix: str = "idlegrid:") -> Broker:
    """In-process for an empty URL (one coordinator); Redis for redis:// or rediss://."""
    if not url:
        return MemoryBroker()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from idlegrid.broker.redis import RedisBroker

        return RedisBroker(url, prefix=prefix)
    raise ValueError(f"unknown broker URL {url!r}: use redis://host:port/db")


__all__ = ["Broker", "MemoryBroker", "open_broker"]
