"""Prompt lengths in tokens, as the coordinator counts them at submission.

Where llama-cpp-python is installed on the coordinator, the model's own tokenizer counts
exactly (the vocabulary alone is loaded: no weights; the last one is kept, so a job's
split and the next job of the same model do not load it again). Without it, a prompt
counts as its UTF-8 length plus two: no byte-level or byte-fallback tokenizer makes more
tokens than bytes (plus a BOS and a leading space), so the bound never lets through a
prompt that will not fit, though it may refuse one that would.
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_lock = threading.Lock()
_kept: dict[str, Any] = {}  # the last vocabulary loaded, by the model file's path


@atexit.register
def _close() -> None:
    """Free it before the interpreter tears llama-cpp-python down (its own `__del__`
    would then find its library's functions gone)."""
    for vocab in _kept.values():
        vocab.close()
    _kept.clear()


def count_tokens(path: Path, texts: list[str]) -> tuple[list[int], bool]:
    """Tokens of each text, and whether the counts are exact (else upper bounds)."""
    with _lock:  # one vocabulary in memory at a time
        vocab = _vocabulary(path)
        if vocab is None:
            return [len(text.encode("utf-8")) + 2 for text in texts], False
        return [
            len(vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)) for text in texts
        ], True


def _vocabulary(path: Path) -> Any:
    """The model's vocabulary through llama.cpp (None: not installed, or it cannot read it)."""
    key = f"{path}:{path.stat().st_size}"
    if key in _kept:
        return _kept[key]
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    try:
        vocab = Llama(model_path=str(path), vocab_only=True, n_ctx=16, n_batch=16, verbose=False)
    except (ValueError, RuntimeError, OSError) as exc:
        log.warning("llama.cpp cannot read the vocabulary of %s: %s", path.name, exc)
        return None
    for old in _kept.values():
        old.close()
    _kept.clear()
    _kept[key] = vocab
    return vocab
