"""The guarded lifecycle update (`store/lifecycle.py`): every legal move of every table
works in SQL on SQLite and PostgreSQL, an illegal one raises before any SQL, and a row a
caller needs moved that is found in an illegal state raises with its id and is logged."""

from __future__ import annotations

import ast
import enum
import hashlib
import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import (
    IllegalTransition,
    JobState,
    NodeState,
    ShardState,
    TaskState,
    TrainingRoundState,
    UploadState,
    can_transition,
)
from idlegrid.store import uploads as upload_sql
from idlegrid.store.base import Claimer, NewJob, NewResult, NewRound, NewShard, NodeRecord
from idlegrid.store.lifecycle import (
    LIFECYCLES,
    IllegalMove,
    check_moved,
    check_row,
    move,
    move_row,
)
from idlegrid.store.schema import jobs, nodes, shards, tasks, training_rounds, uploads
from idlegrid.store.sql import SqlStore

T0 = 1_000_000.0

LEGAL = [
    (table, current, target)
    for table, lifecycle in LIFECYCLES.items()
    for current, target in itertools.product(lifecycle, lifecycle)
    if can_transition(current, target)
]
ILLEGAL = [
    (table, current, target)
    for table, lifecycle in LIFECYCLES.items()
    for current, target in itertools.product(lifecycle, lifecycle)
    if not can_transition(current, target)
]


def _id(case: tuple[Table, enum.Enum, enum.Enum]) -> str:
    table, current, target = case
    return f"{table.name}:{current.value}->{target.value}"


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def _register(store: SqlStore, account_id: int) -> NodeRecord:
    return await store.nodes.register_node(
        account_id,
        f"node-key-{account_id}",
        name="n1",
        worker_version="0.1.0",
        hardware={"cpu_cores": 4},
        benchmark={"matmul_gflops": 10.0},
        kinds=["sleep"],
        slots=4,
        address="127.0.0.1",
        now=T0,
    )


def _job(account_id: int, *, shards: int = 1) -> NewJob:
    return NewJob(
        account_id=account_id,
        kind="sleep",
        params={},
        inputs={},
        replication=1,
        min_quorum=1,
        max_attempts=5,
        priority=0,
        shards=[
            NewShard(index=i, input_hash=_hash(f"in {i}"), input_size=10, items=2, cost_flops=1e6)
            for i in range(shards)
        ],
    )


async def _rows(store: SqlStore) -> dict[Table, int]:
    """One row of each table with a lifecycle; its id."""
    account = await store.accounts.create_account("alice", is_admin=False, now=T0)
    node = await _register(store, account.id)
    created = await store.jobs.create_job(_job(account.id), now=T0)
    [task] = created.ready
    first = NewRound(
        round=0,
        final=False,
        weights_digest="digest",
        checkpoint_hash=_hash("weights"),
        momentum_hash=_hash("momentum"),
        update_hash=None,
        first_shard=0,
        train_shards=1,
        eval_shard=None,
        deadline=T0 + 60,
    )
    await store.rounds.start_training(created.job.id, first, [], now=T0)
    async with store.engine.begin() as conn:
        upload_id, _ = await upload_sql.start_upload(
            conn,
            account.id,
            name="texts.txt",
            purpose="texts",
            size=0,
            quota_bytes=1000,
            now=T0,
            stale_before=0.0,
        )
        round_id = (await conn.execute(select(training_rounds.c.id))).scalar_one()
    return {
        jobs: created.job.id,
        shards: task.shard_id,
        tasks: task.task_id,
        nodes: node.id,
        training_rounds: round_id,
        uploads: upload_id,
    }


async def _put(conn: AsyncConnection, table: Table, row_id: int, state: enum.Enum) -> None:
    """Set up a row's state by hand (the tests' own fixture, no lifecycle move)."""
    await conn.execute(update(table).where(table.c.id == row_id).values(state=state.value))


async def _state(conn: AsyncConnection, table: Table, row_id: int) -> str:
    return (await conn.execute(select(table.c.state).where(table.c.id == row_id))).scalar_one()


# -- in SQL: every legal move, on both backends ----------------------------------------


async def test_every_legal_move_moves_its_row(store: SqlStore) -> None:
    ids = await _rows(store)
    async with store.engine.begin() as conn:
        for table, current, target in LEGAL:
            row_id = ids[table]
            await _put(conn, table, row_id, current)
            # Named sources, and the default ones (`sources_of(target)`).
            for sources in ([current], None):
                await _put(conn, table, row_id, current)
                moved = await conn.execute(
                    move(table, target, table.c.id == row_id, sources=sources)
                )
                assert moved.rowcount == 1, _id((table, current, target))
                assert await _state(conn, table, row_id) == target.value
                assert await move_row(conn, table, row_id, target) is False  # moved already


async def test_a_row_in_no_expected_state_stays(store: SqlStore) -> None:
    ids = await _rows(store)
    async with store.engine.begin() as conn:
        await _put(conn, tasks, ids[tasks], TaskState.ASSIGNED)
        # Another process took the ready task first: the claim changes nothing.
        stays = move(tasks, TaskState.ASSIGNED, tasks.c.id == ids[tasks], sources=[TaskState.READY])
        assert (await conn.execute(stays)).rowcount == 0
        expired = move(tasks, TaskState.EXPIRED, tasks.c.id == ids[tasks])
        assert (await conn.execute(expired.returning(tasks.c.id))).scalars().all() == [ids[tasks]]


async def test_values_are_written_with_the_state(store: SqlStore) -> None:
    ids = await _rows(store)
    async with store.engine.begin() as conn:
        await conn.execute(
            move(jobs, JobState.FAILED, jobs.c.id == ids[jobs], error="why", finished_at=T0)
        )
        row = (await conn.execute(select(jobs).where(jobs.c.id == ids[jobs]))).one()
        assert (row.state, row.error, row.finished_at) == ("failed", "why", T0)


async def test_or_already_matches_rows_in_the_target_too(store: SqlStore) -> None:
    ids = await _rows(store)
    async with store.engine.begin() as conn:
        node = nodes.c.id == ids[nodes]
        assert await _state(conn, nodes, ids[nodes]) == NodeState.ONLINE.value
        plain = move(nodes, NodeState.ONLINE, node, address="10.0.0.1")
        assert (await conn.execute(plain)).rowcount == 0
        refresh = move(nodes, NodeState.ONLINE, node, or_already=True, address="10.0.0.2")
        assert (await conn.execute(refresh)).rowcount == 1
        address = select(nodes.c.address).where(node)
        assert (await conn.execute(address)).scalar_one() == "10.0.0.2"


# -- before SQL: an illegal move is a programming error --------------------------------


@pytest.mark.parametrize("case", ILLEGAL, ids=_id)
def test_an_illegal_expected_move_raises_when_built(case: tuple[Table, Any, Any]) -> None:
    table, current, target = case
    with pytest.raises(IllegalTransition):
        move(table, target, table.c.id == 1, sources=[current])


@pytest.mark.parametrize(
    ("table", "target"),
    [
        (jobs, JobState.QUEUED),
        (tasks, TaskState.READY),
        (training_rounds, TrainingRoundState.OPEN),
        (uploads, UploadState.PARTIAL),
    ],
)
def test_a_state_rows_are_only_created_in_is_no_target(table: Table, target: enum.Enum) -> None:
    with pytest.raises(IllegalTransition, match="no state moves to"):
        move(table, target)


def test_a_state_of_another_lifecycle_raises() -> None:
    move(tasks, TaskState.CANCELLED)  # checked and cached: "cancelled" for tasks is legal
    move(shards, ShardState.CANCELLED, sources=[ShardState.OPEN])
    # StrEnums of two lifecycles compare equal by value; the check must still tell them apart.
    with pytest.raises(IllegalTransition, match="tasks rows are TaskState"):
        move(tasks, JobState.CANCELLED)
    with pytest.raises(IllegalTransition, match="has no lifecycle"):
        move(tasks.alias("other"), TaskState.CANCELLED)
    with pytest.raises(IllegalTransition, match="ShardState"):
        move(training_rounds, TrainingRoundState.CLOSED, sources=[ShardState.OPEN])


def test_the_state_is_the_target_not_a_value() -> None:
    with pytest.raises(TypeError):
        move(tasks, TaskState.CANCELLED, state="completed")


def test_the_guard_is_in_the_sql() -> None:
    def sql(statement: Any) -> str:
        return str(statement.compile(compile_kwargs={"literal_binds": True}))

    assert "tasks.state = 'ready'" in sql(move(tasks, TaskState.ASSIGNED, tasks.c.id == 1))
    completed = move(tasks, TaskState.COMPLETED, tasks.c.id == 1)
    assert "tasks.state IN ('assigned', 'cancelled', 'expired')" in sql(completed)


# -- a row the caller needs moved -------------------------------------------------------


async def test_a_needed_row_in_an_illegal_state_raises_and_is_logged(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await _rows(store)
    task_id = ids[tasks]
    caplog.set_level(logging.ERROR, logger="idlegrid.store")
    with pytest.raises(IllegalMove) as raised:
        async with store.engine.begin() as conn:
            await _put(conn, tasks, task_id, TaskState.COMPLETED)
            await move_row(conn, tasks, task_id, TaskState.CANCELLED, finished_at=T0)
    assert f"tasks {task_id}: TaskState completed -> cancelled" in str(raised.value)
    assert (raised.value.table, raised.value.row_id) == ("tasks", task_id)
    assert (raised.value.current, raised.value.target) == (TaskState.COMPLETED, TaskState.CANCELLED)
    [record] = [r for r in caplog.records if r.name == "idlegrid.store"]
    assert record.levelno == logging.ERROR
    assert f"tasks {task_id}" in record.getMessage()
    async with store.engine.connect() as conn:  # the transaction rolled back
        assert await _state(conn, tasks, task_id) == TaskState.READY.value


async def test_a_needed_row_that_stays_legally_is_no_error(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await _rows(store)
    task_id = ids[tasks]
    async with store.engine.begin() as conn:
        assert await move_row(conn, tasks, task_id, TaskState.ASSIGNED, node_id=None)
        # Still assigned, but held by no node 99: another condition kept it.
        elsewhere = tasks.c.node_id == 99
        assert not await move_row(conn, tasks, task_id, TaskState.EXPIRED, elsewhere)
        # Cancelled by another process: a legal change this caller expects.
        await _put(conn, tasks, task_id, TaskState.CANCELLED)
        settled = [TaskState.CANCELLED]
        assert not await move_row(conn, tasks, task_id, TaskState.FAILED, settled=settled)
        assert not await move_row(conn, tasks, 10**9, TaskState.FAILED)  # no such row
    assert not [r for r in caplog.records if r.name == "idlegrid.store"]


async def test_a_batch_that_left_a_row_in_an_illegal_state_raises(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await _rows(store)
    task_id = ids[tasks]
    take = move(tasks, TaskState.COMPLETED, tasks.c.id == bindparam("b_task"), finished_at=T0)
    with pytest.raises(IllegalMove, match=f"tasks {task_id}: TaskState ready -> completed"):
        async with store.engine.begin() as conn:
            done = await conn.execute(take, [{"b_task": task_id}])
            assert done.rowcount in (0, -1)  # asyncpg counts no batch
            await check_moved(conn, _Counted(0), tasks, [task_id], TaskState.COMPLETED)
    assert any(f"tasks {task_id}" in r.getMessage() for r in caplog.records)
    async with store.engine.begin() as conn:
        await _put(conn, tasks, task_id, TaskState.ASSIGNED)
        done = await conn.execute(take, [{"b_task": task_id}])
        await check_moved(conn, done, tasks, [task_id], TaskState.COMPLETED)  # all moved
        assert await _state(conn, tasks, task_id) == TaskState.COMPLETED.value


async def test_a_batch_of_results_completes_through_the_guarded_take(store: SqlStore) -> None:
    # Several rows in one executemany: the guard's list of states is plain bound values.
    account = await store.accounts.create_account("bob", is_admin=False, now=T0)
    node = await _register(store, account.id)
    created = await store.jobs.create_job(_job(account.id, shards=3), now=T0)
    ids = [task.task_id for task in created.ready]
    claimer = Claimer(node_id=node.id, account_id=account.id, network="", backend="cpu")
    claimed = await store.claims.claim_tasks(
        dict.fromkeys(ids, T0 + 100), claimer, kind="sleep", now=T0
    )
    assert isinstance(claimed, list) and len(claimed) == 3
    await store.results.expire_task(ids[0], now=T0 + 1)  # expired, and still delivers
    results = [NewResult(task_id, _hash(f"out {task_id}"), 1, 0.5) for task_id in ids]
    receipts = await store.results.accept_results(node.id, results, now=T0 + 2)
    assert [receipt.status for receipt in receipts] == ["accepted"] * 3
    async with store.engine.connect() as conn:
        for task_id in ids:
            assert await _state(conn, tasks, task_id) == TaskState.COMPLETED.value


def test_check_row_raises_and_logs_with_the_id(caplog: pytest.LogCaptureFixture) -> None:
    check_row(tasks, 7, TaskState.EXPIRED, TaskState.COMPLETED)
    with pytest.raises(IllegalMove, match="tasks 7: TaskState failed -> completed"):
        check_row(tasks, 7, TaskState.FAILED, TaskState.COMPLETED)
    assert [r.getMessage() for r in caplog.records if r.name == "idlegrid.store"] == [
        "illegal state change refused: tasks 7: TaskState failed -> completed"
    ]


class _Counted:
    """A batch result whose driver counted `rowcount` rows."""

    def __init__(self, rowcount: int) -> None:
        self.rowcount = rowcount


# -- the store writes no state by hand --------------------------------------------------

STORE = Path(__file__).resolve().parents[2] / "src" / "idlegrid" / "store"


def _chain_root(node: ast.AST) -> str | None:
    """The function a method chain starts from: `update` in `update(t).where(x)`."""
    while isinstance(node, ast.Call | ast.Attribute):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                return node.func.id
            node = node.func
        else:
            node = node.value
    return None


def _writes_state_by_hand(tree: ast.AST) -> bool:
    """Whether an `update(...)...values(state=...)` chain appears (inserts create rows in
    their first state, which is no move)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "values" or not any(k.arg == "state" for k in node.keywords):
            continue
        if _chain_root(node.func.value) == "update":
            return True
    return False


def test_every_state_change_in_the_store_is_a_move() -> None:
    by_hand = {
        path.name
        for path in STORE.glob("*.py")
        if path.name != "lifecycle.py"
        and _writes_state_by_hand(ast.parse(path.read_text(encoding="utf-8")))
    }
    assert by_hand == set(), f"state written without store.lifecycle.move: {by_hand}"
    # The check itself finds such a chain.
    assert _writes_state_by_hand(ast.parse("update(t).where(x).values(state='done')"))
    assert not _writes_state_by_hand(ast.parse("insert(t).values(state='ready')"))
