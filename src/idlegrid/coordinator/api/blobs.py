"""/v1/blobs: content-addressed uploads and downloads, with who may read or write each."""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, Request
from fastapi.responses import Response
from pydantic import BaseModel

from idlegrid.blobs import access as blob_access
from idlegrid.blobs.files import BlobError, blob_too_large
from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.api.common import (
    ApiError,
    BlobHash,
    BlobHashPath,
    Caller,
    GridDep,
    StreamedFile,
    router,
)
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.quota_checks import QuotaExceeded
from idlegrid.protocol import MAX_ID
from idlegrid.store.base import (
    TokenInfo,
)


class BlobOut(BaseModel):
    hash: BlobHash
    size: int


@router.put("/blobs/{blob_hash}", status_code=201, response_model=BlobOut, tags=["blobs"])
async def put_blob(
    blob_hash: BlobHashPath, request: Request, token: Caller, grid: GridDep
) -> BlobOut:
    """Upload a blob under its SHA-256; the content must hash to it. The blob then
    belongs to the caller's account too. A node uploads only while it holds a task."""
    now = grid.clock()
    if not await blob_access.may_write(
        grid.store, token, now=now, grace_s=grid.settings.blob_grace_s
    ):
        raise ApiError(403, "forbidden", "a node uploads only the outputs of tasks it holds")
    check_length(request, grid.blobs.max_bytes)
    declared = request.headers.get("content-length", "")
    try:
        allowance = await quotas.blob_allowance(
            grid.store,
            grid.settings,
            token,
            blob_hash,
            int(declared) if declared.isdigit() else None,
        )
        size = await grid.blobs.put_stream(blob_hash, request.stream(), max_bytes=allowance)
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    except BlobError as exc:
        if exc.status == 413 and allowance is not None and allowance < grid.blobs.max_bytes:
            message = (
                f"the account's blobs would pass quota_blob_bytes {grid.settings.quota_blob_bytes}"
            )
            raise ApiError(413, "quota_exceeded", message) from None
        raise ApiError(exc.status, "invalid_blob", exc.message) from None
    await grid.store.blob_owners.add_blob_owner(blob_hash, token.account_id, size=size, now=now)
    return BlobOut(hash=blob_hash, size=size)


@router.get("/blobs/{blob_hash}", tags=["blobs"], response_class=Response)
async def get_blob(
    blob_hash: BlobHashPath,
    token: Caller,
    grid: GridDep,
    x_idlegrid_node: Annotated[int | None, Header(ge=1, le=MAX_ID)] = None,
) -> Response:
    """Download a blob by its SHA-256 (a worker names its node: the scheduler's locality).

    404 for a blob that is missing or that the caller may not read (docs/security.md)."""
    await readable(grid, token, blob_hash)
    try:
        path = grid.blobs.file(blob_hash)
    except BlobError as exc:
        raise ApiError(
            exc.status, "not_found" if exc.status == 404 else "invalid_hash", exc.message
        ) from None
    if token.kind == "node" and x_idlegrid_node is not None:
        grid.node_fetched(x_idlegrid_node, blob_hash, account_id=token.account_id)
    # Streamed from disk as the client reads (Range requests too): memory stays flat
    # however many slow clients download at once (a chunk each).
    return StreamedFile(path, media_type="application/octet-stream")


@router.head("/blobs/{blob_hash}", tags=["blobs"])
async def head_blob(blob_hash: BlobHashPath, token: Caller, grid: GridDep) -> Response:
    """200 if the blob is stored and the caller may read it (so clients skip
    re-uploads), else 404: the same rules as GET."""
    await readable(grid, token, blob_hash)
    if not grid.blobs.exists(blob_hash):
        raise ApiError(404, "not_found", f"no blob {blob_hash}")
    return Response(status_code=200)


async def readable(grid: Grid, token: TokenInfo, blob_hash: str) -> None:
    """404 (as for a missing blob) unless the caller may read this blob."""
    allowed = await blob_access.may_read(
        grid.store, token, blob_hash, now=grid.clock(), grace_s=grid.settings.blob_grace_s
    )
    if not allowed:
        raise ApiError(404, "not_found", f"no blob {blob_hash}")


def check_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", blob_too_large(int(declared), limit))
