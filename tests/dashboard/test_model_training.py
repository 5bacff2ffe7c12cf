"""Training a researcher's own model from the dashboard: the form with a folder zip and a
text, what it refuses and why, and the trained folder it gives back (LoRA merged in).

The models here are made with numpy (names and shapes from `hf_models.entries`), so these
tests need neither torch nor transformers; tests/dashboard/test_dashboard_browser.py
trains one through a real worker and loads the downloaded folder in transformers.
"""

from __future__ import annotations

import dataclasses
import io
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Api
from safetensors.numpy import save
from test_dashboard import Browser, _researcher, _upload

from idlegrid.dashboard import model_folders
from idlegrid.settings import CoordinatorSettings
from idlegrid.training import hf_folder, hf_models

CONFIG = {"model_type": "llama", "vocab_size": 48, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}  # fmt: skip
FORM = "/research/jobs/new?kind=hf-causal-lm"


@pytest.fixture
def settings(settings: CoordinatorSettings) -> CoordinatorSettings:
    """The shared app settings, with room for a small model's files."""
    return dataclasses.replace(settings, max_blob_bytes=2**20)


def _model(seed: int = 0) -> hf_folder.HFModel:
    rng = np.random.default_rng(seed)
    weights = {name: rng.normal(0, 0.02, shape).astype(np.float32)
               for name, shape in hf_models.entries(CONFIG)}  # fmt: skip
    return hf_folder.HFModel(dict(CONFIG), weights, _tokenizer())


def _tokenizer() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", *(f"w{i}" for i in range(40)), "the", "cat", "sat", "."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return str(tokenizer.to_str())


def _zip(model: hf_folder.HFModel, tmp_path: Path, *, inside: str = "", drop: str = "") -> bytes:
    folder = tmp_path / "folder"
    hf_folder.write_folder(folder, model.config, model.weights, model.tokenizer)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in folder.iterdir():
            if file.name != drop:
                archive.write(file, inside + file.name)
    return buffer.getvalue()


def _ids(browser: Browser) -> list[str]:
    """Upload ids on the files page (from each row's job link), the newest first."""
    return re.findall(r"&amp;file=(\d+)", browser.get("/research/files").text)


def test_a_model_folder_and_a_text_make_a_training_job(api: Api, tmp_path: Path) -> None:
    researcher = _researcher(api, "mona")
    model = _model()
    # The folder zipped with its own top directory, as most archivers do.
    assert _upload(researcher, _zip(model, tmp_path, inside="smol/"),
                   purpose="model-folder").status_code == 200  # fmt: skip
    text = " ".join(f"the cat sat w{i % 40} ." for i in range(400)).encode()
    assert _upload(researcher, text, purpose="dataset").status_code == 200
    dataset, folder = _ids(researcher)[:2]
    page = researcher.get(FORM)
    assert 'action="/research/jobs/new/hf-causal-lm"' in page.text
    assert 'for="lora_rank"' in page.text

    def submit(**fields: Any) -> Any:
        form = {"model": folder, "dataset": dataset, "rounds": 2, "workers": 2,
                "inner_steps": 5, "seq_len": 16, **fields}  # fmt: skip
        return researcher.post("/research/jobs/new/hf-causal-lm", form, form=FORM)

    swapped = submit(model=dataset, dataset=folder)
    assert swapped.status_code == 422 and "model folder or gguf model" in swapped.text
    too_long = submit(seq_len=100)
    assert too_long.status_code == 422 and "exceeds the model&#39;s context 64" in too_long.text
    done = submit(lora_rank=4)
    assert done.status_code == 303, done.text
    job_page = researcher.get(done.headers["location"])
    assert "Your llama model, " in job_page.text and "LoRA adapters of rank 4" in job_page.text
    job_id = done.headers["location"].rsplit("/", 1)[1]
    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.admin).json()
    lora = job["params"]["model"]["lora"]
    assert (lora["rank"], lora["targets"]) == (4, ["q_proj", "v_proj"])
    not_yet = researcher.get(f"/research/jobs/{job_id}/model.zip")
    assert not_yet.status_code == 409 and "no trained model" in not_yet.text


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"drop": "config.json"}, "The zip has no config.json"),
        ({"drop": "model.safetensors"}, "has no model.safetensors"),
        ({"broken": True}, "not a zip of a model folder"),
        ({"missing_tensor": True}, "model.layers.1.mlp.down_proj.weight"),
    ],
)
def test_a_bad_model_folder_is_refused_by_name(
    api: Api, tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    researcher = _researcher(api, "nils")
    model = _model()
    if change.get("missing_tensor"):
        model.weights.pop("model.layers.1.mlp.down_proj.weight")
    data = b"PK not really" if change.get("broken") else _zip(model, tmp_path, **{
        k: v for k, v in change.items() if k == "drop"})  # fmt: skip
    assert _upload(researcher, data, purpose="model-folder").status_code == 200
    assert _upload(researcher, b"the cat sat . " * 100, purpose="dataset").status_code == 200
    dataset, folder = _ids(researcher)[:2]
    refused = researcher.post("/research/jobs/new/hf-causal-lm",
                              {"model": folder, "dataset": dataset, "seq_len": 16},
                              form=FORM)  # fmt: skip
    assert refused.status_code == 422, refused.text
    assert problem in refused.text.replace("&#39;", "'"), refused.text


@pytest.mark.parametrize("lora", [None, {"rank": 2, "targets": ["q_proj", "v_proj"]}])
def test_the_trained_folder_holds_the_result_or_the_merged_adapters(
    tmp_path: Path, lora: dict[str, Any] | None
) -> None:
    base = _model()
    (tmp_path / "base").write_bytes(hf_folder.model_blob(base))
    if lora is None:
        result = {name: w + 1.0 for name, w in base.weights.items()}
    else:
        settings = hf_models.LoraSettings.model_validate(lora)
        rng = np.random.default_rng(1)
        result = {name: rng.normal(0, 0.1, shape).astype(np.float32)
                  for name, shape in hf_models.lora_entries(CONFIG, settings)}  # fmt: skip
    (tmp_path / "result").write_bytes(save(result))
    archive = model_folders.folder_zip(tmp_path / "base", tmp_path / "result", lora)
    try:
        with zipfile.ZipFile(archive) as opened:
            assert sorted(opened.namelist()) == ["config.json", "model.safetensors",
                                                 "tokenizer.json"]  # fmt: skip
            opened.extractall(tmp_path / "out")
    finally:
        archive.unlink()
    got = hf_folder.read_folder(tmp_path / "out")
    assert got.config == base.config and got.tokenizer == base.tokenizer
    name = "model.layers.0.self_attn.q_proj.weight"
    if lora is None:
        np.testing.assert_array_equal(got.weights[name], base.weights[name] + 1.0)
    else:
        module = name.removesuffix(".weight")
        delta = 8.0 * result[f"{module}.lora_B"] @ result[f"{module}.lora_A"]  # alpha / rank
        np.testing.assert_allclose(got.weights[name], base.weights[name] + delta, rtol=1e-6)
        np.testing.assert_array_equal(got.weights["model.norm.weight"],
                                      base.weights["model.norm.weight"])  # fmt: skip


@pytest.mark.slow  # the import runs in a child process, which loads transformers
def test_a_file_that_is_no_gguf_model_is_refused_with_the_importers_word(api: Api) -> None:
    researcher = _researcher(api, "olga")
    assert _upload(researcher, b"GGUF but not really", purpose="gguf-model").status_code == 200
    assert _upload(researcher, b"the cat sat . " * 100, purpose="dataset").status_code == 200
    dataset = _ids(researcher)[0]
    files = researcher.get("/research/files").text
    model = re.findall(r"kind=llm-generate&amp;file=(\d+)", files)[0]
    refused = researcher.post("/research/jobs/new/hf-causal-lm",
                              {"model": model, "dataset": dataset, "seq_len": 16},
                              form=FORM)  # fmt: skip
    assert refused.status_code == 422, refused.text
    assert "The GGUF file could not be imported: " in refused.text
