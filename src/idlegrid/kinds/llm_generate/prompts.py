"""Prompts of an `llm-generate` job: JSON Lines in, rendered text out (on the coordinator).

Each non-blank line is an object: `{"prompt": "..."}` (the text as is) or
`{"messages": [{"role": ..., "content": ...}, ...]}`, rendered with the model's chat
template in jinja2's immutable sandbox (a template is the researcher's, so it may not
reach attributes or callables beyond plain data). An optional `"seed"` (an integer) picks
the sampler's draws for that prompt; without one a prompt's seed is the job's seed plus
its line's index among the prompts.

A file of OpenAI Batch API lines (`openai_batch`) is read too: each line's chat messages
or prompt, and its own sampling settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from idlegrid.kinds.base import InputError
from idlegrid.kinds.llm_generate import openai_batch
from idlegrid.kinds.llm_generate.shard import Request

if TYPE_CHECKING:
    from idlegrid.kinds.llm_generate.model import GgufFacts

MAX_PROMPTS = 100_000
MAX_MESSAGES = 256
MAX_PROMPT_CHARS = 1_000_000
ROLES = frozenset({"system", "user", "assistant", "tool"})
_PROBE = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye."},
]


@dataclass(frozen=True)
class Prompt:
    """One prompt as the worker sees it: its index in the input, its text and seed."""

    index: int
    text: str
    seed: int
    # A request's own settings (an OpenAI Batch API line's); None: the job's.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    request: Request | None = None


def parse_prompts(data: bytes, facts: GgufFacts, *, job_seed: int) -> list[Prompt]:
    """The prompts of a JSON Lines blob, rendered; InputError naming the line at fault."""
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts are not UTF-8 text (byte {exc.start})") from None
    prompts: list[Prompt] = []
    batch: bool | None = None  # whether the file is OpenAI Batch API lines
    seen: set[str] = set()
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        if len(prompts) >= MAX_PROMPTS:
            raise InputError(f"prompts: more than {MAX_PROMPTS} lines")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            # json's message ends where its position would go ("Unterminated string
            # starting at"): the column completes it.
            raise InputError(
                f"prompts line {number}: not JSON: {exc.msg} column {exc.colno}; write each "
                'line as one JSON object, e.g. {"prompt": "..."} or {"messages": [...]}'
            ) from None
        if batch is None:
            batch = openai_batch.is_batch_line(record)
        elif batch != openai_batch.is_batch_line(record):
            raise InputError(
                f"prompts line {number}: mixes OpenAI Batch API lines and prompt lines; a "
                "file holds one or the other"
            )
        default = job_seed + len(prompts)
        if batch:
            prompts.append(_batch_prompt(record, facts, number, len(prompts), default, seen))
            continue
        text = _text(record, facts, number)
        seed = _seed(record, number, default=default)
        prompts.append(Prompt(index=len(prompts), text=text, seed=seed))
    if not prompts:
        raise InputError("prompts: no prompt (every line is blank)")
    return prompts


def _batch_prompt(
    record: dict[str, Any], facts: GgufFacts, number: int, index: int, seed: int, seen: set[str]
) -> Prompt:
    line = openai_batch.read_line(record, number, seen)
    if line.messages is not None:
        messages = [
            {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
            for m in line.messages
        ]
        text = render_chat(facts, _messages(messages, number), where=f"line {number}")
    else:
        assert line.text is not None
        text = line.text
    if len(text) > MAX_PROMPT_CHARS:
        raise InputError(f"prompts line {number}: over {MAX_PROMPT_CHARS} characters")
    return Prompt(
        index=index,
        text=text,
        seed=seed if line.seed is None else line.seed,
        max_tokens=line.max_tokens,
        temperature=line.temperature,
        top_p=line.top_p,
        stop=line.stop,
        request=line.request,
    )


def _text(record: Any, facts: GgufFacts, number: int) -> str:
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise InputError(f"prompts line {number}: expected an object with 'prompt' or 'messages'")
    unknown = set(record) - {"prompt", "messages", "seed"}
    if unknown:
        raise InputError(f"prompts line {number}: unknown keys {sorted(unknown)}")
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text:
            raise InputError(f"prompts line {number}: 'prompt' must be a non-empty string")
    else:
        text = render_chat(facts, _messages(record["messages"], number), where=f"line {number}")
    if len(text) > MAX_PROMPT_CHARS:
        raise InputError(f"prompts line {number}: over {MAX_PROMPT_CHARS} characters")
    return text


def _messages(messages: Any, number: int) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise InputError(f"prompts line {number}: 'messages' must be a list of 1 to {MAX_MESSAGES}")
    checked = []
    for message in messages:
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in ROLES
            or not isinstance(message["content"], str)
        ):
            raise InputError(
                f"prompts line {number}: each message is {{'role': one of {sorted(ROLES)}, "
                "'content': a string}"
            )
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def _seed(record: dict[str, Any], number: int, *, default: int) -> int:
    seed = record.get("seed", default)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise InputError(f"prompts line {number}: 'seed' must be an integer from 0 to 2^63-1")
    return seed


def render_chat(facts: GgufFacts, messages: list[dict[str, str]], *, where: str) -> str:
    """`messages` through the model's chat template, in jinja2's sandbox."""
    if facts.chat_template is None:
        raise InputError(f"prompts {where}: 'messages' needs a chat template; the model has none")
    try:
        return _compiled(facts.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=facts.bos_token,
            eos_token=facts.eos_token,
        )
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error of a template is the researcher's
        raise InputError(f"prompts {where}: the chat template fails: {exc}") from None


def check_template(facts: GgufFacts) -> None:
    """InputError unless the model's chat template renders a short conversation."""
    try:
        render_chat(facts, list(_PROBE), where="check")
    except InputError as exc:
        raise InputError(f"model chat template does not render in the sandbox: {exc}") from None


def _compiled(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InputError(f"the chat template raised: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise InputError(f"the chat template does not compile: {exc}") from None
