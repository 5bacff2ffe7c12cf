"""A researcher's files: chunked uploads into the blob store, the file list, deletion.

The browser sends a file in chunks (at most `CHUNK_BYTES`, under the request limit); a
row of `uploads` (store/uploads.py) counts what arrived, the last chunk's file is hashed
and moved into the blob store. Its routes join the researcher's pages (research.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from idlegrid.blobs.files import BlobError
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    Researcher,
    dashboard_of,
    grid_of,
    redirect,
    render,
    store_of,
)
from idlegrid.store import uploads

router = APIRouter()  # under the researcher pages' prefix (research.py)
CHUNK_BYTES = 4 * 1024 * 1024
STALE_UPLOAD_S = 3600.0


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": "upload", "message": message}, status_code=status)


# -- files ---------------------------------------------------------------------------------


@router.get("/files", response_class=HTMLResponse)
async def files_page(request: Request, session: Researcher) -> Response:
    store = store_of(request)
    files = await store.web.web_read(uploads.list_uploads, session.account.id)
    used = await store.web.web_read(uploads.used_bytes, session.account.id)
    return await render(
        request,
        "files.html",
        files=files,
        used=used,
        quota=dashboard_of(request).settings.web_upload_quota_bytes,
        # One file is bounded by the account's upload quota alone, as the API's chunked
        # uploads are (a model of several hundred MB is one file).
        max_file=dashboard_of(request).settings.web_upload_quota_bytes,
        chunk=_chunk_bytes(request),
    )


class UploadStart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    purpose: uploads.Purpose
    size: int = Field(ge=1)


def _chunk_bytes(request: Request) -> int:
    # Under the request body limit, which every path but /v1/blobs/ has.
    return min(CHUNK_BYTES, dashboard_of(request).settings.max_request_bytes)


def _tmp(request: Request, upload_id: int) -> Path:
    return grid_of(request).blobs.tmp_path(f"upload-{upload_id}")


@router.post("/uploads", dependencies=[Csrf])
async def start_upload(request: Request, session: Researcher) -> Response:
    try:
        body = UploadStart.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        return _json_error(422, f"bad upload request: {exc}")
    now = grid_of(request).clock()
    try:
        upload_id, stale = await store_of(request).web.web_write(
            uploads.start_upload,
            session.account.id,
            name=body.name,
            purpose=body.purpose,
            size=body.size,
            quota_bytes=dashboard_of(request).settings.web_upload_quota_bytes,
            now=now,
            stale_before=now - STALE_UPLOAD_S,
        )
    except uploads.OverQuota as exc:
        return _json_error(413, str(exc))
    for old in stale:
        _tmp(request, old).unlink(missing_ok=True)
    _tmp(request, upload_id).touch()
    return JSONResponse({"id": upload_id, "chunk_size": _chunk_bytes(request)}, status_code=201)


@router.put("/uploads/{upload_id}", dependencies=[Csrf])
async def put_chunk(
    request: Request,
    upload_id: Id,
    session: Researcher,
    offset: Annotated[int, Query(ge=0, le=2**62)],
) -> Response:
    """One chunk at `offset`; chunks come in order, each under the request size limit."""
    store = store_of(request)
    upload = await store.web.web_read(uploads.get_upload, upload_id, session.account.id)
    if upload is None or upload.state != "partial":
        return _json_error(404, f"no upload {upload_id} in progress")
    data = await request.body()
    if offset != upload.received or offset + len(data) > upload.size:
        return _json_error(409, f"expected the chunk at offset {upload.received}")
    await asyncio.to_thread(_write_at, _tmp(request, upload_id), offset, data)
    if not await store.web.web_write(
        uploads.advance, upload_id, session.account.id, offset=offset, length=len(data)
    ):
        return _json_error(409, "another chunk arrived at that offset first")
    return JSONResponse({"received": offset + len(data)})


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@router.post("/uploads/{upload_id}/finish", dependencies=[Csrf])
async def finish_upload(request: Request, upload_id: Id, session: Researcher) -> Response:
    store = store_of(request)
    upload = await store.web.web_read(uploads.get_upload, upload_id, session.account.id)
    if upload is None or upload.state != "partial" or upload.received != upload.size:
        return _json_error(409, "the upload is not complete")
    blobs = grid_of(request).blobs
    try:
        blob_hash = await asyncio.to_thread(
            blobs.put_file, _tmp(request, upload_id), size=upload.size, max_bytes=upload.size
        )
    except (BlobError, OSError) as exc:
        await store.web.web_write(uploads.delete_upload, upload_id, session.account.id)
        return _json_error(422, f"the file could not be stored: {exc}")
    now = grid_of(request).clock()
    await store.web.web_write(
        uploads.finish_upload, upload_id, session.account.id, blob_hash=blob_hash, now=now
    )
    # The blob is the account's: its API token reads it, and its jobs may name it.
    await grid_of(request).store.blob_owners.add_blob_owner(
        blob_hash, session.account.id, size=upload.size, now=now
    )
    return JSONResponse({"hash": blob_hash, "size": upload.size})


@router.post("/uploads/{upload_id}/abort", dependencies=[Csrf])
async def abort_upload(request: Request, upload_id: Id, session: Researcher) -> Response:
    """Drop an upload that failed or was cancelled: its row and its partial file."""
    upload = await store_of(request).web.web_read(uploads.get_upload, upload_id, session.account.id)
    if upload is not None and upload.state == "partial":
        await store_of(request).web.web_write(uploads.delete_upload, upload_id, session.account.id)
        _tmp(request, upload_id).unlink(missing_ok=True)
    return Response(status_code=204)


@router.post("/files/{upload_id}/delete", dependencies=[Csrf])
async def delete_file(request: Request, upload_id: Id, session: Researcher) -> Response:
    if not await store_of(request).web.web_write(
        uploads.delete_upload, upload_id, session.account.id
    ):
        raise PageError(404, f"You have no file {upload_id}.")
    return redirect(request, "/research/files", flash="File removed from your list.")
