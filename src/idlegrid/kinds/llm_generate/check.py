"""The check of a claimed generation: one batched prefill over each prompt and its
claimed completion, every token judged against the model's own logits.

For each prompt of the shard, in order:
- the completion's rules: tokens within `max_tokens`, no end-of-generation token but the
  last, the finish reason true ("length": exactly `max_tokens` tokens and no stop; "stop":
  an end token last, or a stop string completed by the last token), and the text the
  tokens decode to, cut before the stop string;
- each token against the logits that predicted it (`runtime.prefill`): its claimed
  log-probability within `Margins.logprob` of the checker's; a greedy token the argmax
  within `Margins.greedy` (logits); a sampled one the token the seeded sampler picks,
  its draw within `Margins.draw` of the token's range (all but `Margins.draw_misses` of
  a completion's tokens);
and over the shard's tokens, the mean |claimed - checked| log-probability within
`Margins.mean_logprob`.

Which margins hold depends on the claim's llama.cpp build (`margins_for`): on the
checker's own CPU build the check is exact (`EXACT`), otherwise it allows honest
cross-build noise (`CROSS`), which every compute-saving cheat exceeds over
`CROSS_MIN_TOKENS` tokens or more (`decisive`). Calibrated with
benchmarks/llm_verify.py (docs/verification.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.kinds.base import Cancelled, RunContext
from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.generate import (
    Settings,
    decode,
    settings_of,
    stop_index,
    token_logprobs,
    wants_pieces,
)
from idlegrid.kinds.llm_generate.sampler import Sampling, draw, interval
from idlegrid.kinds.llm_generate.shard import (
    Completion,
    LlmGenerateParams,
    Output,
    Payload,
    PayloadPrompt,
)

MIN_SAMPLED_LOGPROB = -15.0  # a sampled token the model gives no chance always fails


@dataclass(frozen=True)
class Margins:
    """How far a claim may stray from the checker's logits and still pass.

    greedy: logits a greedy token may lie below the argmax; draw: how far outside its
    token's range of draws a sampled token's draw may fall, for at most `draw_misses` of
    a completion's tokens; logprob: |claimed - checked| log-probability of one token;
    mean_logprob: its mean over the shard's tokens, tested over `mean_min_tokens` tokens or
    more (fewer say too little: the first tokens of a completion are the surest).
    """

    greedy: float
    draw: float
    logprob: float
    mean_logprob: float
    draw_misses: float
    mean_min_tokens: int = 0


# The generator's llama.cpp build is the checker's (`runtime.build`: version, backend,
# CPU features) and both run on the CPU with this project's settings (`runtime.load`):
# the checker's batched logits are then the generator's, bit for bit, at any thread
# count and batch size (measured). The slack covers the output's rounding of
# log-probabilities to 6 decimals. Another quantization of the same weights (Q8_0 made
# from the Q4_1 file) is off by 0.04 on average, 40 times the mean tolerance.
EXACT = Margins(greedy=0.001, draw=1e-6, logprob=0.01, mean_logprob=0.001, draw_misses=0.0)
# Another build (other CPU features, another version) or a GPU backend on either side:
# honest logits part ways from the first token (rounding in the kernels, grown through
# the layers). Calibrated on the CPU (benchmarks/llm_verify.py, docs/verification.md),
# 12 prompts of up to 64 tokens: builds for AVX-512, AVX2 and AVX only, each checking
# the others' greedy and sampled claims (144 shards), differed by up to 0.54 in a token's
# log-probability, 0.066 on average over a shard (0.068 over any completion's first 32
# tokens or more) and 0.52 in a greedy gap. Every claim made by a cheaper model than the
# Q4_1 file's (each quantization llama.cpp makes from it at or below its 5.74 bits per
# weight, 1 to 10 of its 30 layers pruned) was off by 0.15 or more on average over 32
# tokens or more (0.21 over a whole shard): the mean decides, with room both ways.
# Over fewer tokens the first tokens of a completion, where every model is surest, leave
# a cheaper model within honest noise: the mean is not tested below `mean_min_tokens`,
# and such a pass decides nothing (`decisive`). Claims these margins pass that are not
# the Q4_1 model's (Q8_0 made from its file) cost more than the honest run. A GPU
# checker of the same build still uses these margins (batched GPU kernels are not the
# one-token ones); no GPU was measured.
CROSS = Margins(
    greedy=1.0, draw=0.1, logprob=0.75, mean_logprob=0.08, draw_misses=0.1, mean_min_tokens=32
)
# The fewest generated tokens a pass with the cross-build margins must cover to decide.
CROSS_MIN_TOKENS = CROSS.mean_min_tokens


def margins_for(claimed: Output, backend: str, build: str) -> Margins:
    """EXACT for a claim made on this checker's own CPU build, CROSS otherwise."""
    return EXACT if backend == "cpu" and claimed.build == build else CROSS


def decisive(margins: Margins, tokens: int) -> bool:
    """Whether a pass with `margins` over `tokens` checked tokens proves the claim: an
    exact check always; a cross-build one over `mean_min_tokens` (CROSS_MIN_TOKENS) or
    more."""
    return tokens >= margins.mean_min_tokens


@dataclass
class CheckReport:
    """A check's verdict, the first failure if any, and the largest honest-side gaps."""

    passed: bool = True
    reason: str = ""
    tokens: int = 0
    # The largest (max logit - chosen logit) of greedy tokens, and |claimed - checked|
    # log-probability: what the margins are calibrated against.
    greedy_gap: float = 0.0
    logprob_error: float = 0.0
    # The mean |claimed - checked| log-probability over the shard's tokens.
    logprob_mean: float = 0.0
    errors: list[float] = field(default_factory=list)

    def fail(self, reason: str) -> CheckReport:
        if self.passed:
            self.passed, self.reason = False, reason
        return self


def check_shard(
    llm: Any,
    payload: Payload,
    claimed: Output,
    params: LlmGenerateParams,
    ctx: RunContext | None = None,
    margins: Margins = EXACT,
    *,
    stop_early: bool = True,
) -> CheckReport:
    """Check every completion of a claimed shard output (see the module)."""
    report = CheckReport()
    if [c.index for c in claimed.completions] != [p.index for p in payload.prompts]:
        return report.fail("the completions do not answer the shard's prompts in order")
    for prompt, completion in zip(payload.prompts, claimed.completions, strict=True):
        if ctx is not None and ctx.is_cancelled():
            raise Cancelled()
        settings = settings_of(prompt, params)
        if completion.finish == "error":
            problem = _could_not_run(llm, prompt, settings, payload.n_ctx)
        else:
            problem = (
                rules(llm, completion, settings)
                or _pieces(llm, prompt, completion)
                or _completion(llm, prompt, completion, settings, margins, report, stop_early)
            )
        if problem:
            report.fail(f"prompt {prompt.index}, {problem}")
            if stop_early:
                return report
    report.logprob_mean = sum(report.errors) / len(report.errors) if report.errors else 0.0
    if len(report.errors) >= margins.mean_min_tokens and report.logprob_mean > margins.mean_logprob:
        report.fail(
            f"claimed log-probabilities off by {report.logprob_mean:.4f} on average over "
            f"the shard's {len(report.errors)} tokens"
        )
    return report


def _pieces(llm: Any, prompt: PayloadPrompt, completion: Completion) -> str | None:
    """What is wrong with a completion's token bytes: there where its request asked for
    log-probabilities, each the token's own."""
    if wants_pieces(prompt) != (completion.pieces is not None):
        return "token bytes are missing" if wants_pieces(prompt) else "token bytes not asked for"
    if completion.pieces is None:
        return None
    for at, (token, piece) in enumerate(zip(completion.tokens, completion.pieces, strict=True)):
        if runtime.piece(llm, token) != piece:
            return f"token {at}: its bytes are not the token's"
    return None


def _could_not_run(llm: Any, prompt: PayloadPrompt, settings: Settings, n_ctx: int) -> str | None:
    """What is wrong with a claim that a prompt could not run (None: it could not)."""
    needed = len(runtime.tokenize(llm, prompt.text)) + settings.max_tokens
    if needed <= n_ctx:
        return f"claimed it could not run, but its {needed} tokens fit the context of {n_ctx}"
    return None


def _completion(
    llm: Any,
    prompt: PayloadPrompt,
    completion: Completion,
    settings: Settings,
    margins: Margins,
    report: CheckReport,
    stop_early: bool,
) -> str | None:
    """The first broken rule of one completion's tokens (None: none), judged against the
    logits of one batched prefill over its prompt and its tokens."""
    first: str | None = None
    position = 0
    misses = 0
    for rows in runtime.prefill(llm, runtime.tokenize(llm, prompt.text), completion.tokens):
        tokens = completion.tokens[position : position + len(rows)]
        checked = token_logprobs(rows, tokens)
        for offset, token in enumerate(tokens):
            at = position + offset
            problem = _token(rows[offset], token, float(checked[offset]), completion.logprobs[at],
                             prompt.seed, at, settings.sampling, margins, report)  # fmt: skip
            if problem == MISSED_DRAW:
                misses += 1
            elif problem and first is None:
                first = f"token {at}: {problem}"
                if stop_early:
                    return first
        position += len(rows)
    if first is None and misses > margins.draw_misses * len(completion.tokens):
        first = f"{misses} of {len(completion.tokens)} tokens are not the seeded pick"
    return first


def rules(llm: Any, completion: Completion, settings: Settings) -> str | None:
    """What breaks the stop and length rules in a completion (None: nothing)."""
    tokens = completion.tokens
    if not tokens:
        return "no token generated"
    if len(tokens) > settings.max_tokens:
        return f"{len(tokens)} tokens, over max_tokens {settings.max_tokens}"
    vocab = llm.n_vocab()
    if any(not 0 <= t < vocab for t in tokens):
        return f"a token id is outside the vocabulary of {vocab}"
    ends = [i for i, t in enumerate(tokens) if runtime.is_end(llm, t)]
    if ends and ends[0] != len(tokens) - 1:
        return f"generation went on after an end token at {ends[0]}"
    ended = bool(ends)
    body = tokens[:-1] if ended else tokens
    text = decode(b"".join(runtime.piece(llm, t) for t in body))
    cut = stop_index(text, settings.stop) if settings.stop else None
    if ended or completion.finish == "length":
        expected_finish = "stop" if ended else "length"
        if completion.finish != expected_finish:
            return f"finish is {completion.finish!r}; the tokens say {expected_finish!r}"
        if not ended and len(tokens) != settings.max_tokens:
            return f"finish 'length' after {len(tokens)} of {settings.max_tokens} tokens"
        if cut is not None:
            return "a stop string appears and generation went on"
        return None if completion.text == text else "the text is not what the tokens decode to"
    if cut is None:
        return "finish 'stop' without an end token or stop string"
    before = decode(b"".join(runtime.piece(llm, t) for t in tokens[:-1]))
    if stop_index(before, settings.stop) is not None:
        return "a stop string appears before the last token"
    return None if completion.text == text[:cut] else "the text is not what the tokens decode to"


MISSED_DRAW = "missed draw"


def _token(
    row: np.ndarray,
    token: int,
    logprob: float,
    claimed: float,
    seed: int,
    position: int,
    sampling: Sampling,
    margins: Margins,
    report: CheckReport,
) -> str | None:
    """What is wrong with one claimed token (None: nothing; MISSED_DRAW: a sampled
    token's draw outside its range and the margin, counted per completion)."""
    report.tokens += 1
    error = abs(logprob - claimed)
    report.logprob_error = max(report.logprob_error, error)
    report.errors.append(error)
    gap = float(np.max(row)) - float(row[token]) if sampling.greedy else 0.0
    report.greedy_gap = max(report.greedy_gap, gap)
    if error > margins.logprob:
        return f"claimed log-probability off by {error:.4f}"
    if sampling.greedy:
        if gap > margins.greedy:
            return f"not the argmax (its logit is {gap:.3f} below the top)"
        return None
    if logprob < MIN_SAMPLED_LOGPROB:
        return f"a token the model gives no chance (log-probability {logprob:.1f})"
    if _sampled(row, sampling, token, draw(seed, position), margins.draw):
        return MISSED_DRAW
    return None


def _sampled(
    logits: np.ndarray, sampling: Sampling, token: int, drawn: float, margin: float
) -> str | None:
    """Whether the seeded sampler picks `token` from these logits, within `margin` of
    its draw (a close call between two tokens may go either way on other hardware)."""
    span = interval(logits, sampling, token)
    if span is None:
        relaxed = Sampling(
            temperature=sampling.temperature,
            top_p=min(1.0, sampling.top_p + margin),
            top_k=sampling.top_k + 1 if sampling.top_k else 0,
        )
        span = interval(logits, relaxed, token)
        if span is None or drawn < 1.0 - margin:
            return "not a token the sampler can pick here"
        return None
    low, high = span
    if low - margin <= drawn <= high + margin:
        return None
    return f"the seeded draw {drawn:.4f} picks another token (this one covers {low:.4f}-{high:.4f})"
