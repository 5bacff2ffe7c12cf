"""A GGUF file (llama.cpp's format) as a Hugging Face folder a training job takes.

transformers reads GGUF (with the `gguf` package) and dequantizes its tensors to float32;
the folder gets `config.json` (without the GGUF quantization note), `model.safetensors`,
the tokenizer's `tokenizer.json` and `tokenizer_config.json`, its chat template and
`generation_config.json`. Client side only: imports transformers (inside
functions: `load_model` of a folder needs none).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from idlegrid.training import hf_folder


def to_folder(source: Path, folder: Path) -> hf_folder.HFModel:
    """Write the folder of a GGUF file; the model as `hf_folder.read_folder` reads it back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not source.is_file():
        raise hf_folder.ModelError(f"{source} is not a file")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise hf_folder.ModelError(
            f"{source.name}: not a GGUF model transformers reads ({exc})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        with warnings.catch_warnings():
            # huggingface_hub says it cannot, where HF_HUB_DISABLE_PROGRESS_BARS is set
            # (the embedding kinds set it); the bars then stay off, as asked.
            warnings.simplefilter("ignore", UserWarning)
            hf_logging.enable_progress_bar()
    config = model.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "dtype",
        "architectures",
    ):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    weights = {
        name: tensor.detach().float().numpy()
        for name, tensor in model.state_dict().items()
        if not (name == "lm_head.weight" and hf_folder.hf_models.tied(config))
    }
    folder.mkdir(parents=True, exist_ok=True)
    # The tokenizer's settings, special tokens and chat template, and the generation
    # defaults (its end-of-turn token): what makes the folder chat as the GGUF file did.
    tokenizer.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer_json = folder / "tokenizer.json"
    text = tokenizer_json.read_text() if tokenizer_json.exists() else None
    hf_folder.write_folder(folder, config, weights, text)
    return hf_folder.read_folder(folder)


def load_model(source: Path) -> hf_folder.HFModel:
    """A model folder, or a GGUF file converted on the way (needs transformers and gguf)."""
    if source.is_file() and source.suffix.lower() == ".gguf":
        with tempfile.TemporaryDirectory() as folder:
            to_folder(source, Path(folder))
            return hf_folder.read_folder(Path(folder))
    return hf_folder.read_folder(source)
