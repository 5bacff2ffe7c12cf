"""What differs between SQLite and PostgreSQL is said in one place: store/dialect.py.

The store's modules ask `dialect.row_locks` whether to lock rows and `dialect.insert` for
an `INSERT ... ON CONFLICT`; none reads the dialect's name or imports a dialect itself
(the SQLite driver, which is a dialect, and the migrations' environment aside).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from idlegrid.store import dialect
from idlegrid.store.schema import node_quota

STORE = Path(__file__).resolve().parents[2] / "src" / "idlegrid" / "store"
OWN_DIALECT = ("dialect.py", "sqlite_driver.py")


def test_only_the_dialect_module_tells_the_databases_apart() -> None:
    offenders = [
        f"{path.relative_to(STORE)}:{number}"
        for path in sorted(STORE.rglob("*.py"))
        if path.name not in OWN_DIALECT and "migrations" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if ".dialect.name" in line or "sqlalchemy.dialects" in line
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("url", "sqlite"),
    [("sqlite+aiosqlite://", True), ("postgresql+asyncpg://user@127.0.0.1/db", False)],
)
def test_the_dialect_helpers(url: str, sqlite: bool) -> None:
    engine = create_async_engine(url)
    assert dialect.is_sqlite(engine) is sqlite
    assert dialect.row_locks(engine) is not sqlite
    statement = dialect.insert(engine, node_quota).values(node_id=1)
    assert statement.on_conflict_do_nothing() is not None
    assert type(statement).__module__.split(".")[2] == ("sqlite" if sqlite else "postgresql")
