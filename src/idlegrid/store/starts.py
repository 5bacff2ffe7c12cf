"""SQL of coordinator starts: recorded at each start, read by the late rule.

A result stored after its shard was decided is paid when a coordinator start made it
late (`verification.credit.late_result_paid`); this records the starts and reads those
during a task's lease.
"""

from __future__ import annotations

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store.schema import coordinator_starts, tasks
from idlegrid.verification import credit


async def record_start(
    conn: AsyncConnection, process_id: str, *, started_at: float, grace_s: float
) -> None:
    await conn.execute(
        insert(coordinator_starts).values(
            process_id=process_id, started_at=started_at, grace_s=grace_s
        )
    )


async def made_late(conn: AsyncConnection, task_id: int) -> bool:
    """Whether a coordinator start made this task's result late (the late rule)."""
    task = (
        await conn.execute(
            select(tasks.c.assigned_at, tasks.c.finished_at, tasks.c.lease_deadline).where(
                tasks.c.id == task_id
            )
        )
    ).first()
    if task is None or task.assigned_at is None or task.finished_at is None:
        return False
    found = await conn.execute(
        select(coordinator_starts.c.started_at, coordinator_starts.c.grace_s).where(
            coordinator_starts.c.started_at > task.assigned_at,
            coordinator_starts.c.started_at <= task.finished_at,
        )
    )
    return credit.late_result_paid(
        assigned_at=task.assigned_at,
        finished_at=task.finished_at,
        lease_deadline=task.lease_deadline,
        starts=[(row.started_at, row.grace_s) for row in found],
    )
