"""A Hugging Face model folder, and the one `model` blob a training job takes of it.

The folder (`config.json`, `model.safetensors`, optionally `tokenizer.json` and the files
that make it chat: `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`,
the special tokens' maps, `SIDE_FILES`) travels as one idlegrid safetensors container: the
weights as float32 tensors under their names, the config, the tokenizer's JSON text and
the side files' texts in the header. `read_model_blob` is the coordinator's check of it
(ModelError names what is wrong: a tensor, the config, the tokenizer, a side file, a
limit); `write_result` turns a job's result back into the folder that was submitted, its
weights trained (LoRA merged in), or into a PEFT adapter folder. Numpy and safetensors
only (bfloat16 is widened by hand: numpy has no such type); `tokenizers` is imported
inside the functions that parse a tokenizer.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file

from idlegrid.training import hf_models
from idlegrid.training.flat import ContainerError, flatten, pack, unpack

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MODEL_FORMAT = "idlegrid/hf-model"
# A `dataset` input of UTF-8 text holds its bytes under this name.
TEXT_ARRAY = "text"
_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
# The folder's files besides config, weights and tokenizer.json that make the model load and
# chat as it did: the tokenizer's settings and special tokens, its chat template (in its own
# file since transformers 4.47; older folders keep it in tokenizer_config.json), and the
# generation defaults (end-of-turn tokens, sampling).
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
MAX_SIDE_FILE_BYTES = 8 * 2**20
# A PEFT adapter folder: what `PeftModel.from_pretrained` reads.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ModelError(ValueError):
    """A model that cannot be trained as given; the message names the problem."""


@dataclass(frozen=True)
class HFModel:
    config: dict[str, Any]
    weights: dict[str, np.ndarray]  # float32, in the config's parameter order
    tokenizer: str | None  # tokenizer.json's text
    files: Mapping[str, str] = field(default_factory=dict)  # SIDE_FILES present: their text

    @property
    def parameters(self) -> int:
        return sum(int(w.size) for w in self.weights.values())


# -- the folder (client side) -----------------------------------------------------------


def read_folder(folder: Path) -> HFModel:
    """A model folder as saved by transformers; ModelError if a file is missing or bad."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(f"{folder} has no config.json") from None
    except ValueError as exc:
        raise ModelError(f"config.json is not JSON: {exc}") from None
    weights_path = folder / "model.safetensors"
    if not weights_path.exists():
        sharded = " (sharded checkpoints: save with one file)" if any(
            folder.glob("model-*.safetensors")) else ""  # fmt: skip
        raise ModelError(f"{folder} has no model.safetensors{sharded}")
    weights = in_config_order(read_safetensors(weights_path.read_bytes()), config)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer = tokenizer_path.read_text() if tokenizer_path.exists() else None
    files = {name: _side_file(folder / name) for name in SIDE_FILES if (folder / name).is_file()}
    return HFModel(config, weights, tokenizer, check_side_files(files))


def _side_file(path: Path) -> str:
    if path.stat().st_size > MAX_SIDE_FILE_BYTES:
        raise ModelError(f"{path.name} is over {MAX_SIDE_FILE_BYTES // 2**20} MiB")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path.name} is not UTF-8 text ({exc})") from None


def check_side_files(files: object) -> dict[str, str]:
    """The side files of a model, checked: known names, text within the size limit, JSON
    objects where the name says JSON, and no tokenizer that asks for remote code."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise ModelError("model: the side files must be a JSON object of name -> text")
    checked = {}
    for name, text in files.items():
        if name not in SIDE_FILES:
            raise ModelError(f"model: {name!r} is not a file a model folder carries; "
                             f"known: {', '.join(SIDE_FILES)}")  # fmt: skip
        if not isinstance(text, str) or len(text.encode("utf-8")) > MAX_SIDE_FILE_BYTES:
            raise ModelError(f"{name} must be text of at most {MAX_SIDE_FILE_BYTES // 2**20} MiB")
        if name.endswith(".json"):
            try:
                parsed = json.loads(text)
            except ValueError as exc:
                raise ModelError(f"{name} is not JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise ModelError(f"{name} must be a JSON object")
            remote = [key for key in hf_models.REMOTE_CODE_KEYS if parsed.get(key)]
            if remote:
                raise ModelError(f"{name} asks for remote code ({', '.join(remote)}): refused, "
                                 "a model is data and never code")  # fmt: skip
        checked[name] = text
    return checked


def in_config_order(
    weights: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """`weights` with the config's parameters first, in its order (a file keeps its own,
    often alphabetical: layers.10 before layers.2), then any others as they came; a config
    too broken to list its parameters leaves them as they came, for `check_config` to name."""
    try:
        names = [name for name, _ in hf_models.entries(config)]
    except (KeyError, TypeError, ValueError):
        return dict(weights)
    ordered = {name: weights[name] for name in names if name in weights}
    ordered.update((name, array) for name, array in weights.items() if name not in ordered)
    return ordered


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (F32, F16, F64 or BF16)."""
    if len(data) < 8:
        raise ModelError("model.safetensors is too short")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise ModelError(f"model.safetensors header is not JSON: {exc}") from None
    base, tensors = 8 + size, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, stop = (base + int(x) for x in entry["data_offsets"])
        if stop > len(data):
            raise ModelError(f"model.safetensors: tensor {name} runs past the end of the file")
        raw, dtype, shape = data[start:stop], entry["dtype"], tuple(entry["shape"])
        if dtype == "BF16":
            widened = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            array = widened.view(np.float32)
        elif dtype in _DTYPES:
            array = np.frombuffer(raw, dtype=_DTYPES[dtype]).astype(np.float32)
        else:
            raise ModelError(f"model.safetensors: tensor {name} is {dtype}, not floating point")
        if array.size != math.prod(shape):
            raise ModelError(f"model.safetensors: tensor {name} has the wrong byte length")
        tensors[name] = array.reshape(shape)
    return tensors


def text_dataset_blob(text: str) -> bytes:
    """A `dataset` input of raw text, tokenized at submission with the model's tokenizer."""
    return pack({TEXT_ARRAY: np.frombuffer(text.encode("utf-8"), dtype=np.uint8)}, {})


def token_dataset_blob(tokens: np.ndarray) -> bytes:
    """A `dataset` input of token ids."""
    return pack({"tokens": np.ascontiguousarray(tokens, dtype=np.int32)}, {})


def model_blob(model: HFModel) -> bytes:
    """The `model` input of a training job: weights, config and tokenizer in one file."""
    header = {
        "format": MODEL_FORMAT,
        "config": model.config,
        "tokenizer": model.tokenizer,
        "files": dict(model.files),
    }
    weights = {name: np.asarray(w, dtype=np.float32) for name, w in model.weights.items()}
    return pack(weights, header)


# -- the coordinator's check ------------------------------------------------------------


def read_model_blob(blob: bytes, *, max_parameters: int) -> HFModel:
    """The model of a `model` input, checked against its config and the job's limits."""
    try:
        arrays, header = unpack(blob)
    except ContainerError as exc:
        raise ModelError(f"model: {exc}") from None
    if header.get("format") != MODEL_FORMAT:
        raise ModelError(f"model: not a {MODEL_FORMAT} file (build it with idlegrid's SDK "
                         "or CLI from a Hugging Face folder)")  # fmt: skip
    try:
        config = hf_models.check_config(header.get("config"))
    except ValueError as exc:
        raise ModelError(f"config.json: {exc}") from None
    count = hf_models.parameter_count(config)
    if count > max_parameters:
        raise ModelError(f"the model has {count:,} parameters, over this job's limit "
                         f"max_parameters={max_parameters:,}")  # fmt: skip
    weights = check_weights(arrays, config)
    tokenizer = header.get("tokenizer")
    if tokenizer is not None:
        parse_tokenizer(tokenizer)
    return HFModel(config, weights, tokenizer, check_side_files(header.get("files")))


def check_weights(
    arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The tensors in the config's order; ModelError names a missing, extra or bad one."""
    expected = hf_models.entries(config)
    names = {name for name, _ in expected}
    # A tied head may be saved anyway; it is the embedding.
    extra = sorted(set(arrays) - names - {"lm_head.weight"})
    if extra:
        raise ModelError(f"weights: tensor {extra[0]} is not a parameter of this "
                         f"{config['model_type']} config ({len(extra)} unexpected)")  # fmt: skip
    ordered = {}
    for name, shape in expected:
        if name not in arrays:
            raise ModelError(f"weights: tensor {name} {shape} is missing")
        array = arrays[name]
        if tuple(array.shape) != shape:
            raise ModelError(f"weights: tensor {name} has shape {tuple(array.shape)}; "
                             f"the config says {shape}")  # fmt: skip
        if array.dtype.kind != "f":
            raise ModelError(f"weights: tensor {name} is {array.dtype}, not floating point")
        if not np.all(np.isfinite(array)):
            raise ModelError(f"weights: tensor {name} holds NaN or infinite values")
        ordered[name] = np.asarray(array, dtype=np.float32)
    return ordered


def flat_weights(model: HFModel) -> np.ndarray:
    """The whole model as the flat vector full training starts from (the config's order);
    ModelError names a missing, extra or bad tensor."""
    vector, _ = flatten(check_weights(model.weights, model.config))
    return vector


def parse_tokenizer(text: str) -> Tokenizer:
    """The `tokenizers` tokenizer of a tokenizer.json; ModelError if it does not parse."""
    from tokenizers import Tokenizer

    if not isinstance(text, str):
        raise ModelError("tokenizer.json must be JSON text")
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise ModelError(f"tokenizer.json does not parse: {exc}") from None


def tokenize(tokenizer_json: str, text: str) -> np.ndarray:
    """Token ids of `text` (line by line, in order), as int32."""
    tokenizer = parse_tokenizer(tokenizer_json)
    lines = text.splitlines(keepends=True)
    ids = [i for encoded in tokenizer.encode_batch(lines, add_special_tokens=False)
           for i in encoded.ids]  # fmt: skip
    return np.asarray(ids, dtype=np.int32)


# -- the result folder (client side) ----------------------------------------------------


def write_folder(
    folder: Path,
    config: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    tokenizer: str | None,
    files: Mapping[str, str] | None = None,
) -> None:
    """A folder `AutoModelForCausalLM.from_pretrained` loads: config, weights, tokenizer
    and the side files (tokenizer settings, chat template, generation config)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2, default=str))
    tensors = {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in weights.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(folder, tokenizer, files or {})


def _write_tokenizer(folder: Path, tokenizer: str | None, files: Mapping[str, str]) -> None:
    if tokenizer is not None:
        (folder / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


def write_result(
    folder: Path,
    base: HFModel,
    named: Mapping[str, np.ndarray],
    lora: hf_models.LoraSettings | None,
    *,
    base_path: Path | None = None,
) -> str:
    """The trained model as the job asked for it, in `folder`: the submitted folder with
    its weights trained (LoRA adapters merged in), or, for `lora.result == "adapter"`, a
    PEFT adapter folder (`base_path`: the base model's folder, named in its config).
    Returns what was written: "model" or "adapter"."""
    if lora is not None and lora.result == "adapter":
        write_adapter_folder(folder, base, named, lora, base_path=base_path)
        return "adapter"
    weights = trained_weights(base, named, lora)
    write_folder(folder, base.config, weights, base.tokenizer, base.files)
    return "model"


def write_adapter_folder(
    folder: Path,
    base: HFModel,
    named: Mapping[str, np.ndarray],
    lora: hf_models.LoraSettings,
    *,
    base_path: Path | None = None,
) -> None:
    """A PEFT LoRA adapter folder (`adapter_config.json`, `adapter_model.safetensors`), with
    the base's tokenizer and side files, so that `PeftModel.from_pretrained(base, folder)`
    (or `AutoPeftModelForCausalLM`, through `base_model_name_or_path`) loads it and its
    tokenizer chats as the base's did."""
    folder.mkdir(parents=True, exist_ok=True)
    gpt2 = base.config["model_type"] == "gpt2"
    tensors = {}
    for module, _, _ in hf_models.lora_targets(base.config, lora):
        for which in ("lora_A", "lora_B"):
            array = np.ascontiguousarray(named[f"{module}.{which}"], dtype=np.float32)
            tensors[f"base_model.model.{module}.{which}.weight"] = array
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_path is None else str(base_path.resolve()),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(lora.targets),
        "bias": "none",
        "fan_in_fan_out": gpt2,
        "use_rslora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter, indent=2))
    _write_tokenizer(folder, base.tokenizer, base.files)


def read_adapter_folder(folder: Path) -> tuple[hf_models.LoraSettings, dict[str, np.ndarray]]:
    """The LoRA settings and adapters (idlegrid's names) of a PEFT adapter folder that
    `write_adapter_folder` wrote (or peft saved with the same settings)."""
    try:
        adapter = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise ModelError(f"{folder} has no {ADAPTER_CONFIG}") from None
    except ValueError as exc:
        raise ModelError(f"{ADAPTER_CONFIG} is not JSON: {exc}") from None
    if adapter.get("peft_type") != "LORA" or adapter.get("use_rslora"):
        raise ModelError(f"{ADAPTER_CONFIG}: only plain LoRA adapters (peft_type LORA, "
                         "no rsLoRA) are read")  # fmt: skip
    targets = adapter.get("target_modules") or []
    try:
        lora = hf_models.LoraSettings(
            rank=adapter["r"], alpha=adapter["lora_alpha"], targets=tuple(targets)
        )
    except (KeyError, ValueError) as exc:
        raise ModelError(f"{ADAPTER_CONFIG}: {exc}") from None
    named = {}
    for name, array in read_safetensors((folder / ADAPTER_WEIGHTS).read_bytes()).items():
        stem = name.removeprefix("base_model.model.").removesuffix(".weight")
        named[stem.replace(".default", "")] = array
    return lora, named


def trained_weights(
    base: HFModel, named: Mapping[str, np.ndarray], lora: hf_models.LoraSettings | None
) -> dict[str, np.ndarray]:
    """The trained model's named weights from a job's result: the result itself, or the
    base with the LoRA adapters merged in (W + scale * B @ A)."""
    if lora is None:
        return {name: named[name] for name, _ in hf_models.entries(base.config)}
    merged = dict(base.weights)
    gpt2 = base.config["model_type"] == "gpt2"
    for module, _, _ in hf_models.lora_targets(base.config, lora):
        try:
            a, b = named[f"{module}.lora_A"], named[f"{module}.lora_B"]
        except KeyError:
            raise ModelError(f"the adapters have no {module}.lora_A and lora_B") from None
        delta = lora.scale * b @ a
        name = f"{module}.weight"
        merged[name] = merged[name] + (delta.T if gpt2 else delta)
    return merged
