"""Trimmed Hugging Face models for the hf-causal-lm tests: a few layers, a small vocabulary.

Each is made by transformers itself (`from_config`, `save_pretrained`), so the tests check
idlegrid's reading of a folder against what transformers writes. Without transformers
(the worker extra) the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

VOCAB = 48
SIZES: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "qwen2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "mistral": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
}  # fmt: skip


def needs_transformers() -> Any:
    """transformers, or a skip (a failure under CI=true)."""
    try:
        import transformers
    except ImportError:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail("transformers is not installed; CI=true requires the worker extra")
        pytest.skip("transformers is not installed: pip install 'idlegrid[worker]'")
    return transformers


def config_of(model_type: str, *, tied: bool = True, **extra: Any) -> dict[str, Any]:
    """A trimmed config as transformers writes it."""
    transformers = needs_transformers()
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, tie_word_embeddings=tied, **special,
        **{**SIZES[model_type], **extra},
    )  # fmt: skip
    return dict(config.to_dict())


def tiny_folder(
    folder: Path, model_type: str = "llama", *, tied: bool = True, seed: int = 0, **extra: Any
) -> Path:
    """A trimmed model saved by transformers, with a word-level tokenizer.json."""
    transformers = needs_transformers()
    import torch

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**config_of(model_type, tied=tied, **extra))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    return folder


def tokenizer_json() -> str:
    """A byte-free word-level tokenizer over a few words (ids < VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(30)), "the", "cat", "sat", "on",
             "mat", "a", "dog", "ran", ".", ",", "\n"]  # fmt: skip
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return str(tokenizer.to_str())


def text(lines: int = 400, seed: int = 0) -> str:
    """Text in the tokenizer's words with some structure to learn."""
    rng = np.random.default_rng(seed)
    sentences = [
        "the cat sat on the mat .",
        "a dog ran on the mat .",
        "the dog sat , the cat ran .",
    ]
    return "\n".join(str(sentences[int(i)]) for i in rng.integers(0, 3, size=lines)) + "\n"


def read_config(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "config.json").read_text()))
