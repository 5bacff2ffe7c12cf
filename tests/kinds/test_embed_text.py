"""The embed-text kind: input parsing, sharding, output checks, comparison, assembly, run."""

from __future__ import annotations

import copy
import io
import json
import threading

import numpy as np
import pytest
from pydantic import ValidationError

from idlegrid.kinds import get_kind
from idlegrid.kinds.base import Cancelled, InputError, RunContext, ShardSpec, Verdict, WrongOutput
from idlegrid.kinds.embed_text.kind import (
    COSINE_AGREE,
    EMBEDDING_DIM,
    MODEL_PARAMETERS,
    EmbedTextKind,
    EmbedTextParams,
    _low_precision,
    embed_reference,
    embeddings_to_npy,
    estimate_tokens,
    load_model,
    parse_embeddings,
    row_cosines,
    texts_to_jsonl,
)

KIND = EmbedTextKind()
DEFAULT = EmbedTextParams()


def _input_order(payload: bytes) -> list[str]:
    """A one-shard job's texts, back in input order (shards sort them by length)."""
    spec = json.loads(payload)
    return [text for _, text in sorted(zip(spec["ids"], spec["texts"], strict=True))]


def _split(texts: list[str], **params: object) -> list[ShardSpec]:
    return KIND.split({"texts": texts_to_jsonl(texts)}, EmbedTextParams.model_validate(params))


def _unit_rows(rows: int, seed: int = 0) -> np.ndarray:
    matrix = np.random.default_rng(seed).standard_normal((rows, EMBEDDING_DIM))
    return (matrix / np.linalg.norm(matrix, axis=1, keepdims=True)).astype(np.float32)


def _payload(texts: list[str]) -> bytes:
    return json.dumps({"offset": 0, "texts": texts}).encode()


# -- split -------------------------------------------------------------------------------


def test_kind_is_registered() -> None:
    assert isinstance(get_kind("embed-text"), EmbedTextKind)
    assert KIND.input_names == ("texts",)
    assert KIND.result_media_type == "application/x-npy"


def test_split_makes_ordered_shards_of_shard_size() -> None:
    texts = [f"text number {i}" for i in range(10)]
    shards = _split(texts, shard_size=3)
    assert [shard.index for shard in shards] == [0, 1, 2, 3]
    assert [shard.items for shard in shards] == [3, 3, 3, 1]
    payloads = [json.loads(shard.payload) for shard in shards]
    # Longest first (ties in input order), each text once, with its input position.
    ids = [i for payload in payloads for i in payload["ids"]]
    assert sorted(ids) == list(range(10))
    assert [len(texts[i]) for i in ids] == sorted((len(t) for t in texts), reverse=True)
    assert [t for payload in payloads for t in payload["texts"]] == [texts[i] for i in ids]


def test_assemble_with_inputs_restores_input_order() -> None:
    texts = ["a", "bbbbbbbb", "cc", "dddd", "e"]
    shards = _split(texts, shard_size=2)
    outputs = []
    for shard in shards:
        ids = json.loads(shard.payload)["ids"]
        rows = np.zeros((len(ids), 384), dtype=np.float32)
        rows[:, 0] = ids  # each row remembers its text's position
        outputs.append(embeddings_to_npy(rows))
    whole = parse_embeddings(
        KIND.assemble_with_inputs([s.payload for s in shards], outputs, DEFAULT)
    )
    assert whole[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_cost_is_two_flops_per_parameter_per_estimated_token() -> None:
    short, long = "x" * 40, "y" * 10_000
    assert estimate_tokens(short) == 12
    assert estimate_tokens(long) == 256
    (shard,) = _split([short, long])
    assert shard.cost_flops == pytest.approx(2 * MODEL_PARAMETERS * (12 + 256))


def test_split_accepts_strings_objects_blank_lines_crlf_and_bom() -> None:
    blob = '\ufeff"first"\r\n\n   \n{"text": "second", "id": 7}\r\n"third"'.encode()
    (shard,) = KIND.split({"texts": blob}, DEFAULT)
    assert _input_order(shard.payload) == ["first", "second", "third"]


def test_texts_to_jsonl_round_trips_awkward_text() -> None:
    texts = ["plain", "line\nbreak", "para\u2028separator", "ünïcödé 日本", " x "]
    (shard,) = KIND.split({"texts": texts_to_jsonl(texts)}, DEFAULT)
    assert _input_order(shard.payload) == texts


def test_texts_to_jsonl_refuses_non_strings() -> None:
    with pytest.raises(TypeError):
        texts_to_jsonl(["fine", 3])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (
            b'"a"\n"b"\n"c"\n"d"\n"e"\n"f"\n{broken\n',
            "line 7: not valid JSON: Expecting property name enclosed in double quotes column "
            '2; write each line as a JSON string ("a text") or an object {"text": "..."}',
        ),
        (b'"a"\n\n42\n', "line 3: expected a string or an object with a 'text' string"),
        (b'{"body": "x"}\n', "line 1: expected a string or an object with a 'text' string"),
        (b'"ok"\n{"text": 5}\n', "line 2: expected a string or an object with a 'text' string"),
        (b'"ok"\n["a list"]\n', "line 2: expected a string or an object with a 'text' string"),
        (b'"\\ud800"\n', "line 1: text contains an unpaired surrogate"),
        (b'"ok"\n{"text": ""}\n', "line 2: the text is empty"),
        (b'"   "\n', "line 1: the text is empty"),
    ],
)
def test_split_names_the_line_at_fault(blob: bytes, message: str) -> None:
    with pytest.raises(InputError) as caught:
        KIND.split({"texts": blob}, DEFAULT)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("blob", [b"", b"\n\n  \n", b"\r\n"])
def test_split_refuses_input_without_texts(blob: bytes) -> None:
    with pytest.raises(InputError, match="no texts in input"):
        KIND.split({"texts": blob}, DEFAULT)


def test_split_refuses_non_utf8_and_missing_input() -> None:
    with pytest.raises(InputError, match="not UTF-8"):
        KIND.split({"texts": b'"caf\xe9"\n'}, DEFAULT)
    with pytest.raises(InputError, match="missing input 'texts'"):
        KIND.split({}, DEFAULT)


@pytest.mark.parametrize(
    "raw", [{"shard_size": 0}, {"shard_size": 10_001}, {"batch_size": 1025}, {"extra": 1}]
)
def test_params_are_validated(raw: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        KIND.parse_params(raw)


# -- check_output, compare, assemble (no model) ------------------------------------------


def test_check_output_accepts_a_well_formed_output() -> None:
    KIND.check_output(_payload(["a", "b", "c"]), embeddings_to_npy(_unit_rows(3)), DEFAULT)


def _pickled_object_array() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    return buffer.getvalue()


def _npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, embeddings=_unit_rows(2))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (embeddings_to_npy(_unit_rows(3)), "3 embeddings for 2 texts"),
        (embeddings_to_npy(_unit_rows(2)[:, :100]), "shape"),
        (embeddings_to_npy(_unit_rows(2).astype(np.float64)), "float32"),
        (embeddings_to_npy(_unit_rows(2).astype(np.float16)), "float32"),
        (embeddings_to_npy(np.full((2, EMBEDDING_DIM), np.nan, np.float32)), "NaN"),
        (embeddings_to_npy(_unit_rows(2) * 2), "not normalized"),
        (b"certainly not numpy", "not a .npy"),
        (embeddings_to_npy(_unit_rows(2))[:100], "not a readable"),
        (_pickled_object_array(), "not a readable"),
        (_npz(), "not a .npy"),
    ],
)
def test_check_output_refuses_bad_outputs(output: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message):
        KIND.check_output(_payload(["a", "b"]), output, DEFAULT)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (embeddings_to_npy(np.full((2, EMBEDDING_DIM), np.nan, np.float32)), "NaN"),
        (embeddings_to_npy(np.zeros((2, EMBEDDING_DIM), np.float32)), "zeros"),
        (embeddings_to_npy(np.full((2, EMBEDDING_DIM), 384**-0.5, np.float32)), "one value"),
        (embeddings_to_npy(np.vstack([_unit_rows(1), np.zeros((1, 384), np.float32)])), "zeros"),
    ],
)
def test_check_output_calls_nan_zeros_and_constants_lies(output: bytes, message: str) -> None:
    # Well formed, but no honest run returns them: judged as wrong results, not errors.
    with pytest.raises(WrongOutput, match=message):
        KIND.check_output(_payload(["a", "b"]), output, DEFAULT)
    with pytest.raises(WrongOutput, match=message):
        KIND.check_output(_payload(["a", "b"]), output, EmbedTextParams(normalize=False))


def test_check_output_allows_any_length_without_normalize() -> None:
    output = embeddings_to_npy(_unit_rows(2) * 3)
    KIND.check_output(_payload(["a", "b"]), output, EmbedTextParams(normalize=False))


def test_compare_on_synthetic_outputs() -> None:
    rows = _unit_rows(4)
    same = embeddings_to_npy(rows)
    assert KIND.compare(same, same, DEFAULT) is Verdict.AGREE
    assert KIND.compare(same, embeddings_to_npy(rows[:3]), DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(same, b"garbage", DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(b"garbage", b"garbage", DEFAULT) is Verdict.DISAGREE
    zeros = embeddings_to_npy(np.zeros_like(rows))
    assert KIND.compare(zeros, zeros, DEFAULT) is Verdict.DISAGREE
    one_row_off = rows.copy()
    one_row_off[2] = _unit_rows(1, seed=9)[0]
    assert KIND.compare(same, embeddings_to_npy(one_row_off), DEFAULT) is Verdict.DISAGREE


def test_assemble_concatenates_in_shard_order() -> None:
    shapes = [(2, 1.0), (3, 2.0), (1, 3.0)]
    parts = [np.full((rows, EMBEDDING_DIM), value, np.float32) for rows, value in shapes]
    result = parse_embeddings(KIND.assemble([embeddings_to_npy(p) for p in parts], DEFAULT))
    assert result.shape == (6, EMBEDDING_DIM)
    assert result[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 3.0]
    empty = parse_embeddings(KIND.assemble([], DEFAULT))
    assert empty.shape == (0, EMBEDDING_DIM)


def test_assemble_refuses_a_bad_output() -> None:
    with pytest.raises(InputError):
        KIND.assemble([embeddings_to_npy(_unit_rows(1)), b"bad"], DEFAULT)


# -- run (loads the model once, ~6 s on 2 cores) -----------------------------------------

TEXTS = [
    f"Sentence {i}: volunteers lend idle {noun} to embed text for researchers."
    for i, noun in enumerate(["laptops", "GPUs", "desktops", "servers", "consoles"] * 5)
] + ["A cat sat on the mat.", "Quantum chromodynamics describes the strong force."]
OTHER_TEXTS = [f"An unrelated note about baking bread, number {i}." for i in range(len(TEXTS))]


def _run(texts: list[str], **params: object) -> bytes:
    """One shard of `texts`, run and assembled: rows in input order."""
    chosen = EmbedTextParams.model_validate(params)
    (shard,) = KIND.split({"texts": texts_to_jsonl(texts)}, chosen)
    output = KIND.run(shard.payload, chosen, RunContext())
    return KIND.assemble_with_inputs([shard.payload], [output], chosen)


@pytest.fixture(scope="module")
def batched_64() -> bytes:
    return _run(TEXTS, batch_size=64)


@pytest.mark.slow
def test_run_returns_checked_unit_embeddings_like_the_reference(batched_64: bytes) -> None:
    KIND.check_output(_payload(TEXTS), batched_64, DEFAULT)
    embeddings = parse_embeddings(batched_64)
    assert embeddings.shape == (len(TEXTS), EMBEDDING_DIM)
    reference = embed_reference(TEXTS)
    assert row_cosines(embeddings, reference).min() > 0.99999


@pytest.mark.slow
def test_compare_agrees_across_batch_sizes(batched_64: bytes) -> None:
    batched_5 = _run(TEXTS, batch_size=5)
    assert KIND.compare(batched_64, batched_5, DEFAULT) is Verdict.AGREE


@pytest.mark.slow
def test_compare_disagrees_with_other_texts(batched_64: bytes) -> None:
    other = _run(OTHER_TEXTS)
    assert KIND.compare(batched_64, other, DEFAULT) is Verdict.DISAGREE


@pytest.mark.slow
def test_compare_and_noise(batched_64: bytes) -> None:
    embeddings = parse_embeddings(batched_64)
    rng = np.random.default_rng(0)

    def noisy(scale: float) -> bytes:
        noise = rng.standard_normal(embeddings.shape).astype(np.float32) * scale
        return embeddings_to_npy(embeddings + noise)

    def relative(scale: float) -> bytes:
        noise = rng.standard_normal(embeddings.shape) * scale
        out = embeddings * (1 + noise)
        return embeddings_to_npy(
            (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)
        )

    # Measured (benchmarks/calibrate_embed.py): honest runs differ by 1 - cos <= 3.5e-13;
    # sigma 1e-7 per component moves cosines by ~2e-12, inside 1 - COSINE_AGREE = 1e-10;
    # sigma 3e-6 by ~2e-9, noise of 1e-4 relative to each value by ~7e-9.
    assert KIND.compare(batched_64, noisy(1e-7), DEFAULT) is Verdict.AGREE
    assert KIND.compare(batched_64, noisy(3e-6), DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(batched_64, relative(1e-4), DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(batched_64, relative(1e-3), DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(batched_64, noisy(3e-3), DEFAULT) is Verdict.DISAGREE


@pytest.mark.slow
def test_float16_arithmetic_disagrees(batched_64: bytes) -> None:
    # Computed in float16, then normalized in float64 and stored as float32: the values
    # have low mantissa bits (no structural tell); the cosine (~1e-6 off) catches it.
    half = copy.deepcopy(load_model("cpu")).half()  # the shared model stays float32
    raw = np.asarray(half.encode(TEXTS, batch_size=64, normalize_embeddings=False), np.float64)
    out = (raw / np.linalg.norm(raw, axis=1, keepdims=True)).astype(np.float32)
    assert not _low_precision(out)
    assert KIND.compare(batched_64, embeddings_to_npy(out), DEFAULT) is Verdict.DISAGREE


@pytest.mark.slow
def test_low_precision_output_disagrees(batched_64: bytes) -> None:
    embeddings = parse_embeddings(batched_64)
    half = embeddings.astype(np.float16).astype(np.float32)
    bf16 = (embeddings.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    # Half-precision rounding moves cosines by ~3e-8: the cosine catches it, and so does
    # the structural check (every value exactly a 16-bit float), whatever the threshold.
    assert row_cosines(embeddings, half).min() < COSINE_AGREE
    assert _low_precision(half) and _low_precision(bf16) and not _low_precision(embeddings)
    assert KIND.compare(batched_64, embeddings_to_npy(half), DEFAULT) is Verdict.DISAGREE
    assert KIND.compare(batched_64, embeddings_to_npy(bf16), DEFAULT) is Verdict.DISAGREE
    # Two low-precision results of the same computation still agree with each other.
    assert KIND.compare(embeddings_to_npy(half), embeddings_to_npy(half), DEFAULT) is Verdict.AGREE


@pytest.mark.slow
def test_run_without_normalize_returns_raw_lengths() -> None:
    raw = _run(TEXTS[:3], normalize=False)
    KIND.check_output(_payload(TEXTS[:3]), raw, EmbedTextParams(normalize=False))
    norms = np.linalg.norm(parse_embeddings(raw), axis=1)
    assert np.all(np.abs(norms - 1.0) > 0.01)


@pytest.mark.slow
def test_run_reports_progress_per_batch() -> None:
    params = EmbedTextParams(batch_size=4)
    (shard,) = KIND.split({"texts": texts_to_jsonl(TEXTS[:10])}, params)
    progress: list[float] = []
    KIND.run(shard.payload, params, RunContext(report_progress=progress.append))
    assert progress == pytest.approx([0.4, 0.8, 1.0])


@pytest.mark.slow
def test_run_stops_between_batches_when_cancelled() -> None:
    params = EmbedTextParams(batch_size=4)
    (shard,) = KIND.split({"texts": texts_to_jsonl(TEXTS[:10])}, params)
    progress: list[float] = []
    context = RunContext(report_progress=progress.append, is_cancelled=lambda: bool(progress))
    with pytest.raises(Cancelled):
        KIND.run(shard.payload, params, context)
    assert progress == [0.4]


@pytest.mark.slow
def test_concurrent_runs_in_threads_match_sequential(batched_64: bytes) -> None:
    outputs: dict[int, bytes] = {}

    def work(slot: int) -> None:
        outputs[slot] = _run(TEXTS, batch_size=8)

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outputs) == [0, 1, 2]
    for output in outputs.values():
        assert KIND.compare(output, batched_64, DEFAULT) is Verdict.AGREE


@pytest.mark.slow
def test_split_run_assemble_matches_the_reference() -> None:
    params = EmbedTextParams(shard_size=10, batch_size=16)
    shards = KIND.split({"texts": texts_to_jsonl(TEXTS)}, params)
    outputs = [KIND.run(shard.payload, params, RunContext()) for shard in shards]
    for shard, output in zip(shards, outputs, strict=True):
        KIND.check_output(shard.payload, output, params)
    payloads = [shard.payload for shard in shards]
    assembled = parse_embeddings(KIND.assemble_with_inputs(payloads, outputs, params))
    assert row_cosines(assembled, embed_reference(TEXTS)).min() > 0.99999
