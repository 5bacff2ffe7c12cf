"""/v1/uploads: a blob in chunks, for blobs larger than one request (a model's weights).

`POST /v1/uploads` names the blob (its SHA-256 and size) and answers where to go on
from: 0 for a new upload, the bytes already received for one that was interrupted, or
`done` when the blob is stored already. Each `PUT /v1/uploads/{id}?offset=N` adds the
next chunk; the last one's file is hashed, and only a file that hashes to the named
blob enters the blob store, where jobs may name it. The size of such a blob is bounded
by the account's quota (`quota_blob_bytes`), not by `max_blob_bytes`, which bounds a blob
sent in one request (`PUT /v1/blobs/{hash}`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.blobs.files import BlobError
from idlegrid.coordinator.api.common import (
    ApiError,
    BlobHash,
    GridDep,
    ObjectId,
    Researcher,
    router,
)
from idlegrid.coordinator.grid import Grid
from idlegrid.policy import quotas as policy
from idlegrid.store.base import TokenInfo
from idlegrid.store.blob_uploads import BlobUpload

CHUNK_BYTES = 8 * 1024 * 1024


class UploadStart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hash: BlobHash = Field(description="the SHA-256 of the whole blob, lowercase hex")
    size: int = Field(ge=1, le=2**62, description="the blob's size in bytes")
    name: str = Field(default="", max_length=200, description="a file name, for people")


class UploadOut(BaseModel):
    id: int | None = Field(description="the upload's id; none once the blob is stored")
    hash: str
    size: int
    received: int = Field(description="bytes received: the offset of the next chunk")
    chunk_size: int = Field(description="the largest chunk a PUT may carry")
    done: bool = Field(description="the blob is stored (and checked against its hash)")


def chunk_bytes(grid: Grid) -> int:
    """A chunk fits the request body limit, which every path but /v1/blobs/ has."""
    return min(CHUNK_BYTES, grid.settings.max_request_bytes)


def _out(grid: Grid, upload: BlobUpload) -> UploadOut:
    return UploadOut(
        id=upload.id,
        hash=upload.blob_hash,
        size=upload.size,
        received=upload.received,
        chunk_size=chunk_bytes(grid),
        done=False,
    )


def _stored(grid: Grid, blob_hash: str, size: int) -> UploadOut:
    return UploadOut(
        id=None, hash=blob_hash, size=size, received=size, chunk_size=chunk_bytes(grid), done=True
    )


def _partial_file(grid: Grid, upload_id: int) -> Path:
    return grid.blobs.tmp_path(f"upload-{upload_id}")


@router.post(
    "/uploads",
    response_model=UploadOut,
    tags=["blobs"],
    responses={201: {"model": UploadOut, "description": "a new upload: send its chunks"}},
)
async def start_upload(body: UploadStart, token: Researcher, grid: GridDep) -> Response:
    """Start (or go on with) the upload of one blob in chunks; 201 for a new upload.

    An upload of the same blob by the same account that was interrupted is answered
    with the bytes it has (`received`): send the chunks from there. A blob the account
    has already is answered `done`."""
    store, now = grid.store, grid.clock()
    if grid.blobs.exists(body.hash) and await store.blob_owners.owns_or_produced(
        token.account_id, body.hash
    ):
        return _json(_stored(grid, body.hash, grid.blobs.size(body.hash)), 200)
    for stale in await store.blob_uploads.sweep(
        token.account_id, before=now - grid.settings.blob_upload_resume_s
    ):
        _partial_file(grid, stale).unlink(missing_ok=True)
    arriving = await store.blob_uploads.arriving(token.account_id, body.hash)
    if arriving is not None and _partial_file(grid, arriving.id).is_file():
        if arriving.size != body.size:
            raise ApiError(
                422,
                "invalid_upload",
                f"size: {body.size} bytes, but the upload of this blob in progress (id "
                f"{arriving.id}) is of {arriving.size}; a blob's size follows from its hash: "
                f"check the file, or DELETE /v1/uploads/{arriving.id} and start again",
            )
        return _json(_out(grid, arriving), 200)
    if arriving is not None:  # its partial file is gone: start again
        await store.blob_uploads.remove(arriving.id, token.account_id)
    await _check_quota(grid, token, body.size)
    upload = await store.blob_uploads.start(
        token.account_id, blob_hash=body.hash, size=body.size, name=body.name, now=now
    )
    _partial_file(grid, upload.id).touch()
    return _json(_out(grid, upload), 201)


async def _check_quota(grid: Grid, token: TokenInfo, size: int) -> None:
    """The account's blobs, with those still arriving, may take `size` more bytes."""
    if token.is_admin:
        return
    usage = await grid.store.usage.blob_usage(token.account_id)
    arriving = await grid.store.blob_uploads.arriving_bytes(token.account_id)
    refusal = policy.blob_refusal(
        grid.settings.quotas,
        blobs_held=usage.blobs,
        bytes_held=usage.bytes + arriving,
        new_bytes=size,
    )
    if refusal is not None:
        raise ApiError(refusal.status, "quota_exceeded", refusal.message)


@router.get("/uploads/{upload_id}", response_model=UploadOut, tags=["blobs"])
async def upload_state(upload_id: ObjectId, token: Researcher, grid: GridDep) -> UploadOut:
    """How far an upload in progress is (`received`: the offset of the next chunk)."""
    return _out(grid, await _arriving(grid, token, upload_id))


@router.put(
    "/uploads/{upload_id}",
    response_model=UploadOut,
    tags=["blobs"],
    responses={409: {"description": "not the upload's next offset: GET it to go on"}},
)
async def put_chunk(
    upload_id: ObjectId,
    request: Request,
    token: Researcher,
    grid: GridDep,
    offset: Annotated[int, Query(ge=0, le=2**62, description="where the chunk starts")],
) -> UploadOut:
    """The next chunk, at `offset` (the upload's `received`). With the last one the
    blob is hashed and stored: `done`, or 422 if it does not hash to the named blob."""
    upload = await _arriving(grid, token, upload_id)
    if offset != upload.received:
        raise ApiError(
            409,
            "wrong_offset",
            f"offset: {offset}, but the upload has {upload.received} bytes: send the chunk "
            f"at offset {upload.received} (GET /v1/uploads/{upload_id} says where)",
        )
    data = await request.body()
    if not data:  # nothing to add: where the upload stands, as GET says
        return _out(grid, upload)
    if offset + len(data) > upload.size:
        raise ApiError(
            422,
            "invalid_upload",
            f"the chunk ends at byte {offset + len(data)}, past the blob's size "
            f"{upload.size}: send at most {upload.size - offset} bytes",
        )
    path = _partial_file(grid, upload_id)
    try:
        await asyncio.to_thread(_write_at, path, offset, data)
    except FileNotFoundError:
        await grid.store.blob_uploads.remove(upload_id, token.account_id)
        raise ApiError(
            404, "not_found", f"upload {upload_id} lost its partial file: start it again"
        ) from None
    if not await grid.store.blob_uploads.advance(
        upload_id, token.account_id, offset=offset, length=len(data)
    ):
        raise ApiError(
            409,
            "wrong_offset",
            f"offset: another chunk at {offset} arrived first: GET /v1/uploads/{upload_id} "
            "says where to go on from",
        )
    received = offset + len(data)
    if received < upload.size:
        return _out(grid, dataclasses.replace(upload, received=received))
    await _store_blob(grid, token, upload, path)
    return _stored(grid, upload.blob_hash, upload.size)


async def _store_blob(grid: Grid, token: TokenInfo, upload: BlobUpload, path: Path) -> None:
    """Hash the whole file; only one that is the named blob enters the store."""
    try:
        await asyncio.to_thread(
            grid.blobs.put_file,
            path,
            size=upload.size,
            expected_hash=upload.blob_hash,
            max_bytes=upload.size,  # bounded by the account's quota when it started
        )
    except BlobError as exc:
        raise ApiError(
            exc.status,
            "invalid_upload",
            f"upload {upload.id}: {exc.message}; upload the file again (POST /v1/uploads)",
        ) from None
    except OSError as exc:  # the coordinator's disk, not the request
        raise ApiError(
            507,
            "insufficient_storage",
            f"upload {upload.id}: the coordinator could not store the blob ({exc.strerror}); "
            "its operator frees space, then upload the file again (POST /v1/uploads)",
        ) from None
    finally:
        await grid.store.blob_uploads.remove(upload.id, token.account_id)
    await grid.store.blob_owners.add_blob_owner(
        upload.blob_hash, token.account_id, size=upload.size, now=grid.clock()
    )


@router.delete("/uploads/{upload_id}", status_code=204, tags=["blobs"])
async def abort_upload(upload_id: ObjectId, token: Researcher, grid: GridDep) -> Response:
    """Give up an upload in progress: its row and the bytes received go."""
    await _arriving(grid, token, upload_id)
    await grid.store.blob_uploads.remove(upload_id, token.account_id)
    _partial_file(grid, upload_id).unlink(missing_ok=True)
    return Response(status_code=204)


async def _arriving(grid: Grid, token: TokenInfo, upload_id: int) -> BlobUpload:
    upload = await grid.store.blob_uploads.get(upload_id, token.account_id)
    if upload is None:
        raise ApiError(
            404,
            "not_found",
            f"no upload {upload_id} in progress for this account (finished, given up, or "
            "unfinished for longer than blob_upload_resume_s): start it with POST /v1/uploads",
        )
    return upload


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _json(out: UploadOut, status: int) -> Response:
    return Response(out.model_dump_json(), status_code=status, media_type="application/json")
