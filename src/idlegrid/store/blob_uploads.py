"""Chunked blob uploads through the API: the `store.blob_uploads` role.

A blob larger than one request (a model's weights) arrives in chunks. While they do, a
row of `uploads` (purpose "blob") says which blob it will be (`blob_hash`, named by the
client when it starts, checked when the last byte arrived), how large, and how many
bytes arrived (`received`: chunks are taken in order, by a conditional update). An
interrupted upload is found again by its blob's hash and goes on from there. Once the
blob is stored the row goes: its bytes then count through `blob_owners`, and the
dashboard's file list (the browser's uploads, other purposes) never shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import UploadState
from idlegrid.store import uploads as browser_uploads
from idlegrid.store.database import Role, read, write
from idlegrid.store.schema import uploads

PURPOSE = browser_uploads.API_PURPOSE
_PARTIAL = UploadState.PARTIAL.value


@dataclass(frozen=True)
class BlobUpload:
    id: int
    account_id: int
    blob_hash: str
    size: int
    received: int
    created_at: float


def _blob_upload(row: Any) -> BlobUpload:
    return BlobUpload(row.id, row.account_id, row.blob_hash, row.size, row.received, row.created_at)


_MINE = uploads.c.purpose == PURPOSE


class BlobUploads(Role):
    """Blobs arriving in chunks through the API (`store.blob_uploads`)."""

    @write
    async def sweep(self, conn: AsyncConnection, account_id: int, *, before: float) -> list[int]:
        """Forget the account's uploads started before `before` and never finished;
        their ids, whose partial files the caller deletes."""
        stale = [
            row.id
            for row in await conn.execute(
                select(uploads.c.id).where(
                    _MINE,
                    uploads.c.account_id == account_id,
                    uploads.c.state == _PARTIAL,
                    uploads.c.created_at < before,
                )
            )
        ]
        if stale:
            await conn.execute(delete(uploads).where(uploads.c.id.in_(stale)))
        return stale

    @read
    async def arriving(
        self, conn: AsyncConnection, account_id: int, blob_hash: str
    ) -> BlobUpload | None:
        """The account's upload of this blob still arriving, if any (the oldest)."""
        row = (
            await conn.execute(
                select(uploads)
                .where(
                    _MINE,
                    uploads.c.account_id == account_id,
                    uploads.c.blob_hash == blob_hash,
                    uploads.c.state == _PARTIAL,
                )
                .order_by(uploads.c.id)
                .limit(1)
            )
        ).first()
        return _blob_upload(row) if row else None

    @read
    async def get(
        self, conn: AsyncConnection, upload_id: int, account_id: int
    ) -> BlobUpload | None:
        """The account's upload `upload_id` still arriving (None: another's, or gone)."""
        row = (
            await conn.execute(
                select(uploads).where(
                    _MINE,
                    uploads.c.id == upload_id,
                    uploads.c.account_id == account_id,
                    uploads.c.state == _PARTIAL,
                )
            )
        ).first()
        return _blob_upload(row) if row else None

    @read
    async def arriving_bytes(self, conn: AsyncConnection, account_id: int) -> int:
        """Bytes the account's chunked uploads will take once they arrive (for its quota)."""
        query = select(func.coalesce(func.sum(uploads.c.size), 0)).where(
            _MINE, uploads.c.account_id == account_id, uploads.c.state == _PARTIAL
        )
        return int((await conn.execute(query)).scalar_one())

    @write
    async def start(
        self,
        conn: AsyncConnection,
        account_id: int,
        *,
        blob_hash: str,
        size: int,
        name: str,
        now: float,
    ) -> BlobUpload:
        """Open an upload of `size` bytes that must hash to `blob_hash`."""
        result = await conn.execute(
            insert(uploads).values(
                account_id=account_id,
                name=name or blob_hash,
                purpose=PURPOSE,
                size=size,
                received=0,
                state=_PARTIAL,
                blob_hash=blob_hash,
                created_at=now,
            )
        )
        upload_id = int(result.inserted_primary_key[0])  # type: ignore[index]
        return BlobUpload(upload_id, account_id, blob_hash, size, 0, now)

    @write
    async def advance(
        self, conn: AsyncConnection, upload_id: int, account_id: int, *, offset: int, length: int
    ) -> bool:
        """Count a chunk written at `offset`; False unless it is the next one and fits."""
        return await browser_uploads.advance(
            conn, upload_id, account_id, offset=offset, length=length
        )

    @write
    async def remove(self, conn: AsyncConnection, upload_id: int, account_id: int) -> bool:
        """Forget an upload (stored, refused or abandoned)."""
        result = await conn.execute(
            delete(uploads).where(
                _MINE, uploads.c.id == upload_id, uploads.c.account_id == account_id
            )
        )
        return bool(result.rowcount)
