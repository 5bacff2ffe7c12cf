"""Character-level corpora shipped with idlegrid as pinned snapshots, split three ways.

Two corpora, each an xz snapshot in the package pinned by SHA-256 (volunteers on Python
3.11, 3.12 and 3.13 must hold the same characters: verification compares replicas bit
for bit in their inputs, so nothing is read from whatever the interpreter has):

- `pydoc-topics` (the default): CPython 3.11.7's `pydoc_data.topics`, the language
  reference text that `help()` shows, 465,126 characters, 95 kB compressed. The topics
  joined in key order with blank lines between them:
  ``"\\n\\n".join(topics[key] for key in sorted(topics))``. Small: a character model of
  a few hundred thousand parameters overfits it within a few thousand steps.
- `cpython-stdlib`: CPython 3.11.7's standard-library source, the top-level `Lib/*.py`
  files that are pure ASCII (159 of 168), in file-name order, joined with blank lines:
  4,398,642 characters, 842 kB compressed (`stdlib_text` rebuilds it from a `Lib/`).
  Ten times the text: the same models do not overfit it in the benchmark's runs.

Both are PSF-licensed, redistributable with their notice (CPython's LICENSE).

Splits: the first 90% of the text is for training; the last 10% is held out (`eval`, what
a grid job evaluates on), and is itself halved into validation (checkpoint selection and
tuning) and test (the reported figures), so no figure is selected on what reports it.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np

SNAPSHOT_PYTHON = "3.11.7"
# The last tenth of the text is held out, never trained on: validation, then test.
EVAL_FRACTION = 0.1
Split = Literal["train", "eval", "validation", "test"]


@dataclass(frozen=True)
class Corpus:
    """One shipped snapshot: its package file, and the SHA-256 and length of its text."""

    name: str
    snapshot: str
    sha256: str
    chars: int


PYDOC = Corpus(
    "pydoc-topics",
    "pydoc_topics.txt.xz",
    "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee",
    465_126,
)
STDLIB = Corpus(
    "cpython-stdlib",
    "cpython_stdlib.txt.xz",
    "93e54b906347919538c18dcebddac95e2d86066b4b0b2241c8eedf6e5664c29e",
    4_398_642,
)
CORPORA = {corpus.name: corpus for corpus in (PYDOC, STDLIB)}
DEFAULT = PYDOC.name
# The default corpus's pin, as older callers name it.
TEXT_SHA256 = PYDOC.sha256
TEXT_CHARS = PYDOC.chars


class CorpusError(RuntimeError):
    """The shipped snapshot is missing, not the pinned text, or no corpus has that name."""


def get(name: str = DEFAULT) -> Corpus:
    """The corpus called `name`; CorpusError lists the known ones."""
    try:
        return CORPORA[name]
    except KeyError:
        raise CorpusError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}") from None


def by_sha256(sha256: str) -> Corpus | None:
    """The shipped corpus whose text has this SHA-256, if any."""
    return next((c for c in CORPORA.values() if c.sha256 == sha256), None)


@functools.cache
def text(name: str = DEFAULT) -> str:
    """The pinned text of a corpus (checked against its SHA-256 once per process)."""
    corpus = get(name)
    try:
        compressed = resources.files(__package__).joinpath(corpus.snapshot).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise CorpusError(f"corpus snapshot {corpus.snapshot} is missing from the package") from exc
    raw = lzma.decompress(compressed)
    if hashlib.sha256(raw).hexdigest() != corpus.sha256:
        raise CorpusError(f"corpus snapshot {corpus.snapshot} does not match its pinned SHA-256")
    return raw.decode("utf-8")


@functools.cache
def vocabulary(name: str = DEFAULT) -> str:
    """The distinct characters of the corpus, sorted: character i has token id i."""
    return "".join(sorted(set(text(name))))


def encode(characters: str, name: str = DEFAULT) -> np.ndarray:
    """Token ids (uint8) of text made of corpus characters; KeyError names a stranger."""
    ids = {char: i for i, char in enumerate(vocabulary(name))}
    return np.fromiter((ids[char] for char in characters), dtype=np.uint8, count=len(characters))


def decode(tokens: np.ndarray, name: str = DEFAULT) -> str:
    """The text of token ids."""
    chars = vocabulary(name)
    return "".join(chars[int(token)] for token in tokens)


@functools.cache
def _tokens(name: str) -> np.ndarray:
    tokens = encode(text(name), name)
    tokens.flags.writeable = False
    return tokens


def tokens(split: Split, name: str = DEFAULT) -> np.ndarray:
    """Token ids of one split of a corpus; read-only."""
    all_tokens = _tokens(name)
    held_out = int(len(all_tokens) * (1 - EVAL_FRACTION))
    halfway = held_out + (len(all_tokens) - held_out) // 2
    bounds = {"train": (0, held_out), "eval": (held_out, len(all_tokens)),
              "validation": (held_out, halfway), "test": (halfway, len(all_tokens))}  # fmt: skip
    start, stop = bounds[split]
    return all_tokens[start:stop]


def train_tokens(name: str = DEFAULT) -> np.ndarray:
    """Token ids of the training part (the first 90% of the text); read-only."""
    return tokens("train", name)


def eval_tokens(name: str = DEFAULT) -> np.ndarray:
    """Token ids of the held-out part (the last 10%: validation, then test); read-only."""
    return tokens("eval", name)


def matches_stdlib() -> bool:
    """Whether this interpreter's `pydoc_data.topics` is the snapshot's text (informational)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return False
    joined = "\n\n".join(topics[key] for key in sorted(topics))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest() == PYDOC.sha256


def stdlib_text(lib: Path) -> str:
    """The `cpython-stdlib` text built from a CPython `Lib/` folder (3.11.7's is pinned)."""
    sources = (path.read_text("utf-8") for path in sorted(lib.glob("*.py")))
    return "\n\n".join(source for source in sources if source.isascii())
