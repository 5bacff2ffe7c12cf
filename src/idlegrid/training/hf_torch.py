"""Worker side of `hf-causal-lm`: the transformers module of a config, LoRA through peft.

torch, transformers and peft are imported inside functions. The module is built from the
config alone (`AutoModelForCausalLM.from_config`, a class built into transformers: no
code of the model's runs), with dropout off so that a task is a function of its weights,
data and seed, as the built-in architectures' are. Its trained parameters, in the flat
vector's order (`hf_models.entries`, or the adapters of `hf_models.lora_entries`), are
found by name, not by position.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from idlegrid.training import hf_folder, hf_models
from idlegrid.training.hf_models import HFConfig

if TYPE_CHECKING:
    import torch


_DROPOUT_KEYS = (
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "summary_first_dropout",
)
_bases: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
_bases_lock = threading.Lock()


def build(
    config: HFConfig, *, device: str, base: Mapping[str, np.ndarray] | None = None
) -> torch.nn.Module:
    """The model of `config` (base weights from `base` if given), LoRA-wrapped if asked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {key: value for key, value in config.config.items() if key != "model_type"}
    settings.update({key: 0.0 for key in _DROPOUT_KEYS}, use_cache=False)
    hf_config = AutoConfig.for_model(config.config["model_type"], **settings)
    module = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if base is not None:
        _copy_named(module, base)
    if config.gradient_checkpointing:
        module.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    if config.lora is not None:
        module = _with_lora(module, config)
    module.train()
    return module.to(device)


def _with_lora(module: Any, config: HFConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    assert config.lora is not None
    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,  # type: ignore[arg-type]  # peft takes a float
        target_modules=list(config.lora.targets),
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=config.config["model_type"] == "gpt2",
    )
    with warnings.catch_warnings():
        # peft asks transformers a question under its deprecated name.
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        return get_peft_model(module, lora)


def _copy_named(module: Any, named: Mapping[str, np.ndarray]) -> None:
    import torch

    with torch.no_grad():
        for name, array in named.items():
            module.get_parameter(name).copy_(torch.from_numpy(np.ascontiguousarray(array)))


def _parameter_name(config: HFConfig, name: str) -> str:
    if config.lora is None:
        return name
    module, _, which = name.rpartition(".")
    return f"base_model.model.{module}.{which}.default.weight"


def trainable(module: Any, config: HFConfig) -> list[torch.nn.Parameter]:
    """The trained parameters, in the flat vector's order; the others frozen."""
    if config.lora is None:
        listed = hf_models.entries(config.config)
    else:
        listed = hf_models.lora_entries(config.config, config.lora)
    names = [name for name, _ in listed]
    chosen = [module.get_parameter(_parameter_name(config, name)) for name in names]
    if config.lora is not None:
        keep = {id(p) for p in chosen}
        for parameter in module.parameters():
            parameter.requires_grad_(id(parameter) in keep)
    return chosen


def load(
    config: HFConfig,
    weights: np.ndarray,
    device: str,
    base: Mapping[str, np.ndarray] | None,
) -> tuple[Any, list[torch.nn.Parameter]]:
    """The module holding `weights` (the flat trained vector) and its trained parameters.

    Full training: `weights` are the whole model. LoRA: `base` holds the frozen weights
    and `weights` the adapters.
    """
    import torch

    if config.lora is not None and base is None:
        raise ValueError("a LoRA task needs the base model's weights")
    module = build(config, device="cpu", base=base if config.lora is not None else None)
    parameters = trainable(module, config)
    offset = 0
    with torch.no_grad():
        for parameter in parameters:
            count = parameter.numel()
            chunk = torch.from_numpy(weights[offset : offset + count].copy())
            parameter.copy_(chunk.view_as(parameter))
            offset += count
    if offset != weights.size:
        raise ValueError(f"hf-causal-lm has {offset} trained weights, got {weights.size}")
    module = module.to(device)
    return module, trainable(module, config)


def logits(module: Any, inputs: torch.Tensor) -> torch.Tensor:
    """Next-token logits; bf16 autocast on a CUDA device that supports it, else fp32."""
    import torch

    if inputs.device.type == "cuda" and torch.cuda.is_bf16_supported():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return module(input_ids=inputs).logits.float()
    return module(input_ids=inputs).logits


def base_weights(config: HFConfig, fetch: Callable[[str], bytes] | None) -> dict[str, np.ndarray]:
    """The base model's weights (the `model` input), read once per worker process."""
    if config.base is None or fetch is None:
        raise ValueError("a LoRA task needs the model input, and a worker that fetches blobs")
    with _bases_lock:
        held = _bases.get(config.base)
    if held is not None:
        return held
    model = hf_folder.read_model_blob(fetch(config.base), max_parameters=config.max_parameters)
    if model.config.get("model_type") != config.config.get("model_type"):
        raise ValueError("the model input does not match the job's config")
    with _bases_lock:
        _bases[config.base] = model.weights
        while len(_bases) > 1:
            _bases.popitem(last=False)
    return model.weights


def check_tokens(config: HFConfig, top_token: int, seq_len: int) -> None:
    """ValueError if token ids or the window do not fit the model."""
    if top_token >= hf_models.vocab_size(config.config):
        raise ValueError(
            f"token id {top_token} >= vocab_size {hf_models.vocab_size(config.config)}"
        )
    if seq_len > hf_models.context_length(config.config):
        raise ValueError(f"seq_len {seq_len} exceeds the model's context "
                         f"{hf_models.context_length(config.config)}")  # fmt: skip
