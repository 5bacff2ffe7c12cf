"""A researcher's own model on the dashboard: the job form, and the trained folder back.

The form takes an uploaded model (a zip of its Hugging Face folder, or a GGUF file) and
an uploaded text; the job is a diloco-train job of architecture `hf-causal-lm`. The job
page links the trained model as a zip of its folder (`model_folders`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.background import BackgroundTask

from idlegrid.blobs.files import BlobError
from idlegrid.dashboard import forms
from idlegrid.dashboard.model_folders import (
    KIND,
    FormProblem,
    dataset_blob,
    folder_zip,
    import_gguf,
    offers_folder,
    read_folder_zip,
)
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    Researcher,
    dashboard_of,
    grid_of,
    researcher,
    signed_in,
    store_of,
)
from idlegrid.dashboard.research import _new_job, _submit, own_job
from idlegrid.store import uploads
from idlegrid.store.web import WebSession
from idlegrid.training import hf_folder

router = APIRouter(prefix="/research")

# -- the form ------------------------------------------------------------------------------


@router.post("/jobs/new/hf-causal-lm", response_class=HTMLResponse, dependencies=[Csrf])
async def submit_model_training(
    request: Request,
    session: Researcher,
    model: Annotated[int, Form()],
    dataset: Annotated[int, Form()],
    lora_rank: Annotated[int, Form(ge=0, le=1024)] = 0,
    rounds: Annotated[int, Form(ge=1, le=10_000)] = 10,
    workers: Annotated[int, Form(ge=1, le=1000)] = 4,
    inner_steps: Annotated[int, Form(ge=1, le=100_000)] = 100,
    batch_size: Annotated[int, Form(ge=1, le=4096)] = 8,
    micro_batch_size: Annotated[int, Form(ge=0, le=4096)] = 0,
    seq_len: Annotated[int, Form(ge=1, le=4096)] = 256,
    inner_lr: Annotated[float, Form(gt=0, le=1)] = 1e-4,
    outer_lr: Annotated[float, Form(gt=0, le=10)] = 0.7,
    compression: Annotated[Literal["int8", "int4", "none"], Form()] = "int8",
    checkpointing: Annotated[bool, Form()] = False,
    priority: Annotated[int, Form(ge=-100, le=100)] = 0,
) -> Response:
    """A diloco-train job of an uploaded model (folder zip or GGUF) on an uploaded text."""
    values = {"model": model, "dataset": dataset, "lora_rank": lora_rank, "rounds": rounds,
              "workers": workers, "inner_steps": inner_steps, "batch_size": batch_size,
              "micro_batch_size": micro_batch_size, "seq_len": seq_len, "inner_lr": inner_lr,
              "outer_lr": outer_lr, "compression": compression, "priority": priority}  # fmt: skip
    try:
        model_upload = await _upload(request, session, model, ("model-folder", "gguf-model"))
        data_upload = await _upload(request, session, dataset, ("dataset",))
        built = await _model_of(request, model_upload)
        model_hash = await _store(request, session, hf_folder.model_blob(built))
        data = await asyncio.to_thread(_path(request, data_upload).read_bytes)
        data_hash = await _store(request, session, dataset_blob(data))
    except FormProblem as exc:
        return await _new_job(request, session, KIND, error=str(exc), values=values, status=422)
    settings: dict[str, Any] = {"gradient_checkpointing": checkpointing}
    if lora_rank:
        settings["lora"] = {"rank": lora_rank, "targets": _lora_targets(built.config)}
    inner: dict[str, Any] = {"steps": inner_steps, "batch_size": batch_size,
                             "seq_len": seq_len, "lr": inner_lr}  # fmt: skip
    if micro_batch_size:
        inner["micro_batch_size"] = micro_batch_size
    params = {"architecture": KIND, "model": settings, "rounds": rounds, "workers": workers,
              "inner": inner, "outer": {"lr": outer_lr}, "upload": {"method": compression},
              "download": {"method": compression}}  # fmt: skip
    return await _submit(
        request, session, "diloco-train", inputs={"model": model_hash, "dataset": data_hash},
        params=params, replication=None, priority=priority, values=values,
    )  # fmt: skip


@forms.again(r"/research/jobs/new/hf-causal-lm")
async def _form_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    session = await researcher(await signed_in(request))
    return await _new_job(
        request, session, KIND, error=line, values=typed, status=422, field_errors=errors
    )


def _lora_targets(config: dict[str, Any]) -> list[str]:
    """The attention projections a LoRA adapts by default: query and value (GPT-2's fused)."""
    return ["c_attn"] if config.get("model_type") == "gpt2" else ["q_proj", "v_proj"]


async def _upload(
    request: Request, session: WebSession, upload_id: int, purposes: tuple[str, ...]
) -> uploads.Upload:
    found = await store_of(request).web.web_read(uploads.get_upload, upload_id, session.account.id)
    if found is None or found.state != "done" or found.purpose not in purposes:
        wanted = " or ".join(p.replace("-", " ") for p in purposes)
        raise FormProblem(f"Choose one of your uploaded files of the kind {wanted}.")
    return found


async def _store(request: Request, session: WebSession, data: bytes) -> str:
    """Put a blob made from the researcher's files; it is theirs, like the files. It is
    bounded as those are, by the account's upload quota (not by max_blob_bytes: a model
    of several hundred MB is one blob)."""
    grid = grid_of(request)
    quota = dashboard_of(request).settings.web_upload_quota_bytes
    if len(data) > quota:
        raise FormProblem(
            f"The model is {len(data):,} bytes, over the upload quota of {quota:,} bytes "
            "(web_upload_quota_bytes): ask the operator to raise it."
        )
    try:
        blob_hash = await asyncio.to_thread(grid.blobs.keep, data)
    except (BlobError, OSError) as exc:
        raise FormProblem(f"The model could not be stored: {exc}") from None
    await grid.store.blob_owners.add_blob_owner(
        blob_hash, session.account.id, size=len(data), now=grid.clock()
    )
    return blob_hash


async def _model_of(request: Request, upload: uploads.Upload) -> hf_folder.HFModel:
    path = _path(request, upload)
    if upload.purpose == "gguf-model":
        return await import_gguf(path)
    return await asyncio.to_thread(read_folder_zip, path.read_bytes())


def _path(request: Request, upload: uploads.Upload) -> Path:
    assert upload.blob_hash is not None
    return grid_of(request).blobs.path(upload.blob_hash)


# -- the trained folder --------------------------------------------------------------------


@router.get("/jobs/{job_id}/model.zip")
async def download_folder(request: Request, job_id: Id, session: Researcher) -> Response:
    """The trained model as a zip of its Hugging Face folder."""
    job = await own_job(request, session, job_id)
    if not offers_folder(job):
        raise PageError(409, f"Job {job_id} has no trained model to download (yet).")
    blobs = grid_of(request).blobs
    assert job.result_hash is not None
    base_path, result_path = blobs.path(job.inputs["model"]), blobs.path(job.result_hash)
    lora = (job.params.get("model") or {}).get("lora")
    archive = await asyncio.to_thread(folder_zip, base_path, result_path, lora)
    return FileResponse(
        archive, media_type="application/zip", filename=f"job-{job_id}-model.zip",
        background=BackgroundTask(archive.unlink, missing_ok=True),
    )  # fmt: skip
