"""The llm-generate kind in one process, on the real SmolLM2 GGUF with a few tokens:
model checks at submission, sharding by tokens, generation, the check, assembly."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from llm_model import model_path
from pydantic import ValidationError

from idlegrid.kinds import get_kind
from idlegrid.kinds.base import InputError, RunContext, Verdict
from idlegrid.kinds.llm_generate import runtime, worker
from idlegrid.kinds.llm_generate.check import CROSS, EXACT, check_shard, margins_for
from idlegrid.kinds.llm_generate.kind import LlmGenerateParams
from idlegrid.kinds.llm_generate.shard import read_output, read_payload, read_verdict

KIND = get_kind("llm-generate")
PROMPTS = [
    {"messages": [{"role": "user", "content": "Name a color."}]},
    {"prompt": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Count to three."}]},
]


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def model() -> bytes:
    return model_path().read_bytes()


@pytest.fixture(scope="module")
def job(model: bytes) -> tuple[Any, list[Any], list[bytes]]:
    """One submission (three prompts, 3 tokens each, two shards) and its outputs."""
    _, params, shards = submit(model, jsonl(PROMPTS), max_tokens=3, token_budget=80)
    scratch = Path(tempfile.mkdtemp(prefix="llm-test-"))
    # Models this process loaded before (other tests' contexts and threads).
    LOADS_BEFORE.append(worker.models.stats.loads)
    outputs = [KIND.run(s.payload, params, context(model, scratch)) for s in shards]
    return params, shards, outputs


LOADS_BEFORE: list[int] = []


def submit(model: bytes, prompts: bytes, **raw: Any) -> tuple[dict[str, bytes], Any, list[Any]]:
    inputs = {"model": model, "prompts": prompts}
    params = KIND.derive_params(inputs, KIND.parse_params(raw))
    return inputs, params, KIND.split(inputs, params)


def context(model: bytes, tmp_path: Path, check: bytes | None = None) -> RunContext:
    blobs = {hashlib.sha256(model).hexdigest(): model}
    return RunContext(threads=1, fetch=blobs.__getitem__, scratch=tmp_path / "s" / "t", check=check)


def test_submission_reads_the_model_and_cuts_shards_by_tokens(job: Any) -> None:
    params, shards, _ = job
    facts = params.model_facts
    assert (facts.architecture, facts.layers, facts.vocab) == ("llama", 30, 49152)
    assert facts.quantization == "Q4_1" and facts.chat_template
    assert params.n_ctx == 256  # the longest prompt plus max_tokens, rounded up
    assert len(shards) == 2 and [s.items for s in shards] == [
        sum(p.prompt_tokens + 3 for p in read_payload(s.payload).prompts) for s in shards
    ]
    indexes = [p.index for s in shards for p in read_payload(s.payload).prompts]
    assert indexes == [0, 1, 2]
    needs = KIND.requirements(params)
    assert needs.min_disk_mb == 94 and needs.min_memory_mb > 94 + 256


@pytest.mark.parametrize(
    ("prompts", "raw", "message"),
    [
        (b'{"prompt": "a"}\n{"prompt": ', {}, "prompts line 2: not JSON"),
        (jsonl([{"prompt": "word " * 9000}]), {}, "prompts line 1: 9001 prompt tokens"),
        (jsonl([{"prompt": "a"}]), {"token_budget": 20, "max_tokens": 30}, "token_budget 20"),
        (jsonl([{"prompt": "a"}]), {"stop": [""]}, "stop strings"),
    ],
)
def test_bad_prompts_are_named(model: bytes, prompts: bytes, raw: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        submit(model, prompts, **raw)


def test_max_tokens_over_the_cap_is_refused() -> None:
    with pytest.raises(ValidationError, match="max_tokens"):
        KIND.parse_params({"max_tokens": 100_000})


def tiny_gguf(path: Path, *, arch: str = "llama", template: str | None = None) -> bytes:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    if template is not None:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: b"PK\x03\x04 not a model", "not a GGUF file"),
        (lambda p: tiny_gguf(p, arch="bert"), "architecture 'bert' is not one llama.cpp runs"),
        (lambda p: tiny_gguf(p, template="{% for m in messages %}"), "chat template"),
        (lambda p: tiny_gguf(p)[:-16], "cannot be read"),
    ],
)
def test_models_that_may_not_go_to_volunteers(tmp_path: Path, make: Any, message: str) -> None:
    data = make(tmp_path / "model.gguf")
    with pytest.raises(InputError, match=message):
        submit(data, jsonl([{"prompt": "a"}]))


def test_a_shard_is_generated_checked_and_assembled(model: bytes, job: Any, tmp_path: Path) -> None:
    params, shards, outputs = job
    for shard, output in zip(shards, outputs, strict=True):
        KIND.check_output(shard.payload, output, params)
    first = read_output(outputs[0]).completions[0]
    assert len(first.tokens) == 3 and first.finish == "length" and first.text
    assert all(lp <= 0 for lp in first.logprobs)
    # The check task: the claim passes, and its verdict names the claim by hash.
    verdict = KIND.run(shards[0].payload, params, context(model, tmp_path, outputs[0]))
    passed = read_verdict(verdict)
    assert passed is not None and passed.passed, passed
    assert passed.claimed == hashlib.sha256(outputs[0]).hexdigest()
    # Same build: the check's batched logits are the generation's, bit for bit (the
    # output rounds log-probabilities to 6 decimals).
    assert passed.greedy_gap == 0.0 and passed.logprob_error <= 1e-6
    assert KIND.check_verdict(verdict) == (passed.claimed, True)
    assert KIND.compare(outputs[0], verdict, params) == Verdict.AGREE
    result = [json.loads(line) for line in KIND.assemble(outputs, params).splitlines()]
    assert [r["index"] for r in result] == [0, 1, 2]
    assert set(result[0]) == {"index", "text", "tokens", "logprobs", "finish_reason"}
    # The second shard found the model loaded: at most one load (none where an earlier
    # test of this process loaded it), and reuses.
    assert worker.models.stats.loads - LOADS_BEFORE[0] <= 1 and worker.models.stats.reuses >= 2


def test_the_check_catches_tampered_claims(model: bytes, job: Any, tmp_path: Path) -> None:
    params, shards, outputs = job
    payload = read_payload(shards[0].payload)
    honest = read_output(outputs[0])
    llm = worker.loaded(payload, context(model, tmp_path))
    first, second = honest.completions
    cheats = {
        "replayed": [dataclasses.replace(second, index=0), dataclasses.replace(first, index=1)],
        "reversed": [dataclasses.replace(first, tokens=first.tokens[::-1]), second],
        "truncated": [
            dataclasses.replace(first, tokens=first.tokens[:2], logprobs=first.logprobs[:2]),
            second,
        ],
        "forged logprobs": [dataclasses.replace(first, logprobs=[-0.001] * 3), second],
    }
    assert check_shard(llm, payload, honest, params).passed
    for name, completions in cheats.items():
        claimed = dataclasses.replace(honest, completions=completions)
        report = check_shard(llm, payload, claimed, params)
        assert not report.passed, name
    garbage = KIND.run(shards[0].payload, params, context(model, tmp_path, b"not an output"))
    assert read_verdict(garbage) is not None and not read_verdict(garbage).passed


def test_the_margins_follow_the_claimed_build(model: bytes, job: Any, tmp_path: Path) -> None:
    params, shards, outputs = job
    payload = read_payload(shards[0].payload)
    honest = read_output(outputs[0])
    llm = worker.loaded(payload, context(model, tmp_path))
    assert honest.build == runtime.build() and "llama-cpp-python" in honest.build
    assert margins_for(honest, "cpu", runtime.build()) == EXACT
    foreign = dataclasses.replace(honest, build="llama-cpp-python 0.3.36; cpu; AVX2 = 1")
    assert margins_for(foreign, "cpu", runtime.build()) == CROSS
    assert margins_for(honest, "cuda", runtime.build()) == CROSS
    # Every log-probability off by 0.02: far outside an exact check, inside a cross-build one.
    shifted = [
        dataclasses.replace(c, logprobs=[lp - 0.02 for lp in c.logprobs])
        for c in honest.completions
    ]
    claim = dataclasses.replace(honest, completions=shifted)
    report = check_shard(llm, payload, claim, params, margins=EXACT)
    assert not report.passed and "off by 0.0200" in report.reason
    assert check_shard(llm, payload, claim, params, margins=CROSS).passed


def test_sampled_generation_is_repeated_by_the_check(model: bytes, tmp_path: Path) -> None:
    _, params, shards = submit(
        model, jsonl(PROMPTS[:1]), max_tokens=4, temperature=0.9, top_p=0.95, top_k=40
    )
    output = KIND.run(shards[0].payload, params, context(model, tmp_path))
    payload = read_payload(shards[0].payload)
    llm = worker.loaded(payload, context(model, tmp_path))
    assert check_shard(llm, payload, read_output(output), params).passed
    reseeded = dataclasses.replace(
        payload, prompts=[dataclasses.replace(payload.prompts[0], seed=7)]
    )
    other = read_output(KIND.run(_payload_bytes(reseeded), params, context(model, tmp_path)))
    if other.completions[0].tokens != read_output(output).completions[0].tokens:
        assert not check_shard(llm, payload, other, params).passed


def _payload_bytes(payload: Any) -> bytes:
    from idlegrid.kinds.llm_generate.shard import write_payload

    return write_payload(payload)


def test_stop_strings_end_generation_and_the_check_holds_them(model: bytes, tmp_path: Path) -> None:
    _, params, shards = submit(
        model, jsonl([{"prompt": "1, 2, 3, 4, 5,"}]), max_tokens=8, stop=[","]
    )
    output = read_output(KIND.run(shards[0].payload, params, context(model, tmp_path)))
    completion = output.completions[0]
    assert completion.finish == "stop" and "," not in completion.text
    payload = read_payload(shards[0].payload)
    llm = worker.loaded(payload, context(model, tmp_path))
    assert check_shard(llm, payload, output, params).passed
    as_length = dataclasses.replace(completion, finish="length")
    assert not check_shard(
        llm, payload, dataclasses.replace(output, completions=[as_length]), params
    ).passed
    assert isinstance(params, LlmGenerateParams) and runtime.backend() == "cpu"
