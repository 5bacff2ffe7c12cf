"""A researcher's Hugging Face causal language model, as data: config, tensor list, limits.

A model arrives as a `config.json` (its `model_type` one of `MODEL_TYPES`, built into the
pinned transformers), named float weights and optionally a `tokenizer.json`. Nothing in it
is code: a config asking for remote code (`auto_map`, `trust_remote_code`) is refused, and
the tensor names and shapes a config implies are computed here, numpy only, so the
coordinator checks a model's weights against its config without torch or transformers.

LoRA: `lora_entries` lists the adapter's tensors (A: rank x in, B: out x rank) for the
chosen target modules, in a fixed order; only these train and travel, the base stays put.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from idlegrid.training.flat import FlatSpec

MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2")
# Keys that would make transformers import code shipped with the model.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
# Llama-family projections LoRA may adapt; GPT-2's fused ones.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
_MAX_DIM = 1 << 20
_MAX_LAYERS = 512


class LoraSettings(BaseModel):
    """Low-rank adapters (peft's LoRA) on `targets`; only the adapters train and travel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(default=8, ge=1, le=1024)
    alpha: float = Field(default=16.0, gt=0.0, le=1e6)
    targets: tuple[str, ...] = Field(default=("q_proj", "v_proj"), min_length=1, max_length=8)
    result: Literal["merged", "adapter"] = Field(
        default="merged",
        description="what the trained model comes back as: the model folder with the "
        "adapters merged into its weights, or a PEFT adapter folder",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(targets) - set(LLAMA_TARGETS) - set(GPT2_TARGETS))
        if unknown:
            known = ", ".join((*LLAMA_TARGETS, *GPT2_TARGETS))
            raise ValueError(f"unknown LoRA targets {unknown}; known: {known}")
        return targets

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class HFConfig(BaseModel):
    """A Hugging Face causal LM; `config` and `base` follow from the job's `model` input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: dict[str, Any] = Field(default_factory=dict, description="its config.json")
    base: str | None = Field(default=None, description="SHA-256 of the `model` input blob")
    lora: LoraSettings | None = Field(default=None, description="train adapters only")
    max_parameters: int = Field(default=2_000_000_000, ge=1, description="refuse larger models")
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _valid_config(self) -> HFConfig:
        if self.config:
            check_config(self.config)
            if self.lora is not None:
                lora_targets(self.config, self.lora)
        return self

    def base_parameters(self) -> int:
        """Parameters of the whole model (trained or frozen)."""
        return parameter_count(self.config)


def check_config(raw: object) -> dict[str, Any]:
    """The config, checked: an allowlisted model type, no remote code, sane sizes.

    ValueError names the problem. Returns a plain copy of the dict.
    """
    if not isinstance(raw, Mapping):
        raise ValueError("config.json must be a JSON object")
    config = dict(raw)
    remote = [key for key in REMOTE_CODE_KEYS if config.get(key)]
    if remote:
        raise ValueError(f"config asks for remote code ({', '.join(remote)}): refused, "
                         "a model is data and never code")  # fmt: skip
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(MODEL_TYPES)}")  # fmt: skip
    sizes = _gpt2_sizes(config) if model_type == "gpt2" else _llama_sizes(config)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_DIM:
            raise ValueError(f"config {name} must be an integer in 1..{_MAX_DIM}, got {value!r}")
    if sizes["layers"] > _MAX_LAYERS:
        raise ValueError(f"config has {sizes['layers']} layers; at most {_MAX_LAYERS}")
    if sizes["hidden"] % sizes["heads"] and config.get("head_dim") is None:
        raise ValueError(f"hidden size {sizes['hidden']} is not a multiple of "
                         f"{sizes['heads']} attention heads")  # fmt: skip
    if sizes.get("kv_heads", 1) > sizes["heads"] or sizes["heads"] % sizes.get("kv_heads", 1):
        raise ValueError(f"{sizes['heads']} attention heads are not a multiple of "
                         f"{sizes.get('kv_heads')} key-value heads")  # fmt: skip
    return config


def _llama_sizes(config: Mapping[str, Any]) -> dict[str, Any]:
    heads = config.get("num_attention_heads")
    sizes = {
        "vocab_size": config.get("vocab_size"),
        "hidden": config.get("hidden_size"),
        "intermediate_size": config.get("intermediate_size"),
        "layers": config.get("num_hidden_layers"),
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads", heads),
    }
    if config.get("head_dim") is not None:
        sizes["head_dim"] = config["head_dim"]
    return sizes


def _gpt2_sizes(config: Mapping[str, Any]) -> dict[str, Any]:
    sizes = {
        "vocab_size": config.get("vocab_size", 50257),
        "hidden": config.get("n_embd", 768),
        "layers": config.get("n_layer", 12),
        "heads": config.get("n_head", 12),
        "n_positions": config.get("n_positions", 1024),
    }
    if config.get("n_inner") is not None:
        sizes["n_inner"] = config["n_inner"]
    return sizes


def vocab_size(config: Mapping[str, Any]) -> int:
    return int(config.get("vocab_size", 50257 if config.get("model_type") == "gpt2" else 0))


def context_length(config: Mapping[str, Any]) -> int:
    """The longest window the model's positions cover."""
    if config.get("model_type") == "gpt2":
        return int(config.get("n_positions", 1024))
    return int(config.get("max_position_embeddings", 2048))


def tied(config: Mapping[str, Any]) -> bool:
    """Whether the output head shares the token embedding (no `lm_head.weight` of its own)."""
    default = config.get("model_type") == "gpt2"
    return bool(config.get("tie_word_embeddings", default))


def entries(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the model's parameters, as transformers names them."""
    if config["model_type"] == "gpt2":
        return _gpt2_entries(config)
    return _llama_entries(config)


def _llama_entries(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    d, vocab = int(config["hidden_size"]), vocab_size(config)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or d // heads)
    ff = int(config["intermediate_size"])
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    o_bias = config["model_type"] != "qwen2" and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    found: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(int(config["num_hidden_layers"])):
        layer = f"model.layers.{i}"
        for proj, out in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                          ("v_proj", kv_heads * head_dim)):  # fmt: skip
            found += _linear(f"{layer}.self_attn.{proj}", d, out, qkv_bias)
        found += _linear(f"{layer}.self_attn.o_proj", heads * head_dim, d, o_bias)
        found += _linear(f"{layer}.mlp.gate_proj", d, ff, mlp_bias)
        found += _linear(f"{layer}.mlp.up_proj", d, ff, mlp_bias)
        found += _linear(f"{layer}.mlp.down_proj", ff, d, mlp_bias)
        found += [(f"{layer}.input_layernorm.weight", (d,)),
                  (f"{layer}.post_attention_layernorm.weight", (d,))]  # fmt: skip
    found.append(("model.norm.weight", (d,)))
    if not tied(config):
        found.append(("lm_head.weight", (vocab, d)))
    return found


def _linear(
    prefix: str, fan_in: int, fan_out: int, bias: bool
) -> list[tuple[str, tuple[int, ...]]]:
    weight: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.weight", (fan_out, fan_in))]
    return weight + [(f"{prefix}.bias", (fan_out,))] if bias else weight


def _gpt2_entries(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    d, vocab = int(config.get("n_embd", 768)), vocab_size(config)
    inner = int(config.get("n_inner") or 4 * d)
    found: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (vocab, d)),
        ("transformer.wpe.weight", (context_length(config), d)),
    ]
    for i in range(int(config.get("n_layer", 12))):
        block = f"transformer.h.{i}"
        # GPT-2's Conv1D stores weights as (in, out).
        found += [(f"{block}.ln_1.weight", (d,)), (f"{block}.ln_1.bias", (d,)),
                  (f"{block}.attn.c_attn.weight", (d, 3 * d)),
                  (f"{block}.attn.c_attn.bias", (3 * d,)),
                  (f"{block}.attn.c_proj.weight", (d, d)), (f"{block}.attn.c_proj.bias", (d,)),
                  (f"{block}.ln_2.weight", (d,)), (f"{block}.ln_2.bias", (d,)),
                  (f"{block}.mlp.c_fc.weight", (d, inner)), (f"{block}.mlp.c_fc.bias", (inner,)),
                  (f"{block}.mlp.c_proj.weight", (inner, d)),
                  (f"{block}.mlp.c_proj.bias", (d,))]  # fmt: skip
    found += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    if not tied(config):
        found.append(("lm_head.weight", (vocab, d)))
    return found


def flat_spec(config: Mapping[str, Any]) -> FlatSpec:
    return FlatSpec(tuple(entries(config)))


def parameter_count(config: Mapping[str, Any]) -> int:
    return sum(math.prod(shape) for _, shape in entries(config))


# -- LoRA -------------------------------------------------------------------------------


def lora_targets(config: Mapping[str, Any], lora: LoraSettings) -> list[tuple[str, int, int]]:
    """(module name, fan in, fan out) of every adapted projection, in parameter order."""
    gpt2 = config["model_type"] == "gpt2"
    allowed = GPT2_TARGETS if gpt2 else LLAMA_TARGETS
    wrong = sorted(set(lora.targets) - set(allowed))
    if wrong:
        raise ValueError(f"LoRA targets {wrong} are not modules of a {config['model_type']} "
                         f"model; its modules: {', '.join(allowed)}")  # fmt: skip
    found = []
    for name, shape in entries(config):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in lora.targets:
            continue
        fan_in, fan_out = shape if gpt2 else (shape[1], shape[0])
        found.append((module, fan_in, fan_out))
    return found


def lora_entries(
    config: Mapping[str, Any], lora: LoraSettings
) -> list[tuple[str, tuple[int, ...]]]:
    """The adapters' tensors: `<module>.lora_A` (rank, in) and `<module>.lora_B` (out, rank)."""
    found: list[tuple[str, tuple[int, ...]]] = []
    for module, fan_in, fan_out in lora_targets(config, lora):
        found += [(f"{module}.lora_A", (lora.rank, fan_in)),
                  (f"{module}.lora_B", (fan_out, lora.rank))]  # fmt: skip
    return found


# -- memory -----------------------------------------------------------------------------


def memory_need_mb(
    config: Mapping[str, Any],
    *,
    trainable: int,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    bytes_per_value: int = 4,
) -> int:
    """Memory a node needs to train the model: weights, gradients, AdamW and activations.

    Base weights once; per trainable value its gradient, two AdamW moments, the global
    copy and the update (5 more); activations per layer ~ (34 * d + 5 * heads * seq)
    values per token (Korthikanti et al., 2022), or one layer plus a d-vector per layer
    per token with gradient checkpointing; the logits three times (softmax, gradient).
    """
    total = parameter_count(config)
    d = int(config.get("hidden_size") or config.get("n_embd", 768))
    heads = int(config.get("num_attention_heads") or config.get("n_head", 12))
    layers = int(config.get("num_hidden_layers") or config.get("n_layer", 12))
    tokens = micro_batch * seq_len
    per_layer = tokens * (34 * d + 5 * heads * seq_len)
    activations = per_layer + layers * tokens * d if checkpointing else layers * per_layer
    activations += 3 * tokens * vocab_size(config)
    values = total + 5 * trainable + activations
    return 256 + math.ceil(values * bytes_per_value / 2**20)
