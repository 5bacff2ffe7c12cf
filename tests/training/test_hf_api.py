"""A researcher's model through the API: each bad model or dataset is a 422 naming the
problem, and nothing is stored as a job."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Api, assert_error, bearer
from hf_helpers import tiny_folder

from idlegrid.settings import CoordinatorSettings
from idlegrid.training import hf_folder


@pytest.fixture
def settings(settings: CoordinatorSettings) -> CoordinatorSettings:
    # A trimmed model is a few hundred kB.
    return dataclasses.replace(settings, max_blob_bytes=8 << 20, max_request_bytes=1 << 20)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> hf_folder.HFModel:
    return hf_folder.read_folder(tiny_folder(tmp_path_factory.mktemp("m")))


def _with(model: hf_folder.HFModel, **change: Any) -> bytes:
    config = {**model.config, **change.pop("config", {})}
    weights = {**model.weights, **change.pop("weights", {})}
    tokenizer = change.pop("tokenizer", model.tokenizer)
    return hf_folder.model_blob(hf_folder.HFModel(config, weights, tokenizer))


CASES = [
    ("auto_map", {"config": {"auto_map": {"AutoModelForCausalLM": "x.Y"}}}, {},
     "config asks for remote code (auto_map)"),
    ("unknown-type", {"config": {"model_type": "bert"}}, {}, "model_type 'bert' is not supported"),
    ("nonsense-size", {"config": {"num_hidden_layers": 0}}, {}, "layers must be an integer"),
    ("wrong-shape", {"weights": {"model.norm.weight": np.zeros(5, np.float32)}}, {},
     "tensor model.norm.weight has shape (5,); the config says (32,)"),
    ("tokenizer", {"tokenizer": "{not json"}, {}, "tokenizer.json does not parse"),
    ("too-large", {}, {"max_parameters": 1000}, "over this job's limit max_parameters=1,000"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "model_params", "problem"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_a_bad_model_is_a_422_naming_the_problem(
    api: Api, model: hf_folder.HFModel, change: dict[str, Any],
    model_params: dict[str, Any], problem: str,
) -> None:  # fmt: skip
    token = api.token()
    inputs = {
        "model": api.upload(_with(model, **change), token),
        "dataset": api.upload(hf_folder.text_dataset_blob("the cat sat .\n" * 200), token),
    }
    params = {"architecture": "hf-causal-lm", "model": model_params, "rounds": 1, "workers": 1,
              "inner": {"steps": 2, "batch_size": 2, "seq_len": 8}}  # fmt: skip
    body = {"kind": "diloco-train", "inputs": inputs, "params": params}
    response = api.client.post("/v1/jobs", json=body, headers=bearer(token))
    assert problem in assert_error(response, 422)
    assert api.client.get("/v1/jobs", headers=bearer(token)).json() == []


def test_token_ids_beyond_the_vocabulary_are_a_422(api: Api, model: hf_folder.HFModel) -> None:
    token = api.token()
    dataset = hf_folder.token_dataset_blob(np.array([3, 4, 60] * 100))
    inputs = {"model": api.upload(_with(model), token), "dataset": api.upload(dataset, token)}
    body = {"kind": "diloco-train", "inputs": inputs,
            "params": {"architecture": "hf-causal-lm", "inner": {"seq_len": 8}}}  # fmt: skip
    response = api.client.post("/v1/jobs", json=body, headers=bearer(token))
    assert "token id 60 is at or above the model's vocab_size 48" in assert_error(response, 422)


def test_a_model_input_needs_the_hf_architecture(
    api: Api, model: hf_folder.HFModel, tmp_path: Path
) -> None:
    token = api.token()
    dataset = hf_folder.token_dataset_blob(np.arange(500) % 40)
    inputs = {"model": api.upload(_with(model), token), "dataset": api.upload(dataset, token)}
    body = {"kind": "diloco-train", "inputs": inputs, "params": {"architecture": "transformer-lm"}}
    response = api.client.post("/v1/jobs", json=body, headers=bearer(token))
    assert "input 'model' is for architecture 'hf-causal-lm'" in assert_error(response, 422)
