"""The outer optimizer, and download compression that keeps both sides bit-identical."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from idlegrid.kinds.diloco import tasks
from idlegrid.training import compression as c
from idlegrid.training.flat import digest
from idlegrid.training.outer import (
    OuterSettings,
    apply_update,
    nesterov_step,
    publish_update,
)


def test_nesterov_matches_a_hand_computed_step() -> None:
    settings = OuterSettings()  # lr 0.7, momentum 0.9
    buffer = np.zeros(2, dtype=np.float32)
    # Round 1: buf = g = [1, -2]; step = g + 0.9 buf = [1.9, -3.8]; update = -0.7 step.
    update, buffer = nesterov_step(np.array([1.0, -2.0], np.float32), buffer, settings)
    assert buffer.tolist() == pytest.approx([1.0, -2.0])
    assert update.tolist() == pytest.approx([-1.33, 2.66])
    # Round 2: buf = 0.9 [1, -2] + [0.5, 0.5] = [1.4, -1.3]; step = [1.76, -0.67].
    update, buffer = nesterov_step(np.array([0.5, 0.5], np.float32), buffer, settings)
    assert buffer.tolist() == pytest.approx([1.4, -1.3])
    assert update.tolist() == pytest.approx([-1.232, 0.469])
    assert update.dtype == np.float32 and buffer.dtype == np.float32


def test_plain_momentum_steps_along_the_buffer() -> None:
    settings = OuterSettings(lr=0.5, momentum=0.5, nesterov=False)
    update, buffer = nesterov_step(np.ones(1, np.float32), np.ones(1, np.float32), settings)
    assert buffer.tolist() == [1.5] and update.tolist() == [-0.75]


def test_nesterov_agrees_with_torch_sgd() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(50).astype(np.float32)
    parameter = torch.nn.Parameter(torch.from_numpy(weights.copy()))
    optimizer = torch.optim.SGD([parameter], lr=0.7, momentum=0.9, nesterov=True)
    buffer = np.zeros_like(weights)
    for _ in range(5):
        gradient = rng.standard_normal(50).astype(np.float32)
        parameter.grad = torch.from_numpy(gradient.copy())
        optimizer.step()
        update, buffer = nesterov_step(gradient, buffer, OuterSettings())
        weights = weights + update
    assert np.allclose(weights, parameter.detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("method", ["none", "int8", "int4", "topk"])
def test_coordinator_and_worker_stay_bit_identical_over_rounds(method: str) -> None:
    settings = c.Compression(method=method, chunk_size=64, topk_fraction=0.05)
    rng = np.random.default_rng(3)
    coordinator = rng.standard_normal(3000).astype(np.float32)
    worker = coordinator.copy()
    residual = None
    buffer = np.zeros_like(coordinator)
    for _ in range(8):
        gradient = (rng.standard_normal(3000) * 1e-2).astype(np.float32)
        update, buffer = nesterov_step(gradient, buffer, OuterSettings())
        published = publish_update(coordinator, update, residual, settings)
        coordinator, residual = published.weights, published.residual
        # The worker sees only the bytes of the message.
        message = c.decode_message(c.encode_message(published.message))
        worker = apply_update(worker, message)
        assert digest(worker) == digest(coordinator)
        assert np.array_equal(worker, coordinator)


def test_download_error_feedback_delivers_the_whole_update_eventually() -> None:
    rng = np.random.default_rng(4)
    start = rng.standard_normal(1000).astype(np.float32)
    weights, residual = start.copy(), None
    total = np.zeros(1000, dtype=np.float64)
    settings = c.Compression(method="topk", topk_fraction=0.01)
    for _ in range(10):
        update = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
        total += update
        published = publish_update(weights, update, residual, settings)
        weights, residual = published.weights, published.residual
    assert residual is not None
    assert np.allclose(weights.astype(np.float64) + residual, start + total, atol=1e-5)


def test_a_worker_rebuilds_weights_from_a_chain_of_updates() -> None:
    settings = c.Compression(method="int8")
    rng = np.random.default_rng(5)
    history = [rng.standard_normal(500).astype(np.float32)]
    chain = []
    for round_number in range(3):
        update = (rng.standard_normal(500) * 1e-2).astype(np.float32)
        published = publish_update(history[-1], update, None, settings)
        base = tasks.WeightsRef(round_number, digest(history[-1]))
        chain.append(tasks.Link(base, published.message))
        history.append(published.weights)
    task = tasks.TaskPayload(
        mode="train", stream="s", round=3, shard=0, seed=0,
        target=tasks.WeightsRef(3, digest(history[3])),
        data=tasks.CorpusSlice("train", 0, 100), chain=tuple(chain),
    )  # fmt: skip
    task = tasks.decode_task(tasks.encode_task(task))
    # A node holding round 1's weights applies the last two updates.
    held = {digest(history[1]): history[1]}
    rebuilt = tasks.resolve_weights(task, held.get)
    assert np.array_equal(rebuilt, history[3])
    # A node holding nothing needs the keyframe: the checkpoint of round 3's weights.
    with pytest.raises(tasks.MissingWeights):
        tasks.resolve_weights(task, {}.get)
    keyframed = dataclasses.replace(task, keyframe_blob="ab" * 32)
    checkpoints = {"ab" * 32: history[3]}

    def fetched(stale: bool) -> np.ndarray:
        return tasks.resolve_weights(
            keyframed, {}.get, fetch=lambda blob_hash: blob_hash.encode(),
            read_checkpoint=lambda blob: history[0] if stale else checkpoints[blob.decode()],
        )  # fmt: skip

    assert np.array_equal(fetched(stale=False), history[3])
    with pytest.raises(ValueError, match="keyframe"):
        fetched(stale=True)


def test_weights_that_do_not_match_the_digest_are_refused() -> None:
    weights = np.ones(10, dtype=np.float32)
    task = tasks.TaskPayload(
        mode="train", stream="s", round=0, shard=0, seed=0,
        target=tasks.WeightsRef(0, digest(weights + 1)),
        data=tasks.CorpusSlice("train", 0, 100), weights=weights,
    )  # fmt: skip
    with pytest.raises(ValueError, match="digest"):
        tasks.resolve_weights(task, {}.get)


def test_apply_update_refuses_float64_weights_and_leaves_its_input_alone() -> None:
    message = c.Dense(np.ones(3, dtype=np.float32))
    with pytest.raises(TypeError):
        apply_update(np.zeros(3), message)
    weights = np.zeros(3, dtype=np.float32)
    assert apply_update(weights, message).tolist() == [1, 1, 1]
    assert weights.tolist() == [0, 0, 0]


def test_chain_links_may_reference_update_blobs_the_worker_fetches() -> None:
    rng = np.random.default_rng(6)
    before = rng.standard_normal(300).astype(np.float32)
    published = publish_update(before, rng.standard_normal(300).astype(np.float32) * 1e-2,
                               None, c.Compression(method="int4"))  # fmt: skip
    blob = c.encode_message(published.message)
    blobs = {"cd" * 32: blob}
    link = tasks.Link(tasks.WeightsRef(0, digest(before)), blob="cd" * 32)
    task = tasks.TaskPayload(
        mode="train", stream="s", round=1, shard=0, seed=0,
        target=tasks.WeightsRef(1, digest(published.weights)),
        data=tasks.CorpusSlice("train", 0, 100), chain=(link,),
    )  # fmt: skip
    encoded = tasks.encode_task(task)
    assert len(encoded) < 1000  # references only: no weights, no update inside
    held = {digest(before): before}
    rebuilt = tasks.resolve_weights(tasks.decode_task(encoded), held.get, fetch=blobs.__getitem__)
    assert np.array_equal(rebuilt, published.weights)
    with pytest.raises(tasks.MissingWeights, match="fetch"):
        tasks.resolve_weights(tasks.decode_task(encoded), held.get)
    with pytest.raises(ValueError):
        tasks.Link(tasks.WeightsRef(0, "x"))
