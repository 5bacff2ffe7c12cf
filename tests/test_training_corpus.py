"""The character corpus: a pinned snapshot of pydoc_data.topics, split for evaluation."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from idlegrid.training import corpus


def test_the_snapshot_is_the_pinned_text() -> None:
    text = corpus.text()
    assert len(text) == corpus.TEXT_CHARS
    assert 'The "if" statement' in text or "if_stmt" in text


def test_vocabulary_and_tokens_round_trip() -> None:
    vocabulary = corpus.vocabulary()
    assert len(vocabulary) == 103 and list(vocabulary) == sorted(set(vocabulary))
    sample = corpus.text()[1000:1500]
    tokens = corpus.encode(sample)
    assert tokens.dtype == np.uint8 and corpus.decode(tokens) == sample
    with pytest.raises(KeyError):
        corpus.encode("\u2603")


def test_the_held_out_tenth_follows_the_training_text() -> None:
    train, held_out = corpus.train_tokens(), corpus.eval_tokens()
    assert len(train) + len(held_out) == corpus.TEXT_CHARS
    assert len(held_out) == pytest.approx(corpus.TEXT_CHARS / 10, abs=1)
    assert not train.flags.writeable and not held_out.flags.writeable


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="snapshot is of 3.11.7")
def test_the_snapshot_matches_this_interpreters_text() -> None:
    assert corpus.matches_stdlib()


def test_a_snapshot_that_does_not_match_its_hash_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus.text.cache_clear()
    monkeypatch.setattr(corpus, "TEXT_SHA256", "0" * 64)
    try:
        with pytest.raises(corpus.CorpusError, match="SHA-256"):
            corpus.text()
    finally:
        corpus.text.cache_clear()
