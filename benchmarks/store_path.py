"""The coordinator's CPU a task on the dispatch path, SQLite against PostgreSQL + Redis.

    PYTHONPATH=src .venv/bin/python benchmarks/store_path.py [--tasks 2000] [--nodes 4]
        [--slots 8] [--database postgresql://postgres@127.0.0.1:5432/test]
        [--redis redis://127.0.0.1:6379/0] [--rounds 2]

One process, no sockets to nodes: a `Grid` over a real store and broker, and `--nodes`
nodes whose messages are captured (as the group-commit tests do). Each cycle fills every
node's free slots (claims) and hands each node's results back (result check, record,
verification, credit), nodes side by side, until the job of `--tasks` noop tasks at
replication 1 completes. It measures the process's CPU time (user + system) and counts
SQL statements and transactions a task. Both stores run alternately `--rounds` times;
the medians are compared. Last line: `sqlite_cpu_ms: A postgres_cpu_ms: B cpu_ms_ratio: R`.
What it leaves out (HTTP, WebSockets, blob transfer, the worker) costs both stores the
same; `benchmarks/scale_out.py` measures the whole path with real processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import event

from idlegrid import protocol
from idlegrid.blobs.files import BlobStore
from idlegrid.broker.base import Broker
from idlegrid.broker.memory import MemoryBroker
from idlegrid.broker.redis import RedisBroker
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.hub import NodeSession
from idlegrid.kinds.noop import OUTPUT
from idlegrid.policy.scheduler import NodeView
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import sql_url
from idlegrid.store.sql import SqlStore


@dataclass
class Node:
    session: NodeSession
    assigned: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Measured:
    cpu_ms: float  # a task
    statements: float  # a task
    transactions: float  # a task
    seconds: float


async def _node(grid: Grid, account_id: int, index: int, slots: int) -> Node:
    key = f"bench-node-{index}"
    record = await grid.store.nodes.register_node(
        account_id, key, name=key, worker_version="bench", hardware={}, benchmark={},
        kinds=["noop"], slots=slots, address=f"10.0.{index}.1", now=time.time(),
    )  # fmt: skip
    node = Node(session=None)  # type: ignore[arg-type]

    async def send_text(text: str) -> None:
        message = json.loads(text)
        if message["type"] == "assign":
            node.assigned.append(message["task_id"])

    async def close() -> None:
        return None

    view = NodeView(record.id, frozenset({"noop"}), frozenset({"cpu"}), 8192, 10.0)
    node.session = NodeSession(record.id, account_id, key, slots, view, {}, send_text, close)
    grid.hub.add(node.session)
    return node


async def _serve(grid: Grid, node: Node, output: str) -> int:
    """Fill the node's slots, then return a result for each task it got."""
    node.session.requested = node.session.slots
    await grid.fill(node.session)
    done, node.assigned = node.assigned, []
    if done:
        results = [
            protocol.Result(task_id=t, output=output, output_size=len(OUTPUT), elapsed_s=0.001)
            for t in done
        ]
        await grid.accept_results(node.session, results)
    return len(done)


def _counting(store: SqlStore) -> Callable[[], tuple[int, int]]:
    counts = {"statements": 0, "transactions": 0}

    def on_statement(*_: Any) -> None:
        counts["statements"] += 1

    def on_begin(*_: Any) -> None:
        counts["transactions"] += 1

    event.listen(store.engine.sync_engine, "before_cursor_execute", on_statement)
    event.listen(store.engine.sync_engine, "begin", on_begin)
    return lambda: (counts["statements"], counts["transactions"])


async def measure(url: str, broker: Broker, root: Path, args: argparse.Namespace) -> Measured:
    schema = f"bench_{uuid.uuid4().hex[:12]}" if url.startswith("postgresql") else ""
    store = SqlStore(sql_url(url), schema=schema)
    await store.open()
    counted = _counting(store)
    grid = Grid(
        settings=CoordinatorSettings(data_dir=root / "coordinator", backups=False),
        store=store,
        broker=broker,
        blobs=BlobStore(root / "blobs", max_bytes=1 << 30),
    )
    try:
        account = await store.accounts.create_account("bench", is_admin=False, now=time.time())
        nodes = [await _node(grid, account.id, i, args.slots) for i in range(args.nodes)]
        output = grid.blobs.put(OUTPUT)
        for tasks, timed in ((200, False), (args.tasks, True)):
            job = await grid.submit_job(
                account_id=account.id, kind_name="noop", inputs={},
                params={"tasks": tasks}, replication=1, priority=0,
            )  # fmt: skip
            before_cpu, before_wall = time.process_time(), time.perf_counter()
            before = counted()
            while True:
                served = await asyncio.gather(*(_serve(grid, n, output) for n in nodes))
                record = await store.jobs.get_job(job.id)
                assert record is not None
                if record.state.value not in ("queued", "running"):
                    break
                if not any(served):
                    await asyncio.sleep(0.01)
            assert record.state.value == "completed", record
            if timed:
                statements, transactions = (a - b for a, b in zip(counted(), before, strict=True))
                return Measured(
                    cpu_ms=1000 * (time.process_time() - before_cpu) / tasks,
                    statements=statements / tasks,
                    transactions=transactions / tasks,
                    seconds=time.perf_counter() - before_wall,
                )
        raise AssertionError("unreachable")
    finally:
        await grid.aclose()
        await store.close()
        if schema:
            await _drop_schema(url, schema)


async def _drop_schema(url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _round(args: argparse.Namespace, backend: str) -> Measured:
    with tempfile.TemporaryDirectory(prefix="idlegrid-path-") as tmp:
        root = Path(tmp)
        if backend == "sqlite":
            return await measure(f"sqlite:///{root / 'grid.db'}", MemoryBroker(), root, args)
        broker = RedisBroker(args.redis, prefix=f"idlegrid-bench:{uuid.uuid4().hex[:12]}:")
        try:
            return await measure(args.database, broker, root, args)
        finally:
            keys = [key async for key in broker.client.scan_iter(match=broker.prefix + "*")]
            if keys:
                await broker.client.delete(*keys)
            await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--only", choices=["sqlite", "postgres"], help="one store (profiling)")
    args = parser.parse_args()
    runs: dict[str, list[Measured]] = {"sqlite": [], "postgres": []}
    if args.only:
        runs = {args.only: []}
    for _ in range(args.rounds):
        for backend in runs:
            run = asyncio.run(_round(args, backend))
            runs[backend].append(run)
            print(
                f"{backend}: {run.cpu_ms:.2f} CPU ms a task, {run.statements:.1f} statements "
                f"and {run.transactions:.2f} transactions a task, {run.seconds:.1f} s",
                flush=True,
            )
    median = {name: statistics.median(r.cpu_ms for r in found) for name, found in runs.items()}
    if args.only:
        return
    print(
        f"sqlite_cpu_ms: {median['sqlite']:.2f} postgres_cpu_ms: {median['postgres']:.2f} "
        f"cpu_ms_ratio: {median['postgres'] / median['sqlite']:.2f}"
    )


if __name__ == "__main__":
    main()
