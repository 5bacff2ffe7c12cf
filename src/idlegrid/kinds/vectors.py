"""The `vectors` kind: cheap float work with embed-text's shape, for verification tests.

Each item is a float32 unit vector computed by a small fixed random network from the
item's index, so honest nodes compute real floating-point arithmetic (whose results can
differ in the last bits between machines) and the verifier's fuzzy comparison is
exercised exactly as with embed-text, at a thousandth of the cost. The adversarial
simulation (benchmarks/adversarial.py) runs on it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import Field

from idlegrid.kinds.base import (
    InputError,
    KindParams,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
    WrongOutput,
)
from idlegrid.kinds.lies import degenerate

DIM = 32
HIDDEN = 64
# Same threshold as embed-text: honest float32 results agree far closer than this.
COSINE_AGREE = 1.0 - 1e-10


class VectorsParams(KindParams):
    items: int = Field(default=1000, ge=1, le=10_000_000, description="vectors to compute")
    shard_size: int = Field(default=10, ge=1, le=100_000, description="vectors per shard")
    seed: int = Field(default=0, ge=0, description="seed of the fixed network")


class VectorsKind(TaskKind):
    name = "vectors"
    params_model = VectorsParams
    input_names = ()
    result_media_type = "application/x-npy"

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, VectorsParams)
        shards = []
        for index, start in enumerate(range(0, params.items, params.shard_size)):
            count = min(params.shard_size, params.items - start)
            payload = json.dumps({"start": start, "count": count}).encode()
            shards.append(
                ShardSpec(
                    index=index,
                    payload=payload,
                    items=count,
                    cost_flops=2.0 * count * (DIM * HIDDEN * 2),
                )
            )
        return shards

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        assert isinstance(params, VectorsParams)
        spec = json.loads(payload)
        out = compute(spec["start"], spec["count"], params.seed)
        ctx.report_progress(1.0)
        return to_npy(out)

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        rows = json.loads(payload)["count"]
        vectors = parse(output)
        if vectors.shape != (rows, DIM):
            raise InputError(f"expected {rows} vectors of {DIM}, got shape {vectors.shape}")
        problem = degenerate(vectors)
        if problem:
            raise WrongOutput(problem)

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        try:
            first, second = parse(a), parse(b)
        except InputError:
            return Verdict.DISAGREE
        if first.shape != second.shape:
            return Verdict.DISAGREE
        f64, s64 = first.astype(np.float64), second.astype(np.float64)
        norms = np.linalg.norm(f64, axis=1) * np.linalg.norm(s64, axis=1)
        dots = np.einsum("ij,ij->i", f64, s64)
        cosine = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
        return Verdict.AGREE if bool(np.all(cosine >= COSINE_AGREE)) else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        return to_npy(np.concatenate([parse(o) for o in outputs]))


def compute(start: int, count: int, seed: int) -> np.ndarray:
    """The honest output for items start .. start+count-1."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((DIM, HIDDEN)).astype(np.float32) / np.sqrt(DIM)
    w2 = rng.standard_normal((HIDDEN, DIM)).astype(np.float32) / np.sqrt(HIDDEN)
    index = np.arange(start + 1, start + count + 1, dtype=np.float32)[:, None]
    x = np.sin(index * np.arange(1, DIM + 1, dtype=np.float32) * 0.01)
    y = np.tanh(x @ w1) @ w2
    return (y / np.linalg.norm(y, axis=1, keepdims=True)).astype(np.float32)


def to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buffer.getvalue()


def parse(output: bytes) -> np.ndarray:
    if not output.startswith(b"\x93NUMPY"):
        raise InputError("output is not a .npy array")  # .npz and pickles are never opened
    try:
        array = np.load(io.BytesIO(output), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(f"output is not a .npy array: {exc}") from None
    if array.dtype != np.float32 or array.ndim != 2:
        raise InputError("output must be a 2-D float32 array")
    return array
