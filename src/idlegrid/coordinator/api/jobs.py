"""/v1/jobs: submit, list, follow (long poll), cancel, and fetch results and metrics."""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

from fastapi import Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from idlegrid.blobs.files import BlobError
from idlegrid.coordinator.api.blobs import readable
from idlegrid.coordinator.api.common import (
    ApiError,
    BlobHash,
    GridDep,
    JobId,
    Researcher,
    StreamedFile,
    errors_of,
    router,
    validation_message,
)
from idlegrid.coordinator.api.views import JobOut, estimate_out, job_out
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.intake import JobInputError
from idlegrid.coordinator.jobwatch import RECHECK_S
from idlegrid.coordinator.quota_checks import QuotaExceeded
from idlegrid.kinds import InputError, UnknownKind, get_kind
from idlegrid.protocol import MAX_ID
from idlegrid.states import TERMINAL_JOB_STATES
from idlegrid.store.base import (
    JobRecord,
    TokenInfo,
)

# Nesting of job params: deeper is refused before it is stored.
MAX_PARAMS_DEPTH = 32


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


@router.post("/jobs", status_code=201, response_model=JobOut, tags=["jobs"])
async def create_job(body: JobCreate, token: Researcher, grid: GridDep) -> JobOut:
    """Submit a job over uploaded input blobs; it is split into shards at once.

    An input the caller may not read is answered 404, as a missing one is."""
    for blob_hash in body.inputs.values():
        await readable(grid, token, blob_hash)
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
        raise ApiError(422, "invalid_params", validation_message(exc)) from None
    except (InputError, JobInputError) as exc:
        raise ApiError(422, "invalid_input", str(exc)) from None
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    out = await job_out(grid, job, with_shards=False)
    out.waiting_for = await grid.waiting_for(job)
    out.warnings = grid.submission_notes(job.id) + _submission_warnings(job, out.waiting_for)
    out.estimate = estimate_out(await grid.estimate(job))
    return out


def _submission_warnings(job: JobRecord, waiting_for: list[str]) -> list[str]:
    """What the fleet lacks for a job just submitted, each with what to do about it."""
    warnings = []
    for reason in waiting_for:
        if not reason.startswith(f"replication {job.replication} "):  # it names its fixes
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
    jobs = await grid.store.jobs.list_jobs(token.account_id, limit=limit, offset=offset)
    return [await job_out(grid, job, with_shards=False) for job in jobs]


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
    job = await own_job(grid, token, job_id)
    if wait_s > 0:
        job = await _changed_job(grid, token, job, wait_s)
    out = await job_out(grid, job, with_shards=shards)
    if not shards:
        out.waiting_for = await grid.waiting_for(job)
        out.doubts = await grid.doubts(job)
    else:  # it reads every shard: with the shard list, not in a progress bar's long polls
        out.estimate = estimate_out(await grid.estimate(job))
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
        await grid.wait_for_job(job.id, min(until - now, RECHECK_S))
        job = await own_job(grid, token, job.id)
    return job


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, tags=["jobs"])
async def cancel_job(job_id: JobId, token: Researcher, grid: GridDep) -> JobOut:
    """Cancel a job: its queued tasks are dropped, running ones are told to stop."""
    await own_job(grid, token, job_id)
    await grid.cancel_job(job_id)
    return await job_out(grid, await own_job(grid, token, job_id), with_shards=False)


@router.post(
    "/jobs/{job_id}/resubmit",
    status_code=201,
    response_model=JobOut,
    tags=["jobs"],
    responses=errors_of(422),
)
async def resubmit_job(job_id: JobId, token: Researcher, grid: GridDep) -> JobOut:
    """Submit again only the shards of a failed (or cancelled) job that did not complete:
    a new job of those shards, as they were split, with the same kind, params and
    replication. Its result holds those shards' rows, in their order."""
    job = await own_job(grid, token, job_id)
    try:
        new = await grid.resubmit_job(job)
    except JobInputError as exc:
        raise ApiError(422, "invalid_input", str(exc)) from None
    except QuotaExceeded as exc:
        raise ApiError(exc.status, "quota_exceeded", exc.message) from None
    return await job_out(grid, new, with_shards=False)


@router.get(
    "/jobs/{job_id}/result",
    tags=["jobs"],
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the result"},
        **errors_of(409),
    },
)
async def job_result(job_id: JobId, token: Researcher, grid: GridDep) -> Response:
    """The assembled result of a completed job (embed-text: a float32 .npy array)."""
    job = await own_job(grid, token, job_id)
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


@router.get("/jobs/{job_id}/metrics", tags=["jobs"], responses=errors_of(409))
async def job_metrics(job_id: JobId, token: Researcher, grid: GridDep) -> dict[str, Any]:
    """Per-round metrics of a training job: losses, bytes up and down, time, nodes."""
    job = await own_job(grid, token, job_id)
    metrics = await grid.training_metrics(job)
    if metrics is None:
        raise ApiError(409, "not_training", f"job {job_id} is {job.kind}, not a training job")
    return metrics


def _no_result(job: JobRecord) -> str:
    state = job.state.value
    if state in ("queued", "running"):
        return f"job {job.id} is {state}; no result yet"
    reason = f": {job.error}" if job.error else ""
    return f"job {job.id} is {state}{reason}; it has no result and will not get one"


async def own_job(grid: Grid, token: TokenInfo, job_id: int) -> JobRecord:
    job = await grid.store.jobs.get_job(job_id)
    # Another researcher's job is indistinguishable from a missing one.
    if job is None or (job.account_id != token.account_id and not token.is_admin):
        raise ApiError(404, "not_found", f"no job {job_id}")
    return job
