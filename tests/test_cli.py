"""The `idlegrid` command as a newcomer meets it, against a real coordinator on a socket
(uvicorn in a thread): clear one-line errors, human output, the small messages."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from grids import serving_in_thread

from idlegrid.cli.main import main
from idlegrid.settings import CoordinatorSettings


@dataclass
class Live:
    url: str
    admin_token: str

    def run(self, *args: str, token: str | None = None) -> Result:
        env = {"IDLEGRID_SERVER": self.url, "IDLEGRID_TOKEN": token or self.admin_token}
        return CliRunner().invoke(main, list(args), env=env)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    settings = CoordinatorSettings(
        data_dir=tmp_path / "coordinator", monitor_interval_s=3600.0, distinct_networks=False
    )
    with serving_in_thread(settings) as url:
        yield Live(url, settings.admin_token_file.read_text().strip())


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: nobody listens


def _one_line_error(result: Result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


# -- expected failures: one line, a non-zero exit, the traceback only with --debug -------------


@pytest.mark.parametrize("command", [["jobs"], ["submit", "sleep", "-p", "tasks=1"], ["job", "1"]])
def test_an_unreachable_server_is_named_in_one_line(command: list[str]) -> None:
    url = _dead_url()
    result = CliRunner().invoke(main, [*command, "-s", url, "-t", "igr_x"])
    line = _one_line_error(result)
    assert f"cannot reach the coordinator at {url}" in line
    assert result.exit_code == 1


def test_debug_shows_the_traceback() -> None:
    result = CliRunner().invoke(main, ["--debug", "jobs", "-s", _dead_url(), "-t", "igr_x"])
    assert result.exit_code == 1
    assert result.exception is not None and type(result.exception).__name__ == "Unreachable"


def test_a_refused_token_says_what_to_check(live: Live) -> None:
    line = _one_line_error(live.run("jobs", token="igr_not-a-token"))
    assert "401 unauthorized: unknown or revoked token" in line and live.url in line
    assert "IDLEGRID_TOKEN" in line


def test_a_missing_input_file_is_one_line(live: Live, tmp_path: Path) -> None:
    line = _one_line_error(live.run("submit", "embed-text", str(tmp_path / "nope.jsonl")))
    assert line == f"Error: no such file or directory: {tmp_path / 'nope.jsonl'}"


def test_a_full_disk_is_one_line(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    from idlegrid.client import Job

    job_id = live.run("submit", "sleep", "-p", "tasks=1").output.split()[1]
    # A finished job's bytes (no worker runs here), written where every write fails:
    # /dev/full answers each one with ENOSPC.
    monkeypatch.setattr(Job, "result_bytes", lambda self: b"result bytes")
    line = _one_line_error(live.run("results", job_id, "-o", "/dev/full"))
    assert line == (
        "Error: no space left on the device to write /dev/full: free some space and try again"
    )


# -- the small messages --------------------------------------------------------------------


def test_a_param_without_equals_names_the_form(live: Live) -> None:
    result = live.run("submit", "sleep", "-p", "shard_size")
    assert result.exit_code == 2
    assert "expected KEY=VALUE, got 'shard_size'" in result.output


def test_output_with_no_wait_is_refused(live: Live, tmp_path: Path) -> None:
    result = live.run("submit", "sleep", "--no-wait", "-o", str(tmp_path / "out.json"))
    assert result.exit_code == 2 and "drop --no-wait" in result.output


def test_an_empty_text_is_refused_with_its_line(live: Live, tmp_path: Path) -> None:
    texts = tmp_path / "texts.jsonl"
    texts.write_text('"fine"\n{"text": ""}\n')
    line = _one_line_error(live.run("submit", "embed-text", str(texts)))
    assert "422 invalid_input: line 2: the text is empty" in line


def test_a_cancelled_job_says_it_gets_no_result(live: Live, tmp_path: Path) -> None:
    job_id = live.run("submit", "sleep", "-p", "tasks=1").output.split()[1]
    assert live.run("job", job_id, "--cancel").exit_code == 0
    line = _one_line_error(live.run("results", job_id, "-o", str(tmp_path / "r")))
    assert f"job {job_id} is cancelled; it has no result and will not get one" in line


def test_a_cancelled_job_is_resubmitted_as_a_new_job_of_its_shards(live: Live) -> None:
    job_id = live.run("submit", "sleep", "-p", "tasks=3").output.split()[1]
    assert live.run("job", job_id, "--cancel").exit_code == 0
    result = live.run("job", job_id, "--resubmit", "--json")
    assert result.exit_code == 0, result.output
    again = json.loads(result.output)
    assert again["id"] != int(job_id) and again["shards_total"] == 3
    refused = live.run("job", str(again["id"]), "--resubmit")
    assert "is queued; only a failed or cancelled job" in refused.output


# -- submission warnings and the job summary ------------------------------------------------


def test_submit_warns_when_the_fleet_cannot_hold_the_replicas(live: Live) -> None:
    result = live.run("submit", "sleep", "-p", "tasks=1", "--replication", "3")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("job ")
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert any("connect 3 more node(s)" in w for w in warnings), result.output


def test_job_prints_a_summary_and_json_on_request(live: Live) -> None:
    job_id = live.run("submit", "sleep", "-p", "tasks=2", "--replication", "2").output.split()[1]
    shown = live.run("job", job_id)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == f"job {job_id}: sleep, queued"
    assert "0/2 shards (0%)" in lines[1] and "replication  2 per shard" in lines[2]
    created = next(line for line in lines if line.strip().startswith("created"))
    assert time.strftime("%Y-%m-%d") in created  # local time, not an epoch number
    assert any(line.strip().startswith("waiting for: ") for line in lines), shown.output
    raw = json.loads(live.run("job", job_id, "--json").output)
    assert raw["id"] == int(job_id) and isinstance(raw["created_at"], float)


def test_watch_when_piped_prints_one_line_per_change_with_the_reason(live: Live) -> None:
    job_id = live.run("submit", "sleep", "-p", "tasks=1", "--replication", "2").output.split()[1]
    # Ended from another thread a moment later, so the watch sees two states.
    timer = threading.Timer(1.0, lambda: live.run("job", job_id, "--cancel"))
    timer.start()
    try:
        watched = live.run("job", job_id, "--watch")
    finally:
        timer.join()
    assert watched.exit_code == 1  # cancelled
    progress = [line for line in watched.output.splitlines() if line.startswith("[")]
    assert len(progress) == 2, watched.output
    assert f"job {job_id} queued: 0/1 shards; waiting for: " in progress[0]
    assert f"job {job_id} cancelled: 0/1 shards" in progress[1]


# -- tokens ---------------------------------------------------------------------------------


def test_token_create_list_and_revoke(live: Live) -> None:
    made = live.run("token", "create", "--node", "--account", "alice", "--label", "laptop")
    assert made.exit_code == 0, made.output
    secret = made.output.splitlines()[0]
    assert secret.startswith("ign_") and "node token 2 for account alice" in made.output
    listed = live.run("token", "list", "--all")
    assert "alice" in listed.output and "laptop" in listed.output and secret not in listed.output
    assert all(len(line) <= 80 for line in listed.output.splitlines()), listed.output
    revoked = live.run("token", "revoke", "2")
    assert revoked.exit_code == 0 and "revoked node token 2" in revoked.output
    assert json.loads(live.run("token", "list", "--account", "alice", "--json").output) == []


# -- the worker's token --------------------------------------------------------------------


def test_worker_says_which_variable_holds_its_token() -> None:
    result = CliRunner().invoke(main, ["worker"], env={"IDLEGRID_TOKEN": "igr_x"})
    assert result.exit_code == 2
    assert "IDLEGRID_NODE_TOKEN" in result.output and "--token-file" in result.output
    assert "Missing option" not in result.output


def test_worker_refuses_a_researcher_token() -> None:
    result = CliRunner().invoke(main, ["worker"], env={"IDLEGRID_NODE_TOKEN": "igr_x"})
    assert result.exit_code == 2 and "a worker needs a node token (ign_...)" in result.output


def test_worker_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "node-token"
    path.write_text("ign_secret\n")
    path.chmod(0o644)
    result = CliRunner().invoke(main, ["worker", "--token-file", str(path)], env={})
    assert result.exit_code == 2 and f"chmod 600 {path}" in result.output


def test_the_rounds_table_fits_80_columns_uncut() -> None:
    import io

    from rich.console import Console

    from idlegrid.cli import summary

    row = {"round": 12, "final": False, "state": "closed", "train_loss": 2.345678,
           "eval_loss": 2.456789, "updates": 16, "nodes": 16, "bytes_up": 123_456_789,
           "bytes_down": 98_765_432, "round_time_s": 1234.5,
           "closed_by": "min_updates"}  # fmt: skip
    metrics = {"rounds": [row, {**row, "round": 13, "final": True, "closed_by": None}]}
    out = io.StringIO()
    Console(file=out, width=80).print(summary.rounds_table(metrics))
    text = out.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" not in text and "2.3457" in text and "123.5 MB" in text and "13 end" in text


def test_web_account_refuses_a_data_dir_without_a_database_and_changes_nothing(
    tmp_path: Path,
) -> None:
    wrong = tmp_path / "typo-data"
    args = ["web-account", "ada", "--role", "admin", "--password-file", "-"]
    env = {"IDLEGRID_DATABASE_URL": ""}
    result = CliRunner().invoke(
        main, [*args, "--data-dir", str(wrong)], input="a long passphrase\n", env=env
    )
    assert result.exit_code != 0
    assert str(wrong / "idlegrid.db") in result.output and "--create" in result.output
    assert not wrong.exists()  # nothing made: no empty database to sign in to
    made = CliRunner().invoke(
        main, [*args, "--data-dir", str(wrong), "--create"], input="a long passphrase\n", env=env
    )
    assert made.exit_code == 0, made.output
    assert str(wrong / "idlegrid.db") in made.output
    again = CliRunner().invoke(
        main, [*args, "--data-dir", str(wrong)], input="a long passphrase\n", env=env
    )
    assert again.exit_code == 0, again.output  # the database exists now: no --create needed


def test_submit_help_lists_every_kind_with_an_example_that_parses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shlex

    from idlegrid.cli.researcher import submit
    from idlegrid.kinds import KINDS

    text = CliRunner().invoke(main, ["submit", "--help"], terminal_width=80).output
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    # A kind's line: its name (or names) at the indent of the text, then its inputs.
    firsts = [line[2:].split("  ")[0] for line in lines if re.match(r"  [a-z]", line)]
    listed = {name.strip() for first in firsts for name in first.split(",")}
    assert set(KINDS) <= listed, set(KINDS) - listed
    # Each example, its continuation lines joined, is a command the CLI accepts as it is.
    examples: list[str] = []
    for line in (line.strip() for line in lines):
        if line.startswith("idlegrid submit") or (examples and examples[-1].endswith("\\")):
            if examples and examples[-1].endswith("\\"):
                examples[-1] = examples[-1][:-1] + line
            else:
                examples.append(line)
    kinds_shown = {shlex.split(example)[2] for example in examples}
    assert kinds_shown >= {"embed-text", "onnx-infer", "llm-generate", "diloco-train"}
    monkeypatch.chdir(tmp_path)
    for name in ("texts.jsonl", "model.onnx", "data.safetensors", "model.gguf",
                 "prompts.jsonl", "notes.txt"):  # fmt: skip
        (tmp_path / name).write_text("x")
    (tmp_path / "SmolLM2").mkdir()
    for example in examples:
        args = shlex.split(example)[2:]
        context = submit.make_context("submit", [*args, "--token", "t"])
        assert context.params["kind"] in KINDS, example


def test_serve_help_says_what_listens_and_the_blob_limits_defaults() -> None:
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    assert "It prints every address it listens on" in text
    assert "--p2p-host TEXT Address the bootstrap DHT peer listens on" in text
    assert "--max-blob-mb FLOAT Largest blob sent in one request, MiB [default: 256]" in text
    assert "quota_blob_bytes (10 GiB)" in text
    settings = CoordinatorSettings()
    assert settings.max_blob_bytes == 256 * 1024 * 1024  # what the help says
    assert settings.quota_blob_bytes == 10 * 1024**3
