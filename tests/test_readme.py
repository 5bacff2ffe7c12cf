"""The README's quickstart, run as written: its code blocks are read from README.md and
run against a real coordinator and one real worker on this machine, with the example
host, data directory and tokens put in. If the README changes, this runs the new text.

Two deviations, both of setup and not of the commands: `idlegrid serve` is started by
LocalGrid (the same command, on a free port), and the worker skips its benchmark.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import readme
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

EXAMPLE_URL = "http://coordinator.example:8000"
_section, _blocks, _commands = readme.section, readme.blocks, readme.commands


def _bash(command: str, env: dict[str, str], cwd: Path, timeout: float = 180) -> str:
    done = subprocess.run(
        ["bash", "-ec", command], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_the_quickstart_finishes_with_one_worker(tmp_path: Path) -> None:
    section = _section("Quickstart: a coordinator")
    serve, admin, volunteer, shell = _blocks(section, "bash")
    (sdk,) = _blocks(section, "python")
    assert "idlegrid serve" in serve
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "idlegrid"  # what `pip install` puts on PATH, and .venv/bin/idlegrid
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m idlegrid "$@"\n')
    shim.chmod(0o755)
    with LocalGrid(tmp_path / "grid") as grid:
        data_dir = str(grid.data_dir)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
        env.pop("IDLEGRID_TOKEN", None)

        def put_in(command: str) -> str:
            return (
                command.replace(EXAMPLE_URL, grid.url)
                .replace("/var/lib/idlegrid", data_dir)
                .replace(".venv/bin/idlegrid", "idlegrid")
            )

        # The admin's shell: exports, then the volunteer's and the researcher's tokens.
        script = "\n".join(put_in(c) for c in _commands(admin))
        printed = _bash(script + '\necho "$IDLEGRID_TOKEN" > admin.seen', env, tmp_path)
        researcher_token = next(line for line in printed.splitlines() if line.startswith("igr_"))
        assert (tmp_path / "alice.token").read_text().startswith("ign_")
        # The volunteer: the token into a 0600 file, then the worker from it.
        *setup, worker_line = _commands(volunteer)
        _bash("\n".join(put_in(c) for c in setup), env, tmp_path)
        assert (tmp_path / ".idlegrid-token").stat().st_mode & 0o777 == 0o600
        worker = subprocess.Popen(
            # --dedicated: a machine that runs a test suite is never idle.
            ["bash", "-c", f"exec {put_in(worker_line)} --no-benchmark --dedicated --state-dir w"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            grid.wait_for_nodes(1)
            researcher = {**env, "IDLEGRID_SERVER": grid.url, "IDLEGRID_TOKEN": researcher_token}
            (tmp_path / "texts.jsonl").write_text('"a first text"\n{"text": "a second"}\n')
            for command in _commands(shell):
                _bash(put_in(command), researcher, tmp_path)
            assert np.load(tmp_path / "vectors.npy").shape == (2, 384)
            code = put_in(sdk).replace('token="igr_..."', f'token="{researcher_token}"')
            code += "\nassert vectors.shape == (2, 384), vectors.shape\n"
            _bash(f"{sys.executable} - <<'EOF'\n{code}\nEOF", researcher, tmp_path)
            with grid.client() as admin_client:
                assert len(admin_client.nodes()) == 1
        finally:
            worker.terminate()
            output, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, output
        assert "done in" in output and "Traceback" not in output, output


def test_the_quickstart_credits_alice_not_admin(tmp_path: Path) -> None:
    """The node token of the quickstart is on the volunteer's account."""
    admin = _blocks(_section("Quickstart: a coordinator"), "bash")[1]
    assert "token create --node --account alice" in admin
    with LocalGrid(tmp_path) as grid:
        grid.start_worker("w", kinds="sleep", benchmark=False, account="alice")
        grid.wait_for_nodes(1)
        with grid.client() as client:
            client.submit("sleep", params={"tasks": 1, "seconds": 0.1}, replication=1).wait(
                timeout=60
            )
            wait_until(
                lambda: any(n["name"] == "w" for n in client.nodes()), "node w", timeout_s=10
            )
        alice = grid.create_token(account="alice")["token"]
        from idlegrid.client import Client

        with Client(grid.url, alice) as as_alice:
            assert [n["name"] for n in as_alice.nodes()] == ["w"]


def _lines(block: str) -> list[str]:
    """`_commands` of a block whose commands may continue over lines (`\\`)."""
    return _commands(block.replace("\\\n", " "))


def test_the_training_section_finishes_with_two_workers(tmp_path: Path) -> None:
    """The training section's SDK and shell examples, as written, on two workers that
    offer what they offer by default (no --kinds)."""
    section = _section("Training a model")
    (sdk,) = _blocks(section, "python")
    (shell,) = _blocks(section, "bash")
    submit, metrics = _lines(shell)
    from idlegrid.kinds.diloco.dataset import corpus_dataset_blob

    (tmp_path / "dataset.safetensors").write_bytes(corpus_dataset_blob())
    with LocalGrid(tmp_path / "grid") as grid:
        for name in ("a", "b"):
            grid.start_worker(name, benchmark=False, threads=1)
        grid.wait_for_nodes(2)
        token = grid.create_token(account="bob")["token"]
        env = {**os.environ, "IDLEGRID_SERVER": grid.url, "IDLEGRID_TOKEN": token}
        code = sdk.replace(EXAMPLE_URL, grid.url).replace('token="igr_..."', f'token="{token}"')
        code += (
            "\nrounds = [r for r in job.metrics()['rounds'] if not r['final']]"
            "\nassert len(rounds) == 10, rounds"
            "\nassert job.state == 'completed', job.state"
            "\nassert all(w.dtype.name == 'float32' for w in weights.values()), weights"
        )
        _bash(f"{sys.executable} - <<'EOF'\n{code}\nEOF", env, tmp_path, timeout=900)
        # The shell example again, over 2 of its 10 rounds: the SDK's run above showed all
        # 10 finish, and each round costs half a minute here.
        assert "-p rounds=10" in submit
        submit = submit.replace("-p rounds=10", "-p rounds=2")
        printed = _bash(f"{sys.executable} -m {submit}", env, tmp_path, timeout=900)
        job_id = re.search(r"job (\d+)", printed)
        assert job_id, printed
        assert (tmp_path / "weights.safetensors").stat().st_size > 0
        table = _bash(
            f"{sys.executable} -m " + re.sub(r"\b7\b", job_id.group(1), metrics), env, tmp_path
        )
        assert len([line for line in table.splitlines() if line.strip()[:1].isdigit()]) >= 2, table
