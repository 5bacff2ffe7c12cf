"""A trained model comes back whole: the folder that was submitted, its tokenizer settings,
chat template and generation config included, with trained weights (LoRA merged in) or
as a PEFT adapter folder that peft loads; and `export-gguf` refuses what llama.cpp
cannot take, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hf_helpers import needs_transformers, tiny_folder

from idlegrid.cli.main import main
from idlegrid.training import hf_folder, hf_models

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
SIDE = {
    "tokenizer_config.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                         "unk_token": "<unk>",
                                         "tokenizer_class": "PreTrainedTokenizerFast"}),
    "chat_template.jinja": TEMPLATE,
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3],
                                          "max_new_tokens": 7}),
    "special_tokens_map.json": json.dumps({"eos_token": "</s>"}),
}  # fmt: skip


def _chatty_folder(folder: Path, model_type: str = "llama") -> Path:
    tiny_folder(folder, model_type)
    for name, text in SIDE.items():
        (folder / name).write_text(text)
    return folder


def _adapters(model: hf_folder.HFModel, lora: hf_models.LoraSettings) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {name: rng.normal(0, 0.05, size=shape).astype(np.float32)
            for name, shape in hf_models.lora_entries(model.config, lora)}  # fmt: skip


def test_the_side_files_travel_in_the_model_blob(tmp_path: Path) -> None:
    needs_transformers()
    model = hf_folder.read_folder(_chatty_folder(tmp_path / "m"))
    assert dict(model.files) == SIDE
    checked = hf_folder.read_model_blob(hf_folder.model_blob(model), max_parameters=10**9)
    assert dict(checked.files) == SIDE


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"modeling_llama.py": "import os"}, "'modeling_llama.py' is not a file a model"),
        ({"tokenizer_config.json": "{"}, "tokenizer_config.json is not JSON"),
        ({"generation_config.json": "[1]"}, "generation_config.json must be a JSON object"),
        ({"tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": "x.Tok"}})},
         "tokenizer_config.json asks for remote code (auto_map)"),
        ({"chat_template.jinja": 5}, "chat_template.jinja must be text"),
    ],
)  # fmt: skip
def test_the_coordinator_refuses_side_files_that_are_not_data(
    tmp_path: Path, files: dict[str, object], problem: str
) -> None:
    needs_transformers()
    model = hf_folder.read_folder(tiny_folder(tmp_path / "m"))
    blob = hf_folder.model_blob(hf_folder.HFModel(model.config, model.weights, model.tokenizer,
                                                  files))  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(hf_folder.ModelError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        hf_folder.read_model_blob(blob, max_parameters=10**9)


def test_a_merged_result_is_the_submitted_folder_with_trained_weights(tmp_path: Path) -> None:
    transformers = needs_transformers()
    import torch

    base = hf_folder.read_folder(_chatty_folder(tmp_path / "base"))
    lora = hf_models.LoraSettings(rank=2, targets=("q_proj", "v_proj"))
    adapters = _adapters(base, lora)
    assert hf_folder.write_result(tmp_path / "out", base, adapters, lora) == "model"
    for name, text in SIDE.items():
        assert (tmp_path / "out" / name).read_text() == text, name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    chat = [{"role": "user", "content": "the cat"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|user|>the cat\n<|assistant|>"
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.eos_token_id == [2, 3] and generation.max_new_tokens == 7
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ids = torch.tensor([[33, 34, 35]])
    with torch.no_grad():
        assert not torch.allclose(merged(input_ids=ids).logits, plain(input_ids=ids).logits)


# peft asks transformers a question under its deprecated name.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(("model_type", "targets"), [("llama", ("q_proj", "v_proj", "down_proj")),
                                                     ("gpt2", ("c_attn", "c_fc"))])  # fmt: skip
def test_an_adapter_result_loads_in_peft_as_the_merged_one_answers(
    tmp_path: Path, model_type: str, targets: tuple[str, ...]
) -> None:
    transformers = needs_transformers()
    import torch
    from peft import AutoPeftModelForCausalLM

    base_folder = _chatty_folder(tmp_path / "base", model_type)
    base = hf_folder.read_folder(base_folder)
    merged_lora = hf_models.LoraSettings(rank=2, alpha=8.0, targets=targets)
    adapter_lora = merged_lora.model_copy(update={"result": "adapter"})
    adapters = _adapters(base, merged_lora)
    hf_folder.write_result(tmp_path / "merged", base, adapters, merged_lora)
    written = hf_folder.write_result(
        tmp_path / "adapter", base, adapters, adapter_lora, base_path=base_folder
    )
    assert written == "adapter"
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    assert (tmp_path / "adapter" / "chat_template.jinja").read_text() == TEMPLATE
    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[33, 34, 35, 36]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits,
                                   merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)  # fmt: skip
    # And back: the adapter folder reads as the adapters it holds.
    read_lora, read = hf_folder.read_adapter_folder(tmp_path / "adapter")
    assert read_lora.rank == 2 and read_lora.alpha == 8.0 and set(read_lora.targets) == set(targets)
    assert set(read) == set(adapters)
    assert all(np.array_equal(read[name], adapters[name]) for name in adapters)


def test_export_gguf_names_what_llama_cpp_cannot_take(tmp_path: Path) -> None:
    needs_transformers()
    folder = _chatty_folder(tmp_path / "m")  # a word-level tokenizer
    shown = CliRunner().invoke(main, ["model", "export-gguf", str(folder),
                                      str(tmp_path / "m.gguf")])  # fmt: skip
    assert shown.exit_code == 1
    assert "tokenizer.json's model is 'WordLevel'; llama.cpp takes BPE tokenizers" in shown.output
    assert not (tmp_path / "m.gguf").exists()
    shown = CliRunner().invoke(main, ["model", "export-gguf", str(folder), str(tmp_path / "x"),
                                      "--type", "q3_xx"])  # fmt: skip
    assert shown.exit_code == 2 and "q4_k_m" in shown.output
