"""A shard's prompts decoded together (batched.py) on the real SmolLM2 GGUF: the same
tokens and log-probabilities as one prompt after another, bit for bit, through
continuous batching, slot moves and shared-prefix copies; the check passes them exactly;
a prompt that cannot run fails alone; a context too large for memory is retried smaller."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from llm_model import model_path

from idlegrid.kinds import get_kind
from idlegrid.kinds.base import RunContext
from idlegrid.kinds.llm_generate import batched, generate, worker
from idlegrid.kinds.llm_generate.check import EXACT, check_shard
from idlegrid.kinds.llm_generate.shard import Output, read_output, read_payload, write_payload

KIND = get_kind("llm-generate")
# Over MIN_SHARED tokens: the prompts that start with it copy its KV stream.
SYSTEM = "You are a terse assistant. Answer in one short sentence, plainly, without lists. " * 3


def _prompts() -> list[dict[str, Any]]:
    questions = ["Name a color.", "Count to three.", "What is ice?", "Say hi.", "Name a fruit."]
    shared = [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        for q in questions
    ]
    return [
        *shared,
        {"prompt": "The capital of France is"},
        {"prompt": "1, 2, 3, 4,", "seed": 11},
        {"messages": [{"role": "user", "content": "Write a word."}]},
    ]


@pytest.fixture(scope="module")
def model() -> bytes:
    return model_path().read_bytes()


def context(model: bytes, tmp_path: Path, *, sequences: int = 4) -> RunContext:
    blobs = {hashlib.sha256(model).hexdigest(): model}
    return RunContext(
        threads=1, fetch=blobs.__getitem__, scratch=tmp_path / "s" / "t", sequences=sequences
    )


def shard(model: bytes, records: list[dict[str, Any]], **raw: Any) -> tuple[Any, Any]:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    inputs = {"model": model, "prompts": data}
    params = KIND.derive_params(inputs, KIND.parse_params({"token_budget": 100_000, **raw}))
    (only,) = KIND.split(inputs, params)
    return read_payload(only.payload), params


@pytest.mark.parametrize(
    "raw",
    [
        {"max_tokens": 12},
        {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 40},
        {"max_tokens": 12, "stop": ["."]},
    ],
    ids=["greedy", "sampled", "stop"],
)
def test_decoded_together_is_one_at_a_time_bit_for_bit(
    model: bytes, tmp_path: Path, raw: dict[str, Any]
) -> None:
    payload, params = shard(model, _prompts(), **raw)
    ctx = context(model, tmp_path)
    llm = worker.loaded(payload, ctx)
    alone = generate.generate_shard(llm, payload, params, ctx)
    # Four slots for eight prompts: slots are taken over as sequences finish, the last
    # sequence moves into a freed slot, and the system prompt's stream is copied.
    engine = batched.Engine(llm, sequences=4, n_ctx=payload.n_ctx)
    try:
        together = batched.generate_shard(engine, payload, params, ctx)
    finally:
        engine.close()
    assert [c.index for c in together] == [p.index for p in payload.prompts]
    for one, other in zip(alone, together, strict=True):
        assert (one.tokens, one.logprobs, one.text, one.finish) == (
            other.tokens,
            other.logprobs,
            other.text,
            other.finish,
        )
    report = check_shard(
        llm, payload, Output(completions=together, backend="cpu"), params, None, EXACT
    )
    assert report.passed and report.logprob_error == 0.0 and report.greedy_gap == 0.0, report


def test_the_shared_prefix_is_evaluated_once(model: bytes, tmp_path: Path) -> None:
    payload, params = shard(model, _prompts()[:5], max_tokens=2)
    ctx = context(model, tmp_path, sequences=5)
    llm = worker.loaded(payload, ctx)
    engine = batched.Engine(llm, sequences=5, n_ctx=payload.n_ctx)
    evaluated: list[int] = []
    decode = engine.decode

    def counting(rows: list[tuple[int, int, int, bool]]) -> Any:
        evaluated.append(len(rows))
        return decode(rows)

    engine.decode = counting  # type: ignore[method-assign]
    try:
        batched.generate_shard(engine, payload, params, ctx)
    finally:
        engine.close()
    prompt_tokens = sum(p.prompt_tokens for p in payload.prompts)
    shared = min(p.prompt_tokens for p in payload.prompts) - 8  # the system prompt, about
    # The first prompt alone (the others wait to copy it), then its next token and the
    # four others past the copied prefix, then the four's next tokens.
    assert evaluated[0] == payload.prompts[0].prompt_tokens
    assert sum(evaluated[:2]) < prompt_tokens - 3 * shared
    assert evaluated[2:] == [4]


def test_a_prompt_that_does_not_fit_fails_alone_and_the_check_holds_it(
    model: bytes, tmp_path: Path
) -> None:
    payload, params = shard(model, _prompts()[5:], max_tokens=6)
    long_text = "word " * 300  # about 300 tokens: over the shard's context with max_tokens
    prompts = [payload.prompts[0], dataclasses.replace(payload.prompts[1], text=long_text)]
    prompts.append(payload.prompts[2])
    payload = dataclasses.replace(payload, prompts=prompts)
    output = read_output(KIND.run(write_payload(payload), params, context(model, tmp_path)))
    failed = output.completions[1]
    assert failed.finish == "error" and "exceed the context" in failed.error and not failed.tokens
    assert all(c.tokens for i, c in enumerate(output.completions) if i != 1)
    llm = worker.loaded(payload, context(model, tmp_path))
    assert check_shard(llm, payload, output, params).passed
    # Saying a prompt that fits could not run is a lie the check catches.
    lazy = dataclasses.replace(output.completions[0], tokens=[], logprobs=[], text="",
                               finish="error", error="its context is full")  # fmt: skip
    claim = dataclasses.replace(output, completions=[lazy, *output.completions[1:]])
    report = check_shard(llm, payload, claim, params)
    assert not report.passed and "claimed it could not run" in report.reason


def test_a_context_too_large_is_retried_with_fewer_sequences(
    model: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    payload, params = shard(model, _prompts(), max_tokens=3)
    real = batched.Engine.__init__

    def short_of_memory(self: Any, llm: Any, *, sequences: int, n_ctx: int) -> None:
        if sequences > 2:
            raise batched.ContextFailed(f"no memory for {sequences} sequences")
        real(self, llm, sequences=sequences, n_ctx=n_ctx)

    monkeypatch.setattr(batched.Engine, "__init__", short_of_memory)
    monkeypatch.setattr(worker, "Engine", batched.Engine)
    worker._drop_engine()
    output = read_output(
        KIND.run(write_payload(payload), params, context(model, tmp_path, sequences=8))
    )
    worker._drop_engine()
    assert output.sequences == 2
    assert "decoding 4 sequences together instead" in caplog.text
    assert all(len(c.tokens) == 3 for c in output.completions)


def test_sequences_follow_the_memory(model: bytes) -> None:
    _, params = shard(model, _prompts(), max_tokens=3)
    facts = params.model_facts
    per_sequence = facts.kv_cache_bytes(params.n_ctx)
    roomy = facts.file_bytes + 100 * per_sequence
    assert batched.sequences_for(params, 8, cap=32, memory_bytes=roomy) == 8
    assert batched.sequences_for(params, 80, cap=32, memory_bytes=roomy) == 32
    tight = facts.file_bytes + 5 * per_sequence
    assert batched.sequences_for(params, 80, cap=32, memory_bytes=tight) == 5
    assert batched.sequences_for(params, 80, cap=32, memory_bytes=facts.file_bytes) == 1


def test_long_prompts_on_two_threads_are_exact(model: bytes, tmp_path: Path) -> None:
    """Past 256 cached positions (512 cells attended) llama.cpp's CPU flash attention
    splits a lone token's cache across threads (runtime.LONE_TOKEN_THREADS): the last
    sequence of a shard and a shard of one prompt are still the check's logits bit for
    bit."""
    system = "Answer plainly and briefly, with one everyday example for each idea. " * 36
    records = [
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        for q in ("What is rain?", "What is a map?")
    ]
    payload, params = shard(model, records, max_tokens=6)
    assert min(p.prompt_tokens for p in payload.prompts) > 256
    ctx = dataclasses.replace(context(model, tmp_path), threads=2)
    llm = worker.loaded(payload, ctx)
    alone = generate.generate_shard(llm, payload, params, ctx)
    engine = batched.Engine(llm, sequences=2, n_ctx=payload.n_ctx)
    try:
        together = batched.generate_shard(engine, payload, params, ctx)
    finally:
        engine.close()
    for completions in (alone, together):
        claim = Output(completions=completions, backend="cpu")
        report = check_shard(llm, payload, claim, params, None, EXACT, stop_early=False)
        assert report.passed and report.logprob_error == 0.0, report
    assert [c.logprobs for c in alone] == [c.logprobs for c in together]
