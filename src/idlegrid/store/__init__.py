"""Durable state behind the `Store` interface; `open_store` picks the implementation."""

from __future__ import annotations

from idlegrid.store.base import Store
from idlegrid.store.sql import SqlStore


def open_store(url: str) -> Store:
    """The store for a database URL (sqlite+aiosqlite:/// or postgresql+asyncpg://)."""
    if url.startswith("postgresql://"):
        url = "postgresql+asyncpg://" + url.removeprefix("postgresql://")
    elif url.startswith("sqlite:///"):
        url = "sqlite+aiosqlite:///" + url.removeprefix("sqlite:///")
    return SqlStore(url)


__all__ = ["SqlStore", "Store", "open_store"]
