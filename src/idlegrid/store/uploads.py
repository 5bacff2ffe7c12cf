"""Uploads from the browser: a row per file while its chunks arrive, and after.

The bytes go to a temporary file next to the blob store; this table says how many of
them arrived, so chunks are taken in order (a conditional update on `received`) and an
account's total stays under its limit, counted with the files still arriving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import UploadState
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import uploads

Purpose = Literal[
    "texts",
    "dataset",
    "weights",
    "onnx-model",
    "model-inputs",
    "gguf-model",
    "prompts",
    "model-folder",
]
PURPOSES: tuple[Purpose, ...] = ("texts", "dataset", "weights")
# Rows of chunked uploads through the API (`store.blob_uploads`), which sweeps its own:
# they may go on for longer than a browser's.
API_PURPOSE = "blob"


class OverQuota(ValueError):
    """An upload that would take its account over its limit."""


@dataclass(frozen=True)
class Upload:
    id: int
    account_id: int
    name: str
    purpose: Purpose
    size: int
    received: int
    state: Literal["partial", "done"]
    blob_hash: str | None
    created_at: float
    finished_at: float | None


def _upload(row: Any) -> Upload:
    return Upload(
        row.id,
        row.account_id,
        row.name,
        row.purpose,
        row.size,
        row.received,
        row.state,
        row.blob_hash,
        row.created_at,
        row.finished_at,
    )


async def used_bytes(conn: AsyncConnection, account_id: int) -> int:
    """Bytes an account's uploads take, finished or still arriving."""
    query = select(func.coalesce(func.sum(uploads.c.size), 0)).where(
        uploads.c.account_id == account_id
    )
    return int((await conn.execute(query)).scalar_one())


async def start_upload(
    conn: AsyncConnection,
    account_id: int,
    *,
    name: str,
    purpose: Purpose,
    size: int,
    quota_bytes: int,
    now: float,
    stale_before: float,
) -> tuple[int, list[int]]:
    """Open an upload; returns its id and the ids of the account's abandoned ones
    (partial since before `stale_before`), whose rows are gone and whose files the
    caller deletes."""
    stale = [
        row.id
        for row in (
            await conn.execute(
                select(uploads.c.id).where(
                    uploads.c.account_id == account_id,
                    uploads.c.purpose != API_PURPOSE,
                    uploads.c.state == UploadState.PARTIAL.value,
                    uploads.c.created_at < stale_before,
                )
            )
        ).all()
    ]
    if stale:
        await conn.execute(delete(uploads).where(uploads.c.id.in_(stale)))
    used = await used_bytes(conn, account_id)
    if used + size > quota_bytes:
        raise OverQuota(
            f"this file ({size:,} bytes) would take your uploads to {used + size:,} bytes,"
            f" over your limit of {quota_bytes:,}; delete some files first"
        )
    result = await conn.execute(
        insert(uploads).values(
            account_id=account_id,
            name=name,
            purpose=purpose,
            size=size,
            received=0,
            state=UploadState.PARTIAL.value,
            created_at=now,
        )
    )
    return int(result.inserted_primary_key[0]), stale  # type: ignore[index]


async def get_upload(conn: AsyncConnection, upload_id: int, account_id: int) -> Upload | None:
    row = (
        await conn.execute(
            select(uploads).where(uploads.c.id == upload_id, uploads.c.account_id == account_id)
        )
    ).first()
    return _upload(row) if row else None


async def advance(
    conn: AsyncConnection, upload_id: int, account_id: int, *, offset: int, length: int
) -> bool:
    """Count a chunk written at `offset`; False unless it is the next one and fits."""
    result = await conn.execute(
        update(uploads)
        .where(
            uploads.c.id == upload_id,
            uploads.c.account_id == account_id,
            uploads.c.state == UploadState.PARTIAL.value,
            uploads.c.received == offset,
            uploads.c.size >= offset + length,
        )
        .values(received=offset + length)
    )
    return bool(result.rowcount)


async def finish_upload(
    conn: AsyncConnection, upload_id: int, account_id: int, *, blob_hash: str, now: float
) -> bool:
    result = await conn.execute(
        move(
            uploads,
            UploadState.DONE,
            uploads.c.id == upload_id,
            uploads.c.account_id == account_id,
            uploads.c.received == uploads.c.size,
            blob_hash=blob_hash,
            finished_at=now,
        )
    )
    return bool(result.rowcount)


async def delete_upload(conn: AsyncConnection, upload_id: int, account_id: int) -> bool:
    """Forget an upload (the blob stays while jobs may name it: blobs are shared)."""
    result = await conn.execute(
        delete(uploads).where(uploads.c.id == upload_id, uploads.c.account_id == account_id)
    )
    return bool(result.rowcount)


async def list_uploads(
    conn: AsyncConnection, account_id: int, *, purpose: Purpose | None = None, limit: int = 200
) -> list[Upload]:
    query = (
        select(uploads)
        .where(uploads.c.account_id == account_id, uploads.c.state == UploadState.DONE.value)
        .order_by(uploads.c.id.desc())
        .limit(limit)
    )
    if purpose is not None:
        query = query.where(uploads.c.purpose == purpose)
    return [_upload(row) for row in (await conn.execute(query)).all()]
