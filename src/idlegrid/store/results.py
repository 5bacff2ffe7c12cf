"""What comes back from nodes: results recorded exactly once, failures, expiry.

The `store.results` role; each method is one transaction (store/database.py). A result is
taken only from the node that holds its task, once: a repeat with the same output is a
duplicate, one with another output is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import dialect, ledger
from idlegrid.store import trust as trust_rows
from idlegrid.store.base import NewResult, NodeTask, ReceiptStatus, ResultReceipt, TaskInput
from idlegrid.store.database import Role, read, write
from idlegrid.store.lifecycle import check_moved, check_row, move
from idlegrid.store.schema import shards, tasks
from idlegrid.verification.trust import TrustSettings

# Every state a result may complete (`sources_of(COMPLETED)`); `judge_result` takes no
# other, and the rows are locked from that judgement to this update.
_TAKE = move(
    tasks,
    TaskState.COMPLETED,
    tasks.c.id == bindparam("b_task"),
    output_hash=bindparam("b_output_hash"),
    output_size=bindparam("b_output_size"),
    elapsed_s=bindparam("b_elapsed_s"),
    finished_at=bindparam("b_now"),
    outcome=bindparam("b_outcome"),
)


def _repeat(result: NewResult, taken_hash: str) -> ResultReceipt:
    if taken_hash == result.output_hash:
        return ResultReceipt("duplicate")
    return ResultReceipt("rejected", f"task {result.task_id} already reported another output")


def judge_result(
    row: Any | None, task_id: int, node_id: int, output_hash: str
) -> ResultReceipt | None:
    """Why a result cannot be taken as new, or None when it can."""
    if row is None:
        return ResultReceipt("rejected", f"unknown task {task_id}")
    if row.node_id != node_id:
        return ResultReceipt("rejected", f"task {task_id} is not held by this node")
    state = TaskState(row.state)
    if state == TaskState.COMPLETED:
        if row.output_hash == output_hash:
            return ResultReceipt("duplicate", shard_id=row.shard_id, job_id=row.job_id)
        return ResultReceipt("rejected", f"task {task_id} already reported another output")
    if state not in (TaskState.ASSIGNED, TaskState.EXPIRED, TaskState.CANCELLED):
        return ResultReceipt("rejected", f"task {task_id} is {state.value}")
    return None


async def expire(
    conn: AsyncConnection, where: Any, *, trust: TrustSettings, now: float
) -> list[NodeTask]:
    """Expire the assigned tasks matching `where`: their nodes missed the lease.

    Only the rows this update changed are charged and returned: another process may have
    expired (or completed) some of the same tasks a moment before, and a task is an
    error of its node once.
    """
    changed = (
        await conn.execute(
            move(tasks, TaskState.EXPIRED, where, sources=[TaskState.ASSIGNED]).returning(
                tasks.c.id, tasks.c.node_id
            )
        )
    ).all()
    if not changed:
        return []
    found = sorted(changed, key=lambda r: r.id)
    # A missed deadline is an error of the node (BOINC counts it so too).
    await ledger.apply_verdicts(conn, [(r.id, "error") for r in found], settings=trust, now=now)
    return [NodeTask(task_id=r.id, node_id=r.node_id, state=TaskState.EXPIRED) for r in found]


async def _held_rows(conn: AsyncConnection, task_ids: Sequence[int]) -> dict[int, Any]:
    """The tasks results name, with their shards' states: one read for a batch, the rows
    locked on PostgreSQL (in id order, so two batches cannot deadlock; SQLite holds its
    write lock meanwhile)."""
    query = (
        select(
            tasks.c.id,
            tasks.c.node_id,
            tasks.c.state,
            tasks.c.output_hash,
            tasks.c.shard_id,
            tasks.c.job_id,
            shards.c.state.label("shard_state"),
        )
        .join(shards, shards.c.id == tasks.c.shard_id)
        .where(tasks.c.id.in_(sorted(set(task_ids))))
        .order_by(tasks.c.id)
    )
    if dialect.row_locks(conn):
        query = query.with_for_update(of=tasks, key_share=True)
    return {row.id: row for row in (await conn.execute(query)).all()}


@dataclass
class _Taking:
    """What a batch of results comes to: a receipt each, and the rows to write."""

    receipts: list[ResultReceipt] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    taken: dict[int, str] = field(default_factory=dict)  # task id -> output hash
    delivered_late: list[int] = field(default_factory=list)  # expired, delivered after all


def _taking(
    found: dict[int, Any], results: Sequence[NewResult], node_id: int, *, now: float
) -> _Taking:
    """Each result judged against its task's row (`judge_result`), in the batch's order."""
    taking = _Taking()
    for result in results:
        if result.task_id in taking.taken:  # the same task twice in one batch
            taking.receipts.append(_repeat(result, taking.taken[result.task_id]))
            continue
        row = found.get(result.task_id)
        receipt = judge_result(row, result.task_id, node_id, result.output_hash)
        if receipt is not None:
            taking.receipts.append(receipt)
            continue
        assert row is not None
        shard_open = row.shard_state == ShardState.OPEN.value
        check_row(tasks, row.id, TaskState(row.state), TaskState.COMPLETED)
        taking.taken[result.task_id] = result.output_hash
        if row.state == TaskState.EXPIRED.value:
            taking.delivered_late.append(result.task_id)
        taking.changes.append(
            {
                "b_task": result.task_id,
                "b_output_hash": result.output_hash,
                "b_output_size": result.output_size,
                "b_elapsed_s": result.elapsed_s,
                "b_now": now,
                "b_outcome": None if shard_open else "late",
            }
        )
        status: ReceiptStatus = "accepted" if shard_open else "late"
        taking.receipts.append(ResultReceipt(status, shard_id=row.shard_id, job_id=row.job_id))
    return taking


class Results(Role):
    """What comes back from nodes: results, failures, missed leases (`store.results`)."""

    async def accept_result(
        self,
        task_id: int,
        node_id: int,
        *,
        output_hash: str,
        output_size: int,
        elapsed_s: float,
        now: float,
    ) -> ResultReceipt:
        """`accept_results` of one result."""
        result = NewResult(task_id, output_hash, output_size, elapsed_s)
        return (await self.accept_results(node_id, [result], now=now))[0]

    async def accept_results(
        self,
        node_id: int,
        results: Sequence[NewResult],
        *,
        now: float,
    ) -> list[ResultReceipt]:
        """Record several results of one node in one transaction; a receipt for each.

        A task that expired and delivers after all was slow, not lost: the error its expiry
        charged is withdrawn, and its result is judged like any other. A node's error count
        is then the number of its tasks that failed or expired for good.
        """
        if not results:
            return []
        async with self.db.tx() as conn:
            found = await _held_rows(conn, [r.task_id for r in results])
            taking = _taking(found, results, node_id, now=now)
            if taking.changes:
                done = await conn.execute(_TAKE, taking.changes)
                await check_moved(conn, done, tasks, list(taking.taken), TaskState.COMPLETED)
            await trust_rows.withdraw_errors(
                conn, taking.delivered_late, settings=self.trust, now=now
            )
            return taking.receipts

    @read
    async def task_inputs(
        self, conn: AsyncConnection, task_ids: Sequence[int], node_id: int
    ) -> dict[int, TaskInput]:
        """The inputs of those of `task_ids` that `node_id` holds or held."""
        if not task_ids:
            return {}
        query = (
            select(tasks.c.id, tasks.c.job_id, tasks.c.shard_id, shards.c.input_hash)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.id.in_(list(set(task_ids))), tasks.c.node_id == node_id)
        )
        found = (await conn.execute(query)).all()
        return {
            r.id: TaskInput(job_id=r.job_id, shard_id=r.shard_id, input_hash=r.input_hash)
            for r in found
        }

    @write
    async def record_failure(
        self,
        conn: AsyncConnection,
        task_id: int,
        node_id: int,
        *,
        reason: str,
        now: float,
    ) -> bool:
        """The node that holds the task reports it failed; False if it does not hold it.

        An error of the node, unless the task had expired: that was charged already.
        """
        values: dict[str, Any] = dict(failure_reason=reason[:2000], finished_at=now)
        mine = (tasks.c.id == task_id, tasks.c.node_id == node_id)
        failed = TaskState.FAILED
        changed = await conn.execute(
            move(tasks, failed, *mine, sources=[TaskState.ASSIGNED], **values)
        )
        if changed.rowcount == 1:
            await ledger.apply_verdicts(conn, [(task_id, "error")], settings=self.trust, now=now)
            return True
        changed = await conn.execute(
            move(tasks, failed, *mine, sources=[TaskState.EXPIRED], **values)
        )
        return changed.rowcount == 1

    @write(retry_conflicts=True)
    async def expire_overdue(self, conn: AsyncConnection, *, now: float) -> list[NodeTask]:
        """Expire the assigned tasks whose lease ran out."""
        return await expire(conn, tasks.c.lease_deadline < now, trust=self.trust, now=now)

    @write(retry_conflicts=True)
    async def expire_node_tasks(
        self, conn: AsyncConnection, node_id: int, *, now: float
    ) -> list[NodeTask]:
        """Expire the tasks a node holds (it went away)."""
        return await expire(conn, tasks.c.node_id == node_id, trust=self.trust, now=now)

    @write(retry_conflicts=True)
    async def expire_task(
        self, conn: AsyncConnection, task_id: int, *, now: float
    ) -> list[NodeTask]:
        """Expire one task if it is still assigned."""
        return await expire(conn, tasks.c.id == task_id, trust=self.trust, now=now)
