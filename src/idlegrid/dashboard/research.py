"""A researcher's pages: submitting jobs and following them; their files are uploads.py's."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError

from idlegrid.coordinator.api.views import job_out
from idlegrid.coordinator.grid import JobInputError
from idlegrid.coordinator.quota_checks import QuotaExceeded
from idlegrid.dashboard import form_fields, forms, generation, model_folders
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    Researcher,
    grid_of,
    page_bounds,
    redirect,
    render,
    researcher,
    signed_in,
    store_of,
)
from idlegrid.dashboard.uploads import router as files_router
from idlegrid.kinds import InputError, get_kind
from idlegrid.store import uploads, web
from idlegrid.store.base import JobRecord
from idlegrid.store.web import WebSession

router = APIRouter(prefix="/research")
router.include_router(files_router)
RESULT_SUFFIXES = {"application/x-npy": ".npy", "application/x-ndjson": ".jsonl"}
TERMINAL = ("completed", "failed", "cancelled")


# -- jobs ----------------------------------------------------------------------------------


@router.get("/jobs", response_class=HTMLResponse)
async def jobs_page(
    request: Request, session: Researcher, page: Annotated[int, Query(ge=1, le=10_000)] = 1
) -> Response:
    limit, offset = page_bounds(page, 50)
    jobs = await store_of(request).web.web_read(
        web.job_list, session.account.id, limit=limit + 1, offset=offset
    )
    return await render(
        request, "jobs.html", jobs=jobs[:limit], page=page, has_next=len(jobs) > limit
    )


@router.get("/jobs/new", response_class=HTMLResponse)
async def new_job_page(
    request: Request,
    session: Researcher,
    kind: Literal[
        "embed-text", "diloco-train", "hf-causal-lm", "onnx-infer", "llm-generate"
    ] = "embed-text",
) -> Response:
    return await _new_job(request, session, kind, error=None, values={})


async def _new_job(
    request: Request,
    session: WebSession,
    kind: str,
    *,
    error: str | None,
    values: dict[str, Any],
    status: int = 200,
    field_errors: dict[str, str] | None = None,
) -> HTMLResponse:
    files = await store_of(request).web.web_read(uploads.list_uploads, session.account.id)
    return await render(
        request,
        "job_new.html",
        status=status,
        kind=kind,
        files=files,
        error=error,
        values=values,
        field_errors=field_errors or {},
        default_replication=grid_of(request).settings.default_replication,
    )


@forms.again(r"/research/jobs/new/(embed-text|diloco-train|onnx-infer|llm-generate)")
async def _job_form_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    session = await researcher(await signed_in(request))
    kind = request.url.path.rsplit("/", 1)[1]
    return await _new_job(
        request, session, kind, error=line, values=typed, status=422, field_errors=errors
    )


@router.post("/jobs/new/embed-text", response_class=HTMLResponse, dependencies=[Csrf])
async def submit_embed(
    request: Request,
    session: Researcher,
    texts: Annotated[int, Form()],
    shard_size: Annotated[int, Form(ge=1, le=10_000)] = 256,
    replication: Annotated[int, Form(ge=0, le=16)] = 0,
    priority: Annotated[int, Form(ge=-100, le=100)] = 0,
) -> Response:
    values = {"texts": texts, "shard_size": shard_size, "replication": replication}
    upload = await _own_file(request, session, texts)
    if upload is None:
        error = "Choose one of your uploaded JSONL files."
        return await _new_job(
            request, session, "embed-text", error=error, values=values, status=422
        )
    return await _submit(
        request,
        session,
        "embed-text",
        inputs={"texts": upload},
        params={"shard_size": shard_size},
        replication=replication or None,
        priority=priority,
        values=values,
    )


@router.post("/jobs/new/diloco-train", response_class=HTMLResponse, dependencies=[Csrf])
async def submit_diloco(
    request: Request,
    session: Researcher,
    dataset: Annotated[str, Form(max_length=20)],
    architecture: Annotated[Literal["transformer-lm", "mlp", "cnn"], Form()],
    rounds: Annotated[int, Form(ge=1, le=10_000)] = 10,
    workers: Annotated[int, Form(ge=1, le=1000)] = 4,
    inner_steps: Annotated[int, Form(ge=1, le=100_000)] = 50,
    batch_size: Annotated[int, Form(ge=1, le=4096)] = 16,
    inner_lr: Annotated[float, Form(gt=0, le=1)] = 1e-3,
    outer_lr: Annotated[float, Form(gt=0, le=10)] = 0.7,
    compression: Annotated[Literal["int8", "int4", "sign", "topk", "none"], Form()] = "int8",
    priority: Annotated[int, Form(ge=-100, le=100)] = 0,
) -> Response:
    values = {"dataset": dataset, "architecture": architecture, "rounds": rounds}
    if dataset == "corpus":
        builtin = get_kind("diloco-train").builtin_inputs()
        assert builtin is not None  # diloco-train ships its character corpus
        blob = grid_of(request).blobs.put(builtin["dataset"])
    else:
        found = (
            await _own_file(request, session, int(dataset))
            if dataset.isdigit() and len(dataset) < 10
            else None
        )
        if found is None:
            error = "Choose the built-in corpus or one of your uploaded datasets."
            return await _new_job(
                request, session, "diloco-train", error=error, values=values, status=422
            )
        blob = found
    params = {
        "architecture": architecture,
        "rounds": rounds,
        "workers": workers,
        "inner": {"steps": inner_steps, "batch_size": batch_size, "lr": inner_lr},
        "outer": {"lr": outer_lr},
        "upload": {"method": compression},
        "download": {"method": compression},
    }
    return await _submit(
        request,
        session,
        "diloco-train",
        inputs={"dataset": blob},
        params=params,
        replication=None,
        priority=priority,
        values=values,
    )


def _onnx_params(values: dict[str, Any]) -> dict[str, Any]:
    """The onnx-infer params of the form's values; `ValueError` for bad preprocessing."""
    params: dict[str, Any] = {
        "shard_size": values["shard_size"],
        "batch_size": values["batch_size"],
        "outputs": [name.strip() for name in values["outputs"].split(",") if name.strip()],
    }
    if values["crop"].strip():
        params["preprocess"] = form_fields.preprocess(
            *(values[k] for k in ("crop", "resize", "color", "layout", "scale", "mean", "std"))
        )
    return params


@router.post("/jobs/new/onnx-infer", response_class=HTMLResponse, dependencies=[Csrf])
async def submit_onnx(
    request: Request,
    session: Researcher,
    model: Annotated[int, Form()],
    data: Annotated[int, Form()],
    shard_size: Annotated[int, Form(ge=1, le=100_000)] = 256,
    batch_size: Annotated[int, Form(ge=1, le=4096)] = 32,
    outputs: Annotated[str, Form(max_length=2000)] = "",
    crop: Annotated[str, Form(max_length=40)] = "",
    resize: Annotated[str, Form(max_length=10)] = "",
    color: Annotated[Literal["RGB", "L"], Form()] = "RGB",
    layout: Annotated[Literal["NCHW", "NHWC"], Form()] = "NCHW",
    scale: Annotated[Literal["1/255", "1"], Form()] = "1/255",
    mean: Annotated[str, Form(max_length=200)] = "",
    std: Annotated[str, Form(max_length=200)] = "",
    replication: Annotated[int, Form(ge=0, le=16)] = 0,
    priority: Annotated[int, Form(ge=-100, le=100)] = 0,
) -> Response:
    """An ONNX model over uploaded arrays, or over an archive of images with the
    preprocessing given (crop filled in)."""
    values: dict[str, Any] = {
        "model": model, "data": data, "shard_size": shard_size, "batch_size": batch_size,
        "outputs": outputs, "crop": crop, "resize": resize, "color": color, "layout": layout,
        "scale": scale, "mean": mean, "std": std, "replication": replication,
    }  # fmt: skip
    model_blob = await _own_file(request, session, model)
    data_blob = await _own_file(request, session, data)
    error = None
    if model_blob is None:
        error = "Choose one of your uploaded ONNX models."
    elif data_blob is None:
        error = "Choose one of your uploaded model inputs (arrays or an image archive)."
    else:
        try:
            params = _onnx_params(values)
        except ValueError as exc:
            error = f"Image preprocessing: {exc}"
        else:
            return await _submit(
                request,
                session,
                "onnx-infer",
                inputs={"model": model_blob, "data": data_blob},
                params=params,
                replication=replication or None,
                priority=priority,
                values=values,
            )
    return await _new_job(request, session, "onnx-infer", error=error, values=values, status=422)


@router.post("/jobs/new/llm-generate", response_class=HTMLResponse, dependencies=[Csrf])
async def submit_generate(
    request: Request,
    session: Researcher,
    model: Annotated[int, Form()],
    prompts: Annotated[int, Form()],
    max_tokens: Annotated[int, Form(ge=1, le=100_000)] = 128,
    temperature: Annotated[float, Form(ge=0, le=100)] = 0.0,
    top_p: Annotated[float, Form(gt=0, le=1)] = 1.0,
    top_k: Annotated[int, Form(ge=0, le=100_000)] = 0,
    stop: Annotated[str, Form(max_length=1000)] = "",
    seed: Annotated[int, Form(ge=0)] = 0,
    priority: Annotated[int, Form(ge=-100, le=100)] = 0,
) -> Response:
    """A GGUF model over uploaded prompts; the kind checks the model and says what is wrong."""
    values = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "stop": stop}
    model_blob = await _own_file(request, session, model)
    prompts_blob = await _own_file(request, session, prompts)
    if model_blob is None or prompts_blob is None:
        error = "Choose one of your uploaded GGUF models and one of your prompt files."
        return await _new_job(
            request, session, "llm-generate", error=error, values=values, status=422
        )
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
    params["top_p"] = top_p
    params |= {"top_k": top_k, "stop": form_fields.stop_strings(stop), "seed": seed}
    return await _submit(
        request,
        session,
        "llm-generate",
        inputs={"model": model_blob, "prompts": prompts_blob},
        params=params,
        replication=None,
        priority=priority,
        values=values,
    )


async def _own_file(request: Request, session: WebSession, upload_id: int) -> str | None:
    upload = await store_of(request).web.web_read(uploads.get_upload, upload_id, session.account.id)
    return upload.blob_hash if upload is not None and upload.state == "done" else None


async def _submit(
    request: Request,
    session: WebSession,
    kind: str,
    *,
    inputs: dict[str, str],
    params: dict[str, Any],
    replication: int | None,
    priority: int,
    values: dict[str, Any],
) -> Response:
    grid = grid_of(request)
    try:
        job = await grid.submit_job(
            account_id=session.account.id,
            kind_name=kind,
            inputs=inputs,
            params=params,
            replication=replication,
            priority=priority,
        )
    except ValidationError as exc:
        error = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
    except (InputError, JobInputError) as exc:
        error = str(exc)
    except QuotaExceeded as exc:
        error = exc.message
    else:
        return redirect(request, f"/research/jobs/{job.id}", flash=f"Job {job.id} submitted.")
    return await _new_job(request, session, kind, error=error, values=values, status=422)


async def own_job(request: Request, session: WebSession, job_id: int) -> JobRecord:
    job = await grid_of(request).store.jobs.get_job(job_id)
    # Another researcher's job is indistinguishable from a missing one.
    if job is None or (job.account_id != session.account.id and not session.account.is_admin):
        raise PageError(404, f"There is no job {job_id}.")
    return job


async def _job_context(request: Request, job: JobRecord) -> dict[str, Any]:
    grid = grid_of(request)
    view = await job_out(grid, job, with_shards=True)
    return {
        "job": view,
        "training": await grid.training_metrics(job),
        "generation": await generation.summary(grid, job),
        "own_model": model_folders.describe(job),
        "live": view.state not in TERMINAL,
    }


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(request: Request, job_id: Id, session: Researcher) -> Response:
    job = await own_job(request, session, job_id)
    return await render(request, "job.html", **await _job_context(request, job))


@router.get("/jobs/{job_id}/progress", response_class=HTMLResponse)
async def job_progress(request: Request, job_id: Id, session: Researcher) -> Response:
    """The live part of the job page, polled every two seconds while the job runs.

    The poll that finds the job ended reloads the whole page (htmx's HX-Refresh): its
    header loses the cancel button and the submission's banner with it."""
    job = await own_job(request, session, job_id)
    context = await _job_context(request, job)
    response = await render(request, "_job_progress.html", **context)
    if not context["live"] and request.headers.get("hx-request") == "true":
        response.headers["HX-Refresh"] = "true"
    return response


@router.post("/jobs/{job_id}/cancel", dependencies=[Csrf])
async def cancel_job(request: Request, job_id: Id, session: Researcher) -> Response:
    job = await own_job(request, session, job_id)
    if job.state.value not in TERMINAL:
        await grid_of(request).cancel_job(job_id)
    return redirect(request, f"/research/jobs/{job_id}", flash=f"Job {job_id} is cancelled.")


@router.get("/jobs/{job_id}/result")
async def job_result(request: Request, job_id: Id, session: Researcher) -> Response:
    job = await own_job(request, session, job_id)
    if job.result_hash is None:
        raise PageError(409, f"Job {job_id} is {job.state.value}; it has no result yet.")
    kind = get_kind(job.kind)
    suffix = RESULT_SUFFIXES.get(kind.result_media_type, ".safetensors")
    path = grid_of(request).blobs.path(job.result_hash)
    return Response(
        await asyncio.to_thread(path.read_bytes),
        media_type=kind.result_media_type,
        headers={
            "Content-Disposition": f'attachment; filename="job-{job_id}-result{suffix}"',
            "X-Idlegrid-Sha256": job.result_hash,
        },
    )
