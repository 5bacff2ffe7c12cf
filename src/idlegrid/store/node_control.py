"""Each node's settings as the volunteer set them, and what the node says it is doing.

The `store.node_control` role. A setting is one row per node and name, written only when
it is newer than the row it replaces (the later edit wins, worker/remote_settings.py), in
one statement, so two coordinators writing at once keep the newer. The activity row holds
the node's last `status` (running or paused, why, on which device) and why it could not
apply the settings it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import TaskState
from idlegrid.store import dialect, rows
from idlegrid.store.base import NodeRecord
from idlegrid.store.database import Role, read, write
from idlegrid.store.schema import jobs, node_activity, node_daily, node_settings, nodes, tasks


@dataclass(frozen=True)
class SettingRow:
    """One setting of a node: its value, where it was set (web or local), by whom, when."""

    name: str
    value: Any
    source: str
    by: str
    at: float


@dataclass(frozen=True)
class Activity:
    state: str
    reason: str
    device: str
    settings_error: str
    updated_at: float
    # Each device (protocol.DeviceStatus as dicts): state, reason, the tasks on it.
    devices: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class HeldBack:
    """A node whose worker last said it is paused or throttled, and why."""

    node_id: int
    name: str
    state: str  # "paused" or "throttled"
    reason: str


# Node ids per statement: SQLite's older builds take at most 999 bound values.
IDS_PER_QUERY = 500


@dataclass(frozen=True)
class TaskNow:
    """A task a node holds now, for the "my nodes" page."""

    node_id: int
    task_id: int
    job_id: int
    kind: str
    assigned_at: float | None


class NodeControl(Role):
    """Settings and activity of nodes (`store.node_control`)."""

    @read
    async def node(self, conn: AsyncConnection, node_id: int) -> NodeRecord | None:
        row = (await conn.execute(select(nodes).where(nodes.c.id == node_id))).first()
        return None if row is None else rows.node(row)

    @write
    async def put_settings(
        self, conn: AsyncConnection, node_id: int, settings: list[SettingRow]
    ) -> list[str]:
        """Store the rows that are newer than the node's (later wins; at equal times the
        web's, or the newer report: a node's configuration is reported at 0); the names
        written."""
        written = []
        for row in settings:
            values = {
                "node_id": node_id, "name": row.name, "value": row.value,
                "source": row.source, "changed_by": row.by[:100], "changed_at": row.at,
            }  # fmt: skip
            insert = dialect.insert(conn, node_settings).values(**values)
            excluded = insert.excluded
            newer = or_(
                excluded.changed_at > node_settings.c.changed_at,
                and_(
                    excluded.changed_at == node_settings.c.changed_at,
                    or_(excluded.source == "web", node_settings.c.source != "web"),
                ),
            )
            statement = insert.on_conflict_do_update(
                index_elements=[node_settings.c.node_id, node_settings.c.name],
                set_={k: excluded[k] for k in ("value", "source", "changed_by", "changed_at")},
                where=newer,
            )
            if (await conn.execute(statement)).rowcount:
                written.append(row.name)
        return written

    @read
    async def settings_of(
        self, conn: AsyncConnection, node_ids: list[int]
    ) -> dict[int, dict[str, SettingRow]]:
        """Each node's stored settings by name."""
        out: dict[int, dict[str, SettingRow]] = {node_id: {} for node_id in node_ids}
        if not node_ids:
            return out
        query = select(node_settings).where(node_settings.c.node_id.in_(node_ids))
        for r in await conn.execute(query):
            out[r.node_id][r.name] = SettingRow(
                name=r.name, value=r.value, source=r.source, by=r.changed_by, at=r.changed_at
            )
        return out

    @write
    async def record_activity(
        self, conn: AsyncConnection, node_id: int, *, now: float, **fields: Any
    ) -> None:
        """Keep what the node said (`state`, `reason`, `device`, `settings_error`, and
        `devices`: a list of dicts)."""
        known = {k: v for k, v in fields.items() if k in node_activity.c and k != "node_id"}
        insert = dialect.insert(conn, node_activity).values(
            node_id=node_id, updated_at=now, **known
        )
        await conn.execute(
            insert.on_conflict_do_update(
                index_elements=[node_activity.c.node_id], set_={**known, "updated_at": now}
            )
        )

    @read
    async def activity_of(self, conn: AsyncConnection, node_ids: list[int]) -> dict[int, Activity]:
        """What each of the nodes said last (nodes that never said anything left out)."""
        out = {}
        for start in range(0, len(node_ids), IDS_PER_QUERY):
            chunk = node_ids[start : start + IDS_PER_QUERY]
            query = select(node_activity).where(node_activity.c.node_id.in_(chunk))
            for r in await conn.execute(query):
                out[r.node_id] = Activity(
                    r.state,
                    r.reason,
                    r.device,
                    r.settings_error,
                    r.updated_at,
                    tuple(d for d in r.devices or () if isinstance(d, dict)),
                )
        return out

    @read
    async def held_back(self, conn: AsyncConnection) -> list[HeldBack]:
        """Every node whose last word was paused or throttled, connected or not, by id:
        written by whichever coordinator process holds its socket, read by any."""
        query = (
            select(node_activity.c.node_id, nodes.c.name, node_activity.c.state,
                   node_activity.c.reason)
            .select_from(node_activity.join(nodes, nodes.c.id == node_activity.c.node_id))
            .where(node_activity.c.state.in_(("paused", "throttled")))
            .order_by(node_activity.c.node_id)
        )  # fmt: skip
        return [HeldBack(*row) for row in await conn.execute(query)]

    @read
    async def tasks_now(self, conn: AsyncConnection, node_ids: list[int]) -> list[TaskNow]:
        """The tasks the nodes hold now (assigned), oldest first: an index lookup per node."""
        if not node_ids:
            return []
        query = (
            select(tasks.c.node_id, tasks.c.id, tasks.c.job_id, jobs.c.kind, tasks.c.assigned_at)
            .select_from(tasks.join(jobs, jobs.c.id == tasks.c.job_id))
            .where(tasks.c.node_id.in_(node_ids), tasks.c.state == TaskState.ASSIGNED.value)
            .order_by(tasks.c.assigned_at)
        )
        return [TaskNow(*row) for row in await conn.execute(query)]

    @read
    async def credit_on_day(
        self, conn: AsyncConnection, node_ids: list[int], *, day: int
    ) -> dict[int, float]:
        """Credit each node earned on `day` (days since the epoch, UTC)."""
        if not node_ids:
            return {}
        query = select(node_daily.c.node_id, node_daily.c.credit).where(
            node_daily.c.node_id.in_(node_ids), node_daily.c.day == day
        )
        return {r.node_id: float(r.credit) for r in await conn.execute(query)}
