"""A character-level corpus of real English text: CPython's `pydoc_data.topics`, as a snapshot.

`pydoc_data.topics` is the language reference text that `help()` shows, about 465,000
characters. It changes between Python versions, and one training job mixes volunteers on
3.11, 3.12 and 3.13 whose shards must hold the same characters (verification compares
replicas bit for bit in their inputs), so idlegrid ships the 3.11.7 text as a 95 kB xz
snapshot in the package, pinned by SHA-256, instead of reading whatever the interpreter has.
The text is the topics joined in key order with blank lines between them:
``"\\n\\n".join(topics[key] for key in sorted(topics))``. It is PSF-licensed documentation,
redistributable with its notice (CPython's LICENSE).
"""

from __future__ import annotations

import functools
import hashlib
import lzma
from importlib import resources

import numpy as np

SNAPSHOT = "pydoc_topics.txt.xz"
SNAPSHOT_PYTHON = "3.11.7"
TEXT_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
TEXT_CHARS = 465_126
# The last tenth of the text is held out for evaluation, never trained on.
EVAL_FRACTION = 0.1


class CorpusError(RuntimeError):
    """The shipped snapshot is missing or not the pinned text."""


@functools.cache
def text() -> str:
    """The pinned corpus text (checked against TEXT_SHA256 once per process)."""
    try:
        compressed = resources.files(__package__).joinpath(SNAPSHOT).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise CorpusError(f"corpus snapshot {SNAPSHOT} is missing from the package") from exc
    raw = lzma.decompress(compressed)
    if hashlib.sha256(raw).hexdigest() != TEXT_SHA256:
        raise CorpusError(f"corpus snapshot {SNAPSHOT} does not match its pinned SHA-256")
    return raw.decode("utf-8")


@functools.cache
def vocabulary() -> str:
    """The distinct characters of the corpus, sorted: character i has token id i."""
    return "".join(sorted(set(text())))


def encode(characters: str) -> np.ndarray:
    """Token ids (uint8) of text made of corpus characters; KeyError names a stranger."""
    ids = {char: i for i, char in enumerate(vocabulary())}
    return np.fromiter((ids[char] for char in characters), dtype=np.uint8, count=len(characters))


def decode(tokens: np.ndarray) -> str:
    """The text of token ids."""
    chars = vocabulary()
    return "".join(chars[int(token)] for token in tokens)


@functools.cache
def _tokens() -> np.ndarray:
    tokens = encode(text())
    tokens.flags.writeable = False
    return tokens


def train_tokens() -> np.ndarray:
    """Token ids of the training part (the first 90% of the text); read-only."""
    return _tokens()[: _split_point()]


def eval_tokens() -> np.ndarray:
    """Token ids of the held-out part (the last 10% of the text); read-only."""
    return _tokens()[_split_point() :]


def _split_point() -> int:
    return int(len(_tokens()) * (1 - EVAL_FRACTION))


def matches_stdlib() -> bool:
    """Whether this interpreter's `pydoc_data.topics` is the snapshot's text (informational)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return False
    joined = "\n\n".join(topics[key] for key in sorted(topics))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest() == TEXT_SHA256
