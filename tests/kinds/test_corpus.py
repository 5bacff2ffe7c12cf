"""The stdlib docstring corpus: size, shape of its paragraphs, determinism, speed."""

from __future__ import annotations

import json

import pytest
from helpers import run_python

from idlegrid.kinds.embed_text.samples import MAX_CHARS, MIN_CHARS, stdlib_paragraphs


def test_default_corpus_has_2000_distinct_paragraphs() -> None:
    paragraphs = stdlib_paragraphs()
    assert len(paragraphs) == 2000
    assert len(set(paragraphs)) == len(paragraphs)


def test_paragraphs_are_collapsed_prose_of_bounded_length() -> None:
    for paragraph in stdlib_paragraphs(5000):
        assert MIN_CHARS <= len(paragraph) <= MAX_CHARS
        assert any(character.isalpha() for character in paragraph)
        assert paragraph == " ".join(paragraph.split())
        assert not paragraph.startswith(">>>")


def test_corpus_is_deterministic_and_limit_takes_a_prefix() -> None:
    full = stdlib_paragraphs()
    assert stdlib_paragraphs() == full
    assert stdlib_paragraphs(10) == full[:10]
    assert stdlib_paragraphs(0) == []
    assert len(stdlib_paragraphs(10**6)) > 2000


def test_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        stdlib_paragraphs(-1)


def test_fresh_process_builds_it_fast_without_torch() -> None:
    script = (
        "import json, sys, time\n"
        "start = time.perf_counter()\n"
        "from idlegrid.kinds.embed_text.samples import stdlib_paragraphs\n"
        "paragraphs = stdlib_paragraphs()\n"
        "print(json.dumps({'seconds': time.perf_counter() - start, 'first': paragraphs[0],\n"
        "                  'torch': 'torch' in sys.modules}))\n"
    )
    report = json.loads(run_python(script, timeout_s=60))
    assert report["torch"] is False
    assert report["first"] == stdlib_paragraphs(1)[0]
    # Measured ~0.1 s on 2 cores; demos and benchmarks budget 2 s for it.
    assert report["seconds"] < 2.0
