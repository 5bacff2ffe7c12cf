"""OpenAI Batch API files: input lines read as prompts, results written as output lines.

An input line is `{"custom_id", "method": "POST", "url", "body"}` with `url`
"/v1/chat/completions" (a body with `messages`) or "/v1/completions" (a body with
`prompt`), as OpenAI's Batch API, vLLM's `run_batch` and other providers take them. The
body's sampling settings apply to that line alone: `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`, `logprobs`, `n` = 1.
Fields that change nothing here (`model`, `user`, `stream` false, penalties of 0,
`store`, `metadata`) are accepted; any other is refused with its line and name.

An output line is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`, the body a chat completion (or a text completion) with `choices`,
`usage` and, where the line asked, `logprobs`; a request that could not run has
`response` null and `error` saying why.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from idlegrid.kinds.base import InputError
from idlegrid.kinds.llm_generate.shard import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOKENS_CAP,
    Completion,
    Payload,
    Request,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
MAX_CUSTOM_ID = 256
# Body fields that change nothing in a batch here, accepted as OpenAI's clients send them.
_IGNORED = frozenset({"model", "user", "store", "metadata", "service_tier"})
# Fields accepted only at the value that means "off".
_OFF: dict[str, Callable[[Any], bool]] = {
    "stream": lambda v: v is False or v is None,
    "frequency_penalty": lambda v: v in (0, 0.0, None),
    "presence_penalty": lambda v: v in (0, 0.0, None),
    "echo": lambda v: v is False or v is None,
    "top_logprobs": lambda v: v in (0, None),
    "best_of": lambda v: v in (1, None),
    "logit_bias": lambda v: v in ({}, None),
    "stream_options": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
}
_SETTINGS = frozenset(
    {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs"}
)


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file: its prompt (messages or text), its own settings and
    where it came from."""

    request: Request
    messages: list[dict[str, str]] | None
    text: str | None
    seed: int | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...] | None


def is_batch_line(record: Any) -> bool:
    return isinstance(record, dict) and "custom_id" in record


def read_line(record: dict[str, Any], number: int, seen: set[str]) -> BatchLine:
    """One OpenAI Batch API input line; InputError naming the line and the field."""
    where = f"prompts line {number}"
    custom_id, url, body = _envelope(record, where, seen)
    _check_body_fields(body, url, where)
    messages, text = None, None
    if url == CHAT:
        messages = _messages(body.get("messages"), where)
    else:
        text = _prompt(body.get("prompt"), where)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool | int) or logprobs is None:
        raise InputError(f"{where}: body field 'logprobs' must be true or false")
    model = body.get("model", "")
    return BatchLine(
        request=Request(
            custom_id=custom_id,
            url=url,
            model=model if isinstance(model, str) else "",
            logprobs=bool(logprobs),
        ),
        messages=messages,
        text=text,
        seed=_integer(body, "seed", where, 0, 2**63 - 1),
        max_tokens=_max_tokens(body, where),
        temperature=_number(body, "temperature", where, 0.0, 2.0),
        top_p=_number(body, "top_p", where, 0.0, 1.0, open_low=True),
        stop=_stop(body.get("stop"), where),
    )


def _envelope(
    record: dict[str, Any], where: str, seen: set[str]
) -> tuple[str, str, dict[str, Any]]:
    """A line's own fields, checked: its custom_id (added to `seen`), url and body."""
    unknown = set(record) - LINE_KEYS
    if unknown:
        raise InputError(f"{where}: unknown field {sorted(unknown)[0]!r} (a batch line has "
                         "custom_id, method, url, body)")  # fmt: skip
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID:
        raise InputError(
            f"{where}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters"
        )
    if custom_id in seen:
        raise InputError(f"{where}: 'custom_id' {custom_id!r} is used by an earlier line")
    seen.add(custom_id)
    if record.get("method", "POST") != "POST":
        raise InputError(f"{where}: 'method' must be \"POST\"")
    url = record.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise InputError(
            f"{where}: 'url' {url!r} is not an endpoint this grid runs ({CHAT} or {COMPLETIONS})"
        )
    body = record.get("body")
    if not isinstance(body, dict):
        raise InputError(f"{where}: 'body' must be an object")
    return custom_id, url, body


def _check_body_fields(body: dict[str, Any], url: str, where: str) -> None:
    """Refuse a body field the endpoint lacks, one set away from its default, and n != 1."""
    prompt_field = "messages" if url == CHAT else "prompt"
    allowed = _SETTINGS | _IGNORED | set(_OFF) | {prompt_field}
    for name in sorted(body):
        if name not in allowed:
            raise InputError(f"{where}: body field {name!r} is not supported for {url}")
        if name in _OFF and not _OFF[name](body[name]):
            raise InputError(
                f"{where}: body field {name!r} = {body[name]!r} is not supported (only its default)"
            )
    if body.get("n", 1) != 1:
        raise InputError(f"{where}: body field 'n' must be 1 (one completion per line)")


def _messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: body field 'messages' must be a non-empty list")
    checked = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InputError(f"{where}: each message is an object with 'role' and 'content'")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise InputError(f"{where}: message field {sorted(extra)[0]!r} is not supported")
        checked.append(
            {"role": message["role"], "content": _content(message.get("content"), where)}
        )
    return checked


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise InputError(f"{where}: a message's 'content' must be a string or a list of text parts")


def _prompt(prompt: Any, where: str) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise InputError(f"{where}: body field 'prompt' must be a non-empty string")
    return prompt


def _max_tokens(body: dict[str, Any], where: str) -> int | None:
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise InputError(f"{where}: give 'max_tokens' or 'max_completion_tokens', not both")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return _integer(body, name, where, 1, MAX_TOKENS_CAP)


def _integer(body: dict[str, Any], name: str, where: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InputError(f"{where}: body field {name!r} must be an integer from {low} to {high}")
    return value


def _number(
    body: dict[str, Any], name: str, where: str, low: float, high: float, *, open_low: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    fits = isinstance(value, int | float) and not isinstance(value, bool)
    if not fits or not (low < value <= high if open_low else low <= value <= high):
        bound = f"over {low}" if open_low else f"from {low}"
        raise InputError(f"{where}: body field {name!r} must be a number {bound} to {high}")
    return float(value)


def _stop(stop: Any, where: str) -> tuple[str, ...] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise InputError(
            f"{where}: body field 'stop' must be a string or a list of up to {MAX_STOPS} "
            f"strings of 1 to {MAX_STOP_CHARS} characters"
        )
    return tuple(stops)


# -- output ---------------------------------------------------------------------------


def write_lines(
    payloads: Sequence[Payload], completions: dict[int, Completion], *, created: int | None = None
) -> bytes:
    """The job's result as OpenAI Batch API output lines, in input order; `created`: the
    Unix time the completions carry (default: now)."""
    created = int(time.time()) if created is None else created
    prompts = sorted((p for payload in payloads for p in payload.prompts), key=lambda p: p.index)
    lines = []
    for prompt in prompts:
        assert prompt.request is not None
        record = _line(prompt.request, prompt.prompt_tokens, completions[prompt.index], created)
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def _line(request: Request, prompt_tokens: int, completion: Completion, created: int) -> dict:
    digest = hashlib.sha256(request.custom_id.encode()).hexdigest()[:24]
    if completion.finish == "error":
        return {
            "id": f"batch_req_{digest}",
            "custom_id": request.custom_id,
            "response": None,
            "error": {"code": "context_length_exceeded", "message": completion.error},
        }
    chat = request.url == CHAT
    choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": completion.text}
    else:
        choice["text"] = completion.text
    if not request.logprobs:
        choice["logprobs"] = None
    else:
        choice["logprobs"] = _logprobs(completion) if chat else _text_logprobs(completion)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{digest}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion.tokens),
            "total_tokens": prompt_tokens + len(completion.tokens),
        },
    }
    return {
        "id": f"batch_req_{digest}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{digest}", "body": body},
        "error": None,
    }


def _text_logprobs(completion: Completion) -> dict[str, Any]:
    """A text completion's log-probabilities, as /v1/completions writes them."""
    pieces = completion.pieces or [b""] * len(completion.tokens)
    tokens = [piece.decode("utf-8", errors="replace") for piece in pieces]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(completion.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _logprobs(completion: Completion) -> dict[str, Any]:
    """A chat completion's log-probabilities, as /v1/chat/completions writes them."""
    pieces = completion.pieces or [b""] * len(completion.tokens)
    return {
        "content": [
            {
                "token": piece.decode("utf-8", errors="replace"),
                "token_id": token,
                "logprob": logprob,
                "bytes": list(piece),
                "top_logprobs": [],
            }
            for token, logprob, piece in zip(
                completion.tokens, completion.logprobs, pieces, strict=True
            )
        ]
    }
