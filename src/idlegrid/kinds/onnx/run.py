"""One onnx-infer shard on the worker: fetch the model, pick the provider, run the batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from idlegrid.devtools import faults
from idlegrid.kinds.base import Cancelled, InputError, RunContext
from idlegrid.kinds.onnx import data as onnx_data
from idlegrid.kinds.onnx.runtime import (
    SessionKey,
    Sessions,
    available_providers,
    choose_providers,
    runtime_version,
)
from idlegrid.kinds.onnx.shard import (
    OnnxInferParams,
    model_facts,
    parse_payload,
    requested_outputs,
)
from idlegrid.training.flat import pack


class ProviderUnavailable(RuntimeError):
    """This node's ONNX Runtime has none of the providers the job allows."""


def run_shard(
    payload: bytes, params: OnnxInferParams, ctx: RunContext, sessions: Sessions
) -> bytes:
    """The output bytes of one shard: requested outputs, rows in payload order."""
    arrays, header = parse_payload(payload)
    facts = model_facts(params)
    providers = choose_providers(available_providers(), params.providers)
    if not providers:
        raise ProviderUnavailable(
            f"no execution provider of {list(params.providers) or 'any'} on this node"
        )
    fetch = ctx.fetch
    if fetch is None:
        raise RuntimeError("onnx-infer needs the worker's blob fetch for its model")
    key = SessionKey(header["model"], tuple(providers), ctx.threads, params.optimization)
    # The fetch checks the model's SHA-256 against the name the payload gives.
    session = sessions.get(key, lambda: fetch(header["model"]))
    names = requested_outputs(facts, params)
    rows = header["rows"]
    batch = 1 if any(spec.batch_dim == 1 for spec in facts.inputs) else params.batch_size
    feed_of = (
        _image_feed(arrays, header, params, facts) if "names" in header else _array_feed(arrays)
    )
    pieces: list[list[np.ndarray]] = [[] for _ in names]
    for start in range(0, rows, batch):
        if ctx.is_cancelled():
            raise Cancelled()
        if start:  # a provider that breaks after its first batch (tests: faults.failure)
            faults.failure(
                f"onnx-after-first-batch-threads-{ctx.threads}",
                RuntimeError("CUDA failure 700: an illegal memory access (fault point)"),
            )
        results = session.run(names, feed_of(start, min(start + batch, rows)))
        for piece, result in zip(pieces, results, strict=True):
            piece.append(np.asarray(result))
        ctx.report_progress(min(start + batch, rows) / rows)
    outputs = {name: np.concatenate(piece) for name, piece in zip(names, pieces, strict=True)}
    meta = {"provider": session.get_providers()[0], "onnxruntime": runtime_version()}
    return pack(outputs, {**meta, "rows": rows, "start": header["start"]})


def _array_feed(arrays: dict[str, np.ndarray]) -> Any:
    def feed(start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: array[start:stop] for name, array in arrays.items()}

    return feed


def _image_feed(
    arrays: dict[str, np.ndarray], header: dict[str, Any], params: OnnxInferParams, facts: Any
) -> Any:
    spec = params.preprocess
    if spec is None:
        raise InputError("an image shard needs params.preprocess")
    blobs = onnx_data.unpack_images(arrays)
    names = header["names"]
    if len(blobs) != header["rows"] or len(names) != header["rows"]:
        raise InputError("image shard rows do not match its header")
    target = facts.inputs[0]

    def feed(start: int, stop: int) -> dict[str, np.ndarray]:
        images = onnx_data.Images(names=names[start:stop], blobs=blobs[start:stop])
        return {target.name: onnx_data.decode_batch(images, spec, target.dtype)}

    return feed
