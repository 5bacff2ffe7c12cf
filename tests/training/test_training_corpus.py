"""The character corpora: pinned snapshots, split into train, validation and test."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from idlegrid.kinds.diloco import char_corpus as corpus


def test_the_snapshot_is_the_pinned_text() -> None:
    text = corpus.text()
    assert len(text) == corpus.TEXT_CHARS
    assert 'The "if" statement' in text or "if_stmt" in text


def test_the_stdlib_snapshot_is_its_pinned_source() -> None:
    text = corpus.text("cpython-stdlib")
    assert len(text) == corpus.STDLIB.chars and text.isascii()
    assert "def dedent(text):" in text and len(corpus.vocabulary("cpython-stdlib")) == 96


def test_vocabulary_and_tokens_round_trip() -> None:
    vocabulary = corpus.vocabulary()
    assert len(vocabulary) == 103 and list(vocabulary) == sorted(set(vocabulary))
    sample = corpus.text()[1000:1500]
    tokens = corpus.encode(sample)
    assert tokens.dtype == np.uint8 and corpus.decode(tokens) == sample
    with pytest.raises(KeyError):
        corpus.encode("\u2603")


@pytest.mark.parametrize("name", ["pydoc-topics", "cpython-stdlib"])
def test_the_held_out_tenth_is_validation_then_test(name: str) -> None:
    chars = corpus.get(name).chars
    train, held_out = corpus.train_tokens(name), corpus.eval_tokens(name)
    validation, test = corpus.tokens("validation", name), corpus.tokens("test", name)
    assert len(train) + len(held_out) == chars
    assert len(held_out) == pytest.approx(chars / 10, abs=1)
    assert np.array_equal(np.concatenate([validation, test]), held_out)
    assert abs(len(validation) - len(test)) <= 1
    assert not train.flags.writeable and not test.flags.writeable


def test_an_unknown_corpus_is_named_with_the_known_ones() -> None:
    with pytest.raises(corpus.CorpusError, match="pydoc-topics, cpython-stdlib"):
        corpus.get("wikipedia")
    assert corpus.by_sha256(corpus.STDLIB.sha256) == corpus.STDLIB
    assert corpus.by_sha256("0" * 64) is None


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="snapshot is of 3.11.7")
def test_the_snapshot_matches_this_interpreters_text() -> None:
    assert corpus.matches_stdlib()


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="snapshot is of 3.11.7")
def test_the_stdlib_snapshot_rebuilds_from_this_interpreters_lib() -> None:
    import os

    assert corpus.stdlib_text(Path(os.__file__).parent) == corpus.text("cpython-stdlib")


def test_a_snapshot_that_does_not_match_its_hash_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus.text.cache_clear()
    wrong = dataclasses.replace(corpus.PYDOC, sha256="0" * 64)
    monkeypatch.setitem(corpus.CORPORA, corpus.PYDOC.name, wrong)
    try:
        with pytest.raises(corpus.CorpusError, match="SHA-256"):
            corpus.text()
    finally:
        corpus.text.cache_clear()
