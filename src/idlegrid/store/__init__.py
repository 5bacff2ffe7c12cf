"""Durable state: `SqlStore` over SQLite or PostgreSQL, as small roles.

`store.accounts`, `store.nodes`, `store.jobs`, `store.claims`, `store.scheduling`,
`store.results`, `store.rounds`, `store.web`, `store.blob_owners`, `store.usage` and
`store.verification` each live in one module (a `Role` over the shared `Database` of
store/database.py); each operation is one method there that holds its SQL and runs in
one transaction, or in the running `store.batch()`. `Store` names the one implementation
in annotations; `open_store` makes it for a database URL.
"""

from __future__ import annotations

from idlegrid.store.sql import SqlStore
from idlegrid.verification.trust import TrustSettings

Store = SqlStore


def sql_url(url: str) -> str:
    """The SQLAlchemy async URL for a database URL (postgresql:// and sqlite:/// too).

    SQLite gets the store's own driver (`store/sqlite_driver.py`, one thread hop a
    statement); `sqlite+aiosqlite:///` still works when asked for by name.
    """
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + url.split("://", 1)[1]
    if url.startswith("sqlite:///"):
        return "sqlite+idlegrid:///" + url.removeprefix("sqlite:///")
    return url


def open_store(url: str, *, schema: str = "", trust: TrustSettings | None = None) -> Store:
    """The store for a database URL (sqlite+idlegrid:///, sqlite+aiosqlite:/// or postgresql+asyncpg://)."""
    return SqlStore(sql_url(url), schema=schema, trust=trust)


__all__ = ["SqlStore", "Store", "open_store", "sql_url"]
