"""Who may read and write which blob: the `store.blob_owners` role.

A blob belongs to the accounts that uploaded it (`blob_owners`). A job names blobs
besides its shards' payloads (`job_blobs`: its inputs, its training rounds' weights and
updates). A node's account may read a blob while one of its tasks names it, and for a
grace period after (`since`); the policy itself is `blobs/access.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import TaskState
from idlegrid.store import dialect
from idlegrid.store.database import Role, read, write
from idlegrid.store.schema import blob_owners, job_blobs, jobs, shards, tasks

_ASSIGNED = TaskState.ASSIGNED.value


async def add_job_blobs(conn: AsyncConnection, job_id: int, blob_hashes: Iterable[str]) -> None:
    """Record blobs a job names (its inputs, a round's weights) for its nodes to read."""
    rows = [{"job_id": job_id, "blob_hash": h} for h in sorted(set(blob_hashes)) if h]
    if rows:
        await conn.execute(_insert_ignoring_duplicates(conn, job_blobs), rows)


def _insert_ignoring_duplicates(conn: AsyncConnection, table: Any) -> Any:
    return dialect.insert(conn, table).on_conflict_do_nothing()


def _held_since(since: float) -> ColumnElement[bool]:
    """A task held now, or one that ended (or whose lease ran out) at `since` or later."""
    ended = func.coalesce(tasks.c.finished_at, tasks.c.lease_deadline)
    return or_(tasks.c.state == _ASSIGNED, and_(tasks.c.assigned_at.is_not(None), ended >= since))


class BlobOwners(Role):
    """Ownership of blobs, and what an account's tasks name (`store.blob_owners`)."""

    @write
    async def add_blob_owner(
        self, conn: AsyncConnection, blob_hash: str, account_id: int, *, size: int, now: float
    ) -> None:
        """Record that `account_id` uploaded the blob (again: nothing changes)."""
        row = {"blob_hash": blob_hash, "account_id": account_id, "size": size, "created_at": now}
        await conn.execute(_insert_ignoring_duplicates(conn, blob_owners), [row])

    async def owns_or_produced(self, account_id: int, blob_hash: str) -> bool:
        """The account uploaded the blob, or it is the result (or a blob) of its job."""
        owned = exists().where(
            blob_owners.c.blob_hash == blob_hash, blob_owners.c.account_id == account_id
        )
        result = exists().where(jobs.c.account_id == account_id, jobs.c.result_hash == blob_hash)
        named = exists().where(
            job_blobs.c.blob_hash == blob_hash,
            job_blobs.c.job_id == jobs.c.id,
            jobs.c.account_id == account_id,
        )
        return await self._any(or_(owned, result, named))

    async def tasks_name(self, account_id: int, blob_hash: str, *, since: float) -> bool:
        """A task of the account's nodes, held now or until `since`, names the blob."""
        mine = and_(tasks.c.account_id == account_id, _held_since(since))
        payload = exists().where(
            shards.c.input_hash == blob_hash, tasks.c.shard_id == shards.c.id, mine
        )
        named = exists().where(
            job_blobs.c.blob_hash == blob_hash, tasks.c.job_id == job_blobs.c.job_id, mine
        )
        checked = exists().where(tasks.c.checks_hash == blob_hash, mine)  # a check task's
        return await self._any(or_(payload, named, checked))

    async def holds_tasks(self, account_id: int, *, since: float) -> bool:
        """The account's nodes hold a task now, or held one until `since`."""
        return await self._any(exists().where(tasks.c.account_id == account_id, _held_since(since)))

    @read
    async def _any(self, conn: AsyncConnection, condition: ColumnElement[bool]) -> bool:
        return bool((await conn.execute(select(condition))).scalar())
