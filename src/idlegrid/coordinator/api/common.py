"""What every /v1 route shares: its errors (JSON with a code and a message), the caller's
token, the grid, and the router the route modules register on."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, Field, ValidationError

from idlegrid.coordinator.auth import hash_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.guard import Guard, RateLimited
from idlegrid.protocol import MAX_ID, SHA256_PATTERN
from idlegrid.store.base import (
    TokenInfo,
)


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def error_response(
    status: int, code: str, message: str, *, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


def grid_of(request: Request) -> Grid:
    return request.app.state.grid  # type: ignore[no-any-return]


def guard_of(request: Request) -> Guard:
    return request.app.state.guard  # type: ignore[no-any-return]


async def caller(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> TokenInfo:
    """Whoever holds the bearer token (researcher or node).

    Unknown tokens count against the caller's address: past `auth_failures_per_address`
    in `auth_failure_window_s` an unknown token from it gets 429 without a lookup; a
    token that exists is still let in (`Guard.authenticate`)."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(401, "unauthorized", "missing 'Authorization: Bearer <token>' header")
    address = request.client.host if request.client else ""
    token_hash = hash_token(authorization[7:].strip())
    try:
        token = await guard_of(request).authenticate(
            address, token_hash, grid_of(request).store.accounts
        )
    except RateLimited as exc:
        raise ApiError(
            429, "rate_limited", str(exc), headers={"Retry-After": exc.retry_after}
        ) from None
    if token is None:
        raise ApiError(401, "unauthorized", "unknown or revoked token")
    return token


async def metrics_reader(request: Request) -> None:
    """/metrics: an address the `metrics_allow` setting names, or an admin token."""
    if request.client is not None and request.client.host in guard_of(request).metrics_allow:
        return
    token = await caller(request, request.headers.get("authorization"))
    if not token.is_admin:
        raise ApiError(403, "forbidden", "metrics need an admin token or an allowed address")


async def researcher(token: Annotated[TokenInfo, Depends(caller)]) -> TokenInfo:
    """A researcher (API) token; node tokens may only use the node endpoints and blobs."""
    if token.kind != "api":
        raise ApiError(403, "forbidden", "node tokens cannot call researcher endpoints")
    return token


Caller = Annotated[TokenInfo, Depends(caller)]


Researcher = Annotated[TokenInfo, Depends(researcher)]


GridDep = Annotated[Grid, Depends(grid_of)]


# Ids in paths are bounded to what the store holds: a larger one is a 422, not a 500.
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]


ObjectId = Annotated[int, Path(ge=1, le=MAX_ID)]


BlobHashPath = Annotated[
    str, Path(pattern=SHA256_PATTERN, description="lowercase SHA-256 hex digest")
]


BlobHash = Annotated[str, Field(pattern=SHA256_PATTERN)]


class ErrorOut(BaseModel):
    """Every API error: a code to branch on and a message for people."""

    error: str = Field(examples=["not_found"])
    message: str


def errors_of(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorOut, "description": _MEANING[status]} for status in statuses}


_MEANING = {
    400: "the body could not be read as JSON",
    401: "no token, or an unknown or revoked one",
    403: "the token may not do this",
    404: "no such object, or not the caller's (the same answer)",
    405: "method not allowed (the Allow header lists those that are)",
    409: "the object is not in a state for this",
    413: "request body or blob over its size limit, or over a quota",
    422: "invalid request: the message says which field and why",
    429: "too many requests, or over a rate limit",
}


router = APIRouter(prefix="/v1", responses=errors_of(400, 401, 403, 404, 413, 422, 429))


error_responses = errors_of  # for routes outside /v1


class StreamedFile(FileResponse):
    """A file sent in 256 KiB chunks: each chunk is a read in a worker thread and a send,
    so starlette's 64 KiB made a 2 MB shard input 32 thread hops, and 256 KiB makes it 8
    (a quarter less of the coordinator's CPU a download, `benchmarks/blob_transfer.py`),
    at 192 KiB more memory a download in flight."""

    chunk_size = 256 * 1024


def validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
        for err in exc.errors()[:5]
    )
