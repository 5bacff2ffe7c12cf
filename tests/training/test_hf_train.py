"""Training a researcher's Hugging Face model on one machine: the kind's tasks and rounds,
LoRA, micro-batches, gradient checkpointing, and a task resumed after its worker died."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hf_helpers import needs_transformers, text, tiny_folder

from idlegrid.kinds.base import InputError, RunContext
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.data import TokenData
from idlegrid.kinds.diloco.kind import DilocoKind
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.kinds.diloco.rounds import DilocoRounds
from idlegrid.kinds.diloco.task_checkpoint import Checkpointer
from idlegrid.training import hf_folder, models
from idlegrid.training.compression import payload_bytes

KIND = DilocoKind()
INNER = {"steps": 4, "batch_size": 4, "seq_len": 16, "lr": 3e-3}


@pytest.fixture(scope="module")
def model_blob(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    needs_transformers()
    folder = tiny_folder(tmp_path_factory.mktemp("model"))
    return hf_folder.model_blob(hf_folder.read_folder(folder))


def _inputs(model_blob: bytes) -> dict[str, bytes]:
    return {"model": model_blob, "dataset": hf_folder.text_dataset_blob(text())}


def _params(inputs: dict[str, bytes], **raw: Any) -> DilocoParams:
    settings = {"architecture": "hf-causal-lm", "rounds": 2, "workers": 2,
                "inner": INNER, **raw}  # fmt: skip
    params = KIND.derive_params(inputs, KIND.parse_params(settings))
    assert isinstance(params, DilocoParams)
    return params


def _round_0(params: DilocoParams, inputs: dict[str, bytes]) -> tuple[list[bytes], Any, Any]:
    """Round 0's outputs, run as workers run them (blobs fetched by hash)."""
    job = DilocoRounds().job(params, inputs)
    start = job.initial()
    store = {hashlib.sha256(b).hexdigest(): b for b in (start.checkpoint, inputs["model"])}
    outputs = []
    for spec in KIND.split(inputs, params):
        output = KIND.run(spec.payload, params, RunContext(fetch=store.__getitem__))
        KIND.check_output(spec.payload, output, params)
        outputs.append(output)
    return outputs, job, start


def test_full_training_and_lora_rounds_lower_the_loss(model_blob: bytes) -> None:
    inputs = _inputs(model_blob)
    sizes = {}
    for name, model in (
        ("full", {}),
        ("lora", {"lora": {"rank": 2, "targets": ["q_proj", "v_proj"]}}),
    ):
        params = _params(inputs, model=model, upload={"method": "int8"})
        outputs, job, start = _round_0(params, inputs)
        results = [tasks.decode_result(output) for output in outputs]
        assert all(r.loss_last < r.loss_first for r in results), name
        closed = job.close(start.checkpoint, start.optimizer, outputs)
        assert np.isfinite(closed.train_loss)
        sizes[name] = payload_bytes(results[0].update)  # type: ignore[arg-type]
    config = _params(inputs).model_settings()
    assert models.parameter_count("hf-causal-lm", config) == config.base_parameters()
    # Only the adapters travel: 2 layers x 2 projections x (2x32 + 32x2 or 16x2) values.
    assert sizes["lora"] * 30 < sizes["full"], sizes


def test_lora_rounds_draw_the_adapters_from_the_seed(model_blob: bytes) -> None:
    inputs = _inputs(model_blob)
    params = _params(inputs, model={"lora": {"rank": 2}})
    payload = tasks.decode_task(KIND.split(inputs, params)[0].payload)
    assert payload.init_seed == params.seed
    full = tasks.decode_task(KIND.split(inputs, _params(inputs)).pop(0).payload)
    assert full.init_seed is None and full.keyframe_blob is not None


def _train(config: Any, weights: np.ndarray, **change: Any) -> Any:
    from idlegrid.kinds.diloco import inner

    settings = inner.InnerSettings(**{**INNER, **change.pop("inner", {})})
    data = TokenData(np.arange(2000, dtype=np.int32) * 7 % 40)
    return inner.train_inner("hf-causal-lm", config, weights, data, settings, seed=5, **change)


def test_micro_batches_and_checkpointing_give_the_same_update(model_blob: bytes) -> None:
    inputs = _inputs(model_blob)
    params = _params(inputs)
    weights = hf_folder.read_model_blob(model_blob, max_parameters=10**9)
    start = np.concatenate([w.ravel() for w in weights.weights.values()])
    whole = _train(params.model_settings(), start)
    micro = _train(params.model_settings(), start, inner={"micro_batch_size": 1})
    np.testing.assert_allclose(micro.delta, whole.delta, atol=2e-6)
    assert micro.loss_mean == pytest.approx(whole.loss_mean, rel=1e-5)
    checkpointed = params.model_settings().model_copy(update={"gradient_checkpointing": True})
    again = _train(checkpointed, start, inner={"micro_batch_size": 2})
    np.testing.assert_allclose(again.delta, whole.delta, atol=2e-6)


class Killed(Exception):
    """Stands for the worker dying after a step."""


@pytest.mark.parametrize("lora", [None, {"rank": 2}], ids=["full", "lora"])
def test_a_killed_task_goes_on_from_its_checkpoint(
    model_blob: bytes, tmp_path: Path, lora: Any
) -> None:
    inputs = _inputs(model_blob)
    params = _params(inputs, model={} if lora is None else {"lora": lora})
    config = params.model_settings()
    base = hf_folder.read_model_blob(model_blob, max_parameters=10**9).weights
    if lora is None:
        start = np.concatenate([w.ravel() for w in base.values()])
    else:
        start = models.init_weights("hf-causal-lm", config, 0)
    extra = {} if lora is None else {"base": base}
    unbroken = _train(config, start, **extra)

    def die(done: int) -> None:
        if done == 2:
            raise Killed()

    with pytest.raises(Killed):
        _train(config, start, checkpoint=Checkpointer(tmp_path, 0.0), on_step=die, **extra)
    steps: list[int] = []
    resumed = _train(config, start, checkpoint=Checkpointer(tmp_path, 0.0),
                     on_step=steps.append, **extra)  # fmt: skip
    assert steps == [3, 4]  # the AdamW moments and the data position came back
    np.testing.assert_allclose(resumed.delta, unbroken.delta, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"dataset": hf_folder.token_dataset_blob(np.array([1, 2, 48] * 50))},
         "token id 48 is at or above the model's vocab_size 48"),
        ({"model": b"not a model"}, "model: "),
    ],
)  # fmt: skip
def test_bad_data_is_refused_at_submission(
    model_blob: bytes, change: dict[str, bytes], problem: str
) -> None:
    inputs = {**_inputs(model_blob), **change}
    with pytest.raises(InputError, match=problem):
        KIND.split(inputs, _params(inputs))


def test_the_memory_need_follows_the_micro_batch(model_blob: bytes) -> None:
    inputs = _inputs(model_blob)
    small = KIND.requirements(_params(inputs, inner={**INNER, "micro_batch_size": 1}))
    large = KIND.requirements(_params(inputs, inner={**INNER, "batch_size": 512, "seq_len": 64}))
    assert small.min_memory_mb < large.min_memory_mb


def test_robust_aggregation_absorbs_a_poisoned_lora_update(model_blob: bytes) -> None:
    inputs = _inputs(model_blob)
    rule = {"rule": "trimmed-mean", "trim_fraction": 0.25}
    params = _params(inputs, workers=4, model={"lora": {"rank": 2}}, aggregation=rule,
                     upload={"method": "none"})  # fmt: skip
    outputs, job, start = _round_0(params, inputs)
    honest = job.close(start.checkpoint, start.optimizer, outputs)
    poisoned = tasks.decode_result(outputs[0])
    assert poisoned.update is not None
    wrecked = dataclasses.replace(poisoned.update, values=poisoned.update.values * -1000.0)
    outputs[0] = tasks.encode_result(dataclasses.replace(poisoned, update=wrecked))
    closed = job.close(start.checkpoint, start.optimizer, outputs)
    assert closed.max_suspicion > 10 * honest.max_suspicion
    config = params.model_settings()
    from idlegrid.training.flat import weights_from_safetensors

    spec = models.flat_spec("hf-causal-lm", config)
    before = weights_from_safetensors(start.checkpoint, spec)
    moved = np.linalg.norm(weights_from_safetensors(closed.weights.checkpoint, spec) - before)
    honest_moved = np.linalg.norm(
        weights_from_safetensors(honest.weights.checkpoint, spec) - before
    )
    assert moved < 3 * honest_moved


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [("llama", ["q_proj", "v_proj"]), ("gpt2", ["c_attn", "c_proj"])],
)
def test_lora_adapters_train_and_merge_into_a_folder_that_answers_alike(
    tmp_path: Path, model_type: str, targets: list[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from idlegrid.training import hf_torch
    from idlegrid.training.flat import unflatten, weights_from_safetensors
    from idlegrid.training.hf_models import LoraSettings

    base = hf_folder.read_folder(tiny_folder(tmp_path / "base", model_type))
    inputs = _inputs(hf_folder.model_blob(base))
    lora = {"rank": 2, "targets": targets}
    params = _params(inputs, model={"lora": lora}, upload={"method": "none"},
                     inner={**INNER, "lr": 1e-2})  # fmt: skip
    outputs, job, start = _round_0(params, inputs)
    results = [tasks.decode_result(output) for output in outputs]
    assert all(r.loss_last < r.loss_first for r in results), [r.loss_first for r in results]
    closed = job.close(start.checkpoint, start.optimizer, outputs)
    config = params.model_settings()
    spec = models.flat_spec("hf-causal-lm", config)
    adapters = weights_from_safetensors(closed.weights.checkpoint, spec)
    named = unflatten(adapters, spec)
    assert any(np.abs(w).max() > 0 for n, w in named.items() if n.endswith("lora_B"))
    # A and B of every adapted projection of both layers (GPT-2's c_proj is in attention
    # and in the MLP).
    assert len(named) == {"llama": 8, "gpt2": 12}[model_type]
    settings = LoraSettings.model_validate(lora)
    merged = hf_folder.trained_weights(base, named, settings)
    hf_folder.write_folder(tmp_path / "merged", base.config, merged, base.tokenizer)
    folder_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted, _ = hf_torch.load(config, adapters, "cpu", base.weights)
    adapted.eval()
    ids = torch.tensor([[33, 34, 35, 36, 37, 38]])
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        got = folder_model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(plain, expected, atol=1e-4)
