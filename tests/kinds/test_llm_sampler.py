"""The llm-generate sampler both sides run: picks, their ranges, and the seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from idlegrid.kinds.llm_generate.sampler import Sampling, candidates, choose, draw, interval


def test_greedy_is_the_argmax_lowest_id_on_ties() -> None:
    logits = np.array([0.0, 3.0, 3.0, -1.0], dtype=np.float32)
    assert choose(logits, Sampling(), seed=1, position=0) == 1


def test_draws_follow_seed_and_position_only() -> None:
    assert draw(7, 3) == draw(7, 3)
    assert draw(7, 3) != draw(7, 4) and draw(7, 3) != draw(8, 3)
    values = [draw(0, i) for i in range(2000)]
    assert min(values) >= 0.0 and max(values) < 1.0
    assert abs(float(np.mean(values)) - 0.5) < 0.03


def test_sampled_picks_match_the_distribution() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float64)).astype(np.float32)
    sampling = Sampling(temperature=1.0)
    picks = [choose(logits, sampling, seed=5, position=i) for i in range(3000)]
    shares = np.bincount(picks, minlength=3) / len(picks)
    assert np.allclose(shares, [0.5, 0.3, 0.2], atol=0.03)


@pytest.mark.parametrize(
    ("sampling", "kept"),
    [
        (Sampling(temperature=1.0, top_k=2), [0, 1]),
        (Sampling(temperature=1.0, top_p=0.6), [0, 1]),
        (Sampling(temperature=1.0, top_p=0.4), [0]),
        (Sampling(temperature=1.0), [0, 1, 2]),
    ],
)
def test_top_k_and_top_p_cut_the_candidates(sampling: Sampling, kept: list[int]) -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    tokens, probs = candidates(logits, sampling)
    assert tokens.tolist() == kept
    assert abs(float(probs.sum()) - 1.0) < 1e-9


def test_the_pick_lies_in_its_interval() -> None:
    rng = np.random.default_rng(0)
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=50)
    for position in range(200):
        logits = rng.normal(size=1000).astype(np.float32) * 3
        token = choose(logits, sampling, seed=11, position=position)
        span = interval(logits, sampling, token)
        assert span is not None and span[0] <= draw(11, position) < span[1] + 1e-12
