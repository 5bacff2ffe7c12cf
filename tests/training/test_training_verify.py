"""Comparing replicas: count sketches, and the tolerance calibrated on thread counts."""

from __future__ import annotations

import numpy as np
import pytest

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco.data import TokenData
from idlegrid.training import models, verify


def test_a_sketch_estimates_relative_distance() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(100_000).astype(np.float32)
    for scale in (1e-4, 1e-2, 0.3):
        b = a + scale * rng.standard_normal(a.size).astype(np.float32)
        exact = verify.relative_distance(a, b)
        estimate = verify.relative_distance(verify.sketch(a), verify.sketch(b))
        assert estimate == pytest.approx(exact, rel=0.2)


def test_sketch_is_linear_and_the_same_everywhere() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 5000)).astype(np.float32)
    assert np.allclose(verify.sketch(a + b), verify.sketch(a) + verify.sketch(b), atol=1e-4)
    assert np.array_equal(verify.sketch(a), verify.sketch(a.copy()))
    assert verify.sketch(a).shape == (verify.SKETCH_SIZE,)


def test_a_sketch_drawn_in_parts_is_the_one_drawn_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers of different versions must agree: the map is still the one int64 draw.
    monkeypatch.setattr(verify, "_SKETCH_PART", 1000)
    verify._sketch_map.cache_clear()
    vector = np.random.default_rng(2).standard_normal(2_501).astype(np.float32)
    rng = np.random.default_rng([verify._SKETCH_SEED, vector.size, verify.SKETCH_SIZE])
    buckets = rng.integers(0, verify.SKETCH_SIZE, size=vector.size)
    signs = rng.integers(0, 2, size=vector.size).astype(np.float64) * 2 - 1
    whole = np.bincount(buckets, weights=signs * vector, minlength=verify.SKETCH_SIZE)
    try:
        assert np.allclose(verify.sketch(vector), whole.astype(np.float32), rtol=1e-6, atol=1e-6)
    finally:
        verify._sketch_map.cache_clear()


@pytest.mark.parametrize(
    ("a", "b", "agree"),
    [(1.0, 1.001, True), (1.0, 1.02, False), (0.0, 0.005, True), (1.0, float("nan"), False)],
)
def test_losses_agree(a: float, b: float, agree: bool) -> None:
    assert verify.losses_agree(a, b) is agree


def test_zero_vectors_agree_and_nan_does_not() -> None:
    zero = np.zeros(4, np.float32)
    assert verify.deltas_agree(zero, zero)
    assert not verify.deltas_agree(zero, np.array([np.nan, 0, 0, 0], np.float32))


def test_tolerance_holds_across_thread_counts_and_catches_another_seed() -> None:
    """Calibration: the same task with 1 and 2 CPU threads, and with another seed."""
    torch = pytest.importorskip("torch")
    from idlegrid.kinds.diloco import inner

    config = models.LMConfig(vocab=103, context=32, width=32, layers=2, heads=4)
    weights = models.init_weights("transformer-lm", config, 0)
    data = TokenData(corpus.train_tokens()[:50_000])
    settings = inner.InnerSettings(steps=20, batch_size=8, seq_len=32)
    before = torch.get_num_threads()
    deltas = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            deltas[threads] = inner.train_inner(
                "transformer-lm", config, weights, data, settings, seed=1
            ).delta
    finally:
        torch.set_num_threads(before)
    other = inner.train_inner("transformer-lm", config, weights, data, settings, seed=2).delta
    honest = verify.relative_distance(verify.sketch(deltas[1]), verify.sketch(deltas[2]))
    cheat = verify.relative_distance(verify.sketch(deltas[1]), verify.sketch(other))
    assert honest < verify.DELTA_TOLERANCE / 100
    assert cheat > 5 * verify.DELTA_TOLERANCE
