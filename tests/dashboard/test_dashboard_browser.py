"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real
coordinator process and real worker processes (idlegrid.devtools.localgrid).

Playwright never downloads a browser here: it launches /usr/bin/chromium (apt packages
`chromium` and `chromium-driver`). Without it these tests skip, except under CI=true,
where they fail. IDLEGRID_SCREENSHOTS=DIR also saves the pages' screenshots to DIR.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser import missing

from idlegrid.devtools.localgrid import LocalGrid

CHROMIUM = os.environ.get("IDLEGRID_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PASSWORD = "a long enough passphrase"
QUOTA_BYTES = 4 * 1024 * 1024  # each account's uploads, so a test can go over it


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGrid]:
    root = tmp_path_factory.mktemp("browser-grid")
    env = {
        "IDLEGRID_DISTINCT_ACCOUNTS": "false",
        "IDLEGRID_MONITOR_INTERVAL_S": "0.5",
        "IDLEGRID_WEB_UPLOAD_QUOTA_BYTES": str(QUOTA_BYTES),
    }
    with LocalGrid(root, replication=1, extra_env=env, heartbeat_s=1.0) as local:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "idlegrid",
                "web-account",
                "rhea",
                "--role",
                "researcher",
                "--password-file",
                "-",
                "--data-dir",
                str(local.data_dir),
            ],
            input=PASSWORD + "\n",
            text=True,
            check=True,
            env=local.env,
            capture_output=True,
        )
        yield local


class Watched:
    """A browser page that records console errors and uncaught exceptions."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def go(self, path: str) -> Any:
        response = self.page.goto(self.base + path)
        self.page.wait_for_load_state("load")
        return response

    def shot(self, name: str) -> None:
        folder = os.environ.get("IDLEGRID_SCREENSHOTS")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)

    def sign_in(self, login: str) -> None:
        self.go("/signin")
        self.page.fill("#login", login)
        self.page.fill("#password", PASSWORD)
        self.page.click("main button[type=submit]")
        self.page.wait_for_load_state("load")


def _page(browser: Any, grid: LocalGrid, **context: Any) -> Watched:
    return Watched(browser.new_context(**context).new_page(), grid.url)


def test_a_volunteer_signs_up_adds_a_node_and_earns_credit(browser: Any, grid: LocalGrid) -> None:
    tab = _page(browser, grid, viewport={"width": 1280, "height": 900})
    tab.go("/signup")
    tab.page.fill("#username", "wanda")
    tab.page.fill("#email", "wanda@example.org")
    tab.page.fill("#password", PASSWORD)
    tab.page.click("main button[type=submit]")
    tab.page.wait_for_url("**/my/nodes")
    assert "No nodes yet" in tab.page.content()

    tab.go("/my/nodes/add")
    tab.page.fill("#name", "wanda-laptop")
    tab.page.click("main button[type=submit]")
    token = tab.page.inner_text("#node-token").strip()
    start = tab.page.locator("code.command").last.inner_text()
    assert f"--server {grid.url} --token-file" in start and token not in start
    tab.shot("add-node")

    grid.start_worker("wanda-laptop", kinds="sleep", benchmark=False, token=token)
    tab.go("/my/nodes")
    # The table refreshes itself (HTMX) until the worker's node shows online.
    tab.page.locator("#node-table .state-online").wait_for(timeout=90_000)
    assert "wanda-laptop" in tab.page.inner_text("#node-table")

    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 4, "seconds": 0.05})
        job.wait(timeout=120)
    tab.go("/leaderboard/accounts")
    row = tab.page.locator("table.board tbody tr", has_text="wanda")
    assert row.count() == 1
    credit = float(row.locator("td").nth(3).inner_text().replace(",", ""))
    assert credit > 0 and row.locator("td").nth(5).inner_text() == "4"  # validated results
    tab.shot("leaderboard")
    tab.go("/my/nodes")
    tab.shot("my-nodes")
    tab.go("/")
    assert tab.page.inner_text("#nodes-online") == "1"
    tab.shot("status")
    node_link = tab.page.goto(grid.url + "/leaderboard/nodes")
    assert node_link is not None
    tab.page.click("table.board tbody tr a")
    tab.page.locator(".chart-area canvas").first.wait_for(timeout=10_000)
    tab.shot("node")
    assert tab.errors == []


def test_a_researcher_embeds_an_uploaded_file(browser: Any, grid: LocalGrid) -> None:
    pytest.importorskip("sentence_transformers")
    grid.start_worker("embedder", kinds="embed-text", benchmark=False, threads=2)
    tab = _page(browser, grid, viewport={"width": 1280, "height": 900}, accept_downloads=True)
    tab.sign_in("rhea")
    texts = [f"volunteer computing sentence number {i}" for i in range(40)]
    tab.go("/research/files")
    tab.page.select_option("#purpose", "texts")
    tab.page.set_input_files(
        "#file",
        files=[
            {
                "name": "sentences.jsonl",
                "mimeType": "application/jsonl",
                "buffer": "\n".join(json.dumps(t) for t in texts).encode(),
            }
        ],
    )
    tab.page.click("#upload-button")
    tab.page.locator("#files", has_text="sentences.jsonl").wait_for(timeout=30_000)
    tab.shot("files")

    tab.page.click("#files a.button:has-text('Embed')")
    tab.page.fill("#shard_size", "10")
    tab.shot("submit")
    tab.page.click("text=Submit embedding job")
    tab.page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    # The progress part polls until the job is done and a download appears.
    tab.page.locator("#download").wait_for(timeout=240_000)
    assert "completed" in tab.page.inner_text("#job-state")
    tab.shot("job")
    with tab.page.expect_download() as info:
        tab.page.click("#download")
    vectors = np.load(io.BytesIO(Path(info.value.path()).read_bytes()))
    assert vectors.shape == (len(texts), 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    assert tab.errors == []


def _upload(tab: Watched, purpose: str, name: str, data: bytes) -> None:
    tab.go("/research/files")
    tab.page.select_option("#purpose", purpose)
    tab.page.set_input_files(
        "#file", files=[{"name": name, "mimeType": "application/octet-stream", "buffer": data}]
    )
    tab.page.click("#upload-button")


def test_a_researcher_runs_an_onnx_model_over_images(browser: Any, grid: LocalGrid) -> None:
    pytest.importorskip("onnxruntime")
    from safetensors.numpy import load

    from idlegrid.kinds.onnx import data as onnx_data
    from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, images, zip_images

    grid.start_worker("onnx-node", kinds="onnx-infer", benchmark=False, threads=2)
    tab = _page(browser, grid, viewport={"width": 1280, "height": 900}, accept_downloads=True)
    tab.sign_in("rhea")
    # Over the account's limit: the page says so, and nothing is kept.
    _upload(tab, "model-inputs", "too-big.zip", b"\0" * (QUOTA_BYTES + 1))
    tab.page.locator("#upload-error").wait_for(timeout=30_000)
    assert "limit" in tab.page.inner_text("#upload-error")
    assert "too-big.zip" not in tab.page.inner_text("main")

    model, archive = conv_net(size=32), zip_images(images(12, size=40))
    _upload(tab, "onnx-model", "convnet.onnx", model)
    tab.page.locator("#files", has_text="convnet.onnx").wait_for(timeout=30_000)
    _upload(tab, "model-inputs", "pictures.zip", archive)
    tab.page.locator("#files", has_text="pictures.zip").wait_for(timeout=30_000)
    tab.page.click("#files a.button:has-text('Run') >> nth=0")
    tab.page.fill("#shard_size", "4")
    tab.page.fill("#crop", "32x32")
    tab.page.fill("#resize", "36")
    tab.page.fill("#mean", "0.485, 0.456, 0.406")
    tab.page.fill("#std", "0.229, 0.224, 0.225")
    tab.shot("submit-onnx")
    tab.page.click("text=Submit ONNX job")
    tab.page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    tab.page.locator("#download").wait_for(timeout=240_000)
    assert "completed" in tab.page.inner_text("#job-state")
    with tab.page.expect_download() as info:
        tab.page.click("#download")
    result = load(Path(info.value.path()).read_bytes())
    assert sorted(result) == ["embedding", "label", "logits"]

    import onnxruntime

    spec = onnx_data.Preprocess.model_validate(IMAGENET_PREPROCESS)  # what the form said
    batch = onnx_data.decode_batch(onnx_data.load_images(archive), spec, "float32")
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"image": batch})
    assert result["logits"].shape == (12, 10)
    assert np.allclose(result["logits"], logits, rtol=1e-4, atol=1e-5)
    # The one error: the browser logs the 413 that refused the upload over the quota.
    assert [e for e in tab.errors if "status of 413" not in e] == [], tab.errors


def test_a_researcher_trains_their_own_model(browser: Any, grid: LocalGrid, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from idlegrid.dashboard.model_folders import KIND

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "mine")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "cat", "sat", "on", "mat", "."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "mine" / "tokenizer.json"))
    folder_zip = io.BytesIO()
    with zipfile.ZipFile(folder_zip, "w") as archive:
        for file in (tmp_path / "mine").iterdir():
            archive.write(file, f"mine/{file.name}")

    grid.start_worker("trainer", kinds="diloco-train", benchmark=False, threads=1)
    tab = _page(browser, grid, viewport={"width": 1280, "height": 900}, accept_downloads=True)
    tab.sign_in("rhea")
    _upload(tab, "model-folder", "mine.zip", folder_zip.getvalue())
    tab.page.locator("#files", has_text="mine.zip").wait_for(timeout=30_000)
    _upload(tab, "dataset", "cats.txt", b"the cat sat on the mat .\n" * 300)
    tab.page.locator("#files", has_text="cats.txt").wait_for(timeout=30_000)
    tab.page.click("#files a.button:has-text('Train') >> nth=1")  # the model's row
    assert f"kind={KIND}&file=" in tab.page.url
    for field, value in (("rounds", "2"), ("workers", "1"), ("inner_steps", "10"),
                         ("seq_len", "16"), ("inner_lr", "0.01")):  # fmt: skip
        tab.page.fill(f"#{field}", value)
    tab.shot("submit-own-model")
    tab.page.click("text=Submit model training job")
    tab.page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    tab.page.locator("#download-model").wait_for(timeout=240_000)
    tab.page.locator(".chart-area canvas").first.wait_for(timeout=10_000)  # the loss curve
    tab.shot("own-model-job")
    with tab.page.expect_download() as info:
        tab.page.click("#download-model")
    with zipfile.ZipFile(info.value.path()) as archive:
        archive.extractall(tmp_path / "trained")
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mine")
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained.get_parameter(name), original.get_parameter(name))
    assert tab.errors == []


def test_no_page_logs_a_console_error(browser: Any, grid: LocalGrid) -> None:
    """An admin (who may see every page) walks them all, forms included."""
    subprocess.run(
        [sys.executable, "-m", "idlegrid", "web-account", "ada", "--role", "admin",
         "--password-file", "-", "--data-dir", str(grid.data_dir)],
        input=PASSWORD + "\n", text=True, check=True, env=grid.env, capture_output=True,
    )  # fmt: skip
    tab = _page(browser, grid, viewport={"width": 1280, "height": 900})
    tab.sign_in("ada")
    tab.go("/teams/new")
    tab.page.fill("#name", "the walkers")
    tab.page.click("main button[type=submit]")
    tab.page.wait_for_url(re.compile(r".*/teams/\d+$"))
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 1})
    pages = [
        "/", "/leaderboard/accounts", "/leaderboard/teams?sort=recent", "/leaderboard/nodes",
        "/teams", "/teams/new", tab.page.url.removeprefix(grid.url), "/users/1", "/stats",
        "/account", "/my/nodes", "/my/nodes/add", "/research/files", "/research/jobs",
        "/research/jobs/new?kind=embed-text", "/research/jobs/new?kind=diloco-train",
        "/research/jobs/new?kind=onnx-infer", "/research/jobs/new?kind=hf-causal-lm",
        f"/research/jobs/{job.id}", "/admin",
        "/admin/metrics",
    ]  # fmt: skip
    for path in pages:
        assert tab.go(path).status == 200, path
    assert tab.errors == []


def test_the_rules_hold_in_the_browser(browser: Any, grid: LocalGrid) -> None:
    visitor = _page(browser, grid)
    response = visitor.go("/my/nodes")
    assert visitor.page.url.startswith(grid.url + "/signin?next=")
    assert response is not None and response.status == 200
    visitor.go("/signup")
    visitor.page.fill("#username", "vic")
    visitor.page.fill("#email", "vic@example.org")
    visitor.page.fill("#password", PASSWORD)
    visitor.page.click("main button[type=submit]")
    visitor.page.wait_for_url("**/my/nodes")
    assert visitor.go("/research/jobs").status == 403
    assert visitor.go("/research/jobs/1").status == 403  # a volunteer: no researcher page
    forged = visitor.page.evaluate(
        "() => fetch('/teams/new', {method: 'POST', headers: {'Content-Type':"
        " 'application/x-www-form-urlencoded'}, body: 'name=forged'}).then(r => r.status)"
    )
    assert forged == 403
    researcher = _page(browser, grid)
    researcher.sign_in("rhea")
    with grid.client() as client:
        someone_elses = client.submit("sleep", params={"tasks": 1})
    assert researcher.go(f"/research/jobs/{someone_elses.id}").status == 404
    # Every public page, signed out, on a phone-sized screen, with no console error.
    phone = _page(browser, grid, viewport={"width": 390, "height": 844}, is_mobile=True)
    for path in ("/", "/leaderboard/accounts", "/leaderboard/teams", "/teams", "/signin", "/stats"):
        assert phone.go(path).status == 200
        width = phone.page.evaluate("document.documentElement.scrollWidth")
        assert width <= 400, f"{path} is {width}px wide on a phone"
    phone.go("/")
    phone.shot("status-phone")
    assert phone.errors == []
    # The refusals above are the only errors: the browser logs each 403 and 404 it got.
    for tab in (visitor, researcher):
        assert all("status of 40" in error for error in tab.errors), tab.errors


def test_read_only_pages_render_without_javascript(browser: Any, grid: LocalGrid) -> None:
    tab = _page(browser, grid, java_script_enabled=False)
    for path in ("/", "/leaderboard/accounts?sort=recent", "/teams", "/stats", "/signin"):
        assert tab.go(path).status == 200
        assert "idlegrid" in tab.page.title()
    assert "Nodes online" in tab.page.content() or tab.go("/") is not None
