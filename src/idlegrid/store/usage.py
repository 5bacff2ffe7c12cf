"""What an account holds, for its quotas (`coordinator/quota_checks.py`): the `store.usage` role."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store.database import Role, read
from idlegrid.store.schema import blob_owners


class BlobUsage(NamedTuple):
    blobs: int
    bytes: int


class Usage(Role):
    """What an account holds (`store.usage`)."""

    @read
    async def blob_usage(self, conn: AsyncConnection, account_id: int) -> BlobUsage:
        """The blobs the account owns (uploaded): how many, and their bytes."""
        query = select(func.count(), func.coalesce(func.sum(blob_owners.c.size), 0)).where(
            blob_owners.c.account_id == account_id
        )
        count, size = (await conn.execute(query)).one()
        return BlobUsage(int(count), int(size))
