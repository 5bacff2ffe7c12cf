"""Inner steps on a worker: determinism, pseudo-gradients, losses, data checks."""

from __future__ import annotations

import numpy as np
import pytest

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco.data import ExampleData, TokenData
from idlegrid.kinds.diloco.worker_state import OptimizerState as WorkerOptimizerState
from idlegrid.training import models

torch = pytest.importorskip("torch")
from idlegrid.kinds.diloco import inner  # noqa: E402

LM = models.LMConfig(vocab=103, context=32, width=16, layers=1, heads=2)
SETTINGS = inner.InnerSettings(steps=8, batch_size=4, seq_len=32, lr=3e-3)


COSINE = inner.InnerSettings(steps=10, lr=1.0, run_warmup_steps=4, decay_steps=24, min_lr_ratio=0.1)


@pytest.mark.parametrize(
    ("settings", "run_step", "lr"),
    [
        (inner.InnerSettings(lr=0.5), 0, 0.5),  # the default: constant
        (inner.InnerSettings(lr=0.5), 10_000, 0.5),
        (COSINE, 0, 0.2),  # warmup: (step + 1) / (warmup + 1)
        (COSINE, 3, 0.8),
        (COSINE, 4, 1.0),  # the peak, where decay starts
        (COSINE, 14, 0.55),  # halfway: floor + (1 - floor) / 2
        (COSINE, 24, 0.1),  # decay_steps: the floor
        (COSINE, 100, 0.1),  # and it stays there
        (COSINE.model_copy(update={"min_lr_ratio": 0.0}), 24, 0.0),
    ],
)
def test_run_lr_warms_up_then_decays_by_cosine(
    settings: inner.InnerSettings, run_step: int, lr: float
) -> None:
    assert inner.run_lr(settings, run_step) == pytest.approx(lr, abs=1e-12)


@pytest.mark.parametrize(
    ("round_number", "step", "task_warmup", "lr"),
    [
        (0, 0, 0, 0.2),  # round 0 starts in the run's warmup
        (1, 0, 0, inner.run_lr(COSINE, 10)),  # round 1 starts at run step 10
        (1, 4, 0, 0.55),  # run step 14
        (1, 0, 1, inner.run_lr(COSINE, 10) / 2),  # the task's own warmup on top
        (1, 1, 1, inner.run_lr(COSINE, 11)),
        (2, 9, 0, inner.run_lr(COSINE, 29)),
    ],
)
def test_a_task_follows_the_run_schedule_from_its_round(
    round_number: int, step: int, task_warmup: int, lr: float
) -> None:
    task_settings = COSINE.model_copy(update={"warmup_steps": task_warmup})
    settings = inner.for_round(task_settings, round_number)
    assert settings.first_step == round_number * COSINE.steps
    assert inner.task_lr(settings, step) == pytest.approx(lr, abs=1e-12)


def _lm_data() -> TokenData:
    return TokenData(corpus.train_tokens()[:20_000])


def _train(seed: int, weights: np.ndarray | None = None) -> inner.InnerResult:
    start = models.init_weights("transformer-lm", LM, 0) if weights is None else weights
    return inner.train_inner("transformer-lm", LM, start, _lm_data(), SETTINGS, seed=seed)


def test_the_same_seed_gives_the_same_bits() -> None:
    first, second = _train(seed=5), _train(seed=5)
    assert np.array_equal(first.delta, second.delta)
    assert first.loss_mean == second.loss_mean
    assert not np.array_equal(first.delta, _train(seed=6).delta)


def test_the_pseudo_gradient_is_global_minus_local_weights() -> None:
    weights = models.init_weights("transformer-lm", LM, 0)
    result = _train(seed=1, weights=weights)
    assert result.delta.dtype == np.float32 and result.delta.shape == weights.shape
    assert np.linalg.norm(result.delta) > 0
    assert result.loss_first > result.loss_last
    # Weights are not modified in place.
    assert np.array_equal(weights, models.init_weights("transformer-lm", LM, 0))


def test_evaluation_is_fixed_and_lower_after_training() -> None:
    weights = models.init_weights("transformer-lm", LM, 0)
    held_out = TokenData(corpus.eval_tokens())

    def loss(w: np.ndarray) -> float:
        return inner.evaluate(
            "transformer-lm", LM, w, held_out, batches=2, batch_size=4, seq_len=32
        )

    assert loss(weights) == loss(weights)
    trained = weights - _train(seed=1).delta
    assert loss(trained) < loss(weights)


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_classifiers_train_on_examples(architecture: str) -> None:
    rng = np.random.default_rng(0)
    config = models.parse_config(architecture, {"inputs": 64, "classes": 3} if architecture == "mlp"
                                 else {"image_size": 8, "width": 4, "classes": 3})  # fmt: skip
    x = rng.standard_normal((60, 1, 8, 8)).astype(np.float32)
    data = ExampleData(x if architecture == "cnn" else x.reshape(60, 64), rng.integers(0, 3, 60))
    weights = models.init_weights(architecture, config, 0)
    settings = inner.InnerSettings(steps=5, batch_size=8)
    result = inner.train_inner(architecture, config, weights, data, settings, seed=0)
    assert result.delta.shape == weights.shape and np.isfinite(result.loss_mean)


def test_data_that_does_not_fit_the_model_is_refused() -> None:
    weights = models.init_weights("transformer-lm", LM, 0)
    too_big = TokenData(np.full(100, 200, dtype=np.uint8))
    with pytest.raises(ValueError, match="vocab"):
        inner.train_inner("transformer-lm", LM, weights, too_big, SETTINGS, seed=0)
    long = inner.InnerSettings(steps=1, seq_len=64)
    with pytest.raises(ValueError, match="context"):
        inner.train_inner("transformer-lm", LM, weights, _lm_data(), long, seed=0)
    examples = ExampleData(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="tokens"):
        inner.train_inner("transformer-lm", LM, weights, examples, SETTINGS, seed=0)


def test_on_step_sees_every_step_and_may_stop_the_run() -> None:
    seen: list[int] = []
    weights = models.init_weights("transformer-lm", LM, 0)
    inner.train_inner("transformer-lm", LM, weights, _lm_data(), SETTINGS, seed=0,
                      on_step=seen.append)  # fmt: skip
    assert seen == list(range(1, 9))

    def stop(done: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        inner.train_inner("transformer-lm", LM, weights, _lm_data(), SETTINGS, seed=0, on_step=stop)


KEEP = SETTINGS.model_copy(update={"keep_state": True})


def test_a_task_keeps_adamw_moments_only_when_asked() -> None:
    weights = models.init_weights("transformer-lm", LM, 0)
    assert (
        inner.train_inner("transformer-lm", LM, weights, _lm_data(), SETTINGS, seed=0).state is None
    )
    state = inner.train_inner("transformer-lm", LM, weights, _lm_data(), KEEP, seed=0).state
    assert state is not None and state.step == KEEP.steps and state.fits(weights.size)
    assert np.all(state.exp_avg_sq >= 0) and np.abs(state.exp_avg).max() > 0


def test_kept_moments_carry_into_the_next_task_and_its_step_count() -> None:
    weights = models.init_weights("transformer-lm", LM, 0)
    first = inner.train_inner("transformer-lm", LM, weights, _lm_data(), KEEP, seed=0)
    start = weights - first.delta
    fresh = inner.train_inner("transformer-lm", LM, start, _lm_data(), KEEP, seed=1)
    carried = inner.train_inner(
        "transformer-lm", LM, start, _lm_data(), KEEP, seed=1, state=first.state
    )
    assert carried.state is not None and carried.state.step == 2 * KEEP.steps
    assert not np.array_equal(carried.delta, fresh.delta)
    # Moments of another model's size are ignored: the task starts them at zero.
    other = WorkerOptimizerState(3, np.zeros(5, np.float32), np.zeros(5, np.float32))
    ignored = inner.train_inner("transformer-lm", LM, start, _lm_data(), KEEP, seed=1, state=other)
    assert np.array_equal(ignored.delta, fresh.delta)


def test_adamw_state_goes_into_torch_and_back_unchanged() -> None:
    module = models.build_module("transformer-lm", LM)
    optimizer = torch.optim.AdamW(module.parameters())
    size = sum(p.numel() for p in module.parameters())
    rng = np.random.default_rng(0)
    state = WorkerOptimizerState(
        7, rng.standard_normal(size).astype(np.float32), rng.random(size).astype(np.float32)
    )
    inner._load_state(optimizer, state)
    back = inner._save_state(optimizer)
    assert back.step == 7
    assert np.array_equal(back.exp_avg, state.exp_avg)
    assert np.array_equal(back.exp_avg_sq, state.exp_avg_sq)
