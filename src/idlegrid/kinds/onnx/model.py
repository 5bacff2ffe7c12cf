"""What an ONNX model is and whether it may go to volunteers: checked on the coordinator.

A researcher's model is data, never code, only while it stays inside the standard ONNX
operator set: a custom-domain operator would make a volunteer's ONNX Runtime look for a
shared library, and an external-data reference would make it open a file path of the
researcher's choosing. `inspect_model` refuses both, runs `onnx.checker`, applies size
limits, and describes the graph's inputs and outputs (`ModelFacts`) so the dataset can be
matched against them and the scheduler can size a shard. It needs `onnx` and numpy only:
no ONNX Runtime, no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.blobs import files as blobs
from idlegrid.kinds.base import InputError

# The standard operator domains; everything else is a custom operator.
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})
MAX_MODEL_BYTES = 256 * 2**20
MAX_NODES = 200_000
MAX_INPUTS = 32
MAX_OUTPUTS = 32
MAX_RANK = 8
# Oldest default-domain opset accepted: ONNX Runtime guarantees nothing below 7.
MIN_OPSET = 7
# Runtime overhead of one ONNX Runtime session beyond weights and activations (MiB).
SESSION_OVERHEAD_MB = 64
# Element types a dataset may feed (ONNX TensorProto names -> numpy).
DTYPES = {
    "float": "float32",
    "float16": "float16",
    "double": "float64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
}


class TensorFacts(BaseModel):
    """One graph input or output: its name, numpy dtype and shape (None: a free dim)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(max_length=200)
    dtype: str = Field(max_length=20)
    # Dims after the first (the batch dim); None where the model leaves a dim free.
    row_shape: tuple[int | None, ...] = Field(max_length=MAX_RANK)
    # The first dim when the model fixes it (1 means: one row per run); None: free.
    batch_dim: int | None = None


class ModelFacts(BaseModel):
    """What the coordinator learned from a model at submission (stored with the job)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    opset: int = Field(ge=1)
    inputs: tuple[TensorFacts, ...]
    outputs: tuple[TensorFacts, ...]
    initializer_bytes: int = Field(ge=0)
    # Bytes of all intermediate tensors per row of a batch (an upper bound on the peak).
    activation_bytes_per_row: int = Field(ge=0)
    # Multiply-accumulate work per row, times two (FLOPs), where shapes tell it.
    flops_per_row: float = Field(ge=0.0)

    def output(self, name: str) -> TensorFacts:
        return next(o for o in self.outputs if o.name == name)

    def memory_mb(self, batch_size: int) -> int:
        """Memory a shard needs: weights (ONNX Runtime may hold a second, optimised copy),
        one batch's intermediate tensors, and the session's own overhead."""
        weights = 2 * self.initializer_bytes
        activations = self.activation_bytes_per_row * batch_size
        return SESSION_OVERHEAD_MB + -(-(weights + activations) // 2**20)


FACTS_KEPT = 64  # models whose facts a coordinator keeps, most recently used


class _FactsCache:
    """The facts of models that passed, by the SHA-256 of their bytes: a researcher who
    submits job after job with one model pays for its parse, check and shape inference
    once (a 9 MB model: 25 ms against 8 ms of hashing). A model that failed is checked
    again each time (its error is what the researcher needs to see)."""

    def __init__(self, kept: int = FACTS_KEPT) -> None:
        self._kept = kept
        self._facts: OrderedDict[str, ModelFacts] = OrderedDict()
        self._lock = threading.Lock()  # submissions split in worker threads

    def get(self, digest: str) -> ModelFacts | None:
        with self._lock:
            facts = self._facts.get(digest)
            if facts is not None:
                self._facts.move_to_end(digest)
            return facts

    def put(self, digest: str, facts: ModelFacts) -> None:
        with self._lock:
            self._facts[digest] = facts
            while len(self._facts) > self._kept:
                self._facts.popitem(last=False)


_checked = _FactsCache()


def checked_facts(digest: str) -> ModelFacts | None:
    """The facts of the model with this SHA-256 if it was checked and passed lately."""
    return _checked.get(digest)


def inspect_model(data: bytes, *, digest: str | None = None) -> ModelFacts:
    """Check a model blob for volunteers and describe it; InputError naming the problem.
    `digest`: the bytes' SHA-256 where the caller knows it."""
    if len(data) > MAX_MODEL_BYTES:
        raise InputError(f"model is {len(data)} bytes, over the {MAX_MODEL_BYTES} byte limit")
    digest = digest or blobs.sha256_hex(data)
    facts = _checked.get(digest)
    if facts is None:
        facts = _inspect(data)
        _checked.put(digest, facts)
    return facts


def _inspect(data: bytes) -> ModelFacts:
    onnx = _onnx()
    model = _parse(onnx, data)
    _check_domains(model)
    _check_no_external_data(onnx, model)
    if len(model.graph.node) > MAX_NODES:
        raise InputError(f"model has {len(model.graph.node)} nodes, over the {MAX_NODES} limit")
    try:
        # The original bytes: given the parsed model, the checker would serialise it again.
        onnx.checker.check_model(data)
    except onnx.checker.ValidationError as exc:
        raise InputError(f"model fails onnx.checker: {_first_line(exc)}") from None
    opset = _default_opset(model)
    inputs = tuple(_tensor_facts(v, "input") for v in _real_inputs(model))
    outputs = tuple(_tensor_facts(v, "output") for v in model.graph.output)
    if not inputs or len(inputs) > MAX_INPUTS:
        raise InputError(f"model must have 1 to {MAX_INPUTS} inputs, has {len(inputs)}")
    if not outputs or len(outputs) > MAX_OUTPUTS:
        raise InputError(f"model must have 1 to {MAX_OUTPUTS} outputs, has {len(outputs)}")
    activations, flops = _activation_estimate(onnx, model)
    return ModelFacts(
        opset=opset,
        inputs=inputs,
        outputs=outputs,
        initializer_bytes=sum(_tensor_bytes(t) for t in model.graph.initializer),
        activation_bytes_per_row=activations,
        flops_per_row=flops,
    )


def _onnx():  # type: ignore[no-untyped-def]
    import onnx  # a core dependency, imported late: only onnx-infer submissions need it

    return onnx


def _parse(onnx, data: bytes):  # type: ignore[no-untyped-def]
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InputError(f"model is not an ONNX file: {_first_line(exc)}") from None
    if not model.HasField("graph") or not model.opset_import:
        raise InputError("model is not an ONNX file: it has no graph or no opset")
    return model


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:500] if lines else type(exc).__name__


def _check_domains(model) -> None:  # type: ignore[no-untyped-def]
    if model.functions:
        raise InputError("model-local functions are not allowed: only standard ONNX operators")
    for opset in model.opset_import:
        if opset.domain not in STANDARD_DOMAINS:
            raise InputError(
                f"custom operator domain {opset.domain!r} is not allowed: "
                "only standard ONNX operators run on volunteers"
            )
    for node in _all_nodes(model.graph):
        if node.domain not in STANDARD_DOMAINS:
            raise InputError(
                f"node {node.name or node.op_type!r} uses custom operator "
                f"{node.domain}.{node.op_type}: only standard ONNX operators are allowed"
            )


def _all_nodes(graph) -> Iterator:  # type: ignore[no-untyped-def]
    """Every node, with those of subgraphs (If, Loop, Scan bodies)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in (attribute.g, *attribute.graphs):
                if subgraph is not None and subgraph.ByteSize():
                    yield from _all_nodes(subgraph)


def _all_tensors(onnx, model) -> Iterator:  # type: ignore[no-untyped-def]
    """Every stored tensor: initializers and constants, also inside subgraphs."""
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors
                if attribute.HasField("g"):
                    graphs.append(attribute.g)
                graphs.extend(attribute.graphs)


def _check_no_external_data(onnx, model) -> None:  # type: ignore[no-untyped-def]
    for tensor in _all_tensors(onnx, model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.external_data:
            raise InputError(
                f"tensor {tensor.name!r} refers to external data (a file path): "
                "the model must carry all its weights inside the one file"
            )


def _default_opset(model) -> int:  # type: ignore[no-untyped-def]
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            if opset.version < MIN_OPSET:
                raise InputError(f"model opset {opset.version} is below {MIN_OPSET}")
            return int(opset.version)
    raise InputError("model imports no default-domain (ai.onnx) opset")


def _real_inputs(model) -> list:  # type: ignore[no-untyped-def]
    # IR >= 4 lists initializers among the inputs as overridable defaults: not data.
    stored = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in stored]


def _tensor_facts(value, role: str) -> TensorFacts:  # type: ignore[no-untyped-def]
    onnx = _onnx()
    if not value.type.HasField("tensor_type"):
        raise InputError(f"{role} {value.name!r} is not a tensor (sequences and maps are not run)")
    tensor_type = value.type.tensor_type
    element = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower()
    if element not in DTYPES:
        raise InputError(f"{role} {value.name!r} has element type {element}, not supported")
    if not tensor_type.HasField("shape") or not tensor_type.shape.dim:
        raise InputError(f"{role} {value.name!r} needs a shape with a first (batch) dimension")
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    if len(dims) > MAX_RANK:
        raise InputError(f"{role} {value.name!r} has rank {len(dims)}, over {MAX_RANK}")
    batch = dims[0]
    if role == "input" and batch not in (None, 1):
        raise InputError(
            f"input {value.name!r} fixes its first dimension to {batch}: the batch dimension "
            "must be free (or 1, one row per run)"
        )
    return TensorFacts(
        name=value.name[:200], dtype=DTYPES[element], row_shape=tuple(dims[1:]), batch_dim=batch
    )


def _tensor_bytes(tensor) -> int:  # type: ignore[no-untyped-def]
    onnx = _onnx()
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 4
    return count * itemsize


def _activation_estimate(onnx, model) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """Bytes of intermediate tensors, and FLOPs of MatMul/Gemm/Conv, per row.

    From ONNX shape inference with the batch dim taken as 1; a dim it cannot resolve
    counts as 1, so a model of unresolvable shapes is priced low, never refused.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - an estimate: a failed inference leaves it at 0
        return 0, 0.0
    shapes: dict[str, list[int]] = {}
    activation_bytes = 0
    for value in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
        tensor_type = value.type.tensor_type
        dims = [max(1, d.dim_value) for d in tensor_type.shape.dim]
        shapes[value.name] = dims
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            itemsize = 4
        activation_bytes += int(np.prod(dims, dtype=np.int64)) * itemsize
    for tensor in inferred.graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    return activation_bytes, _flops(inferred.graph.node, shapes)


def _flops(nodes: Iterable, shapes: dict[str, list[int]]) -> float:  # type: ignore[type-arg]
    total = 0.0
    for node in nodes:
        out = shapes.get(node.output[0]) if node.output else None
        if not out:
            continue
        if node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2:
            left = shapes.get(node.input[0])
            if left:
                inner = left[0] if _transposed(node, "transA") else left[-1]
                total += 2.0 * float(np.prod(out)) * inner
        elif node.op_type == "Conv" and len(node.input) >= 2:
            weight = shapes.get(node.input[1])
            if weight and len(weight) >= 2:
                total += 2.0 * float(np.prod(out)) * float(np.prod(weight[1:]))
    return total


def _transposed(node, name: str) -> bool:  # type: ignore[no-untyped-def]
    return any(a.name == name and a.i == 1 for a in node.attribute)
