"""What a GGUF model is and whether it may go to volunteers: checked on the coordinator.

A GGUF file is data: a header of key-value pairs, tensor descriptions and the tensors.
`inspect_gguf` reads the header with the `gguf` package (no llama.cpp needed), refuses an
architecture llama.cpp cannot run as a text generator, tensor types it does not know, and
sizes past the limits below or that do not add up to the file; it returns the facts the
scheduler and the sharding need (`GgufFacts`): file size, layers, KV heads, context
length, vocabulary, special tokens, the chat template (which the kind renders in
jinja2's sandbox at submission: `prompts.check_template`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from idlegrid.kinds.base import InputError

# Decoder architectures llama.cpp (as built by llama-cpp-python 0.3.36) runs for text
# generation. Encoders (bert, t5encoder), vision and audio towers are left out.
ARCHITECTURES = frozenset(
    {
        "arctic", "baichuan", "bitnet", "bloom", "chatglm", "codeshell", "cohere2",
        "command-r", "dbrx", "deci", "deepseek", "deepseek2", "exaone", "falcon", "gemma",
        "gemma2", "gemma3", "glm4", "gpt2", "gptj", "gptneox", "granite", "granitemoe",
        "internlm2", "jais", "llama", "minicpm", "minicpm3", "mpt", "nemotron", "olmo",
        "olmo2", "olmoe", "openelm", "orion", "phi2", "phi3", "phimoe", "plamo", "qwen",
        "qwen2", "qwen2moe", "qwen3", "qwen3moe", "refact", "stablelm", "starcoder",
        "starcoder2", "xverse",
    }
)  # fmt: skip
MAX_MODEL_BYTES = 64 * 2**30
MAX_TENSORS = 100_000
MAX_LAYERS = 1024
MAX_EMBEDDING = 65_536
MAX_VOCAB = 1_048_576
MAX_CONTEXT = 1_048_576
MAX_TEMPLATE_CHARS = 65_536
# What llama.cpp needs beyond the weights and the KV cache: compute buffers, scratch (MiB).
RUNTIME_OVERHEAD_MB = 256


class GgufFacts(BaseModel):
    """What the coordinator learned from a GGUF header at submission (stored with the job)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    architecture: str = Field(max_length=40)
    name: str = Field(default="", max_length=200)
    file_bytes: int = Field(ge=1)
    parameters: int = Field(ge=1)
    layers: int = Field(ge=1)
    embedding: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    context_length: int = Field(ge=1)
    vocab: int = Field(ge=1)
    quantization: str = Field(max_length=40)
    bos_token: str = Field(default="", max_length=200)
    eos_token: str = Field(default="", max_length=200)
    chat_template: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS)

    def kv_cache_bytes(self, n_ctx: int) -> int:
        """The KV cache at `n_ctx` tokens: keys and values, 16-bit, every layer."""
        head_dim = self.embedding // self.heads
        return 2 * 2 * self.layers * n_ctx * self.kv_heads * head_dim

    def memory_mb(self, n_ctx: int) -> int:
        """Memory a node needs to run the model at `n_ctx`: weights, KV cache, overhead."""
        total = self.file_bytes + self.kv_cache_bytes(n_ctx)
        return RUNTIME_OVERHEAD_MB + -(-total // 2**20)

    def flops_per_token(self) -> float:
        """Forward-pass FLOPs of one token (two per weight)."""
        return 2.0 * self.parameters


FACTS_KEPT = 16
_checked: OrderedDict[str, GgufFacts] = OrderedDict()
_lock = threading.Lock()  # submissions split in worker threads


def inspect_gguf(path: Path, *, digest: str) -> GgufFacts:
    """Check a GGUF file for volunteers and describe it; InputError naming the problem.
    A model that passed is not read again (its header takes seconds to parse)."""
    with _lock:
        facts = _checked.get(digest)
        if facts is not None:
            _checked.move_to_end(digest)
            return facts
    facts = _inspect(path)
    with _lock:
        _checked[digest] = facts
        while len(_checked) > FACTS_KEPT:
            _checked.popitem(last=False)
    return facts


def _inspect(path: Path) -> GgufFacts:
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise InputError(f"model is {size} bytes, over the {MAX_MODEL_BYTES} byte limit")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise InputError("model is not a GGUF file (it does not start with 'GGUF')")
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise InputError(f"model: the GGUF header cannot be read: {exc}") from None
    fields = _Fields(reader)
    arch = fields.text("general.architecture")
    if arch not in ARCHITECTURES:
        raise InputError(
            f"model architecture {arch!r} is not one llama.cpp runs for generation "
            f"here; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    parameters = _check_tensors(reader, size)
    facts = GgufFacts(
        architecture=arch,
        name=fields.text("general.name", default="")[:200],
        file_bytes=size,
        parameters=parameters,
        layers=fields.count(f"{arch}.block_count", MAX_LAYERS),
        embedding=fields.count(f"{arch}.embedding_length", MAX_EMBEDDING),
        heads=fields.count(f"{arch}.attention.head_count", MAX_EMBEDDING),
        kv_heads=fields.count(
            f"{arch}.attention.head_count_kv",
            MAX_EMBEDDING,
            default=fields.count(f"{arch}.attention.head_count", MAX_EMBEDDING),
        ),
        context_length=fields.count(f"{arch}.context_length", MAX_CONTEXT),
        vocab=_vocab(fields, arch),
        quantization=_quantization(reader),
        bos_token=fields.token("tokenizer.ggml.bos_token_id"),
        eos_token=fields.token("tokenizer.ggml.eos_token_id"),
        chat_template=_template(fields),
    )
    if facts.kv_heads > facts.heads or facts.embedding % facts.heads:
        raise InputError(
            f"model: {facts.heads} attention heads, {facts.kv_heads} KV heads and "
            f"embedding {facts.embedding} do not fit together"
        )
    return facts


def _check_tensors(reader: Any, size: int) -> int:
    """Parameters of the model; InputError on too many tensors, an unknown type or sizes
    that do not fit in the file."""
    import gguf

    if not reader.tensors:
        raise InputError("model has no tensors")
    if len(reader.tensors) > MAX_TENSORS:
        raise InputError(f"model has {len(reader.tensors)} tensors, over {MAX_TENSORS}")
    parameters = total = 0
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind not in gguf.GGML_QUANT_SIZES:
            raise InputError(f"tensor {tensor.name!r} has an unknown type {kind}")
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        elements = int(tensor.n_elements)
        if elements <= 0 or elements % block:
            raise InputError(f"tensor {tensor.name!r} has {elements} elements for type {kind.name}")
        parameters += elements
        total += elements // block * type_bytes
    if total > size:
        raise InputError(f"model tensors need {total} bytes; the file has {size}")
    return parameters


def _vocab(fields: _Fields, arch: str) -> int:
    tokens = fields.length("tokenizer.ggml.tokens")
    if tokens == 0:
        raise InputError("model has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if tokens > MAX_VOCAB:
        raise InputError(f"model vocabulary has {tokens} tokens, over {MAX_VOCAB}")
    declared = fields.count(f"{arch}.vocab_size", MAX_VOCAB, default=tokens)
    if declared != tokens:
        raise InputError(f"model declares {declared} vocabulary entries and has {tokens} tokens")
    return tokens


def _quantization(reader: Any) -> str:
    """The most common weight type of the model's matrices (its quantization)."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2:
            name = tensor.tensor_type.name
            counts[name] = counts.get(name, 0) + int(tensor.n_elements)
    return max(counts, key=lambda name: counts[name]) if counts else "F32"


def _template(fields: _Fields) -> str | None:
    if not fields.has("tokenizer.chat_template"):
        return None
    template = fields.text("tokenizer.chat_template")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InputError(f"model chat template is over {MAX_TEMPLATE_CHARS} characters")
    return template


class _Fields:
    """Typed reads of a GGUF header's key-value pairs, each failure an InputError."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def has(self, key: str) -> bool:
        return key in self._fields

    def _value(self, key: str) -> Any:
        try:
            return self._fields[key].contents()
        except KeyError:
            raise InputError(f"model header has no {key!r}") from None
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise InputError(f"model header {key!r} cannot be read: {exc}") from None

    def text(self, key: str, *, default: str | None = None) -> str:
        if default is not None and key not in self._fields:
            return default
        value = self._value(key)
        if not isinstance(value, str):
            raise InputError(f"model header {key!r} is not text")
        return value

    def count(self, key: str, limit: int, *, default: int | None = None) -> int:
        if default is not None and key not in self._fields:
            return default
        value = self._value(key)
        if isinstance(value, list):  # per-layer values (some architectures): the largest
            value = max(value, default=0)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise InputError(f"model header {key!r} is {value!r}; expected 1 to {limit}")
        return value

    def length(self, key: str) -> int:
        field = self._fields.get(key)
        return 0 if field is None else len(field.data)

    def token(self, key: str) -> str:
        """The text of the special token whose id `key` names ("" if none)."""
        if key not in self._fields:
            return ""
        token_id = self._value(key)
        field = self._fields.get("tokenizer.ggml.tokens")
        if not isinstance(token_id, int) or field is None or not 0 <= token_id < len(field.data):
            raise InputError(f"model header {key!r} names no token of the vocabulary")
        return str(field.contents(token_id))[:200]
