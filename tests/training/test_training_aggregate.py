"""Aggregation rules, a poisoned update among honest ones, staleness, and closing a round."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from idlegrid.training import aggregate as agg
from idlegrid.training import closing
from idlegrid.training.compression import Compression, decode
from idlegrid.training.outer import OuterSettings, apply_update


def _honest(count: int, length: int = 2000, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Updates that share a direction and differ by noise, and their common direction."""
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(length).astype(np.float32)
    noise = 0.3 * rng.standard_normal((count, length))
    return [(direction + n).astype(np.float32) for n in noise], direction


def test_every_rule_returns_the_update_when_all_agree() -> None:
    update = np.arange(10, dtype=np.float32)
    for rule in ("mean", "trimmed-mean", "centered-clip"):
        result = agg.aggregate([update] * 5, agg.Aggregation(rule=rule))
        assert np.allclose(result, update), rule


POISONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "scaled x1000": lambda u: 1000 * u,
    "sign flipped x10": lambda u: -10 * u,
    "noise": lambda u: np.random.default_rng(9).standard_normal(u.size).astype(np.float32) * 100,
}


@pytest.mark.parametrize("poison", POISONS, ids=list(POISONS))
def test_one_poisoned_update_wrecks_the_mean_but_not_the_robust_rules(poison: str) -> None:
    updates, direction = _honest(8)
    honest_mean = agg.mean(updates)
    updates[3] = POISONS[poison](updates[3])

    def error(rule: agg.Rule) -> float:
        result = agg.aggregate(updates, agg.Aggregation(rule=rule))
        return float(np.linalg.norm(result - honest_mean) / np.linalg.norm(honest_mean))

    assert error("mean") > 1.0
    assert error("trimmed-mean") < 0.1
    assert error("centered-clip") < 0.1
    # The poisoned update is also the one that stands out.
    suspicion = agg.distances(updates, agg.aggregate(updates, agg.Aggregation(rule="trimmed-mean")))
    assert int(np.argmax(suspicion)) == 3


@pytest.mark.parametrize(
    ("updates", "fraction", "trimmed"),
    [(1, 0.2, 0), (2, 0.2, 0), (3, 0.2, 1), (4, 0.2, 1), (5, 0.2, 1), (10, 0.2, 2),
     (10, 0.3, 3), (10, 0.0, 0), (4, 0.49, 1)],
)  # fmt: skip
def test_trim_count(updates: int, fraction: float, trimmed: int) -> None:
    assert agg.trim_count(updates, fraction) == trimmed


def test_trimmed_mean_drops_the_extremes_per_coordinate() -> None:
    updates = [np.array([1, 100], np.float32), np.array([2, -100], np.float32),
               np.array([3, 0], np.float32), np.array([1000, 1], np.float32)]  # fmt: skip
    assert agg.trimmed_mean(updates, 1).tolist() == [2.5, 0.5]
    with pytest.raises(ValueError):
        agg.trimmed_mean(updates, 2)


def test_centered_clip_moves_at_most_tau_over_n_per_update() -> None:
    center = np.zeros(3, dtype=np.float32)
    updates = [np.zeros(3, np.float32)] * 3 + [np.array([1e6, 0, 0], np.float32)]
    result = agg.centered_clip(updates, tau=1.0, center=center, iterations=1)
    assert result.tolist() == pytest.approx([0.25, 0, 0])


@pytest.mark.parametrize(("staleness", "alpha", "weight"),
                         [(0, 0.5, 1.0), (3, 0.5, 0.5), (1, 1.0, 0.5), (8, 0.0, 1.0)])  # fmt: skip
def test_staleness_weight(staleness: int, alpha: float, weight: float) -> None:
    assert agg.staleness_weight(staleness, alpha) == pytest.approx(weight)


def test_stale_updates_pull_less() -> None:
    fresh, stale = np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    settings = agg.Aggregation(staleness_alpha=1.0)
    result = agg.aggregate([fresh, stale], settings, staleness=[0, 2])
    assert result.tolist() == pytest.approx([1.0] * 4)  # (1 + 3 / 3) / 2


def test_weighted_mean_and_refusals() -> None:
    a, b = np.zeros(2, np.float32), np.ones(2, np.float32)
    assert agg.mean([a, b], weights=[1, 3]).tolist() == [0.75, 0.75]
    with pytest.raises(ValueError):
        agg.mean([a, b], weights=[0, 0])
    with pytest.raises(ValueError):
        agg.mean([])


# -- a whole round ----------------------------------------------------------------------


def _close(
    state: closing.RoundState, updates: list[closing.Update], **kw: Any
) -> closing.ClosedRound:
    return closing.close_round(
        state, updates, rule=agg.Aggregation(), outer=OuterSettings(),
        download=Compression(method="int8"), **kw,
    )  # fmt: skip


def test_closing_a_round_moves_the_weights_by_the_published_update() -> None:
    state = closing.initial_state(np.ones(300, dtype=np.float32))
    updates = [closing.Update(np.full(300, 0.1, np.float32), 0, loss) for loss in (2.0, 4.0)]
    closed = _close(state, updates)
    assert closed.state.round == 1 and closed.train_loss == pytest.approx(3.0)
    assert np.array_equal(closed.state.weights, apply_update(state.weights, closed.message))
    # Nesterov's first step: -0.7 * (1 + 0.9) * 0.1 per value, up to int8 rounding.
    assert np.allclose(decode(closed.message), -0.133, atol=1e-3)


def test_late_updates_are_dropped_unless_the_round_is_asynchronous() -> None:
    state = closing.RoundState(5, np.zeros(10, np.float32), np.zeros(10, np.float32))
    late = [closing.Update(np.ones(10, np.float32), 3)]
    assert not np.any(_close(state, late).state.weights)
    moved = _close(state, late, asynchronous=True).state.weights
    assert np.all(moved < 0)
    future = [closing.Update(np.ones(10, np.float32), 6)]
    assert not np.any(_close(state, future, asynchronous=True).state.weights)


@pytest.mark.parametrize(
    ("base_rounds", "max_staleness", "applied", "dropped"),
    [
        ((5, 4, 3), 2, 2, 0),
        ((5, 4, 3), 1, 1, 1),
        ((5, 2), 2, 0, 1),
        ((4, 3), None, 2, 0),
    ],
)
def test_asynchronous_rounds_weigh_stale_updates_up_to_max_staleness(
    base_rounds: tuple[int, ...], max_staleness: int | None, applied: int, dropped: int
) -> None:
    state = closing.RoundState(5, np.zeros(10, np.float32), np.zeros(10, np.float32))
    updates = [closing.Update(np.ones(10, np.float32), r) for r in base_rounds]
    closed = _close(state, updates, asynchronous=True, max_staleness=max_staleness)
    assert (closed.stale_applied, closed.stale_dropped) == (applied, dropped)


def test_a_stale_update_pulls_by_its_staleness_weight() -> None:
    state = closing.RoundState(5, np.zeros(10, np.float32), np.zeros(10, np.float32))
    rule = agg.Aggregation(staleness_alpha=1.0)
    fresh = closing.Update(np.ones(10, np.float32), 5)
    stale = closing.Update(np.ones(10, np.float32), 2)  # s = 3: weight 1/4
    gradient = agg.aggregate([fresh.delta, stale.delta], rule, staleness=[0, 3])
    assert np.allclose(gradient, (1 + 0.25) / 2)
    closed = closing.close_round(state, [fresh, stale], rule=rule, outer=OuterSettings(),
                                 download=Compression(method="none"), asynchronous=True,
                                 max_staleness=3)  # fmt: skip
    alone = closing.close_round(state, [fresh], rule=rule, outer=OuterSettings(),
                                download=Compression(method="none"))  # fmt: skip
    # The stale update moves the weights, less than a fresh one would (mean of 1 and 1/4).
    assert np.allclose(closed.state.weights, 0.625 * alone.state.weights)


def test_a_round_without_updates_still_advances() -> None:
    state = closing.initial_state(np.ones(10, dtype=np.float32))
    closed = _close(state, [])
    assert closed.state.round == 1 and np.array_equal(closed.state.weights, state.weights)


def test_task_seeds_differ_by_round_and_shard_and_repeat_for_replicas() -> None:
    seeds = {closing.task_seed(7, r, s) for r in range(20) for s in range(20)}
    assert len(seeds) == 400
    assert closing.task_seed(7, 3, 4) == closing.task_seed(7, 3, 4)
    assert 0 <= closing.task_seed(7, 3, 4) < 2**63
