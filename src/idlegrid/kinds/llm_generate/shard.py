"""What both sides of `llm-generate` share: its params, a shard's payload and its output.

The kind (on the coordinator) writes payloads and reads outputs; the runtime (on the
worker) reads payloads and writes outputs; the check reads both. A payload is JSON:
the model's blob hash, the context size, and the shard's prompts (index in the job,
rendered text, seed, prompt tokens as counted at submission). An output is JSON: for each
prompt, the generated text, its token ids, each token's log-probability under the model
and why it stopped; plus the llama.cpp backend that ran it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from idlegrid.kinds.base import InputError, KindParams
from idlegrid.kinds.llm_generate.model import GgufFacts
from idlegrid.kinds.llm_generate.sampler import Sampling

MAX_TOKENS_CAP = 4096
MAX_STOPS = 8
MAX_STOP_CHARS = 64


class LlmGenerateParams(KindParams):
    max_tokens: int = Field(
        default=128, ge=1, le=MAX_TOKENS_CAP, description="tokens generated per prompt at most"
    )
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1000, description="0: no cut")
    stop: tuple[str, ...] = Field(
        default=(), max_length=MAX_STOPS, description="generation stops before any of these"
    )
    seed: int = Field(default=0, ge=0, lt=2**62, description="prompt i's seed: seed + i")
    token_budget: int = Field(
        default=8192,
        ge=16,
        le=1_000_000,
        description="prompt tokens plus max_tokens per shard, summed over its prompts",
    )
    # Filled in by the coordinator at submission (whatever was sent).
    model_facts: GgufFacts | None = None
    n_ctx: int = Field(default=0, ge=0, description="context a shard needs (set at submission)")

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def facts_of(params: LlmGenerateParams) -> GgufFacts:
    if params.model_facts is None:
        raise InputError("the job has no model facts (it was not submitted through split)")
    return params.model_facts


def check_stops(stops: tuple[str, ...]) -> None:
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InputError(f"stop strings must be 1 to {MAX_STOP_CHARS} characters: {stop!r}")


@dataclass(frozen=True)
class Request:
    """Where an OpenAI Batch API line came from, to write its output line."""

    custom_id: str
    url: str  # "/v1/chat/completions" or "/v1/completions"
    model: str = ""
    logprobs: bool = False


@dataclass(frozen=True)
class PayloadPrompt:
    index: int
    text: str
    seed: int
    prompt_tokens: int
    # A request's own settings (an OpenAI Batch API line's); None: the job's.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    request: Request | None = None


@dataclass(frozen=True)
class Payload:
    model: str
    n_ctx: int
    prompts: list[PayloadPrompt]


_OWN = ("max_tokens", "temperature", "top_p", "stop")


def write_payload(payload: Payload) -> bytes:
    return json.dumps(
        {
            "model": payload.model,
            "n_ctx": payload.n_ctx,
            "prompts": [_write_prompt(p) for p in payload.prompts],
        },
        ensure_ascii=False,
    ).encode()


def _write_prompt(prompt: PayloadPrompt) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": prompt.index,
        "text": prompt.text,
        "seed": prompt.seed,
        "tokens": prompt.prompt_tokens,
    }
    for name in _OWN:
        if getattr(prompt, name) is not None:
            record[name] = getattr(prompt, name)
    if prompt.request is not None:
        record["request"] = dataclasses.asdict(prompt.request)
    return record


def read_payload(data: bytes) -> Payload:
    try:
        raw = json.loads(data)
        return Payload(
            model=str(raw["model"]),
            n_ctx=int(raw["n_ctx"]),
            prompts=[_read_prompt(p) for p in raw["prompts"]],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"shard payload: {exc}") from None


def _read_prompt(raw: dict[str, Any]) -> PayloadPrompt:
    request = raw.get("request")
    stop = raw.get("stop")
    return PayloadPrompt(
        index=int(raw["index"]),
        text=str(raw["text"]),
        seed=int(raw["seed"]),
        prompt_tokens=int(raw["tokens"]),
        max_tokens=None if raw.get("max_tokens") is None else int(raw["max_tokens"]),
        temperature=None if raw.get("temperature") is None else float(raw["temperature"]),
        top_p=None if raw.get("top_p") is None else float(raw["top_p"]),
        stop=None if stop is None else tuple(str(s) for s in stop),
        request=None if request is None else Request(**request),
    )


# "error": the prompt could not run (`Completion.error` says why); it has no tokens.
Finish = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class Completion:
    """One prompt's generation: text, token ids, log-probability of each, why it ended."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish: Finish
    error: str = ""
    # Each token's bytes, where the prompt's request asked for log-probabilities (an
    # OpenAI Batch API line's `logprobs`); None: not asked.
    pieces: list[bytes] | None = None


@dataclass(frozen=True)
class Output:
    completions: list[Completion]
    backend: str
    # The llama.cpp build that made it (`runtime.build`): a checker on the same build
    # reproduces its logits exactly and holds it to the tight margins.
    build: str = ""
    # Sequences the node decoded together (batched.Engine); 0: not said.
    sequences: int = 0


def write_output(output: Output) -> bytes:
    return json.dumps(
        {
            "backend": output.backend,
            "build": output.build,
            "sequences": output.sequences,
            "results": [_write_completion(c) for c in output.completions],
        },
        ensure_ascii=False,
    ).encode()


def _write_completion(completion: Completion) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": completion.index,
        "text": completion.text,
        "tokens": completion.tokens,
        "logprobs": [round(lp, 6) for lp in completion.logprobs],
        "finish": completion.finish,
    }
    if completion.error:
        record["error"] = completion.error
    if completion.pieces is not None:
        record["pieces"] = [piece.hex() for piece in completion.pieces]
    return record


def read_output(data: bytes) -> Output:
    """A shard output, parsed and checked for shape; InputError naming what is wrong."""
    try:
        raw = json.loads(data)
        backend = raw["backend"]
        results = raw["results"]
        if not isinstance(backend, str) or not isinstance(results, list):
            raise TypeError("backend and results")
        build = raw.get("build", "")
        if not isinstance(build, str):
            raise TypeError("build")
        sequences = raw.get("sequences", 0)
        if not isinstance(sequences, int) or isinstance(sequences, bool) or sequences < 0:
            raise TypeError("sequences")
        completions = [_completion(r) for r in results]
        return Output(
            completions=completions,
            backend=backend[:100],
            build=build[:500],
            sequences=min(sequences, 1 << 16),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"output: {exc}") from None


def _completion(raw: Any) -> Completion:
    tokens, logprobs = raw["tokens"], raw["logprobs"]
    if not (isinstance(tokens, list) and isinstance(logprobs, list)):
        raise TypeError("tokens and logprobs must be lists")
    if len(tokens) != len(logprobs):
        raise ValueError(f"{len(tokens)} tokens and {len(logprobs)} log-probabilities")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise TypeError("token ids must be non-negative integers")
    if not all(isinstance(lp, int | float) and math.isfinite(lp) and lp <= 0 for lp in logprobs):
        raise ValueError("log-probabilities must be finite and at most 0")
    if raw["finish"] not in ("stop", "length", "error") or not isinstance(raw["text"], str):
        raise ValueError("finish must be 'stop', 'length' or 'error', text a string")
    error = raw.get("error", "")
    if not isinstance(error, str) or (raw["finish"] == "error") != bool(error):
        raise ValueError("an 'error' finish, and only that, says why in 'error'")
    if raw["finish"] == "error" and (tokens or raw["text"]):
        raise ValueError("a prompt that could not run has no tokens and no text")
    pieces = raw.get("pieces")
    if pieces is not None and (
        not isinstance(pieces, list)
        or len(pieces) != len(tokens)
        or not all(isinstance(p, str) and len(p) <= 256 for p in pieces)
    ):
        raise ValueError("pieces must be one hex string per token")
    return Completion(
        index=int(raw["index"]),
        text=raw["text"],
        tokens=tokens,
        logprobs=[float(lp) for lp in logprobs],
        finish=raw["finish"],
        error=error[:500],
        pieces=None if pieces is None else [bytes.fromhex(p) for p in pieces],
    )


@dataclass(frozen=True)
class CheckVerdict:
    """A check task's answer: the claimed output it judged (SHA-256), and how."""

    claimed: str
    passed: bool
    reason: str = ""
    tokens: int = 0
    greedy_gap: float = 0.0
    logprob_error: float = 0.0
    backend: str = ""
    # False: a pass within margins that over so few tokens prove nothing
    # (`check.decisive`: another build's check of a short shard).
    decides: bool = True


def write_verdict(verdict: CheckVerdict) -> bytes:
    return json.dumps(
        {
            "check": {
                "claimed": verdict.claimed,
                "passed": verdict.passed,
                "reason": verdict.reason[:500],
                "tokens": verdict.tokens,
                "greedy_gap": round(verdict.greedy_gap, 6),
                "logprob_error": round(verdict.logprob_error, 6),
                "backend": verdict.backend[:100],
                "decides": verdict.decides,
            }
        }
    ).encode()


def read_verdict(data: bytes) -> CheckVerdict | None:
    """A check task's verdict, or None if `data` is not one (a generation, or garbage)."""
    if not data.startswith(b'{"check"'):
        return None
    try:
        raw = json.loads(data)["check"]
        claimed, passed = raw["claimed"], raw["passed"]
        if not isinstance(claimed, str) or len(claimed) != 64 or not isinstance(passed, bool):
            return None
        return CheckVerdict(
            claimed=claimed,
            passed=passed,
            reason=str(raw.get("reason", ""))[:500],
            tokens=int(raw.get("tokens", 0)),
            greedy_gap=float(raw.get("greedy_gap", 0.0)),
            logprob_error=float(raw.get("logprob_error", 0.0)),
            backend=str(raw.get("backend", ""))[:100],
            decides=raw.get("decides", True) is not False,
        )
    except (ValueError, KeyError, TypeError):
        return None
