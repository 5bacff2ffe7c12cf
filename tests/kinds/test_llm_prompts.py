"""Prompts of llm-generate: JSON Lines parsed, chat templates rendered in the sandbox."""

from __future__ import annotations

import pytest

from idlegrid.kinds.base import InputError
from idlegrid.kinds.llm_generate.model import GgufFacts
from idlegrid.kinds.llm_generate.prompts import check_template, parse_prompts

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def facts(template: str | None = CHATML) -> GgufFacts:
    return GgufFacts(
        architecture="llama",
        file_bytes=1000,
        parameters=100,
        layers=2,
        embedding=64,
        heads=4,
        kv_heads=2,
        context_length=2048,
        vocab=100,
        quantization="Q4_1",
        chat_template=template,
    )


def test_prompts_and_messages_render_with_seeds() -> None:
    data = (
        b'{"prompt": "Once upon"}\n\n'
        b'{"messages": [{"role": "user", "content": "Hi"}], "seed": 99}\n'
    )
    first, second = parse_prompts(data, facts(), job_seed=10)
    assert (first.index, first.text, first.seed) == (0, "Once upon", 10)
    assert second.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert second.seed == 99


def test_a_broken_json_line_is_said_whole_with_the_fix() -> None:
    data = b'{"prompt": "a"}\n{"prompt": "an unfinished line}\n'
    with pytest.raises(InputError) as raised:
        parse_prompts(data, facts(), job_seed=0)
    assert str(raised.value) == (
        "prompts line 2: not JSON: Unterminated string starting at column 12; write each "
        'line as one JSON object, e.g. {"prompt": "..."} or {"messages": [...]}'
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"prompt": "a"}\n{"prompt": \n', "prompts line 2: not JSON"),
        (b'["a"]\n', "prompts line 1: expected an object"),
        (b'{"prompt": "a", "extra": 1}\n', "unknown keys ['extra']"),
        (b'{"prompt": ""}\n', "'prompt' must be a non-empty string"),
        (b'{"messages": [{"role": "god", "content": "x"}]}\n', "each message is"),
        (b'{"prompt": "a", "seed": -1}\n', "'seed' must be an integer"),
        (b"\n\n", "no prompt"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_lines_are_named(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_prompts(data, facts(), job_seed=0)


def test_messages_need_a_template() -> None:
    with pytest.raises(InputError, match="needs a chat template"):
        parse_prompts(b'{"messages": [{"role": "user", "content": "x"}]}', facts(None), job_seed=0)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}", "does not compile"),
        ("{{ raise_exception('no system role') }}", "raised: no system role"),
        ("{{ messages.__class__.__mro__ }}", "fails"),
        ("{{ ''.__class__.__subclasses__() }}", "fails"),
    ],
)
def test_templates_that_fail_in_the_sandbox(template: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        check_template(facts(template))
