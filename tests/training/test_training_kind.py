"""The `diloco-train` kind: split, run, check, compare and assemble, as the grid calls them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from hashlib import sha256
from typing import Any

import numpy as np
import pytest
from helpers import run_python
from pydantic import ValidationError

from idlegrid.kinds import Cancelled, InputError, RunContext, Verdict, get_kind
from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import dataset, rounds, tasks
from idlegrid.kinds.diloco import kind as diloco
from idlegrid.kinds.diloco.data import ExampleData
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.training import closing, compression, models
from idlegrid.training.flat import digest, pack, read_metadata, weights_from_safetensors

pytest.importorskip("torch")

KIND = get_kind("diloco-train")
SMALL: dict[str, Any] = {
    "workers": 2,
    "model": {"width": 16, "layers": 1, "heads": 2, "context": 32},
    "inner": {"steps": 4, "batch_size": 4, "seq_len": 32},
}


def _params(**changes: Any) -> DilocoParams:
    params = KIND.parse_params({**SMALL, **changes})
    assert isinstance(params, DilocoParams)
    return params


@pytest.fixture(autouse=True)
def fresh_worker() -> Iterator[None]:
    diloco.WORKER_STATE.clear()
    yield
    diloco.WORKER_STATE.clear()


def _round0(params: DilocoParams) -> list[bytes]:
    return [s.payload for s in KIND.split({"dataset": dataset.corpus_dataset_blob()}, params)]


def _run(payload: bytes, params: DilocoParams, **ctx: Any) -> bytes:
    return KIND.run(payload, params, RunContext(threads=1, **ctx))


def test_the_kind_is_registered_and_importing_it_needs_no_torch() -> None:
    assert isinstance(KIND, diloco.DilocoKind)
    code = (
        "import sys, idlegrid.kinds, idlegrid.kinds.diloco.run; assert 'torch' not in sys.modules"
    )
    run_python(code, timeout_s=60)


@pytest.mark.parametrize(
    "raw",
    [
        {"architecture": "resnet-900"},
        {"model": {"width": 30, "heads": 4}},
        {"upload": {"method": "int2"}},
        {"outer": {"momentum": 1.0}},
        {"inner": {"steps": 0}},
        {"aggregation": {"rule": "median-of-means"}},
        {"learning_rate": 1.0},
        {"workers": 2, "min_updates": 3},
        {"rounds": 2, "inner": {"ramp": [5, 5, 5]}},
        {"inner": {"ramp": [0]}},
        {"inner": {"first_step": 10}},
    ],
)
def test_bad_params_are_refused(raw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        KIND.parse_params(raw)


def test_split_makes_round_zero_from_the_seed() -> None:
    params = _params()
    decoded = [tasks.decode_task(p) for p in _round0(params)]
    weights = rounds.initial_weights(params)
    assert [t.shard for t in decoded] == [0, 1]
    assert {t.round for t in decoded} == {0} and len({t.seed for t in decoded}) == 2
    assert all(t.target.digest == digest(weights) for t in decoded)
    # No weights travel: nodes draw them from the seed, or fetch the checkpoint.
    keyframe = sha256(rounds.checkpoint(params, closing.initial_state(weights))).hexdigest()
    assert all(t.weights is None and t.init_seed == params.seed for t in decoded)
    assert all(t.keyframe_blob == keyframe for t in decoded)
    resolved = tasks.resolve_weights(decoded[0], lambda _: None, initialize=lambda seed: (
        rounds.initial_weights(params.model_copy(update={"seed": seed}))))  # fmt: skip
    assert np.array_equal(resolved, weights)
    slices = [t.data for t in decoded]
    assert all(isinstance(s, tasks.CorpusSlice) for s in slices)
    assert slices[0].stop == slices[1].start  # type: ignore[union-attr]
    assert slices[1].stop == len(corpus.train_tokens())  # type: ignore[union-attr]
    assert KIND.requirements(params).min_memory_mb >= 256


def test_replicas_agree_and_other_shards_or_tampering_do_not() -> None:
    params = _params()
    payloads = _round0(params)
    first = _run(payloads[0], params)
    KIND.check_output(payloads[0], first, params)
    assert KIND.compare(first, _run(payloads[0], params), params) == Verdict.AGREE
    assert KIND.compare(first, _run(payloads[1], params), params) == Verdict.DISAGREE
    assert KIND.compare(first, b"junk", params) == Verdict.DISAGREE
    result = tasks.decode_result(first)
    assert result.update is not None
    poisoned = compression.quantize(1000 * compression.decode(result.update), bits=8)
    tampered = tasks.encode_result(dataclasses.replace(result, update=poisoned))
    assert KIND.compare(first, tampered, params) == Verdict.DISAGREE


def test_check_output_refuses_results_of_another_task_or_shape() -> None:
    params = _params()
    payloads = _round0(params)
    output = _run(payloads[0], params)
    with pytest.raises(InputError, match="task was"):
        KIND.check_output(payloads[1], output, params)
    with pytest.raises(InputError, match="int8"):
        KIND.check_output(payloads[0], output, _params(upload={"method": "int4"}))
    with pytest.raises(InputError):
        KIND.check_output(payloads[0], b"not safetensors", params)


def test_assemble_closes_round_zero_into_safetensors_weights() -> None:
    params = _params()
    outputs = [_run(p, params) for p in _round0(params)]
    blob = KIND.assemble(outputs, params)
    spec = models.flat_spec(params.architecture, params.model_settings())
    weights = weights_from_safetensors(blob, spec)
    state = closing.initial_state(rounds.initial_weights(params))
    updates = [
        closing.Update(compression.decode(r.update), 0, r.loss_mean)  # type: ignore[arg-type]
        for r in map(tasks.decode_result, outputs)
    ]
    expected = closing.close_round(
        state, updates, rule=params.aggregation, outer=params.outer, download=params.download
    )
    assert np.array_equal(weights, expected.state.weights)
    assert '"round":1' in read_metadata(blob)["idlegrid"]


def test_round_one_needs_only_the_update_on_a_node_that_ran_round_zero() -> None:
    params = _params()
    payloads = _round0(params)
    outputs = [_run(p, params) for p in payloads]
    state = closing.initial_state(rounds.initial_weights(params))
    updates = [
        closing.Update(compression.decode(r.update), 0)  # type: ignore[arg-type]
        for r in map(tasks.decode_result, outputs)
    ]
    closed = closing.close_round(
        state, updates, rule=params.aggregation, outer=params.outer, download=params.download
    )
    link = tasks.Link(tasks.WeightsRef(0, state.digest), closed.message)
    train, _ = dataset.read_dataset(dataset.corpus_dataset_blob())
    task = rounds.round_task(params, closed.state, train, 0, stream="job-1", chain=(link,))
    payload = tasks.encode_task(task)
    assert len(payload) < 4 * state.weights.size / 3  # an int8 update, not fp32 weights
    result = tasks.decode_result(_run(payload, params))
    assert result.round == 1 and result.weights_digest == closed.state.digest
    diloco.WORKER_STATE.clear()
    with pytest.raises(InputError, match="inline weights"):
        _run(payload, params)


def test_topk_replicas_with_different_residuals_still_agree() -> None:
    params = _params(upload={"method": "topk", "topk_fraction": 0.05})
    payload = _round0(params)[0]
    first = _run(payload, params)  # leaves a residual on this node
    second = _run(payload, params)  # sends with that residual added
    a, b = tasks.decode_result(first), tasks.decode_result(second)
    assert a.update is not None and b.update is not None
    assert not np.array_equal(compression.decode(a.update), compression.decode(b.update))
    assert KIND.compare(first, second, params) == Verdict.AGREE


def test_a_classifier_trains_on_an_uploaded_dataset() -> None:
    rng = np.random.default_rng(0)
    data = ExampleData(rng.standard_normal((80, 12)).astype(np.float32), rng.integers(0, 3, 80))
    params = _params(architecture="mlp", model={"inputs": 12, "hidden": [8], "classes": 3},
                     inner={"steps": 3, "batch_size": 4})  # fmt: skip
    payloads = [s.payload for s in KIND.split({"dataset": dataset.dataset_blob(data)}, params)]
    output = _run(payloads[1], params)
    KIND.check_output(payloads[1], output, params)
    train = tasks.decode_task(payloads[1]).data
    assert isinstance(train, ExampleData) and len(train) == 36  # half of the first 72


def test_an_eval_task_returns_the_held_out_loss() -> None:
    params = _params()
    weights = rounds.initial_weights(params)
    task = tasks.TaskPayload(
        mode="eval", stream="job-1", round=0, shard=0, seed=0,
        target=tasks.WeightsRef(0, digest(weights)), weights=weights,
        data=tasks.CorpusSlice("eval", 0, len(corpus.eval_tokens())),
    )  # fmt: skip
    payload = tasks.encode_task(task)
    output = _run(payload, params)
    KIND.check_output(payload, output, params)
    result = tasks.decode_result(output)
    assert result.update is None and result.loss_mean == pytest.approx(np.log(103), rel=0.05)
    assert KIND.compare(output, _run(payload, params), params) == Verdict.AGREE


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (b"garbage", "dataset"),
        (pack({}, {"corpus": "wikipedia"}), "unknown corpus"),
        (pack({"tokens": np.zeros(5, np.float32)}, {}), "tokens"),
        (pack({"tokens": np.zeros(1, np.uint8)}, {}), "too small"),
    ],
)
def test_unusable_datasets_are_input_errors(dataset: bytes, match: str) -> None:
    with pytest.raises(InputError, match=match):
        KIND.split({"dataset": dataset}, _params())


def test_a_malformed_payload_is_an_input_error_and_cancel_stops_a_task() -> None:
    params = _params()
    with pytest.raises(InputError, match="payload"):
        _run(b"\x00" * 64, params)
    with pytest.raises(Cancelled):
        _run(_round0(params)[0], params, is_cancelled=lambda: True)


def test_a_node_joining_mid_training_fetches_the_keyframe_checkpoint() -> None:
    from idlegrid.kinds.diloco import run as runner
    from idlegrid.kinds.diloco.worker_state import WorkerState

    params = _params()
    state = closing.initial_state(rounds.initial_weights(params))
    update = np.full(state.weights.size, 1e-3, np.float32)
    closed = closing.close_round(
        state, [closing.Update(update, 0)], rule=params.aggregation, outer=params.outer,
        download=params.download,
    )  # fmt: skip
    blobs = {"ab" * 32: rounds.checkpoint(params, closed.state)}
    train, _ = dataset.read_dataset(dataset.corpus_dataset_blob())
    link = tasks.Link(tasks.WeightsRef(0, state.digest), closed.message)
    task = rounds.round_task(params, closed.state, train, 1, stream="job-1", chain=(link,),
                             keyframe_blob="ab" * 32)  # fmt: skip
    newcomer = WorkerState()
    result = runner.run_task(task, params.train_spec(), newcomer, fetch=blobs.__getitem__)
    assert result.weights_digest == closed.state.digest
    assert newcomer.weights(closed.state.digest) is not None


def test_a_ramped_job_gives_each_round_its_own_h() -> None:
    params = _params(rounds=3, inner={**SMALL["inner"], "ramp": [2]})
    assert [s.items for s in KIND.split({"dataset": dataset.corpus_dataset_blob()}, params)] == [
        2,
        2,
    ]
    assert rounds.train_flops(params, 1) == 2 * rounds.train_flops(params, 0)
    done: list[float] = []
    _run(_round0(params)[0], params, report_progress=done.append)
    assert done[-1] == 1.0 and len(done) == 2


def test_the_stdlib_corpus_travels_by_name_and_pin() -> None:
    train, held_out = dataset.read_dataset(dataset.corpus_dataset_blob("cpython-stdlib"))
    assert isinstance(train, tasks.CorpusSlice) and isinstance(held_out, tasks.CorpusSlice)
    assert (train.corpus, held_out.corpus) == ("cpython-stdlib", "cpython-stdlib")
    assert train.stop == len(corpus.train_tokens("cpython-stdlib"))
    params = _params()
    shard = tasks.shard_ref(train, 1, params.workers)
    task = rounds.round_task(params, closing.initial_state(rounds.initial_weights(params)),
                             train, 1, stream="job-1")  # fmt: skip
    decoded = tasks.decode_task(tasks.encode_task(task))
    assert decoded.data == shard and decoded.data.load().tokens.size == shard.stop - shard.start
    wrong_pin = pack({}, {"corpus": "cpython-stdlib", "sha256": corpus.PYDOC.sha256})
    with pytest.raises(InputError, match="unknown corpus"):
        dataset.read_dataset(wrong_pin)
