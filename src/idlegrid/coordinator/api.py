"""The REST API under /v1: jobs, results, blobs, tokens, nodes.

Every error is JSON: {"error": <code>, "message": <human-readable text>}.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from idlegrid.blobs import access as blob_access
from idlegrid.blobs.files import BlobError
from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.auth import display_prefix, hash_token, new_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.guard import Guard
from idlegrid.coordinator.intake import JobInputError
from idlegrid.coordinator.jobwatch import RECHECK_S
from idlegrid.coordinator.quota_checks import QuotaExceeded
from idlegrid.kinds import InputError, UnknownKind, get_kind
from idlegrid.protocol import MAX_ID, SHA256_PATTERN
from idlegrid.states import TERMINAL_JOB_STATES
from idlegrid.store.base import (
    AccountExists,
    JobRecord,
    NodeRecord,
    ShardRecord,
    TokenInfo,
)
from idlegrid.verification import trust as trust_policy
from idlegrid.verification.credit import CreditTotals, recent_average


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
    in `auth_failure_window_s` it gets 429 whatever token it sends."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(401, "unauthorized", "missing 'Authorization: Bearer <token>' header")
    failures = guard_of(request).auth
    address = request.client.host if request.client else ""
    wait_s = failures.retry_after_s(address)
    if wait_s > 0:
        raise ApiError(
            429,
            "rate_limited",
            f"too many unknown tokens from this address (auth_failures_per_address "
            f"{failures.limit} in {failures.window_s:g} s); try again in {wait_s:.0f} s",
            headers={"Retry-After": str(math.ceil(wait_s))},
        )
    token = await grid_of(request).store.find_token(hash_token(authorization[7:].strip()))
    if token is None:
        failures.failed(address)
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
# Nesting of job params: deeper is refused before it is stored.
MAX_PARAMS_DEPTH = 32


class ErrorOut(BaseModel):
    """Every API error: a code to branch on and a message for people."""

    error: str = Field(examples=["not_found"])
    message: str


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
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

router = APIRouter(prefix="/v1", responses=_errors(400, 401, 403, 404, 413, 422, 429))
error_responses = _errors  # for routes outside /v1


# -- models --------------------------------------------------------------------------------


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(max_length=40, examples=["embed-text"])
    inputs: dict[Annotated[str, Field(max_length=64)], BlobHash] = Field(
        default_factory=dict, max_length=16, description="input name -> SHA-256 of an uploaded blob"
    )
    params: dict[str, Any] = Field(default_factory=dict, description="settings of the kind")
    replication: int | None = Field(
        default=None, ge=1, le=16, description="replicas per shard (default: the grid's, 3)"
    )
    max_total_results: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="tasks one shard may use before it fails (default: the grid's)",
    )
    priority: int = Field(default=0, ge=-100, le=100)

    @field_validator("params")
    @classmethod
    def _storable(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Finite numbers within the store's integers, nested at most MAX_PARAMS_DEPTH."""
        problem = _unstorable(params, depth=0)
        if problem:
            raise ValueError(problem)
        return params


def _unstorable(value: Any, *, depth: int) -> str | None:
    if depth > MAX_PARAMS_DEPTH:
        return f"nested deeper than {MAX_PARAMS_DEPTH} levels"
    if isinstance(value, float) and not math.isfinite(value):
        return "numbers must be finite"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return "integers must fit in 64 bits"
    children = value.values() if isinstance(value, dict) else value
    if isinstance(value, dict | list):
        for child in children:
            problem = _unstorable(child, depth=depth + 1)
            if problem:
                return problem
    return None


class ShardOut(BaseModel):
    index: int
    state: str
    items: int
    attempts: int
    live_tasks: int
    progress: float


class JobOut(BaseModel):
    id: int
    kind: str
    state: str
    params: dict[str, Any]
    inputs: dict[str, BlobHash]
    replication: int
    priority: int
    shards_total: int
    shards_done: int
    items_total: int
    progress: float
    shard_counts: dict[str, int]
    tasks_completed: int
    max_total_results: int
    effective_replication: float | None = Field(
        description="tasks run per shard done (adaptive replication lowers it)"
    )
    waiting_for: list[str] = Field(
        default_factory=list,
        description="why the job cannot progress: no node can run it, or too few to "
        "hold its replicas (single-job view and submission only)",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="at submission: what will keep the job waiting, with the fix",
    )
    result: BlobHash | None
    result_size: int | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    shards: list[ShardOut] | None = None


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["api", "node"] = "api"
    label: str = Field(default="", max_length=100)
    account: str | None = Field(
        default=None,
        max_length=100,
        pattern=r"^[A-Za-z0-9_.@-]+$",
        description="admin only: make the token for this account (created if missing)",
    )


class TokenOut(BaseModel):
    token: str
    kind: str
    account: str
    prefix: str
    id: int


class TokenListed(BaseModel):
    id: int
    account: str
    kind: str
    prefix: str
    label: str
    created_at: float
    revoked_at: float | None


class NodeOut(BaseModel):
    id: int
    name: str
    state: str
    online: bool
    slots: int
    kinds: list[str]
    hardware: dict[str, Any]
    benchmark: dict[str, Any]
    worker_version: str
    uptime_s: float
    last_seen_at: float
    credit_total: float
    recent_average_credit: float
    suspended: bool
    # What the node's idle policy said last ("paused: user active 12 s ago"); "" when it
    # is not connected to this coordinator process.
    activity: str = ""


# -- jobs ----------------------------------------------------------------------------------


@router.post("/jobs", status_code=201, response_model=JobOut, tags=["jobs"])
async def create_job(body: JobCreate, token: Researcher, grid: GridDep) -> JobOut:
    """Submit a job over uploaded input blobs; it is split into shards at once.

    An input the caller may not read is answered 404, as a missing one is."""
    for blob_hash in body.inputs.values():
        await _readable(grid, token, blob_hash)
    try:
        get_kind(body.kind)
        job = await grid.submit_job(
            account_id=token.account_id,
            kind_name=body.kind,
            inputs=body.inputs,
            params=body.params,
            replication=body.replication,
            priority=body.priority,
            max_total_results=body.max_total_results,
        )
    except UnknownKind as exc:
        raise ApiError(422, "unknown_kind", str(exc)) from None
    except ValidationError as exc:
        raise ApiError(422, "invalid_params", _validation_message(exc)) from None
    except (InputError, JobInputError) as exc:
        raise ApiError(422, "invalid_input", str(exc)) from None
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    out = await _job_out(grid, job, with_shards=False)
    out.waiting_for = await grid.waiting_for(job)
    out.warnings = _submission_warnings(job, out.waiting_for)
    return out


def _submission_warnings(job: JobRecord, waiting_for: list[str]) -> list[str]:
    """What the fleet lacks for a job just submitted, each with what to do about it."""
    warnings = []
    for reason in waiting_for:
        if job.replication > 1 and reason.startswith(f"replication {job.replication} "):
            reason += (
                "; the job waits until enough such nodes connect. To run it on fewer, "
                "submit with replication=1 (CLI: --replication 1), or give each "
                "volunteer a node token on an account of their own"
            )
        else:
            reason += "; the job waits until such a node connects"
        warnings.append(reason)
    return warnings


@router.get("/jobs", response_model=list[JobOut], tags=["jobs"])
async def list_jobs(
    token: Researcher,
    grid: GridDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> list[JobOut]:
    """Your jobs, newest first."""
    jobs = await grid.store.list_jobs(token.account_id, limit=limit, offset=offset)
    return [await _job_out(grid, job, with_shards=False) for job in jobs]


class StreamedFile(FileResponse):
    """A file sent in 256 KiB chunks: each chunk is a read in a worker thread and a send,
    so starlette's 64 KiB made a 2 MB shard input 32 thread hops, and 256 KiB makes it 8
    (a quarter less of the coordinator's CPU a download, `benchmarks/blob_transfer.py`),
    at 192 KiB more memory a download in flight."""

    chunk_size = 256 * 1024


MAX_WAIT_S = 60.0  # the longest long poll of a job: below every proxy's idle timeout
PROGRESS_EVERY_S = 0.5  # a long poll answers progress no sooner (a job's end at once)


@router.get("/jobs/{job_id}", response_model=JobOut, tags=["jobs"])
async def get_job(
    job_id: JobId,
    token: Researcher,
    grid: GridDep,
    wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
    shards: bool = True,
) -> JobOut:
    """One job with per-shard progress (`shards=false`: without the shard list; its
    `waiting_for` is there either way).

    `wait_s` (0 to 60): a long poll. The answer comes when the job has ended, or when its
    progress (shards done, or its state) moved since the request came (at most twice a
    second), or after `wait_s` seconds, whichever is first; a client waiting for a job
    sends the next one at once.
    """
    job = await _own_job(grid, token, job_id)
    if wait_s > 0:
        job = await _changed_job(grid, token, job, wait_s)
    out = await _job_out(grid, job, with_shards=shards)
    if not shards:
        out.waiting_for = await grid.waiting_for(job)
    return out


async def _changed_job(grid: Grid, token: TokenInfo, job: JobRecord, wait_s: float) -> JobRecord:
    """`job` once it ended or moved on, or after `wait_s` seconds (its latest record).

    Its end is answered at once; progress no sooner than PROGRESS_EVERY_S after the
    request came: a job whose shards finish many times a second would otherwise cost a
    request (its token check, its record, `waiting_for`) per shard, for a progress bar
    that moves a little less often."""
    asked = time.monotonic()
    deadline = asked + wait_s
    seen = (job.state, job.shard_counts.get("done", 0))
    while job.state not in TERMINAL_JOB_STATES:
        now = time.monotonic()
        moved = (job.state, job.shard_counts.get("done", 0)) != seen
        if now >= deadline or (moved and now - asked >= PROGRESS_EVERY_S):
            break
        until = min(deadline, asked + PROGRESS_EVERY_S) if moved else deadline
        # Woken by a commit or a job end in this process; re-read now and then anyway,
        # for results another coordinator process stored.
        await grid.context.job_watch.wait(job.id, min(until - now, RECHECK_S))
        job = await _own_job(grid, token, job.id)
    return job


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, tags=["jobs"])
async def cancel_job(job_id: JobId, token: Researcher, grid: GridDep) -> JobOut:
    """Cancel a job: its queued tasks are dropped, running ones are told to stop."""
    await _own_job(grid, token, job_id)
    await grid.cancel_job(job_id)
    return await _job_out(grid, await _own_job(grid, token, job_id), with_shards=False)


@router.get(
    "/jobs/{job_id}/result",
    tags=["jobs"],
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the result"},
        **_errors(409),
    },
)
async def job_result(job_id: JobId, token: Researcher, grid: GridDep) -> Response:
    """The assembled result of a completed job (embed-text: a float32 .npy array)."""
    job = await _own_job(grid, token, job_id)
    if job.result_hash is None:
        raise ApiError(409, "not_ready", _no_result(job))
    try:
        path = grid.blobs.file(job.result_hash)
    except BlobError as exc:
        raise ApiError(404, "not_found", f"job {job_id}'s result is gone: {exc.message}") from None
    # Streamed from disk (in chunks, as the client reads), never read whole into memory.
    return StreamedFile(
        path,
        media_type=get_kind(job.kind).result_media_type,
        headers={"X-Idlegrid-Sha256": job.result_hash},
    )


@router.get("/jobs/{job_id}/metrics", tags=["jobs"], responses=_errors(409))
async def job_metrics(job_id: JobId, token: Researcher, grid: GridDep) -> dict[str, Any]:
    """Per-round metrics of a training job: losses, bytes up and down, time, nodes."""
    job = await _own_job(grid, token, job_id)
    if not grid.rounds.drives(get_kind(job.kind)):
        raise ApiError(409, "not_training", f"job {job_id} is {job.kind}, not a training job")
    return await grid.rounds.metrics(job)


def _no_result(job: JobRecord) -> str:
    state = job.state.value
    if state in ("queued", "running"):
        return f"job {job.id} is {state}; no result yet"
    reason = f": {job.error}" if job.error else ""
    return f"job {job.id} is {state}{reason}; it has no result and will not get one"


async def _own_job(grid: Grid, token: TokenInfo, job_id: int) -> JobRecord:
    job = await grid.store.get_job(job_id)
    # Another researcher's job is indistinguishable from a missing one.
    if job is None or (job.account_id != token.account_id and not token.is_admin):
        raise ApiError(404, "not_found", f"no job {job_id}")
    return job


async def _job_out(grid: Grid, job: JobRecord, *, with_shards: bool) -> JobOut:
    shard_list = None
    waiting_for: list[str] = []
    if with_shards:
        progress = _task_progress(grid)
        shard_list = [_shard_out(s, progress) for s in await grid.store.list_shards(job.id)]
        waiting_for = await grid.waiting_for(job)
    done = job.shard_counts.get("done", 0)
    return JobOut(
        id=job.id,
        kind=job.kind,
        state=job.state.value,
        params=job.params,
        inputs=job.inputs,
        replication=job.replication,
        priority=job.priority,
        shards_total=job.shards_total,
        shards_done=done,
        items_total=job.items_total,
        progress=done / job.shards_total if job.shards_total else 1.0,
        shard_counts=job.shard_counts,
        tasks_completed=job.tasks_run,
        max_total_results=job.max_attempts,
        effective_replication=round(job.tasks_run / done, 3) if done else None,
        result=job.result_hash,
        result_size=job.result_size,
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        shards=shard_list,
        waiting_for=waiting_for,
    )


job_out = _job_out  # the dashboard's job pages show the same figures


def _task_progress(grid: Grid) -> dict[int, float]:
    progress: dict[int, float] = {}
    for session in grid.hub.sessions():
        progress.update(session.progress)
    return progress


def _shard_out(shard: ShardRecord, progress: dict[int, float]) -> ShardOut:
    fraction = 1.0 if shard.state.value == "done" else 0.0
    return ShardOut(
        index=shard.index,
        state=shard.state.value,
        items=shard.items,
        attempts=shard.attempts,
        live_tasks=shard.live_tasks,
        progress=fraction if fraction else progress.get(shard.id, 0.0),
    )


# -- blobs ---------------------------------------------------------------------------------


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
    _check_length(request, grid.blobs.max_bytes)
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
    await grid.store.add_blob_owner(blob_hash, token.account_id, size=size, now=now)
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
    await _readable(grid, token, blob_hash)
    try:
        path = grid.blobs.file(blob_hash)
    except BlobError as exc:
        raise ApiError(
            exc.status, "not_found" if exc.status == 404 else "invalid_hash", exc.message
        ) from None
    if token.kind == "node" and x_idlegrid_node is not None:
        session = grid.hub.get(x_idlegrid_node)
        if session is not None and session.account_id == token.account_id:
            session.hold(blob_hash)
    # Streamed from disk as the client reads (Range requests too): memory stays flat
    # however many slow clients download at once (a chunk each).
    return StreamedFile(path, media_type="application/octet-stream")


@router.head("/blobs/{blob_hash}", tags=["blobs"])
async def head_blob(blob_hash: BlobHashPath, token: Caller, grid: GridDep) -> Response:
    """200 if the blob is stored and the caller may read it (so clients skip
    re-uploads), else 404: the same rules as GET."""
    await _readable(grid, token, blob_hash)
    if not grid.blobs.exists(blob_hash):
        raise ApiError(404, "not_found", f"no blob {blob_hash}")
    return Response(status_code=200)


async def _readable(grid: Grid, token: TokenInfo, blob_hash: str) -> None:
    """404 (as for a missing blob) unless the caller may read this blob."""
    allowed = await blob_access.may_read(
        grid.store, token, blob_hash, now=grid.clock(), grace_s=grid.settings.blob_grace_s
    )
    if not allowed:
        raise ApiError(404, "not_found", f"no blob {blob_hash}")


def _check_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", f"body of {declared} bytes is over the {limit} limit")


# -- accounts, tokens, nodes ---------------------------------------------------------------


@router.post("/tokens", status_code=201, response_model=TokenOut, tags=["accounts"])
async def create_token(body: TokenCreate, token: Researcher, grid: GridDep) -> TokenOut:
    """Make a token for your account; admins may name another account (made if new)."""
    account_id, account_name = token.account_id, token.account_name
    if body.account and body.account != token.account_name:
        if not token.is_admin:
            raise ApiError(403, "forbidden", "only admins can make tokens for other accounts")
        account = await grid.store.get_account(body.account)
        if account is None:
            try:
                account = await grid.store.create_account(
                    body.account, is_admin=False, now=grid.clock()
                )
            except AccountExists:  # made a moment ago by a concurrent request
                account = await grid.store.get_account(body.account)
                assert account is not None
        account_id, account_name = account.id, account.name
    try:
        await quotas.check_new_token(grid.store, grid.settings, account_id)
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    secret = new_token(body.kind)
    token_id = await grid.store.add_token(
        account_id,
        kind=body.kind,
        token_hash=hash_token(secret),
        prefix=display_prefix(secret),
        label=body.label,
        now=grid.clock(),
    )
    return TokenOut(
        token=secret,
        kind=body.kind,
        account=account_name,
        prefix=display_prefix(secret),
        id=token_id,
    )


@router.get("/tokens", response_model=list[TokenListed], tags=["accounts"])
async def list_tokens(
    token: Researcher,
    grid: GridDep,
    account: Annotated[str | None, Query(max_length=100)] = None,
    all_accounts: Annotated[bool, Query(alias="all")] = False,
    revoked: bool = False,
) -> list[TokenListed]:
    """Your tokens (never their secrets); admins may ask for one account or all of them."""
    account_id = await _token_scope(grid, token, account, all_accounts)
    found = await grid.store.list_tokens(account_id, include_revoked=revoked)
    return [TokenListed(**vars(record)) for record in found]


@router.delete("/tokens/{token_id}", response_model=TokenListed, tags=["accounts"])
async def revoke_token(token_id: ObjectId, token: Researcher, grid: GridDep) -> TokenListed:
    """Revoke a token of yours (admins: anyone's). A node already connected with it keeps
    its connection until it drops; it cannot connect again."""
    account_id = None if token.is_admin else token.account_id
    revoked = await grid.store.revoke_token(token_id, account_id=account_id, now=grid.clock())
    if revoked is None:
        raise ApiError(404, "not_found", f"no live token {token_id}")
    return TokenListed(**vars(revoked))


async def _token_scope(
    grid: Grid, token: TokenInfo, account: str | None, all_accounts: bool
) -> int | None:
    """Whose tokens a listing shows: the caller's, or (admins only) another's or all."""
    if not (all_accounts or account) or account == token.account_name:
        return token.account_id
    if not token.is_admin:
        raise ApiError(403, "forbidden", "only admins can list other accounts' tokens")
    if all_accounts:
        return None
    found = await grid.store.get_account(account or "")
    if found is None:
        raise ApiError(404, "not_found", f"no account {account!r}")
    return found.id


@router.get("/me", tags=["accounts"])
async def me(token: Caller, grid: GridDep) -> dict[str, Any]:
    """Who this token belongs to, with the account's credit and standing."""
    account = await grid.store.account_by_id(token.account_id)
    assert account is not None  # a valid token's account exists
    return {
        "account": token.account_name,
        "kind": token.kind,
        "admin": token.is_admin,
        **_credit_out(account.credit, grid.clock()),
        "flagged": account.flagged_at is not None,
        "flag_reason": account.flag_reason,
    }


def _credit_out(totals: CreditTotals, now: float) -> dict[str, float]:
    """Credit for validated work: all time, and the recent average per day (RAC)."""
    return {
        "credit_total": totals.total,
        "recent_average_credit": recent_average(totals, now=now),
    }


@router.get("/nodes", response_model=list[NodeOut], tags=["nodes"])
async def list_nodes(token: Researcher, grid: GridDep) -> list[NodeOut]:
    """Your nodes (all nodes for admins) with hardware, benchmark and uptime."""
    nodes = await grid.store.list_nodes(None if token.is_admin else token.account_id)
    # Connected to this process or, with several coordinators, to another one.
    connected = set(await grid.broker.connections()) | {s.node_id for s in grid.hub.sessions()}
    now = grid.clock()
    activity = {s.node_id: s.status_reason for s in grid.hub.sessions()}
    return [
        _node_out(node, online=node.id in connected, now=now, activity=activity.get(node.id, ""))
        for node in nodes
    ]


@router.get("/nodes/{node_id}/trust", tags=["nodes"])
async def node_trust(node_id: ObjectId, token: Researcher, grid: GridDep) -> list[dict[str, Any]]:
    """A node's trust per kind and backend: streak, totals, quota, credibility."""
    mine = await grid.store.list_nodes(None if token.is_admin else token.account_id)
    if node_id not in {node.id for node in mine}:
        raise ApiError(404, "not_found", f"no node {node_id}")
    return [
        {
            "kind": row.kind,
            "backend": row.backend,
            "consecutive_valid": row.trust.consecutive_valid,
            "valid": row.trust.valid_total,
            "invalid": row.trust.invalid_total,
            "errors": row.trust.error_total,
            "error_rate": round(row.trust.error_rate, 4),
            "daily_quota": row.trust.daily_quota,
            "used_today": row.quota_used_today,
            "suspended": row.trust.suspended,
            "credibility": round(trust_policy.credibility(row.trust, grid.trust), 6),
            "runs_alone": trust_policy.is_trusted(row.trust, grid.trust),
        }
        for row in await grid.store.node_trust(node_id)
    ]


def _node_out(node: NodeRecord, *, online: bool, now: float, activity: str = "") -> NodeOut:
    return NodeOut(
        id=node.id,
        name=node.name,
        state=node.state.value,
        online=online,
        slots=node.slots,
        kinds=node.kinds,
        hardware=node.hardware,
        benchmark=node.benchmark,
        worker_version=node.worker_version,
        uptime_s=node.connected_seconds,
        last_seen_at=node.last_seen_at,
        suspended=node.suspended_at is not None,
        activity=activity,
        **_credit_out(node.credit, now),
    )


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
        for err in exc.errors()[:5]
    )
