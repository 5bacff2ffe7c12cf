"""The README's one-machine quickstart, run as written (a coordinator started exactly as
its line says, three volunteers' workers, an embedding job at the default replication of
3, from the shell), then a new researcher's first steps on its dashboard in Chromium, as
the README tells them: sign up, get the researcher role from the admin (signed in with
the README's `web-account` line), upload texts, submit the embedding form as it stands
(its shard size made 10, so there are shards to follow), follow the job's page and
download the vectors. Then the README's LoRA path on the same grid: its shell block
(`import-gguf` of SmolLM2, a LoRA job, `export-gguf`, an `llm-generate` chat), and the
same in the dashboard: the model folder's zip and the text uploaded, a training job with
a LoRA rank, its model folder downloaded and chatted with in transformers, exported to
GGUF, and asked a question through the generation form.

Deviations of setup, not of the commands: `idlegrid` is this test run's, the workers skip
their benchmark, the password that `web-account` asks for comes on stdin
(`--password-file -`), `notes.txt` (the researcher's own text) is written here, and
`serve` starts exactly as the quickstart's line says: the model folder's 500 MB zip goes
up in chunks to the account's upload quota, and so does the model it becomes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import readme
from browser import chromium_page
from helpers import wait_until

pytestmark = pytest.mark.slow

PASSWORD = "a long enough passphrase"
README_URL = "http://127.0.0.1:8000"


# The researcher's own text (`notes.txt`): a few lines in SmolLM2's chat format, so that
# a few LoRA steps have something to learn.
NOTES = "".join(
    f"<|im_start|>user\nWhat is the capital of {country}?<|im_end|>\n"
    f"<|im_start|>assistant\nThe capital of {country} is {capital}.<|im_end|>\n"
    for country, capital in [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"),
                             ("Peru", "Lima"), ("Japan", "Tokyo")] * 8
)  # fmt: skip
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _shell(tmp_path: Path) -> dict[str, str]:
    """A new user's shell: an empty home, `.venv/bin/idlegrid` and `python` this test run's."""
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    shim = venv_bin / "idlegrid"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m idlegrid "$@"\n')
    shim.chmod(0o755)
    python = venv_bin / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDLEGRID_")}
    return {**env, "HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}


def _stop_group(pgid: int, timeout_s: float = 60) -> None:
    """SIGTERM a process group (what the README's shells started), and wait until it ends."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _started(command: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[Any]:
    """Run `command` in bash in a session of its own (what it starts in the background
    stays in its process group); the group is stopped after."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-ec", command], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield proc
        finally:
            _stop_group(proc.pid)
            proc.wait(10)


def _await_health(url: str, log: Path) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, f"the coordinator at {url} ({log.read_text()[-2000:]})", timeout_s=60)


def _shell_script(block: str, url: str) -> str:
    """The admin's shell of the quickstart, to its `web-account` line (which prompts)."""
    return "\n".join(
        line.replace(README_URL, url).replace("idlegrid worker", "idlegrid worker --no-benchmark")
        for line in readme.commands(block)
        if "web-account" not in line
    )


def _admin_token(tmp_path: Path) -> str:
    return (tmp_path / "home" / "idlegrid-data" / "admin-token").read_text().strip()


def _the_lora_block(block: str, env: dict[str, str], tmp_path: Path) -> None:
    """The README's LoRA block, as written, in the quickstart's shell (as the admin)."""
    (tmp_path / "notes.txt").write_text(NOTES)
    script = "\n".join(readme.commands(block))
    done = subprocess.run(["bash", "-ec", script], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "SmolLM2-tuned" / name).read_bytes() == (
            tmp_path / "SmolLM2" / name
        ).read_bytes(), name
    (row,) = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert row["text"].strip() and row["tokens"], row


def _upload(page: Any, purpose: str, path: Path) -> None:
    """Research → Files: upload `path` as `purpose` (chunks, with a progress bar)."""
    page.click("nav[aria-label=Main] >> text=Research")
    page.click("nav.tabs >> text=Files")
    page.select_option("#purpose", purpose)
    page.set_input_files("#file", str(path))
    page.click("#upload-button")
    page.locator("#files", has_text=path.name).wait_for(timeout=600_000)


def _chat(folder: Path) -> str:
    """The folder's tokenizer renders the chat with its template; the model answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)  # fmt: skip
    with torch.no_grad():
        answer = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return str(tokenizer.decode(answer[0][prompt["input_ids"].shape[1] :],
                                skip_special_tokens=True))  # fmt: skip


def _researcher_tunes_and_chats(
    page: Any, url: str, block: str, env: dict[str, str], tmp_path: Path
) -> None:
    """The README's dashboard path: the zip and the text uploaded, a LoRA job, its folder
    downloaded and chatted with, exported, and asked through the generation form."""
    _upload(page, "model-folder", tmp_path / "SmolLM2.zip")
    _upload(page, "dataset", tmp_path / "notes.txt")
    page.locator("#files tr", has_text="SmolLM2.zip").locator("a.button:has-text('Train')").click()
    for field, value in (("#lora_rank", "4"), ("#rounds", "1"), ("#workers", "1"),
                         ("#inner_steps", "3"), ("#batch_size", "2"), ("#seq_len", "32"),
                         ("#inner_lr", "0.003")):  # fmt: skip
        page.fill(field, value)
    page.click("text=Submit model training job")
    page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    assert "LoRA adapters of rank 4" in page.inner_text("main")
    page.locator("#download-model").wait_for(timeout=1_200_000)
    with page.expect_download(timeout=600_000) as info:
        page.click("#download-model")
    folder = tmp_path / "SmolLM2-web"
    with zipfile.ZipFile(info.value.path()) as archive:
        archive.extractall(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        assert (folder / name).read_bytes() == (tmp_path / "SmolLM2" / name).read_bytes(), name
    answer = _chat(folder)
    assert answer.strip(), answer

    (export,) = [line for line in readme.commands(block) if "export-gguf" in line]
    export = export.replace("SmolLM2-tuned", "SmolLM2-web")
    done = subprocess.run(["bash", "-ec", export], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    _upload(page, "gguf-model", tmp_path / "SmolLM2-web.gguf")
    _upload(page, "prompts", tmp_path / "chat.jsonl")
    row = page.locator("#files tr", has_text="SmolLM2-web.gguf")
    row.locator("a.button:has-text('Generate')").click()
    prompts = page.locator("#prompts option", has_text="chat.jsonl").get_attribute("value")
    page.select_option("#prompts", value=prompts)
    page.fill("#max_tokens", "8")
    page.click("text=Submit generation job")
    page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    page.locator("#download").wait_for(timeout=900_000)
    page.reload()
    completion = page.locator("section[aria-labelledby=generation-heading] tbody tr td.wrap")
    said = completion.first.inner_text()
    # The grid's llama.cpp (q8_0) answers as transformers did (float32), to its first word.
    assert said.split()[:1] == answer.split()[:1], (said, answer)


def _web_account_line(block: str) -> str:
    (line,) = [line for line in readme.commands(block) if "web-account" in line]
    return line


def _make_researcher(browser_page: Any, url: str, name: str) -> None:
    """The admin, signed in, gives `name` the researcher role under "Admin"."""
    browser_page.goto(f"{url}/signin")
    browser_page.fill("#login", "admin")
    browser_page.fill("#password", PASSWORD)
    browser_page.click("main button[type=submit]")
    browser_page.wait_for_load_state("load")
    browser_page.click("nav[aria-label=Main] >> text=Admin")
    browser_page.fill("#q", name)
    browser_page.click("form.search button[type=submit]")
    browser_page.wait_for_load_state("load")
    row = browser_page.locator("#accounts tbody tr", has_text=name)
    row.locator("select[name=role]").select_option("researcher")
    row.locator("button", has_text="Set role").click()
    browser_page.wait_for_load_state("load")
    row = browser_page.locator("#accounts tbody tr", has_text=name)
    assert row.locator("td").nth(1).inner_text() == "researcher"


def _researcher_embeds(page: Any, url: str, texts: list[str]) -> np.ndarray:
    """Upload, the form as it stands, the job page followed to its download."""
    page.goto(url)  # the role shows from the next page on
    page.click("nav[aria-label=Main] >> text=Research")
    page.click("nav.tabs >> text=Files")
    page.select_option("#purpose", "texts")
    body = "\n".join(json.dumps(t) for t in texts).encode()
    page.set_input_files(
        "#file", files=[{"name": "notes.jsonl", "mimeType": "application/jsonl", "buffer": body}]
    )
    page.click("#upload-button")
    page.locator("#files", has_text="notes.jsonl").wait_for(timeout=30_000)
    page.click("#files a.button:has-text('Embed')")
    assert "the grid's default, 3 on distinct nodes" in page.inner_text("main")
    page.fill("#shard_size", "10")  # a few shards, so there is progress to follow
    page.click("text=Submit embedding job")
    page.wait_for_url(re.compile(r".*/research/jobs/\d+$"))
    # Not done when the page first shows it (9 tasks to run); the page follows the job by
    # itself (HTMX), with no reload, until the download shows.
    assert page.inner_text("#job-state").strip() in ("queued", "running")
    assert page.locator("#download").count() == 0
    page.locator("#download").wait_for(timeout=300_000)
    assert "completed" in page.inner_text("#job-state")
    card = page.locator(".stat", has_text="Effective replication").locator(".value")
    assert float(card.inner_text()) >= 3.0
    with page.expect_download() as info:
        page.click("#download")
    return np.load(io.BytesIO(Path(info.value.path()).read_bytes()))


def test_the_one_machine_quickstart_and_a_researcher_on_its_dashboard(tmp_path: Path) -> None:
    serve_block, shell_block = readme.blocks(readme.section("Quickstart: one machine"), "bash")
    (serve,) = [line for line in readme.commands(serve_block) if "idlegrid serve" in line]
    assert "--replica-networks shared" in serve
    (lora_block,) = readme.blocks(readme.section("Your own model with LoRA"), "bash")
    env = _shell(tmp_path)
    url = README_URL
    with socket.socket() as sock:  # the quickstart's port, as its shell expects it
        if sock.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("something listens on 127.0.0.1:8000, where the quickstart serves")
    with (
        _started(serve, env, tmp_path, tmp_path / "serve.log"),
        contextlib.ExitStack() as stack,
    ):
        _await_health(url, tmp_path / "serve.log")
        shell_log = tmp_path / "shell.log"
        shell = stack.enter_context(
            _started(_shell_script(shell_block, url), env, tmp_path, shell_log)
        )
        # The script ends after `idlegrid job 1`; the workers it started stay.
        assert shell.wait(900) == 0, shell_log.read_text()
        printed = shell_log.read_text()
        vectors = np.load(tmp_path / "vectors.npy")
        assert vectors.shape == (3, 384) and vectors.dtype == np.float32
        effective = re.search(r"3 per shard \(effective ([\d.]+) tasks per shard done\)", printed)
        assert "completed" in printed and effective and float(effective[1]) >= 3, printed
        account = subprocess.run(
            ["bash", "-c", f"{_web_account_line(shell_block)} --password-file -"],
            input=PASSWORD + "\n", env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert account.returncode == 0, account.stdout + account.stderr

        with chromium_page(accept_downloads=True) as page:
            page.goto(url)
            page.click(".who >> text=Join")
            page.fill("#username", "rhea")
            page.fill("#email", "rhea@example.org")
            page.fill("#password", PASSWORD)
            page.click("main button[type=submit]")
            page.wait_for_url("**/my/nodes")
            admin = page.context.browser.new_context().new_page()
            _make_researcher(admin, url, "rhea")
            texts = [f"a researcher's sentence number {i}" for i in range(30)]
            embedded = _researcher_embeds(page, url, texts)
            assert embedded.shape == (30, 384)
            assert np.allclose(np.linalg.norm(embedded, axis=1), 1.0, atol=1e-3)

            admin_env = {**env, "IDLEGRID_SERVER": url,
                         "IDLEGRID_TOKEN": _admin_token(tmp_path)}  # fmt: skip
            _the_lora_block(lora_block, admin_env, tmp_path)
            _researcher_tunes_and_chats(page, url, lora_block, env, tmp_path)
    for log in (tmp_path / "home" / ".idlegrid").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
