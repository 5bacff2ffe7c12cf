"""One shard's generation on the worker: each prompt's token loop, through llama.cpp.

Tokens are picked by `sampler.choose` from the logits of the last position (so a checker
can repeat the pick), each one's log-probability is its log-softmax under the model's
own logits (temperature 1), and generation stops at an end-of-generation token, at a
stop string (the text is cut before it; the token that completed it is kept) or after
`max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from idlegrid.kinds.base import Cancelled, RunContext
from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.sampler import Sampling, choose
from idlegrid.kinds.llm_generate.shard import (
    Completion,
    LlmGenerateParams,
    Payload,
    PayloadPrompt,
)


class PromptTooLong(ValueError):
    """A prompt and its max_tokens do not fit in the shard's context."""


@dataclass(frozen=True)
class Settings:
    """How one prompt is generated: the job's params, or the prompt's own request."""

    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]


def settings_of(prompt: PayloadPrompt, params: LlmGenerateParams) -> Settings:
    """A prompt's settings: those its request set, else the job's."""
    job = params.sampling()
    return Settings(
        max_tokens=params.max_tokens if prompt.max_tokens is None else prompt.max_tokens,
        sampling=Sampling(
            temperature=job.temperature if prompt.temperature is None else prompt.temperature,
            top_p=job.top_p if prompt.top_p is None else prompt.top_p,
            top_k=job.top_k,
        ),
        stop=params.stop if prompt.stop is None else prompt.stop,
    )


def wants_pieces(prompt: PayloadPrompt) -> bool:
    """Whether the prompt's output carries each token's bytes (its request asked for
    log-probabilities, which name their tokens)."""
    return prompt.request is not None and prompt.request.logprobs


def failed(prompt: PayloadPrompt, reason: str) -> Completion:
    """The completion of a prompt that could not run, and why."""
    return Completion(
        index=prompt.index, text="", tokens=[], logprobs=[], finish="error", error=reason
    )


def generate_shard(
    llm: Any, payload: Payload, params: LlmGenerateParams, ctx: RunContext
) -> list[Completion]:
    """The completions of a shard's prompts, one prompt after another (the reference the
    batched decoder, batched.generate_shard, reproduces)."""
    total = sum(p.prompt_tokens + settings_of(p, params).max_tokens for p in payload.prompts)
    done = 0
    completions = []
    for prompt in payload.prompts:
        if ctx.is_cancelled():
            raise Cancelled()
        try:
            completions.append(generate(llm, prompt, params, ctx))
        except PromptTooLong as exc:
            completions.append(failed(prompt, str(exc)))
        done += prompt.prompt_tokens + settings_of(prompt, params).max_tokens
        ctx.report_progress(done / max(1, total))
    return completions


def generate(
    llm: Any, prompt: PayloadPrompt, params: LlmGenerateParams, ctx: RunContext | None = None
) -> Completion:
    """One prompt's completion."""
    settings = settings_of(prompt, params)
    tokens = runtime.tokenize(llm, prompt.text)
    if len(tokens) + settings.max_tokens > llm.n_ctx():
        raise PromptTooLong(
            f"its {len(tokens)} prompt tokens and max_tokens {settings.max_tokens} "
            f"exceed the context of {llm.n_ctx()}"
        )
    runtime.start(llm, tokens)
    sampling = settings.sampling
    generated: list[int] = []
    logprobs: list[float] = []
    text = bytearray()
    for position in range(settings.max_tokens):
        logits = runtime.last_logits(llm)
        token = choose(logits, sampling, seed=prompt.seed, position=position)
        generated.append(token)
        logprobs.append(token_logprob(logits, token))
        if runtime.is_end(llm, token):
            return _done(llm, prompt, generated, logprobs, text, "stop", None)
        text += runtime.piece(llm, token)
        cut = stop_index(decode(text), settings.stop) if settings.stop else None
        if cut is not None:
            return _done(llm, prompt, generated, logprobs, text, "stop", cut)
        if position + 1 < settings.max_tokens:
            if ctx is not None and position % 16 == 15 and ctx.is_cancelled():
                raise Cancelled()
            llm.eval([token])
    return _done(llm, prompt, generated, logprobs, text, "length", None)


def _done(
    llm: Any,
    prompt: PayloadPrompt,
    tokens: list[int],
    logprobs: list[float],
    text: bytearray,
    finish: Any,
    cut: int | None,
) -> Completion:
    decoded = decode(text)
    return Completion(
        index=prompt.index,
        text=decoded if cut is None else decoded[:cut],
        tokens=tokens,
        logprobs=logprobs,
        finish=finish,
        pieces=pieces(llm, tokens) if wants_pieces(prompt) else None,
    )


def pieces(llm: Any, tokens: list[int]) -> list[bytes]:
    """Each token's bytes."""
    return [runtime.piece(llm, token) for token in tokens]


def token_logprob(logits: np.ndarray, token: int) -> float:
    """log-softmax of `logits` at `token` (float64)."""
    return float(token_logprobs(logits[np.newaxis, :], [token])[0])


def token_logprobs(rows: np.ndarray, tokens: list[int]) -> np.ndarray:
    """log-softmax of each row of `rows` at its token (float64): the generator's numbers,
    bit for bit, when the check's rows are the generator's logits."""
    peak = rows.max(axis=1).astype(np.float64)
    total = np.exp(rows.astype(np.float64) - peak[:, np.newaxis]).sum(axis=1)
    chosen = rows[np.arange(len(tokens)), tokens].astype(np.float64)
    return chosen - peak - np.log(total)


def decode(data: bytes | bytearray) -> str:
    """Generated bytes as text, as both sides decode them (a cut UTF-8 sequence replaced)."""
    return bytes(data).decode("utf-8", errors="replace")


def stop_index(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in `text`, if any does."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None
