"""OpenAI Batch API files through llm-generate: input lines as OpenAI's Batch API
documentation shows them (chat and text completions, each with its own settings), output
lines in its shape, and every unsupported line or field refused by line and name."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from grids import serving
from llm_model import model_path

from idlegrid.client import Client, IdlegridError
from idlegrid.kinds import get_kind
from idlegrid.kinds.base import InputError, RunContext
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker import hardware
from idlegrid.worker.daemon import Worker

KIND = get_kind("llm-generate")

# The shape of the Batch API's documented input file ("Preparing your batch file"), with
# this grid's small model's few tokens.
BATCH = [
    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-3.5-turbo-0125",
              "messages": [{"role": "system", "content": "You are a helpful assistant."},
                           {"role": "user", "content": "Hello world!"}],
              "max_tokens": 8}},
    {"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-3.5-turbo-0125",
              "messages": [{"role": "system", "content": "You are an unhelpful assistant."},
                           {"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}],
              "max_completion_tokens": 6, "temperature": 0.7, "top_p": 0.9, "seed": 42,
              "logprobs": True, "n": 1}},
    {"custom_id": "request-3", "method": "POST", "url": "/v1/completions",
     "body": {"model": "smollm2", "prompt": "1, 2, 3, 4,", "max_tokens": 8, "stop": ["7"],
              "temperature": 0, "logprobs": 1}},
]  # fmt: skip


def jsonl(records: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def model() -> bytes:
    return model_path().read_bytes()


def run_job(model: bytes, records: list[Any], tmp_path: Path) -> list[dict[str, Any]]:
    inputs = {"model": model, "prompts": jsonl(records)}
    params = KIND.derive_params(inputs, KIND.parse_params({}))
    shards = KIND.split(inputs, params)
    blobs = {hashlib.sha256(model).hexdigest(): model}
    ctx = RunContext(threads=1, fetch=blobs.__getitem__, scratch=tmp_path / "s" / "t", sequences=4)
    outputs = [KIND.run(s.payload, params, ctx) for s in shards]
    for shard, output in zip(shards, outputs, strict=True):
        KIND.check_output(shard.payload, output, params)
    result = KIND.assemble_with_inputs([s.payload for s in shards], outputs, params)
    return [json.loads(line) for line in result.decode().splitlines()]


def assert_output_line(line: dict[str, Any], request: dict[str, Any]) -> None:
    """One line as the Batch API's output file has it."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["custom_id"] == request["custom_id"] and line["error"] is None
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
    body = response["body"]
    chat = request["url"] == "/v1/chat/completions"
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["model"] == request["body"]["model"] and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    if chat:
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
    else:
        assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    most = request["body"].get("max_tokens") or request["body"].get("max_completion_tokens")
    assert usage["completion_tokens"] <= most
    if request["body"].get("logprobs") and not chat:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"])
        assert choice["text"] in "".join(logprobs["tokens"])
        assert logprobs["text_offset"][0] == 0
    elif request["body"].get("logprobs"):
        content = choice["logprobs"]["content"]
        assert len(content) == usage["completion_tokens"]
        text = b"".join(bytes(entry["bytes"]) for entry in content).decode(errors="replace")
        assert choice["message"]["content"] in text
        assert all(e["logprob"] <= 0 and isinstance(e["token"], str) for e in content)
    else:
        assert choice["logprobs"] is None


def test_a_batch_file_comes_back_as_batch_output_lines(model: bytes, tmp_path: Path) -> None:
    lines = run_job(model, BATCH, tmp_path)
    assert [line["custom_id"] for line in lines] == ["request-1", "request-2", "request-3"]
    for line, request in zip(lines, BATCH, strict=True):
        assert_output_line(line, request)
    # Each line's own settings held: request-3 stopped before its stop string.
    text = lines[2]["response"]["body"]["choices"][0]["text"]
    assert "7" not in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["body"].update(tools=[]), "line 2: body field 'tools' is not supported"),
        (lambda r: r.update(url="/v1/embeddings"), "line 2: 'url' '/v1/embeddings' is not an"),
        (lambda r: r["body"].update(n=2), "line 2: body field 'n' must be 1"),
        (lambda r: r.update(custom_id="request-1"), "line 2: 'custom_id' 'request-1' is used"),
        (lambda r: r.update(extra=1), "line 2: unknown field 'extra'"),
        (lambda r: r["body"].update(stream=True), "line 2: body field 'stream' = True"),
        (
            lambda r: r["body"].update(max_completion_tokens=0),
            "line 2: body field 'max_completion_tokens' must",
        ),
        (lambda r: r["body"].update(temperature=3), "line 2: body field 'temperature' must be"),
    ],
)
def test_an_unsupported_line_is_named(model: bytes, change: Any, message: str) -> None:
    records = json.loads(json.dumps(BATCH))
    change(records[1])
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        KIND.derive_params({"model": model, "prompts": jsonl(records)}, KIND.parse_params({}))


def test_a_broken_or_mixed_file_is_named(model: bytes) -> None:
    broken = jsonl(BATCH[:1]) + b'{"custom_id": "x", "body": {\n'
    with pytest.raises(InputError, match=r"line 2: not JSON: .* column \d+"):
        KIND.derive_params({"model": model, "prompts": broken}, KIND.parse_params({}))
    mixed = jsonl([BATCH[0], {"prompt": "Hi"}])
    with pytest.raises(InputError, match="line 2: mixes OpenAI Batch API lines and prompt"):
        KIND.derive_params({"model": model, "prompts": mixed}, KIND.parse_params({}))


async def test_a_batch_file_through_the_grid(tmp_path: Path) -> None:
    """Submitted with the SDK as a file, generated by a worker daemon and checked by
    others, fetched as Batch API output lines; a bad file is a 422 naming its line."""
    url_settings = CoordinatorSettings(
        data_dir=tmp_path / "coordinator", heartbeat_interval_s=0.2,
        distinct_accounts=False, distinct_networks=False,
    )  # fmt: skip
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_bytes(jsonl(BATCH))
    async with serving(url_settings) as url:
        client = Client(url, token=url_settings.admin_token_file.read_text().strip())
        workers = [await _worker(client, url, tmp_path / f"w{i}") for i in range(3)]
        runs = [asyncio.create_task(w.run()) for w in workers]
        try:
            job = await asyncio.to_thread(client.generate, model_path(), batch_file)
            await asyncio.to_thread(job.wait, timeout=300, poll_s=0.2)
            lines = await asyncio.to_thread(job.result)
            for line, request in zip(lines, BATCH, strict=True):
                assert_output_line(line, request)
            bad = json.loads(json.dumps(BATCH))
            bad[2]["body"]["n"] = 3
            batch_file.write_bytes(jsonl(bad))
            with pytest.raises(IdlegridError) as refused:
                await asyncio.to_thread(client.generate, model_path(), batch_file)
            assert refused.value.status == 422 and "line 3" in str(refused.value)
        finally:
            for worker in workers:
                worker.stop()
            await asyncio.gather(*runs)
            client.close()


async def _worker(client: Client, url: str, state: Path) -> Worker:
    token = (await asyncio.to_thread(client.create_token, kind="node"))["token"]
    worker = Worker(
        WorkerSettings(
            servers=(url,), token=token, state_dir=state, benchmark=False, dedicated=True,
            control_port=-1, kinds=("llm-generate",), threads=1, sequences=4,
        )
    )  # fmt: skip
    worker.hardware = HardwareProfile(
        memory_mb=hardware.memory_mb(),
        disk_free_mb=hardware.disk_free_mb(state),
        llama=hardware.llama_info(),
    )
    return worker
