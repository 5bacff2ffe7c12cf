"""Streaming DiLoCo's fragments: the partition, the fragment's outer step, the worker's side."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from idlegrid.kinds.diloco import tasks
from idlegrid.training import closing, fragments, models
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, decode, length
from idlegrid.training.flat import digest
from idlegrid.training.fragments import Span, Streaming
from idlegrid.training.outer import OuterSettings, apply_update

LM = models.LMConfig(vocab=20, context=8, width=8, layers=4, heads=2)


@pytest.mark.parametrize(
    ("architecture", "config", "count"),
    [
        ("transformer-lm", LM, 1),
        ("transformer-lm", LM, 2),
        ("transformer-lm", LM, 3),
        ("transformer-lm", LM, 4),
        ("mlp", models.MLPConfig(inputs=5, hidden=[7, 6], classes=3), 3),
        ("cnn", models.CNNConfig(channels=1, image_size=8, width=4, classes=3), 2),
    ],
)
def test_the_partition_covers_every_parameter_once_in_whole_layers(
    architecture: str, config: object, count: int
) -> None:
    spans = fragments.partition(architecture, config, count)
    size = models.parameter_count(architecture, config)
    assert len(spans) == count
    covered = np.zeros(size, np.int64)
    for span in spans:
        covered[span.slice] += 1
    assert np.all(covered == 1)
    # Every boundary falls between two parameters, never inside one.
    ends, offset = {0}, 0
    for param in models.param_list(architecture, config):
        offset += int(np.prod(param.shape))
        ends.add(offset)
    assert all(span.start in ends and span.stop in ends for span in spans)


def test_a_transformers_embeddings_go_first_and_its_head_last() -> None:
    spans = fragments.partition("transformer-lm", LM, 2)
    names = [p.name for p in models.param_list("transformer-lm", LM)]
    offsets = np.cumsum(
        [0] + [int(np.prod(p.shape)) for p in models.param_list("transformer-lm", LM)]
    )
    where = {name: int(offsets[i]) for i, name in enumerate(names)}
    assert spans[0].start == where["tokens.weight"] == 0
    assert spans[0].start <= where["blocks.1.out.bias"] < spans[0].stop  # 2 blocks each
    assert spans[1].start == where["blocks.2.norm1.weight"]
    assert spans[1].start <= where["head.weight"] < spans[1].stop == offsets[-1]


@pytest.mark.parametrize("count", [0, 5])
def test_more_fragments_than_layers_are_refused(count: int) -> None:
    with pytest.raises(ValueError, match="fragments"):
        fragments.partition("transformer-lm", LM, count)


def test_spans_that_do_not_tile_the_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="tile"):
        Streaming((Span(0, 4), Span(5, 8)))
    with pytest.raises(ValueError, match="mix"):
        Streaming((Span(0, 4),), mix=1.0)


def _state(size: int, rng: np.random.Generator) -> closing.RoundState:
    state = closing.initial_state(rng.standard_normal(size).astype(np.float32))
    return dataclasses.replace(
        state,
        round=3,
        momentum=rng.standard_normal(size).astype(np.float32),
        download_residual=rng.standard_normal(size).astype(np.float32) * 0.01,
    )


@pytest.mark.parametrize("method", ["none", "int8", "int4", "topk"])
def test_the_outer_step_moves_only_the_synced_fragment(method: str) -> None:
    rng = np.random.default_rng(0)
    state, fragment = _state(1000, rng), Span(300, 700)
    updates = [closing.Update(rng.standard_normal(400).astype(np.float32), 3, 1.0)
               for _ in range(3)]  # fmt: skip
    download = Compression(method=method, error_feedback=method != "none")
    closed = closing.close_round(
        state, updates, rule=Aggregation(), outer=OuterSettings(), download=download,
        fragment=fragment,
    )  # fmt: skip
    new = closed.state
    outside = np.r_[0:300, 700:1000]
    assert np.array_equal(new.weights[outside], state.weights[outside])
    assert np.array_equal(new.momentum[outside], state.momentum[outside])
    assert new.download_residual is not None and state.download_residual is not None
    assert np.array_equal(new.download_residual[outside], state.download_residual[outside])
    assert not np.array_equal(new.weights[300:700], state.weights[300:700])
    assert not np.array_equal(new.momentum[300:700], state.momentum[300:700])
    # The message covers the fragment alone; a worker applying it there gets the new weights.
    assert length(closed.message) == 400
    assert digest(apply_update(state.weights, closed.message, fragment.slice)) == new.digest
    # The same step as closing the fragment on its own.
    alone = closing.close_round(
        closing.RoundState(3, state.weights[300:700], state.momentum[300:700],
                           state.download_residual[300:700]),
        updates, rule=Aggregation(), outer=OuterSettings(), download=download,
    )  # fmt: skip
    assert np.array_equal(alone.state.weights, new.weights[300:700])
    assert np.array_equal(alone.state.momentum, new.momentum[300:700])


def test_a_fragment_round_refuses_updates_of_another_size_and_asynchronous_mode() -> None:
    rng = np.random.default_rng(1)
    state = _state(100, rng)
    wrong = [closing.Update(np.zeros(100, np.float32), 3)]
    settings = {"rule": Aggregation(), "outer": OuterSettings(), "download": Compression()}
    with pytest.raises(ValueError, match="fragment of 50"):
        closing.close_round(state, wrong, fragment=Span(0, 50), **settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="synchronous"):
        closing.close_round(state, [], fragment=Span(0, 50), asynchronous=True, **settings)  # type: ignore[arg-type]


def test_a_fragment_round_without_updates_keeps_the_momentum() -> None:
    rng = np.random.default_rng(2)
    state = dataclasses.replace(_state(100, rng), download_residual=None)
    closed = closing.close_round(
        state, [closing.Update(np.ones(50, np.float32), 1)], rule=Aggregation(),
        outer=OuterSettings(), download=Compression(), fragment=Span(50, 100),
    )  # fmt: skip
    assert closed.stale_dropped == 1 and closed.state.round == 4
    assert np.array_equal(closed.state.momentum, state.momentum)
    assert np.array_equal(closed.state.weights, state.weights)
    assert length(closed.message) == 50 and not np.any(decode(closed.message))


def test_a_task_starts_from_its_local_weights_with_the_last_synced_fragment_mixed() -> None:
    spans = Streaming((Span(0, 2), Span(2, 4), Span(4, 6)), mix=0.25)
    global_w = np.full(6, 8.0, np.float32)
    local = np.arange(6, dtype=np.float32)
    assert np.array_equal(fragments.starting_weights(spans, 4, global_w, None), global_w)
    assert np.array_equal(fragments.starting_weights(spans, 0, global_w, local), global_w)
    # Round 4 follows round 3, which synced fragment 3 % 3 = 0.
    start = fragments.starting_weights(spans, 4, global_w, local)
    assert start.tolist() == [6.0, 6.25, 2.0, 3.0, 4.0, 5.0]
    # Round 4 syncs fragment 1: its global value minus the local one, and nothing else.
    trained = start - 1
    assert fragments.pseudo_gradient(spans, 4, global_w, trained).tolist() == [7.0, 6.0]


def test_a_streaming_payload_survives_its_bytes_and_rebuilds_weights_by_fragment() -> None:
    spans = Streaming((Span(0, 3), Span(3, 8)), mix=0.5)
    base = np.arange(8, dtype=np.float32)
    update = Compression(method="none")
    from idlegrid.training.compression import compress

    message, _ = compress(np.ones(5, np.float32), update)  # round 1 syncs fragment 1
    target = base.copy()
    target[3:] += 1
    task = tasks.TaskPayload(
        mode="train", stream="s", round=2, shard=0, seed=1,
        target=tasks.WeightsRef(2, digest(target)), data=tasks.CorpusSlice("train", 0, 100),
        chain=(tasks.Link(tasks.WeightsRef(1, digest(base)), message),), streaming=spans,
    )  # fmt: skip
    back = tasks.decode_task(tasks.encode_task(task))
    assert back.streaming == spans
    held = {digest(base): base}
    rebuilt = tasks.resolve_weights(back, held.get)
    assert np.array_equal(rebuilt, target)


def test_a_node_keeps_local_weights_per_shard_for_the_next_round_only() -> None:
    from idlegrid.kinds.diloco.worker_state import WorkerState

    node = WorkerState()
    node.set_local_weights("run", 1, 5, np.ones(3, np.float32))
    assert node.local_weights("run", 1, 6) is not None
    assert node.local_weights("run", 1, 7) is None  # it missed round 6: stale, not used
    assert node.local_weights("run", 0, 6) is None and node.local_weights("x", 1, 6) is None


# -- through the simulation -------------------------------------------------------------

torch = pytest.importorskip("torch")

import diloco_simulate as simulate  # noqa: E402

from idlegrid.kinds.diloco.inner import InnerSettings  # noqa: E402
from idlegrid.training.fragments import StreamingSettings  # noqa: E402

TINY = simulate.Setup(
    workers=2,
    rounds=4,
    corpus="pydoc-topics",
    model=models.LMConfig(vocab=103, context=16, width=16, layers=2, heads=2),
    inner=InnerSettings(steps=6, batch_size=4, seq_len=16, lr=3e-3),
    outer=OuterSettings(lr=0.7, momentum=0.9),
    upload=Compression(method="int8"),
    download=Compression(method="int8"),
    eval_batches=2,
    sync_lr=None,
    seeded_start=True,
)


def test_streaming_trains_and_each_round_moves_its_fragments_bytes() -> None:
    quiet = lambda line: None  # noqa: E731
    whole = simulate.run_diloco(TINY, progress=quiet)
    setup = dataclasses.replace(TINY, streaming=StreamingSettings(fragments=2, mix=0.5))
    streamed = simulate.run_diloco(setup, progress=quiet)
    losses = [point.validation for point in streamed.curve]
    assert losses[-1] < losses[0] - 0.3
    size = models.parameter_count("transformer-lm", TINY.model)
    # Uploads: one int8 pseudo-gradient a round (a byte a value, a float32 scale per 256),
    # of the round's fragment alone: rounds 0 and 2 sync fragment 0, rounds 1 and 3
    # fragment 1, so the four rounds send 2 * size values where the whole model sends
    # 4 * size; the rest of a result (sketch, header) is the same.
    saved = whole.bytes_sent - streamed.bytes_sent
    assert 2 * size < saved < 2 * size * (1 + 4 / 256) + 200
    # Downloads: rounds 1, 2 and 3 apply the updates of rounds 0, 1 and 2 (fragments 0,
    # 1 and 0) where the whole model's are three full updates.
    spans = setup.streaming_spans()
    assert spans is not None
    first, second = (span.size for span in spans.spans)
    received = whole.bytes_received - streamed.bytes_received
    assert first + 2 * second < received < (first + 2 * second) * (1 + 4 / 256) + 200


def test_one_fragment_without_mixing_is_plain_diloco() -> None:
    quiet = lambda line: None  # noqa: E731
    short = dataclasses.replace(TINY, rounds=2)
    plain = simulate.run_diloco(short, progress=quiet)
    one = simulate.run_diloco(
        dataclasses.replace(short, streaming=StreamingSettings(fragments=1)), progress=quiet
    )
    assert [p.validation for p in one.curve] == pytest.approx(
        [p.validation for p in plain.curve], abs=2e-3
    )


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["--fragments", "3"], "--fragments 3"), (["--mix", "1"], "--mix 1")],
)
def test_the_command_line_refuses_fragments_it_cannot_cut(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        simulate.parse_args(["--layers", "2", *argv])
    assert reason in capsys.readouterr().err


def test_the_command_line_runs_streaming(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--total-steps", "4", "--inner-steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--width", "16", "--layers", "2", "--fragments", "2",
            "--corpus", "pydoc-topics"]  # fmt: skip
    assert simulate.main(argv) == 0
    assert "bytes_ratio:" in capsys.readouterr().out.splitlines()[-1]
