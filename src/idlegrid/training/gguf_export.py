"""A trained model folder as a GGUF file that llama.cpp runs: `idlegrid model export-gguf`.

The conversion is llama.cpp's own (`convert_hf_to_gguf.py`: its Llama, Qwen2 and GPT-2
models, the base model's hyperparameters, tensor types and GPT-2-style vocabulary),
ported to the four model types a training job takes and written with the `gguf`
package's writer: the tensors renamed by gguf's table (`get_tensor_name_map`), llama's
query and key rows permuted into llama.cpp's rotary layout, norms and biases kept in
float32, the tokenizer as llama.cpp's `gpt2` (byte-level BPE, its pre-tokenizer told by
the hash of a probe text's tokens, `gguf_pre_tokenizers.json`) or `llama` model
(SentencePiece-style BPE with byte fallback), and the special tokens, `add_bos_token` and
chat template through gguf's `SpecialVocab`.

Quantization: f32, f16, bf16 and q8_0 are written here; every other type is made from
the float32 file by llama.cpp's own quantizer (`llama_model_quantize`, in
llama-cpp-python, the worker extra), which keeps the output and embedding tensors at the
precision llama.cpp chooses for that type. Client side: transformers reads the
tokenizer (as llama.cpp's script does), numpy the weights; no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from idlegrid.training import hf_folder, hf_models

log = logging.getLogger(__name__)

# Types gguf writes itself, as llama.cpp's converter does (`--outtype`).
WRITTEN = ("f32", "f16", "bf16", "q8_0")
# Types llama.cpp's quantizer makes from a float32 file (its `llama-quantize` names).
QUANTIZED = (
    "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l",
    "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
)  # fmt: skip
TYPES = WRITTEN + QUANTIZED
DEFAULT_TYPE = "q8_0"
_PRE_TABLE = Path(__file__).with_name("gguf_pre_tokenizers.json")


class ExportError(ValueError):
    """A model that cannot be written as GGUF; the message names the problem."""


@dataclass(frozen=True)
class Exported:
    path: Path
    architecture: str
    quantization: str
    tokenizer: str  # llama.cpp's tokenizer model and pre-tokenizer, e.g. "gpt2/smollm"
    size: int


def export(
    folder: Path, out: Path, *, quantization: str = DEFAULT_TYPE, base: Path | None = None
) -> Exported:
    """Write the model of `folder` (a model folder, or a PEFT adapter folder merged into
    its base: `base`, or the folder its adapter_config.json names) as GGUF to `out`."""
    if quantization not in TYPES:
        raise ExportError(f"unknown type {quantization!r}; types: {', '.join(TYPES)}")
    model = _read(folder, base)
    gguf_arch = _architecture(model.config)
    if quantization in WRITTEN:
        tokenizer = _write(model, folder, out, quantization, gguf_arch)
    else:
        with tempfile.TemporaryDirectory(prefix="idlegrid-gguf-", dir=out.parent) as scratch:
            full = Path(scratch) / "f32.gguf"
            tokenizer = _write(model, folder, full, "f32", gguf_arch)
            _quantize(full, out, quantization)
    return Exported(out, gguf_arch, quantization, tokenizer, out.stat().st_size)


def _read(folder: Path, base: Path | None) -> hf_folder.HFModel:
    if not (folder / hf_folder.ADAPTER_CONFIG).exists():
        return hf_folder.read_folder(folder)
    lora, adapters = hf_folder.read_adapter_folder(folder)
    if base is None:
        named = json.loads((folder / hf_folder.ADAPTER_CONFIG).read_text())
        if not named.get("base_model_name_or_path"):
            raise ExportError(f"{folder} is an adapter folder that names no base model: "
                              "give the base model's folder (--base)")  # fmt: skip
        base = Path(named["base_model_name_or_path"])
    if not base.is_dir():
        raise ExportError(f"the adapters' base model {base} is not a folder here (--base)")
    base_model = hf_folder.read_folder(base)
    weights = hf_folder.trained_weights(base_model, adapters, lora)
    # The tokenizer and side files of the adapter folder are the ones it was saved with.
    return hf_folder.HFModel(base_model.config, weights, base_model.tokenizer, base_model.files)


# -- the architecture -------------------------------------------------------------------


def _architecture(config: Mapping[str, Any]) -> str:
    import gguf

    model_type = config["model_type"]
    archs = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA,
             "qwen2": gguf.MODEL_ARCH.QWEN2, "gpt2": gguf.MODEL_ARCH.GPT2}  # fmt: skip
    arch = archs.get(model_type)
    if arch is None:
        raise ExportError(f"model_type {model_type!r} is not exported; exported: llama, "
                          "mistral, qwen2, gpt2")  # fmt: skip
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default", "linear"):
        raise ExportError(f"rope scaling {kind!r} is not exported here; llama.cpp's "
                          "convert_hf_to_gguf.py converts it")  # fmt: skip
    return str(gguf.MODEL_ARCH_NAMES[arch])


def _hyperparameters(writer: Any, config: Mapping[str, Any], file_type: Any) -> None:
    """The architecture's keys, as llama.cpp's TextModel, LlamaModel and GPT2Model set them."""
    layers = _blocks(config)
    writer.add_block_count(layers)
    if config["model_type"] == "gpt2":
        d = int(config.get("n_embd", 768))
        writer.add_context_length(hf_models.context_length(config))
        writer.add_embedding_length(d)
        writer.add_feed_forward_length(int(config.get("n_inner") or 4 * d))
        writer.add_head_count(int(config.get("n_head", 12)))
        writer.add_layer_norm_eps(float(config.get("layer_norm_epsilon", 1e-5)))
        writer.add_file_type(file_type)
        return
    heads = int(config["num_attention_heads"])
    writer.add_context_length(hf_models.context_length(config))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    scaling = config.get("rope_scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type")) == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if config.get("head_dim") is not None:
        writer.add_key_length(int(config["head_dim"]))
        writer.add_value_length(int(config["head_dim"]))
    writer.add_file_type(file_type)
    if config["model_type"] != "qwen2":
        writer.add_vocab_size(hf_models.vocab_size(config))
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        writer.add_rope_dimension_count(int(head_dim))


def _blocks(config: Mapping[str, Any]) -> int:
    return int(config.get("num_hidden_layers") or config.get("n_layer", 12))


# -- tensors ----------------------------------------------------------------------------


def _tensors(config: Mapping[str, Any], weights: Mapping[str, np.ndarray], arch: str) -> Iterator[
    tuple[str, np.ndarray]
]:  # fmt: skip
    """(llama.cpp's name, float32 array) of every tensor, in the converter's layout."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, _blocks(config))
    model_type = config["model_type"]
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    for name, array in weights.items():
        data = np.asarray(array, dtype=np.float32)
        if model_type in ("llama", "mistral"):
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, heads, heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, heads, kv_heads)
        elif model_type == "gpt2" and name.endswith(
            (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
        ):
            data = data.T  # Conv1D keeps (in, out); llama.cpp wants (out, in)
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ExportError(f"tensor {name} has no llama.cpp name for {arch}")
        yield new_name, np.ascontiguousarray(data)


def _permute(weights: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved, as llama.cpp ropes them."""
    if kv_heads != heads:
        heads = kv_heads
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensor_type(name: str, data: np.ndarray, wanted: Any) -> Any:
    """The converter's rule: 1-D tensors, norms, position embeddings and non-weights stay
    float32; the rest take the file's type."""
    import gguf

    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    if name.startswith("position_embd"):
        return gguf.GGMLQuantizationType.F32
    return wanted


# -- the tokenizer ----------------------------------------------------------------------


def _vocabulary(writer: Any, folder: Path, model: hf_folder.HFModel) -> str:
    """The tokenizer's keys; returns llama.cpp's tokenizer model and pre-tokenizer."""
    import gguf

    if model.tokenizer is None:
        raise ExportError("the model folder has no tokenizer.json: llama.cpp needs the "
                          "tokenizer inside the GGUF file")  # fmt: skip
    spec = json.loads(model.tokenizer).get("model") or {}
    if spec.get("type") != "BPE":
        raise ExportError(f"tokenizer.json's model is {spec.get('type')!r}; llama.cpp takes "
                          "BPE tokenizers (byte-level, or SentencePiece-style)")  # fmt: skip
    vocab_size = hf_models.vocab_size(model.config)
    with _tokenizer_folder(folder, model) as source:
        if spec.get("byte_fallback"):
            described = _llama_vocab(writer, source)
        else:
            described = _gpt2_vocab(writer, source, vocab_size)
            special = gguf.SpecialVocab(source, load_merges=True)
            special.add_to_gguf(writer, quiet=True)
    if model.config["model_type"] in ("llama", "mistral") and vocab_size == 49152:
        # LlamaModel.set_vocab: the small models of this vocabulary (granite, SmolLM)
        # prepend no BOS token.
        writer.add_add_bos_token(False)
    return described


@contextlib.contextmanager
def _tokenizer_folder(folder: Path, model: hf_folder.HFModel) -> Iterator[Path]:
    """The folder to read the tokenizer from: `folder` itself, or (for an adapter folder
    without one) a scratch folder of the model's tokenizer files."""
    if (folder / "tokenizer.json").is_file():
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="idlegrid-tokenizer-") as scratch:
        assert model.tokenizer is not None
        Path(scratch, "tokenizer.json").write_text(model.tokenizer, encoding="utf-8")
        for name, text in model.files.items():
            Path(scratch, name).write_text(text, encoding="utf-8")
        yield Path(scratch)


def _gpt2_vocab(writer: Any, source: Path, vocab_size: int) -> str:
    """TextModel.get_vocab_base and _set_vocab_gpt2: tokens, their types, pre-tokenizer."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"the tokenizer has ids up to {max(vocab.values())}, past the "
                          f"model's vocab_size {vocab_size}")  # fmt: skip
    pre = _pre_tokenizer(tokenizer)
    reverse = {i: token for token, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token: str = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                # llama.cpp takes added tokens as normalized: as the tokenizer reads them.
                token = str(tokenizer.decode(tokenizer.encode(token, add_special_tokens=False)))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    return f"gpt2/{pre}"


def _looks_special(token: str) -> bool:
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _pre_tokenizer(tokenizer: Any) -> str:
    """llama.cpp's name of the tokenizer's pre-tokenizer: the hash of the probe text's
    tokens looked up in the converter's table (get_vocab_base_pre)."""
    table = json.loads(_PRE_TABLE.read_text(encoding="utf-8"))
    tokens = tokenizer.encode(table["chktxt"])
    digest = hashlib.sha256(str(tokens).encode()).hexdigest()
    pre = table["pre"].get(digest)
    if pre is None:
        raise ExportError(f"llama.cpp does not know this tokenizer's pre-tokenizer (probe "
                          f"hash {digest[:16]}...): convert it with llama.cpp's own "
                          "convert_hf_to_gguf.py, once it lists it")  # fmt: skip
    return str(pre)


def _llama_vocab(writer: Any, source: Path) -> str:
    """TextModel._set_vocab_llama_hf: a SentencePiece-style BPE tokenizer.json."""
    import gguf

    vocab = gguf.LlamaHfVocab(source)
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(source, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return "llama/default"


# -- writing ----------------------------------------------------------------------------


def _write(model: hf_folder.HFModel, folder: Path, out: Path, quantization: str, arch: str) -> str:
    import gguf

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantization]  # fmt: skip
    wanted = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}[quantization]  # fmt: skip
    writer = gguf.GGUFWriter(out, arch)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(folder.resolve().name)
        _hyperparameters(writer, model.config, file_type)
        tokenizer = _vocabulary(writer, folder, model)
        for name, data in _tensors(model.config, model.weights, arch):
            encoded, qtype = _encoded(name, data, _tensor_type(name, data, wanted))
            writer.add_tensor(name, encoded, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)
        raise
    writer.close()
    return tokenizer


def _encoded(name: str, data: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    import gguf

    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        # A row whose length is not a multiple of the block: the converter's fallback.
        log.info("%s: rows of %d values do not fill %s blocks; F16", name, data.shape[-1], qtype)
        fallback = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, fallback), fallback


def _quantize(source: Path, out: Path, quantization: str) -> None:
    """llama.cpp's quantizer over a float32 GGUF file (as `llama-quantize` runs it)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ExportError(f"{quantization} is made by llama.cpp's quantizer: install "
                          f"idlegrid[worker] (llama-cpp-python) ({exc}); or export as "
                          f"{', '.join(WRITTEN)}") from None  # fmt: skip
    name = "LLAMA_FTYPE_MOSTLY_" + quantization.upper()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = max(1, (os.cpu_count() or 1))
    failed = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if failed:
        out.unlink(missing_ok=True)
        raise ExportError(f"llama.cpp's quantizer failed ({failed}) making {quantization}")
