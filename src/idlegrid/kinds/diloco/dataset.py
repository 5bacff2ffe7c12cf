"""A `diloco-train` job's `dataset` input: arrays, or the name of a built-in character corpus.

A dataset blob with no arrays and the header {"corpus": "pydoc-topics"} (or
"cpython-stdlib", with the corpus's SHA-256) names a corpus shipped with idlegrid, so no
data bytes travel (`corpus_dataset_blob`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from idlegrid.kinds.base import InputError
from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import data as datasets
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.training.flat import ContainerError, pack, unpack

CORPUS_NAME = "pydoc-topics"


def stream_id(params: DilocoParams, dataset: bytes) -> str:
    """A name for one training run in workers' caches, when no job id is at hand."""
    text = params.model_dump_json().encode() + hashlib.sha256(dataset).digest()
    return "run-" + hashlib.sha256(text).hexdigest()[:16]


def corpus_dataset_blob(name: str = CORPUS_NAME) -> bytes:
    """A `dataset` input that names a built-in character corpus (no data inside)."""
    return pack({}, {"corpus": name, "sha256": corpus.get(name).sha256})


def dataset_blob(train: datasets.Dataset, held_out: datasets.Dataset | None = None) -> bytes:
    """A `dataset` input of arrays, optionally with its held-out split."""
    arrays = datasets.to_arrays(train, "")
    if held_out is not None:
        arrays.update(datasets.to_arrays(held_out, "eval."))
    return pack(arrays, {})


def read_dataset(blob: bytes) -> tuple[tasks.DataRef, tasks.DataRef]:
    """The training and held-out data of a `dataset` input; InputError if unusable."""
    try:
        arrays, header = unpack(blob)
        if header.get("corpus") is not None:
            return _corpus_dataset(header)
        train = datasets.from_arrays(arrays, "")
        if any(name.startswith("eval.") for name in arrays):
            return train, datasets.from_arrays(arrays, "eval.")
    except ContainerError as exc:
        raise InputError(f"dataset: {exc}") from None
    cut = len(train) - max(1, len(train) // 10)
    if cut <= 0:
        raise InputError("dataset: too small to hold a tenth out for evaluation")
    return _split_off(train, cut)


def _corpus_dataset(header: Mapping[str, Any]) -> tuple[tasks.DataRef, tasks.DataRef]:
    known = corpus.CORPORA.get(str(header["corpus"]))
    if known is None or header.get("sha256") != known.sha256:
        raise InputError(f"dataset: unknown corpus {header['corpus']!r}; "
                         f"known: {', '.join(corpus.CORPORA)}")  # fmt: skip
    train, held_out = len(corpus.train_tokens(known.name)), len(corpus.eval_tokens(known.name))
    return (tasks.CorpusSlice("train", 0, train, known.name),
            tasks.CorpusSlice("eval", 0, held_out, known.name))  # fmt: skip


def _split_off(data: datasets.Dataset, cut: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    if isinstance(data, datasets.TokenData):
        return datasets.TokenData(data.tokens[:cut]), datasets.TokenData(data.tokens[cut:])
    return (
        datasets.ExampleData(data.x[:cut], data.y[:cut]),
        datasets.ExampleData(data.x[cut:], data.y[cut:]),
    )
