"""What the job page shows of a generation job (llm-generate): the model, the settings,
how its shards were checked, and the first completions once it is done."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from idlegrid.coordinator.grid import Grid
from idlegrid.store.base import JobRecord

KIND = "llm-generate"
PREVIEW = 5  # completions shown on the page
PREVIEW_BYTES = 256 * 1024  # of the result read for them


async def summary(grid: Grid, job: JobRecord) -> dict[str, Any] | None:
    """The generation block of the job page; None for a job of another kind."""
    if job.kind != KIND:
        return None
    params = job.params
    facts = params.get("model_facts") or {}
    preview: list[dict[str, Any]] = []
    if job.result_hash is not None:
        preview = await asyncio.to_thread(_preview, grid, job.result_hash)
    return {
        "model": facts.get("name") or facts.get("architecture", "?"),
        "architecture": facts.get("architecture", "?"),
        "quantization": facts.get("quantization", "?"),
        "parameters": facts.get("parameters", 0),
        "context": params.get("n_ctx", 0),
        "max_tokens": params.get("max_tokens"),
        "temperature": params.get("temperature"),
        "checked": job.replication > 1,
        "preview": preview,
    }


def _preview(grid: Grid, result_hash: str) -> list[dict[str, Any]]:
    with grid.blobs.path(result_hash).open("rb") as file:
        head = file.read(PREVIEW_BYTES)
    found = []
    for line in head.splitlines()[:PREVIEW]:
        try:
            record = json.loads(line)
        except ValueError:
            break  # a line cut by the read
        found.append(
            {
                "index": record["index"],
                "text": record["text"][:500],
                "tokens": len(record["tokens"]),
                "finish": record["finish_reason"],
            }
        )
    return found
