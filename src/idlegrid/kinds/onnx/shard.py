"""What both sides of `onnx-infer` share: its params and the format of a shard payload.

The kind (`onnx_infer`, on the coordinator) writes payloads and reads results; the
runner (`onnx_run`, on the worker) reads payloads. Both import this module, so neither
imports the other.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import Field

from idlegrid.kinds.base import InputError, KindParams
from idlegrid.kinds.onnx.compare import Tolerance
from idlegrid.kinds.onnx.data import Preprocess
from idlegrid.kinds.onnx.model import ModelFacts
from idlegrid.training.flat import ContainerError, unpack


class OnnxInferParams(KindParams):
    shard_size: int = Field(default=256, ge=1, le=100_000, description="rows per shard")
    batch_size: int = Field(default=32, ge=1, le=4096, description="rows per model run")
    outputs: tuple[str, ...] = Field(
        default=(), max_length=32, description="model outputs to return; empty: all"
    )
    preprocess: Preprocess | None = Field(
        default=None, description="how images become the model input (image datasets only)"
    )
    tolerances: dict[str, Tolerance] = Field(
        default_factory=dict, max_length=32, description="per output; unnamed outputs: defaults"
    )
    providers: tuple[str, ...] = Field(
        default=(), max_length=8, description="execution providers allowed; empty: any"
    )
    optimization: Literal["disable", "basic", "extended", "all"] = "all"
    # Filled in by the coordinator from the model at submission (whatever was sent).
    model_facts: ModelFacts | None = None


def model_facts(params: OnnxInferParams) -> ModelFacts:
    """The model's facts the coordinator filled in at submission."""
    if params.model_facts is None:
        raise InputError("the job has no model facts (it was not submitted through split)")
    return params.model_facts


def requested_outputs(facts: ModelFacts, params: OnnxInferParams) -> list[str]:
    """Names of the outputs a shard returns: those asked for, else all of the model's."""
    return list(params.outputs) or [o.name for o in facts.outputs]


def parse_payload(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A shard payload's arrays and header (model hash, start, rows, image names)."""
    try:
        arrays, header = unpack(payload)
    except ContainerError as exc:
        raise InputError(f"shard payload: {exc}") from None
    _check_header(header)
    return arrays, header


def payload_header(payload: bytes) -> dict[str, Any]:
    """A shard payload's header alone (its arrays are not read)."""
    from idlegrid.training.flat import read_metadata

    try:
        header = json.loads(read_metadata(payload).get("idlegrid", "{}"))
    except (ContainerError, ValueError) as exc:
        raise InputError(f"shard payload: {exc}") from None
    _check_header(header)
    return dict(header)


def _check_header(header: Any) -> None:
    if not (
        isinstance(header, dict)
        and isinstance(header.get("model"), str)
        and isinstance(header.get("start"), int)
        and isinstance(header.get("rows"), int)
    ):
        raise InputError("shard payload header needs model, start and rows")
