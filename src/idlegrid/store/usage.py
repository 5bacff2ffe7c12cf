"""What an account holds, for its quotas (`coordinator/quotas.py`), mixed into `SqlStore`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple, Protocol

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.store.schema import blob_owners


class BlobUsage(NamedTuple):
    blobs: int
    bytes: int


class UsageStore(Protocol):
    async def blob_usage(self, account_id: int) -> BlobUsage:
        """The blobs the account owns (uploaded): how many, and their bytes."""
        ...


class UsageSql:
    """The usage methods of `SqlStore`."""

    if TYPE_CHECKING:  # provided by SqlStore

        def _read(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]: ...

    async def blob_usage(self, account_id: int) -> BlobUsage:
        query = select(func.count(), func.coalesce(func.sum(blob_owners.c.size), 0)).where(
            blob_owners.c.account_id == account_id
        )
        async with self._read() as conn:
            count, size = (await conn.execute(query)).one()
        return BlobUsage(int(count), int(size))
