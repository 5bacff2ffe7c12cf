"""What differs between the store's two databases, decided in one place.

SQLite has one writer at a time (the `Database`'s write lock); PostgreSQL runs writers side
by side, so the store locks rows there (`row_locks`). Each has its own `INSERT ... ON
CONFLICT` (`insert`). Everything else is the same SQL on both.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite


def is_sqlite(bind: Any) -> bool:
    """Whether an engine or a connection is SQLite's (else PostgreSQL's)."""
    return bool(bind.dialect.name == "sqlite")


def row_locks(conn: Any) -> bool:
    """Whether to lock rows: PostgreSQL. SQLite has one writer at a time.

    The store's row locks are `FOR NO KEY UPDATE` (`with_for_update(key_share=True)`): no
    key ever changes, and a plain `FOR UPDATE` also waits for the `KEY SHARE` locks that
    foreign-key checks take. A claim that sets a task's node holds one on the node's row,
    so a result batch granting that node credit under `FOR UPDATE` and the claim asking
    for the node's trust next deadlocked.
    """
    return not is_sqlite(conn)


def insert(conn: Any, table: Table) -> Any:
    """An INSERT of the connection's dialect: one that takes `on_conflict_do_nothing` and
    `on_conflict_do_update` (with `.excluded`)."""
    return (sqlite if is_sqlite(conn) else postgresql).insert(table)
