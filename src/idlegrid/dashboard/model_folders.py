"""A researcher's model as the dashboard takes it and gives it back: folder zips, GGUF.

A model arrives as an uploaded file, either a zip of its Hugging Face folder
(`config.json`, `model.safetensors`, `tokenizer.json`) or a GGUF file, which `idlegrid
model import-gguf` turns into that folder in a child process (the coordinator itself
never imports torch or transformers). A training text arrives as UTF-8 text or as token
ids (safetensors). A finished job's model goes back as a zip of its folder, LoRA
adapters merged in, which `AutoModelForCausalLM.from_pretrained` loads once unpacked.
"""

from __future__ import annotations

import asyncio
import io
import os
import struct
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from idlegrid.store.base import JobRecord
from idlegrid.training import hf_folder, hf_models

KIND = "hf-causal-lm"  # the architecture, and the form's name among the job kinds
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", *hf_folder.SIDE_FILES)
IMPORT_TIMEOUT_S = 900.0


class FormProblem(ValueError):
    """What is wrong with a chosen file, in words for the form."""


def read_folder_zip(data: bytes) -> hf_folder.HFModel:
    """The model of a zip of its folder (the files at its top, or in one folder there)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise FormProblem("The model file is not a zip of a model folder.") from None
    with archive, tempfile.TemporaryDirectory(prefix="idlegrid-model-") as scratch:
        members = {Path(info.filename).name: info for info in archive.infolist()
                   if Path(info.filename).name in FOLDER_FILES and not info.is_dir()}  # fmt: skip
        if "config.json" not in members:
            raise FormProblem("The zip has no config.json: zip the model's folder as "
                              "transformers saved it.")  # fmt: skip
        if sum(info.file_size for info in members.values()) > 8 * len(data) + 2**20:
            raise FormProblem("The zip unpacks to far more than its size: refused.")
        for name, info in members.items():
            Path(scratch, name).write_bytes(archive.read(info))
        try:
            return hf_folder.read_folder(Path(scratch))
        except hf_folder.ModelError as exc:
            raise FormProblem(f"The model folder: {str(exc).replace(scratch, 'the zip')}") from None


async def import_gguf(path: Path) -> hf_folder.HFModel:
    """A GGUF file's folder, made by `idlegrid model import-gguf` in a child process."""
    with tempfile.TemporaryDirectory(prefix="idlegrid-gguf-") as scratch:
        source = Path(scratch, "model.gguf")
        os.symlink(path, source)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idlegrid", "model", "import-gguf", str(source),
            str(Path(scratch, "folder")),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            output, _ = await asyncio.wait_for(child.communicate(), IMPORT_TIMEOUT_S)
        except TimeoutError:
            child.kill()
            await child.wait()
            raise FormProblem("Reading the GGUF file took too long.") from None
        if child.returncode != 0:
            said = output.decode(errors="replace").strip().splitlines()
            raise FormProblem(f"The GGUF file could not be imported: {said[-1] if said else ''}"
                              " (the coordinator needs transformers and gguf for GGUF; or run "
                              "`idlegrid model import-gguf` yourself and upload the folder "
                              "as a zip)")  # fmt: skip
        return await asyncio.to_thread(hf_folder.read_folder, Path(scratch, "folder"))


def dataset_blob(data: bytes) -> bytes:
    """The `dataset` input of an uploaded file: safetensors as it is, else UTF-8 text."""
    if _is_safetensors(data):
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormProblem(f"The dataset is neither safetensors nor UTF-8 text ({exc}).") from None
    return hf_folder.text_dataset_blob(text)


def _is_safetensors(data: bytes) -> bool:
    if len(data) < 10:
        return False
    (size,) = struct.unpack("<Q", data[:8])
    return 8 + size <= len(data) and data[8:9] == b"{"


# -- the trained folder --------------------------------------------------------------------


def offers_folder(job: JobRecord) -> bool:
    """Whether a job's result is a researcher's model, downloadable as its folder."""
    return (
        job.kind == "diloco-train"
        and job.params.get("architecture") == KIND
        and "model" in job.inputs
        and job.result_hash is not None
    )


def folder_zip(base_path: Path, result_path: Path, lora: dict[str, Any] | None) -> Path:
    """A temporary zip of the trained folder: the base's config, tokenizer and side files
    with the result's weights (or the base with the result's adapters merged in); or the
    PEFT adapter folder, when the job asked for one."""
    from safetensors.numpy import load

    base = hf_folder.read_model_blob(base_path.read_bytes(), max_parameters=2**40)
    named = load(result_path.read_bytes())
    settings = None if lora is None else hf_models.LoraSettings.model_validate(lora)
    handle, name = tempfile.mkstemp(prefix="idlegrid-model-", suffix=".zip")
    os.close(handle)
    with tempfile.TemporaryDirectory(prefix="idlegrid-folder-") as scratch:
        hf_folder.write_result(Path(scratch), base, named, settings)
        with zipfile.ZipFile(name, "w", zipfile.ZIP_STORED) as archive:
            for file in sorted(Path(scratch).iterdir()):
                archive.write(file, file.name)
    return Path(name)


def describe(job: JobRecord) -> dict[str, Any] | None:
    """What the job page says of a researcher's model: its type, size and LoRA rank."""
    if job.params.get("architecture") != KIND:
        return None
    settings = job.params.get("model") or {}
    config = settings.get("config") or {}
    lora = settings.get("lora")
    return {
        "model_type": config.get("model_type", "?"),
        "parameters": hf_models.parameter_count(config) if config else None,
        "lora_rank": None if lora is None else lora.get("rank"),
        "folder": offers_folder(job),
    }
