"""The `onnx-infer` kind: a researcher's ONNX model over a dataset, on any node's hardware.

Inputs: `model` (an ONNX file: checked on the coordinator by `onnx_model.inspect_model`
before any volunteer sees it) and `data` (arrays or images: `onnx_data`). Rows are cut
into contiguous shards; a shard's payload is a safetensors file of its rows (or of its
encoded images) that names the model blob, which the worker fetches through its cache.
The worker runs ONNX Runtime on the best execution provider it has (`onnx_runtime`) and
returns a safetensors file of the requested outputs that records the provider. Results of
one shard are compared output by output (`onnx_compare`); `assemble` puts rows back in
input order. The job's result is a safetensors file, one array per output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from idlegrid.kinds.base import (
    InputError,
    KindParams,
    Requirements,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
    required_input,
    required_input_hash,
)
from idlegrid.kinds.onnx import data as onnx_data
from idlegrid.kinds.onnx.compare import compare_outputs
from idlegrid.kinds.onnx.model import ModelFacts, TensorFacts, checked_facts, inspect_model
from idlegrid.kinds.onnx.runtime import PREFERENCE, Sessions
from idlegrid.kinds.onnx.shard import (
    OnnxInferParams,
    model_facts,
    payload_header,
    requested_outputs,
)
from idlegrid.training.flat import ContainerError, pack, unpack

_sessions = Sessions()


class OnnxInferKind(TaskKind):
    """Run an ONNX model over named arrays or images, shard by shard."""

    name = "onnx-infer"
    uses_gpu = True
    params_model = OnnxInferParams
    input_names = ("model", "data")
    result_media_type = "application/x-safetensors"

    def derive_params(self, inputs: Mapping[str, bytes], params: KindParams) -> KindParams:
        assert isinstance(params, OnnxInferParams)
        digest = required_input_hash(inputs, "model")
        # A model checked lately is not read again (the store's copy is the same bytes).
        facts = checked_facts(digest) or inspect_model(
            required_input(inputs, "model"), digest=digest
        )
        return params.model_copy(update={"model_facts": facts})

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, OnnxInferParams)
        # The grid calls derive_params just before, which checked the model and replaced
        # whatever model_facts a researcher sent; checking it twice would double the cost.
        facts = params.model_facts or inspect_model(required_input(inputs, "model"))
        _check_params(facts, params)
        data = required_input(inputs, "data")
        header = {"model": required_input_hash(inputs, "model")}
        if onnx_data.kind_of(data) in ("zip", "tar"):
            return _image_shards(data, facts, params, header)
        return _array_shards(data, facts, params, header)

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, OnnxInferParams)
        providers = frozenset(params.providers or PREFERENCE)
        facts = params.model_facts
        if facts is None:
            return Requirements(onnx_providers=providers)
        return Requirements(
            min_memory_mb=facts.memory_mb(params.batch_size),
            onnx_providers=providers,
            min_onnx_opset=facts.opset,
        )

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        assert isinstance(params, OnnxInferParams)
        from idlegrid.kinds.onnx import run as onnx_run

        return onnx_run.run_shard(payload, params, ctx, _sessions)

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        assert isinstance(params, OnnxInferParams)
        header = payload_header(payload)
        arrays, meta = parse_output(output)
        facts = model_facts(params)
        wanted = requested_outputs(facts, params)
        if sorted(arrays) != sorted(wanted):
            raise InputError(f"output has arrays {sorted(arrays)}, expected {sorted(wanted)}")
        for name in wanted:
            _check_output_array(name, arrays[name], facts.output(name), header["rows"])
        if meta.get("provider") not in PREFERENCE:
            raise InputError(f"output names no known execution provider: {meta.get('provider')}")

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        assert isinstance(params, OnnxInferParams)
        try:
            (first, _), (second, _) = parse_output(a), parse_output(b)
        except InputError:
            return Verdict.DISAGREE
        return compare_outputs(first, second, params.tolerances)

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        raise InputError("onnx-infer assembles with its shard payloads")

    def assemble_with_inputs(
        self, payloads: Sequence[bytes], outputs: Sequence[bytes], params: KindParams
    ) -> bytes:
        assert isinstance(params, OnnxInferParams)
        headers = [payload_header(p) for p in payloads]
        parsed = [parse_output(o) for o in outputs]
        expected = 0
        for header in headers:
            if header["start"] != expected:
                raise InputError("shards do not cover the dataset's rows in order")
            expected += header["rows"]
        names = requested_outputs(model_facts(params), params)
        result = {name: np.concatenate([arrays[name] for arrays, _ in parsed]) for name in names}
        providers: dict[str, int] = {}
        for _, meta in parsed:
            providers[meta["provider"]] = providers.get(meta["provider"], 0) + 1
        summary: dict[str, Any] = {"rows": expected, "providers": providers}
        image_names = [n for header in headers for n in header.get("names", [])]
        if image_names:
            summary["names"] = image_names
        return pack(result, summary)


# -- submission checks -------------------------------------------------------------------


def _check_params(facts: ModelFacts, params: OnnxInferParams) -> None:
    known = {o.name for o in facts.outputs}
    for name in (*params.outputs, *params.tolerances):
        if name not in known:
            raise InputError(f"the model has no output {name!r}; it has {sorted(known)}")
    if len(set(params.outputs)) != len(params.outputs):
        raise InputError("outputs names an output twice")
    unknown = [p for p in params.providers if p not in PREFERENCE]
    if unknown:
        raise InputError(f"unknown execution providers {unknown}; known: {list(PREFERENCE)}")


def _array_shards(
    data: bytes, facts: ModelFacts, params: OnnxInferParams, header: dict[str, Any]
) -> list[ShardSpec]:
    if params.preprocess is not None:
        raise InputError("preprocess applies to image datasets (a zip or tar of images) only")
    single = facts.inputs[0].name if len(facts.inputs) == 1 else None
    arrays = onnx_data.load_arrays(data, single)
    rows = _match_arrays(arrays, facts.inputs)
    shards = []
    for index, start in enumerate(range(0, rows, params.shard_size)):
        count = min(params.shard_size, rows - start)
        part = {name: array[start : start + count] for name, array in arrays.items()}
        shards.append(_shard(index, part, {**header, "start": start, "rows": count}, facts))
    return shards


def _match_arrays(arrays: Mapping[str, np.ndarray], inputs: Sequence[TensorFacts]) -> int:
    """Rows of a dataset whose arrays are exactly the model's inputs; InputError if not."""
    wanted = {spec.name for spec in inputs}
    if set(arrays) != wanted:
        raise InputError(
            f"dataset arrays {sorted(arrays)} do not match the model inputs {sorted(wanted)}"
        )
    counts = set()
    for spec in inputs:
        array = arrays[spec.name]
        if array.dtype != np.dtype(spec.dtype):
            raise InputError(f"input {spec.name!r} is {array.dtype}, the model takes {spec.dtype}")
        _check_row_shape(f"input {spec.name!r}", array.shape, spec.row_shape)
        counts.add(array.shape[0])
    if len(counts) != 1:
        raise InputError(f"dataset arrays have different row counts: {sorted(counts)}")
    rows = counts.pop()
    if rows == 0:
        raise InputError("the dataset has no rows")
    return int(rows)


def _check_row_shape(what: str, shape: tuple[int, ...], row_shape: tuple[int | None, ...]) -> None:
    if len(shape) != len(row_shape) + 1:
        raise InputError(f"{what} has shape {shape}; the model wants (rows, {_dims(row_shape)})")
    for got, want in zip(shape[1:], row_shape, strict=True):
        if want is not None and got != want:
            raise InputError(
                f"{what} has shape {shape}; the model wants (rows, {_dims(row_shape)})"
            )


def _dims(row_shape: tuple[int | None, ...]) -> str:
    return ", ".join("?" if d is None else str(d) for d in row_shape)


def _image_shards(
    data: bytes, facts: ModelFacts, params: OnnxInferParams, header: dict[str, Any]
) -> list[ShardSpec]:
    spec = params.preprocess
    if spec is None:
        raise InputError("an image dataset needs params.preprocess (crop, mean, std, layout)")
    if len(facts.inputs) != 1:
        raise InputError(f"an image dataset feeds a model of one input; it has {len(facts.inputs)}")
    target = facts.inputs[0]
    if target.dtype not in ("float32", "float16"):
        raise InputError(f"input {target.name!r} is {target.dtype}: images need a float input")
    _check_row_shape(
        f"preprocess ({spec.layout}, crop {spec.crop})", (1, *spec.row_shape()), target.row_shape
    )
    images = onnx_data.load_images(data)
    for name, blob in zip(images.names, images.blobs, strict=True):
        onnx_data.decode(name, blob, spec, target.dtype)  # every broken file named now
    shards = []
    for index, start in enumerate(range(0, len(images.names), params.shard_size)):
        stop = min(start + params.shard_size, len(images.names))
        part = onnx_data.pack_images(images.blobs[start:stop])
        shard_header = {**header, "start": start, "rows": stop - start}
        shard_header["names"] = images.names[start:stop]
        shards.append(_shard(index, part, shard_header, facts))
    return shards


def _shard(
    index: int, arrays: dict[str, np.ndarray], header: dict[str, Any], facts: ModelFacts
) -> ShardSpec:
    rows = header["rows"]
    flops = facts.flops_per_row or 2.0 * facts.initializer_bytes / 4
    return ShardSpec(
        index=index, payload=pack(arrays, header), items=rows, cost_flops=rows * max(flops, 1.0)
    )


# -- payloads and outputs ----------------------------------------------------------------


def parse_output(output: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A shard output's arrays (by output name) and header (provider, runtime version)."""
    try:
        arrays, header = unpack(output)
    except ContainerError as exc:
        raise InputError(f"output: {exc}") from None
    if not isinstance(header.get("provider"), str):
        raise InputError("output header names no execution provider")
    return arrays, header


def _check_output_array(name: str, array: np.ndarray, spec: TensorFacts, rows: int) -> None:
    if array.dtype != np.dtype(spec.dtype):
        raise InputError(f"output {name!r} is {array.dtype}, the model makes {spec.dtype}")
    if array.ndim != len(spec.row_shape) + 1 or array.shape[0] != rows:
        raise InputError(f"output {name!r} has shape {array.shape} for {rows} rows")
    for got, want in zip(array.shape[1:], spec.row_shape, strict=True):
        if want is not None and got != want:
            raise InputError(f"output {name!r} has shape {array.shape}")
