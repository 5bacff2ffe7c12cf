"""A researcher's Hugging Face model as data: its tensors from its config, its checks.

The tensor list `hf_models` computes (numpy, no transformers) must be what transformers
builds for each allowlisted model type; every refusal names its problem.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hf_helpers import config_of, needs_transformers, tiny_folder, tokenizer_json

from idlegrid.training import hf_folder, hf_models

MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_entries_are_the_tensors_transformers_builds(model_type: str, tied: bool) -> None:
    transformers = needs_transformers()
    config = config_of(model_type, tied=tied)
    module = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    built = [(name, tuple(p.shape)) for name, p in module.named_parameters()]
    assert hf_models.entries(hf_models.check_config(config)) == built


def test_qwen2_and_attention_bias_give_biases() -> None:
    names = {name for name, _ in hf_models.entries(config_of("llama", attention_bias=True))}
    assert "model.layers.0.self_attn.o_proj.bias" in names
    names = {name for name, _ in hf_models.entries(config_of("qwen2"))}
    assert "model.layers.1.self_attn.v_proj.bias" in names


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"auto_map": {"AutoModelForCausalLM": "modeling.Mine"}}, "remote code (auto_map)"),
        ({"trust_remote_code": True}, "remote code (trust_remote_code)"),
        ({"model_type": "my-own-net"}, "model_type 'my-own-net' is not supported"),
        ({"hidden_size": -4}, "hidden must be an integer"),
        ({"num_hidden_layers": 10_000}, "at most 512"),
        ({"vocab_size": "many"}, "vocab_size must be an integer"),
        ({"hidden_size": 30, "head_dim": None}, "not a multiple of 4 attention heads"),
        ({"num_key_value_heads": 3}, "not a multiple of 3 key-value heads"),
    ],
)
def test_configs_refused_name_the_problem(change: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError) as raised:
        hf_models.check_config({**config_of("llama"), **change})
    assert problem in str(raised.value)


def test_lora_lists_adapters_of_the_chosen_projections() -> None:
    config = config_of("llama")
    lora = hf_models.LoraSettings(rank=4, targets=("q_proj", "v_proj"))
    adapters = hf_models.lora_entries(config, lora)
    assert adapters[:2] == [("model.layers.0.self_attn.q_proj.lora_A", (4, 32)),
                            ("model.layers.0.self_attn.q_proj.lora_B", (32, 4))]  # fmt: skip
    assert ("model.layers.1.self_attn.v_proj.lora_B", (16, 4)) in adapters
    assert len(adapters) == 2 * 2 * 2
    gpt2 = hf_models.lora_entries(config_of("gpt2"), hf_models.LoraSettings(targets=("c_attn",)))
    assert gpt2[0] == ("transformer.h.0.attn.c_attn.lora_A", (8, 32))
    with pytest.raises(ValueError, match="not modules of a gpt2 model"):
        hf_models.lora_targets(config_of("gpt2"), lora)


def _blob(folder: Path, **change: object) -> bytes:
    model = hf_folder.read_folder(folder)
    return hf_folder.model_blob(
        hf_folder.HFModel(model.config, {**model.weights, **change}, model.tokenizer)  # type: ignore[dict-item]
    )


def test_a_folder_round_trips_and_bad_weights_name_the_tensor(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path / "m")
    model = hf_folder.read_model_blob(_blob(folder), max_parameters=10**9)
    assert list(model.weights) == [name for name, _ in hf_models.entries(model.config)]
    weights = hf_folder.read_folder(folder).weights
    wrong = np.zeros((3, 32), dtype=np.float32)
    with pytest.raises(hf_folder.ModelError, match=r"model\.norm\.weight has shape \(3, 32\)"):
        hf_folder.read_model_blob(
            _blob(folder, **{"model.norm.weight": wrong}), max_parameters=10**9
        )
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    blob = hf_folder.model_blob(hf_folder.HFModel(model.config, missing, None))
    with pytest.raises(hf_folder.ModelError, match=r"up_proj\.weight \(64, 32\) is missing"):
        hf_folder.read_model_blob(blob, max_parameters=10**9)
    extra = _blob(folder, **{"model.layers.9.extra.weight": wrong})
    with pytest.raises(hf_folder.ModelError, match="layers.9.extra.weight is not a parameter"):
        hf_folder.read_model_blob(extra, max_parameters=10**9)
    with pytest.raises(hf_folder.ModelError, match="over this job's limit max_parameters=1,000"):
        hf_folder.read_model_blob(_blob(folder), max_parameters=1000)


def test_full_training_starts_from_the_folder_s_own_weights(tmp_path: Path) -> None:
    """A safetensors file keeps its tensors by name (layers.0.input_layernorm before
    layers.0.self_attn); the flat vector must follow the config, as the workers read it."""
    transformers = needs_transformers()
    import torch

    from idlegrid.training import hf_torch, models

    folder = tiny_folder(tmp_path / "m")
    model = hf_folder.read_folder(folder)
    assert list(model.weights) == [name for name, _ in hf_models.entries(model.config)]
    config = models.parse_config("hf-causal-lm", {"config": model.config, "base": "m"})
    module, _ = hf_torch.load(config, hf_folder.flat_weights(model), "cpu", None)
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, parameter in saved.named_parameters():
        assert torch.equal(module.get_parameter(name), parameter), name


def test_a_tokenizer_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    model = hf_folder.read_folder(tiny_folder(tmp_path / "m"))
    broken = hf_folder.HFModel(model.config, model.weights, '{"model": {"type": "Nonsense"}}')
    with pytest.raises(hf_folder.ModelError, match="tokenizer.json does not parse"):
        hf_folder.read_model_blob(hf_folder.model_blob(broken), max_parameters=10**9)
    ids = hf_folder.tokenize(tokenizer_json(), "the cat sat\non the mat .\n")
    assert ids.dtype == np.int32 and ids.tolist()[:3] == [33, 34, 35]


def test_bfloat16_weights_are_widened_exactly(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save

    values = torch.tensor([[1.5, -2.25], [3.0e-3, 7.0]], dtype=torch.bfloat16)
    read = hf_folder.read_safetensors(save({"w": values}))
    np.testing.assert_array_equal(read["w"], values.float().numpy())


def test_memory_need_grows_with_micro_batch_and_falls_with_checkpointing() -> None:
    config = config_of("llama")
    need = {
        (micro, ckpt): hf_models.memory_need_mb(
            config, trainable=10_000, micro_batch=micro, seq_len=64, checkpointing=ckpt
        )
        for micro in (1, 64) for ckpt in (False, True)
    }  # fmt: skip
    assert need[(64, False)] > need[(1, False)] >= 256
    assert need[(64, True)] < need[(64, False)]
    smol = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "tie_word_embeddings": True}  # fmt: skip
    # SmolLM2-135M: 134.5M parameters (transformers counts the same).
    assert hf_models.parameter_count(smol) == 134_515_008
    full = hf_models.memory_need_mb(smol, trainable=134_515_008, micro_batch=8, seq_len=256,
                                    checkpointing=False)  # fmt: skip
    assert 3_000 < full < 12_000
