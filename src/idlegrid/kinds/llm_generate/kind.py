"""The `llm-generate` kind: a GGUF language model over prompts, on any node's llama.cpp.

Inputs: `model` (a GGUF file, checked on the coordinator by `model.inspect_gguf` before
any volunteer sees it) and `prompts` (JSON Lines, `prompts.parse_prompts`). Prompts are
cut into contiguous shards by a token budget (prompt tokens plus `max_tokens`, summed);
a shard's payload names the model blob, which the worker fetches once per hash and keeps
loaded between tasks (`runtime.Models`). A shard's output holds each prompt's text,
token ids, the log-probability of each token and why it stopped; the job's result is
JSON Lines in input order.

Generation is verified by a check, not by replicas (docs/verification.md): honest nodes
on different hardware diverge token by token once two logits are close, so two
generations are compared only for identity; a check task runs one batched prefill over
each prompt and the claimed completion (`check.check_shard`) on another node.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from idlegrid.blobs import files as blobs
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
from idlegrid.kinds.llm_generate import defects, openai_batch
from idlegrid.kinds.llm_generate.check import CROSS
from idlegrid.kinds.llm_generate.generate import settings_of
from idlegrid.kinds.llm_generate.model import GgufFacts, inspect_gguf
from idlegrid.kinds.llm_generate.prompts import Prompt, check_template, parse_prompts
from idlegrid.kinds.llm_generate.shard import (
    CheckVerdict,
    Completion,
    LlmGenerateParams,
    Output,
    Payload,
    PayloadPrompt,
    check_stops,
    facts_of,
    read_output,
    read_payload,
    read_verdict,
    write_output,
    write_payload,
)
from idlegrid.kinds.llm_generate.tokens import count_tokens

# FLOP/s of a node's llama.cpp (two FLOPs per weight per token, prompt and generated)
# over its benchmark's matmul GFLOPS: 0.17 to 0.28 on SmolLM2-135M Q4_1 on this project's
# 2-core VM (benchmarks/llm_benchmark_share.py, docs/llm-generate.md).
BENCHMARK_SHARE = 0.2
# The context a shard's model is loaded with is rounded up to this many tokens, so that
# shards of one job (and jobs of one model) share a loaded model.
CONTEXT_STEP = 256
# Prompts whose first this many characters (some 60 tokens) are the same are cut into
# shards side by side.
GROUP_PREFIX_CHARS = 256


class LlmGenerateKind(TaskKind):
    """Generate text with a GGUF model over JSON Lines prompts, shard by shard."""

    name = "llm-generate"
    uses_gpu = True
    params_model = LlmGenerateParams
    input_names = ("model", "prompts")
    result_media_type = "application/x-ndjson"
    # Nominal speed of a node new to the kind: a small model's tokens on a busy CPU.
    default_gflops = 20.0
    checks = True
    # llama.cpp builds: exact checks on the output's own build only (check.margins_for).
    names_builds = True
    # An output and its check (a failed check is confirmed by a second checker).
    default_replication = 2
    # The loaded model stays in the task process for the next shard of it (runtime.Models).
    holds_state = True
    # llama.cpp's decoding is bound by memory, not arithmetic: a small share of a node's
    # matmul peak (measured: docs/llm-generate.md, "A job sized against its fleet").
    benchmark_share = BENCHMARK_SHARE

    def derive_params(self, inputs: Mapping[str, bytes], params: KindParams) -> KindParams:
        assert isinstance(params, LlmGenerateParams)
        check_stops(params.stop)
        with _model_file(inputs) as path:
            facts = inspect_gguf(path, digest=required_input_hash(inputs, "model"))
            if facts.chat_template is not None:
                check_template(facts)
            prompts = parse_prompts(required_input(inputs, "prompts"), facts, job_seed=params.seed)
            counts, _ = count_tokens(path, [p.text for p in prompts])
        for prompt, count in zip(prompts, counts, strict=True):
            most = _max_tokens(prompt, params)
            if count + most > facts.context_length:
                raise InputError(
                    f"prompts line {prompt.index + 1}: {count} prompt tokens and max_tokens "
                    f"{most} exceed the model's context of {facts.context_length}"
                )
        longest = max(c + _max_tokens(p, params) for p, c in zip(prompts, counts, strict=True))
        n_ctx = min(facts.context_length, -(-longest // CONTEXT_STEP) * CONTEXT_STEP)
        if params.token_budget < longest:
            raise InputError(
                f"token_budget {params.token_budget} is below the longest prompt plus "
                f"max_tokens ({longest} tokens)"
            )
        return params.model_copy(update={"model_facts": facts, "n_ctx": n_ctx})

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, LlmGenerateParams)
        if params.model_facts is None or not params.n_ctx:
            params = self.derive_params(inputs, params)
            assert isinstance(params, LlmGenerateParams)
        facts = facts_of(params)
        prompts = parse_prompts(required_input(inputs, "prompts"), facts, job_seed=params.seed)
        with _model_file(inputs) as path:
            counts, _ = count_tokens(path, [p.text for p in prompts])
        model = required_input_hash(inputs, "model")
        shards: list[ShardSpec] = []
        group: list[PayloadPrompt] = []
        for prompt, count in _grouped(prompts, counts):
            cost = count + _max_tokens(prompt, params)
            if group and _budget(group, params) + cost > params.token_budget:
                shards.append(_shard(len(shards), model, group, params, facts))
                group = []
            group.append(_payload_prompt(prompt, count))
        shards.append(_shard(len(shards), model, group, params, facts))
        return shards

    def cut(self, params: KindParams, max_cost: float) -> KindParams | None:
        """A token budget whose shards cost at most `max_cost` (a prompt over it stays a
        shard of its own)."""
        assert isinstance(params, LlmGenerateParams)
        budget = int(max_cost // facts_of(params).flops_per_token())
        if budget >= params.token_budget:
            return None
        return params.model_copy(update={"token_budget": max(16, budget)})

    def describe_shard(self, spec: ShardSpec, params: KindParams) -> tuple[str, str]:
        numbers = sorted(p.index + 1 for p in read_payload(spec.payload).prompts)
        named = ", ".join(map(str, numbers[:3])) + (", ..." if len(numbers) > 3 else "")
        lines = f"line{'s' if len(numbers) > 1 else ''} {named}"
        return (f"prompts {lines} ({spec.items:,} tokens with max_tokens)",
                "lower max_tokens, or shorten the prompt")  # fmt: skip

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, LlmGenerateParams)
        facts = params.model_facts
        if facts is None:
            return Requirements()
        return Requirements(
            min_memory_mb=facts.memory_mb(params.n_ctx or facts.context_length),
            min_disk_mb=-(-facts.file_bytes // 2**20),
        )

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        assert isinstance(params, LlmGenerateParams)
        from idlegrid.kinds.llm_generate import worker

        return worker.run_shard(read_payload(payload), params, ctx)

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        assert isinstance(params, LlmGenerateParams)
        if self.check_verdict(output) is not None:
            return  # a check task's verdict (its role is checked by the verifier)
        shard, claimed = read_payload(payload), read_output(output)
        indexes = [p.index for p in shard.prompts]
        if [c.index for c in claimed.completions] != indexes:
            raise InputError(f"output answers prompts {[c.index for c in claimed.completions]}")
        vocab = facts_of(params).vocab
        for prompt, completion in zip(shard.prompts, claimed.completions, strict=True):
            if completion.finish == "error":
                continue  # no tokens (read_output); the check confirms it could not run
            most = settings_of(prompt, params).max_tokens
            if not 1 <= len(completion.tokens) <= most:
                raise InputError(
                    f"prompt {completion.index}: {len(completion.tokens)} tokens "
                    f"(1 to {most} allowed)"
                )
            if max(completion.tokens) >= vocab:
                raise InputError(f"prompt {completion.index}: a token id is past the vocabulary")

    def claimed_build(self, output: bytes) -> str:
        try:
            return read_output(output).build
        except InputError:
            return ""  # not an output: the verifier finds it in the wrong role

    def check_decides(self, output: bytes) -> bool:
        verdict = read_verdict(output)
        return verdict is None or verdict.decides

    def plant_defect(self, output: bytes, draw: float) -> bytes | None:
        try:
            claimed = read_output(output)
        except InputError:
            return None
        return write_output(defects.plant(claimed, draw))

    def check_verdict(self, output: bytes) -> tuple[str, bool] | None:
        verdict = read_verdict(output)
        return None if verdict is None else (verdict.claimed, verdict.passed)

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        """A generation and a check of it agree when the check passed it; two checks of
        one output when they say the same. Two generations agree when they are the same
        tokens with log-probabilities within the cross-build margins, and disagree when
        the same tokens' log-probabilities are further apart; honest ones on other
        hardware may differ in their tokens, so a difference there proves nothing."""
        first, second = read_verdict(a), read_verdict(b)
        if first is not None or second is not None:
            return _compare_checks(a, first, b, second)
        try:
            one, other = read_output(a), read_output(b)
        except InputError:
            return Verdict.DISAGREE
        same = [c.tokens for c in one.completions] == [c.tokens for c in other.completions]
        if not same:
            return Verdict.INCONCLUSIVE
        # The same tokens: their log-probabilities must agree as a check's would across
        # builds, or one of them was made up.
        errors = [
            abs(a - b)
            for x, y in zip(one.completions, other.completions, strict=True)
            for a, b in zip(x.logprobs, y.logprobs, strict=True)
        ]
        if errors and (
            max(errors) > CROSS.logprob or sum(errors) / len(errors) > CROSS.mean_logprob
        ):
            return Verdict.DISAGREE
        return Verdict.AGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        completions = _by_index(outputs)
        return _write_result([completions[index] for index in range(len(completions))])

    def assemble_with_inputs(
        self, payloads: Sequence[bytes], outputs: Sequence[bytes], params: KindParams
    ) -> bytes:
        """The result in input order: OpenAI Batch API output lines for a batch file's
        job, else the project's own lines."""
        shards = [read_payload(payload) for payload in payloads]
        completions = _by_index(outputs)
        if any(p.request is not None for shard in shards for p in shard.prompts):
            return openai_batch.write_lines(shards, completions)
        return self.assemble(outputs, params)


def _compare_checks(
    a: bytes, first: CheckVerdict | None, b: bytes, second: CheckVerdict | None
) -> Verdict:
    if first is not None and second is not None:
        if first.claimed != second.claimed:
            return Verdict.INCONCLUSIVE
        return Verdict.AGREE if first.passed == second.passed else Verdict.DISAGREE
    check, generation = (first, b) if first is not None else (second, a)
    assert check is not None
    if check.claimed != blobs.sha256_hex(generation):
        return Verdict.INCONCLUSIVE
    return Verdict.AGREE if check.passed else Verdict.DISAGREE


def _grouped(prompts: list[Prompt], counts: list[int]) -> list[tuple[Prompt, int]]:
    """Prompts that start with the same `GROUP_PREFIX_CHARS` characters (a long system
    prompt, few-shot examples) side by side, so they share shards, where the prefix is
    evaluated once (batched.py); groups in the order of their first prompt, prompts in
    input order within each (prompts with no such prefix stay in input order)."""
    groups: dict[str, list[tuple[Prompt, int]]] = {}
    for prompt, count in zip(prompts, counts, strict=True):
        groups.setdefault(prompt.text[:GROUP_PREFIX_CHARS], []).append((prompt, count))
    return [pair for group in groups.values() for pair in group]


def _by_index(outputs: Sequence[bytes]) -> dict[int, Completion]:
    """The shards' completions by prompt index; InputError unless they are each prompt once."""
    completions: dict[int, Completion] = {}
    for output in outputs:
        for completion in read_output(output).completions:
            completions.setdefault(completion.index, completion)
    if sorted(completions) != list(range(len(completions))):
        raise InputError("shards do not cover the job's prompts once each")
    return completions


def _write_result(completions: list[Completion]) -> bytes:
    lines = []
    for completion in completions:
        record: dict[str, object] = {
            "index": completion.index,
            "text": completion.text,
            "tokens": completion.tokens,
            "logprobs": completion.logprobs,
            "finish_reason": completion.finish,
        }
        if completion.error:
            record["error"] = completion.error
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def _max_tokens(prompt: Prompt, params: LlmGenerateParams) -> int:
    return params.max_tokens if prompt.max_tokens is None else prompt.max_tokens


def generated_tokens(output: bytes) -> int:
    """Tokens a shard output (or a job result) holds: the progress a researcher sees."""
    return sum(len(c.tokens) for c in read_output(output).completions)


def _budget(group: list[PayloadPrompt], params: LlmGenerateParams) -> int:
    return sum(p.prompt_tokens + settings_of(p, params).max_tokens for p in group)


def _payload_prompt(prompt: Prompt, count: int) -> PayloadPrompt:
    return PayloadPrompt(
        index=prompt.index,
        text=prompt.text,
        seed=prompt.seed,
        prompt_tokens=count,
        max_tokens=prompt.max_tokens,
        temperature=prompt.temperature,
        top_p=prompt.top_p,
        stop=prompt.stop,
        request=prompt.request,
    )


def _shard(
    index: int, model: str, group: list[PayloadPrompt], params: LlmGenerateParams, facts: GgufFacts
) -> ShardSpec:
    payload = Payload(model=model, n_ctx=params.n_ctx, prompts=group)
    tokens = _budget(group, params)
    return ShardSpec(
        index=index,
        payload=write_payload(payload),
        items=tokens,  # progress and speeds count tokens (prompt plus max_tokens)
        cost_flops=tokens * facts.flops_per_token(),
    )


@contextlib.contextmanager
def _model_file(inputs: Mapping[str, bytes]) -> Iterator[Path]:
    """The model input as a file: the blob store's own, or a temporary copy of bytes."""
    if isinstance(inputs, blobs.StoredInputs):
        yield inputs.file_of("model")
        return
    with tempfile.TemporaryDirectory(prefix="idlegrid-gguf-") as folder:
        path = Path(folder) / "model.gguf"
        path.write_bytes(required_input(inputs, "model"))
        yield path


__all__ = ["LlmGenerateKind", "LlmGenerateParams", "Output", "generated_tokens", "write_output"]
