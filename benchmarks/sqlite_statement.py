"""What one SQL statement costs through the coordinator's SQLite driver stack.

    PYTHONPATH=src .venv/bin/python benchmarks/sqlite_statement.py [--statements 300]

The store runs on SQLAlchemy's async engine. Through `sqlite+aiosqlite` every statement
goes to aiosqlite's thread and back four times (cursor, execute, fetch, close), each a
hand-off between two threads; through the store's own driver, `sqlite+idlegrid`
(`store/sqlite_driver.py`), once. This times a trivial one-row SELECT and UPDATE through
both stacks (inside one transaction, rolled back at the end; warm statement cache) and
the same statements on a plain `sqlite3` connection in this thread, likewise, on one
file: the per-statement overhead that bounds the grid's dispatch latency
(docs/benchmarks.md, "Dispatch against arq").
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

import idlegrid.store.sqlite_driver  # noqa: F401  registers sqlite+idlegrid

SELECT = "SELECT v FROM t WHERE id = 1"
UPDATE = "UPDATE t SET v = v + 1 WHERE id = 1"


async def through_the_stack(driver: str, path: Path, n: int) -> tuple[float, float]:
    """Seconds a statement (select, update) through SQLAlchemy async on `driver`."""
    engine = create_async_engine(f"sqlite+{driver}:///{path}")
    try:
        async with engine.connect() as conn:
            timings = []
            for statement in (SELECT, UPDATE):
                await conn.execute(text(statement))  # warm the statement cache
                began = time.perf_counter()
                for _ in range(n):
                    result = await conn.execute(text(statement))
                    if result.returns_rows:
                        result.all()
                timings.append((time.perf_counter() - began) / n)
            await conn.rollback()
    finally:
        await engine.dispose()
    return timings[0], timings[1]


def plain(path: Path, n: int) -> tuple[float, float]:
    conn = sqlite3.connect(path)
    try:
        timings = []
        for statement in (SELECT, UPDATE):
            began = time.perf_counter()
            for _ in range(n):
                conn.execute(statement).fetchall()
            timings.append((time.perf_counter() - began) / n)
        conn.rollback()
    finally:
        conn.close()
    return timings[0], timings[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--statements", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idlegrid-sqlite-") as tmp:
        path = Path(tmp) / "t.db"
        with sqlite3.connect(path) as setup:
            setup.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER)")
            setup.execute("INSERT INTO t (v) VALUES (1)")
        direct = plain(path, args.statements)
        via = {
            driver: asyncio.run(through_the_stack(driver, path, args.statements))
            for driver in ("aiosqlite", "idlegrid")
        }
    for i, name in enumerate(("select", "update")):
        slow, fast = via["aiosqlite"][i], via["idlegrid"][i]
        print(f"{name}: ms a statement: aiosqlite {slow * 1e3:.3f}, "
              f"sqlite+idlegrid {fast * 1e3:.3f} (x{slow / fast:.1f}), "
              f"sqlite3 in-thread {direct[i] * 1e3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
