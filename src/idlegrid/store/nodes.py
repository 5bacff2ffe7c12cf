"""Nodes: registration under Sybil limits, presence, and what a node holds.

The `store.nodes` role; each method is one transaction (store/database.py).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Float, bindparam, case, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import NodeState, TaskState
from idlegrid.store import dialect, rows
from idlegrid.store import trust as trust_rows
from idlegrid.store.base import (
    NodeRecord,
    NodeTask,
    NodeTrust,
    RegistrationLimits,
    RegistrationRefused,
)
from idlegrid.store.database import Role, read, retry_conflicts, write
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import accounts, jobs, node_quota, node_trust, nodes, shards, tasks

HELD = (TaskState.ASSIGNED.value, TaskState.EXPIRED.value)
TOUCH_CHUNK = 500  # nodes per presence statement


async def check_new_node(
    conn: AsyncConnection,
    account_id: int,
    address: str,
    limits: RegistrationLimits,
    *,
    now: float,
) -> None:
    """Sybil limits on a new node (checked, not locked: two racing registrations
    may both pass the last free place, which bounds the excess to the races)."""
    flagged = (
        await conn.execute(
            select(accounts.c.flag_reason).where(
                accounts.c.id == account_id, accounts.c.flagged_at.is_not(None)
            )
        )
    ).first()
    if flagged is not None:
        raise RegistrationRefused(
            f"this account is flagged ({flagged.flag_reason}); it cannot add nodes"
        )

    async def count(*where: Any) -> int:
        query = select(func.count()).select_from(nodes).where(*where)
        return int((await conn.execute(query)).scalar_one())

    hour_ago = now - 3600.0
    if await count(nodes.c.account_id == account_id) >= limits.max_nodes_per_account:
        raise RegistrationRefused(
            f"this account has {limits.max_nodes_per_account} nodes, the most allowed"
        )
    recent = await count(nodes.c.account_id == account_id, nodes.c.created_at > hour_ago)
    if recent >= limits.per_account_per_hour:
        raise RegistrationRefused(
            f"this account registered {recent} nodes in the last hour "
            f"(limit {limits.per_account_per_hour}); try again later"
        )
    if address:
        recent = await count(nodes.c.address == address, nodes.c.created_at > hour_ago)
        if recent >= limits.per_address_per_hour:
            raise RegistrationRefused(
                f"{recent} nodes registered from {address} in the last hour "
                f"(limit {limits.per_address_per_hour}); try again later"
            )


def _touch_statement() -> Any:
    at = bindparam("at", type_=Float)
    return (
        update(nodes)
        .where(nodes.c.id == bindparam("node"), nodes.c.last_seen_at < at)
        .values(
            # Gaps longer than a minute were time away, not uptime.
            connected_seconds=nodes.c.connected_seconds
            + case((at - nodes.c.last_seen_at > 60.0, 0.0), else_=at - nodes.c.last_seen_at),
            last_seen_at=at,
        )
    )


_TOUCH = _touch_statement()


async def list_trust(
    conn: AsyncConnection, node_id: int, *, now: float | None = None
) -> list[NodeTrust]:
    same = (
        (node_quota.c.node_id == node_trust.c.node_id)
        & (node_quota.c.kind == node_trust.c.kind)
        & (node_quota.c.backend == node_trust.c.backend)
    )
    found = (
        await conn.execute(
            select(node_trust, node_quota.c.day.label("quota_day"), node_quota.c.used)
            .select_from(node_trust.outerjoin(node_quota, same))
            .where(node_trust.c.node_id == node_id)
            .order_by(node_trust.c.kind, node_trust.c.backend)
        )
    ).all()
    at = time.time() if now is None else now
    return [
        NodeTrust(
            row.node_id,
            row.kind,
            row.backend,
            trust_rows.trust_of(row),
            trust_rows.used_today(row.quota_day, row.used, at),
        )
        for row in found
    ]


async def _insert_or_refresh(
    conn: AsyncConnection, account_id: int, node_key: str, values: dict[str, Any], *, now: float
) -> None:
    """A new node inserted online, or a known one of this account refreshed (and online)."""
    # INSERT .. ON CONFLICT: two processes registering one new node both succeed.
    inserted = await conn.execute(
        dialect.insert(conn, nodes)
        .values(
            account_id=account_id,
            node_key=node_key,
            created_at=now,
            connected_seconds=0.0,
            state=NodeState.ONLINE.value,
            **values,
        )
        .on_conflict_do_nothing(index_elements=[nodes.c.node_key])
    )
    if inserted.rowcount != 1:
        # Known and online already (a reconnect before its old connection was missed):
        # still refreshed, so `or_already`.
        updated = await conn.execute(
            move(
                nodes,
                NodeState.ONLINE,
                nodes.c.node_key == node_key,
                nodes.c.account_id == account_id,
                or_already=True,
                **values,
            )
        )
        if updated.rowcount != 1:
            raise RegistrationRefused("this node key belongs to another account")


class Nodes(Role):
    """Nodes: registration, presence, what they hold, their trust (`store.nodes`)."""

    @write
    async def register_node(
        self,
        conn: AsyncConnection,
        account_id: int,
        node_key: str,
        *,
        name: str,
        worker_version: str,
        hardware: dict[str, Any],
        benchmark: dict[str, Any],
        kinds: list[str],
        slots: int,
        address: str,
        now: float,
        network: str = "",
        limits: RegistrationLimits | None = None,
    ) -> NodeRecord:
        """Register or refresh a node; `RegistrationRefused` says why a new one may not.

        Inserts the node, or updates it when its key is known (its state aside: it is
        online now, from either state).
        """
        values: dict[str, Any] = dict(
            name=name,
            worker_version=worker_version,
            hardware=hardware,
            benchmark=benchmark,
            kinds=kinds,
            slots=slots,
            address=address,
            network=network,
            last_seen_at=now,
        )
        known = (await conn.execute(select(nodes.c.id).where(nodes.c.node_key == node_key))).first()
        if known is None and limits is not None:
            await check_new_node(conn, account_id, address, limits, now=now)
        await _insert_or_refresh(conn, account_id, node_key, values, now=now)
        row = (await conn.execute(select(nodes).where(nodes.c.node_key == node_key))).one()
        return rows.node(row)

    @write
    async def set_node_offline(self, conn: AsyncConnection, node_id: int, *, now: float) -> None:
        await conn.execute(move(nodes, NodeState.OFFLINE, nodes.c.id == node_id, last_seen_at=now))

    @retry_conflicts
    async def touch_nodes(self, seen: dict[int, float]) -> None:
        """Record last-seen times and add the time since the previous touch to uptime."""
        if not seen:
            return
        # One statement executed for many rows: a fleet's presence in one round trip. In node
        # id order, the order every transaction locks node rows in: two processes touching
        # overlapping fleets (two leaders for a moment) wait for each other, never deadlock.
        params = [{"node": node, "at": seen[node]} for node in sorted(seen)]
        # In chunks: binding a whole fleet's rows at once would hold the event loop.
        async with self.db.tx() as conn:
            for start in range(0, len(params), TOUCH_CHUNK):
                await conn.execute(_TOUCH, params[start : start + TOUCH_CHUNK])

    @read
    async def list_nodes(
        self, conn: AsyncConnection, account_id: int | None = None
    ) -> list[NodeRecord]:
        query = select(nodes).order_by(nodes.c.id)
        if account_id is not None:
            query = query.where(nodes.c.account_id == account_id)
        return [rows.node(row) for row in await conn.execute(query)]

    @read
    async def node_tasks(self, conn: AsyncConnection, node_id: int) -> list[NodeTask]:
        query = select(tasks.c.id, tasks.c.state).where(
            tasks.c.node_id == node_id, tasks.c.state.in_(HELD)
        )
        found = (await conn.execute(query)).all()
        return [NodeTask(task_id=r.id, node_id=node_id, state=TaskState(r.state)) for r in found]

    @read
    async def measured_speeds(
        self, conn: AsyncConnection, node_id: int, *, last: int = 50
    ) -> dict[str, float]:
        """FLOP/s per kind of the node's last validated tasks, as the coordinator timed
        them (assignment to result) against their shards' nominal cost; kinds it has
        no validated task of are absent."""
        query = (
            select(jobs.c.kind, shards.c.cost_flops, tasks.c.assigned_at, tasks.c.finished_at)
            .select_from(tasks.join(shards, shards.c.id == tasks.c.shard_id).join(jobs))
            .where(
                tasks.c.node_id == node_id,
                tasks.c.outcome == "valid",
                tasks.c.assigned_at.is_not(None),
                tasks.c.finished_at.is_not(None),
            )
            .order_by(tasks.c.id.desc())
            .limit(last)
        )
        flops: dict[str, float] = {}
        seconds: dict[str, float] = {}
        for row in (await conn.execute(query)).all():
            flops[row.kind] = flops.get(row.kind, 0.0) + row.cost_flops
            seconds[row.kind] = seconds.get(row.kind, 0.0) + max(
                0.0, row.finished_at - row.assigned_at
            )
        return {kind: flops[kind] / seconds[kind] for kind in flops if seconds[kind] > 0}

    @read
    async def node_trust(self, conn: AsyncConnection, node_id: int) -> list[NodeTrust]:
        return await list_trust(conn, node_id)
