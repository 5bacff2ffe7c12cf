"""The architectures a training job may pick: built into the worker, never researcher code.

Each architecture has a config (pydantic), a parameter list (names, shapes and how to
initialise each) and a torch module with exactly those parameters in that order. The
parameter list and the seeded initialisation are numpy only, so the coordinator creates
round 0's weights without torch; torch is imported inside `build_module` and the modules'
constructors only.

- `mlp`: fully connected classifier, ReLU between layers.
- `cnn`: two 3x3 conv + ReLU + 2x2 max-pool stages, then a linear classifier.
- `transformer-lm`: a small decoder-only (GPT-style, pre-norm) character language model.
- `hf-causal-lm`: a researcher's Hugging Face causal LM (`hf_models`): its config and
  initial weights come from the job's `model` input, its module from transformers; with
  `lora`, the trained parameters are the adapters alone, drawn from the seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from idlegrid.training import hf_models
from idlegrid.training.flat import FlatSpec
from idlegrid.training.hf_models import HFConfig

if TYPE_CHECKING:
    import torch


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MLPConfig(_Config):
    inputs: int = Field(default=784, ge=1, le=1 << 20)
    hidden: tuple[int, ...] = Field(default=(128,), max_length=16)
    classes: int = Field(default=10, ge=2, le=1 << 16)


class CNNConfig(_Config):
    channels: int = Field(default=1, ge=1, le=16)
    image_size: int = Field(default=28, ge=4, le=512, description="height = width")
    width: int = Field(default=16, ge=1, le=512, description="channels of the first conv")
    classes: int = Field(default=10, ge=2, le=1 << 16)


class LMConfig(_Config):
    vocab: int = Field(default=103, ge=2, le=1 << 16)
    context: int = Field(default=64, ge=1, le=4096)
    width: int = Field(default=64, ge=8, le=4096)
    layers: int = Field(default=2, ge=1, le=48)
    heads: int = Field(default=4, ge=1, le=64)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> LMConfig:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        return self


@dataclass(frozen=True)
class Param:
    """One parameter: its name in the torch module, its shape, its initial distribution."""

    name: str
    shape: tuple[int, ...]
    init: str  # "zeros", "ones", "normal", or "pretrained" (from the job's model input)
    std: float = 0.0


@dataclass(frozen=True)
class Architecture:
    name: str
    config: type[BaseModel]
    params: Callable[[Any], list[Param]]
    module: Callable[[Any], torch.nn.Module]
    task: str  # "classify" or "language-model"


# -- parameter lists (numpy side) -------------------------------------------------------


def _linear(prefix: str, fan_in: int, fan_out: int, std: float | None = None) -> list[Param]:
    # He initialisation for ReLU layers unless a std is given.
    scale = math.sqrt(2.0 / fan_in) if std is None else std
    return [
        Param(f"{prefix}.weight", (fan_out, fan_in), "normal", scale),
        Param(f"{prefix}.bias", (fan_out,), "zeros"),
    ]


def _mlp_params(config: MLPConfig) -> list[Param]:
    sizes = (config.inputs, *config.hidden, config.classes)
    params: list[Param] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        last = i == len(sizes) - 2
        params += _linear(f"layers.{i}", fan_in, fan_out, 1 / math.sqrt(fan_in) if last else None)
    return params


def _cnn_params(config: CNNConfig) -> list[Param]:
    width, channels = config.width, config.channels
    features = 2 * width * (config.image_size // 4) ** 2
    return [
        Param("conv1.weight", (width, channels, 3, 3), "normal", math.sqrt(2 / (9 * channels))),
        Param("conv1.bias", (width,), "zeros"),
        Param("conv2.weight", (2 * width, width, 3, 3), "normal", math.sqrt(2 / (9 * width))),
        Param("conv2.bias", (2 * width,), "zeros"),
        *_linear("head", features, config.classes, 1 / math.sqrt(features)),
    ]


def _layer_norm(prefix: str, width: int) -> list[Param]:
    return [Param(f"{prefix}.weight", (width,), "ones"), Param(f"{prefix}.bias", (width,), "zeros")]


def _lm_params(config: LMConfig) -> list[Param]:
    # GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers).
    d, std = config.width, 0.02
    residual_std = std / math.sqrt(2 * config.layers)
    params = [
        Param("tokens.weight", (config.vocab, d), "normal", std),
        Param("positions.weight", (config.context, d), "normal", std),
    ]
    for i in range(config.layers):
        block = f"blocks.{i}"
        params += _layer_norm(f"{block}.norm1", d)
        params += _linear(f"{block}.qkv", d, 3 * d, std)
        params += _linear(f"{block}.proj", d, d, residual_std)
        params += _layer_norm(f"{block}.norm2", d)
        params += _linear(f"{block}.fc", d, 4 * d, std)
        params += _linear(f"{block}.out", 4 * d, d, residual_std)
    return params + _layer_norm("norm", d) + _linear("head", d, config.vocab, std)


def _hf_params(config: HFConfig) -> list[Param]:
    if not config.config:
        raise ValueError("hf-causal-lm takes its config from the job's `model` input")
    if config.lora is None:
        return [
            Param(name, shape, "pretrained") for name, shape in hf_models.entries(config.config)
        ]
    # peft's A is uniform in +-1/sqrt(fan_in) (std 1/sqrt(3 fan_in)); B starts at zero,
    # so the adapted model starts as the base model.
    return [
        Param(name, shape, "zeros") if name.endswith("lora_B")
        else Param(name, shape, "normal", 1 / math.sqrt(3 * shape[1]))
        for name, shape in hf_models.lora_entries(config.config, config.lora)
    ]  # fmt: skip


# -- registry ---------------------------------------------------------------------------


def _mlp_module(config: MLPConfig) -> torch.nn.Module:
    from idlegrid.training import torch_modules

    return torch_modules.MLP(config.inputs, config.hidden, config.classes)


def _cnn_module(config: CNNConfig) -> torch.nn.Module:
    from idlegrid.training import torch_modules

    return torch_modules.CNN(config.channels, config.image_size, config.width, config.classes)


def _lm_module(config: LMConfig) -> torch.nn.Module:
    from idlegrid.training import torch_modules

    return torch_modules.CharTransformer(
        config.vocab, config.context, config.width, config.layers, config.heads
    )


def _hf_module(config: HFConfig) -> torch.nn.Module:
    from idlegrid.training import hf_torch

    return hf_torch.build(config, device="cpu")


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("mlp", MLPConfig, _mlp_params, _mlp_module, "classify"),
        Architecture("cnn", CNNConfig, _cnn_params, _cnn_module, "classify"),
        Architecture("transformer-lm", LMConfig, _lm_params, _lm_module, "language-model"),
        Architecture("hf-causal-lm", HFConfig, _hf_params, _hf_module, "language-model"),
    )
}


def get_architecture(name: str) -> Architecture:
    """The built-in architecture called `name`; ValueError lists the known ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unknown architecture {name!r}; known: {known}") from None


def parse_config(name: str, raw: Mapping[str, Any]) -> Any:
    """The validated config of architecture `name` (pydantic.ValidationError if invalid)."""
    return get_architecture(name).config.model_validate(dict(raw))


def param_list(name: str, config: Any) -> list[Param]:
    """The parameters of an architecture, in the torch module's order."""
    return get_architecture(name).params(config)


def flat_spec(name: str, config: Any) -> FlatSpec:
    """Names and shapes of the flat weight vector of an architecture."""
    return FlatSpec(tuple((p.name, p.shape) for p in param_list(name, config)))


def init_weights(name: str, config: Any, seed: int) -> np.ndarray:
    """Seeded initial weights as one float32 vector (numpy only: no torch needed)."""
    rng = np.random.default_rng(seed)
    parts = []
    for param in param_list(name, config):
        count = math.prod(param.shape)
        if param.init == "pretrained":
            raise ValueError(f"{name}'s weights come from the job's model input, not a seed")
        if param.init == "normal":
            parts.append(rng.normal(0.0, param.std, size=count).astype(np.float32))
        else:
            parts.append(np.full(count, 1.0 if param.init == "ones" else 0.0, dtype=np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def parameter_count(name: str, config: Any) -> int:
    return flat_spec(name, config).size


def compute_parameters(name: str, config: Any) -> int:
    """Parameters a forward pass runs through (a LoRA model's base ones included)."""
    if isinstance(config, HFConfig):
        return config.base_parameters()
    return parameter_count(name, config)


def is_language_model(name: str) -> bool:
    return get_architecture(name).task == "language-model"


def seeded(name: str, config: Any) -> bool:
    """Whether round 0's weights are drawn from the seed (else they are a model input)."""
    return all(param.init != "pretrained" for param in param_list(name, config))


def build_module(name: str, config: Any) -> torch.nn.Module:
    """The torch module of an architecture (imports torch); its weights are arbitrary."""
    return get_architecture(name).module(config)
