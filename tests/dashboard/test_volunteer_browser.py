"""A new volunteer's first steps, in Chromium against a real coordinator process: sign up,
create a node token, read the commands of "Add a node", run them on this machine as
written (the worker's wheel from the coordinator's /download, the token into a private
file), and see the node online under "My nodes", its tasks validated and credited.

The commands run in a fresh virtual environment whose only extra path is this test run's
site-packages, so pip finds the worker's dependencies installed and fetches nothing but
the wheel (PIP_NO_INDEX); idlegrid itself comes from the wheel. The start command gets
the flags a test grid needs (compute whatever the machine does, no benchmark, a free
control port, the sleep kind only). The packages are built with the README's own line
of its quickstart (`scripts/build-downloads.sh --data-dir ...`), given `--no-binary` to
skip the one-file worker's minute of PyInstaller (tests/worker/test_worker_binary.py
runs that binary).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from browser import chromium_page

from idlegrid import __version__
from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README_DATA_DIR = "/var/lib/idlegrid"
PASSWORD = "a long enough passphrase"
TEST_FLAGS = ["--dedicated", "--no-benchmark", "--control-port", "0", "--kinds", "sleep"]


def _machine(root: Path) -> dict[str, str]:
    """A new volunteer's shell: an empty home, a Python without idlegrid on its PATH."""
    home = root / "home"
    home.mkdir()
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    # ensurepip's older setuptools would hide the test run's one, which torch needs.
    subprocess.run(
        [env_dir / "bin" / "python", "-m", "pip", "uninstall", "-qy", "setuptools"],
        check=True, capture_output=True,
    )  # fmt: skip
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    (site / "test-run.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR")}
    return {
        **keep,
        "HOME": str(home),
        "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def _readme_build_line() -> str:
    """The README quickstart's command that builds what /download serves."""
    text = (ROOT / "README.md").read_text()
    lines = [
        line.split("  #", 1)[0].strip()
        for line in text.splitlines()
        if line.startswith("scripts/build-downloads.sh")
    ]
    assert lines, "the README no longer says how to build the packages /download serves"
    return lines[0]


def test_a_volunteer_installs_a_worker_from_the_coordinator(tmp_path: Path) -> None:
    with LocalGrid(tmp_path / "grid", replication=1, heartbeat_s=1.0) as grid:
        build = _readme_build_line().replace(README_DATA_DIR, str(grid.data_dir))
        built = subprocess.run(
            ["bash", "-c", f"{build} --no-binary"], cwd=ROOT,
            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert built.returncode == 0, built.stdout + built.stderr
        wheel = grid.data_dir / "downloads" / f"idlegrid-{__version__}-py3-none-any.whl"
        with chromium_page(viewport={"width": 1280, "height": 900}) as page:
            page.goto(f"{grid.url}/signup")
            page.fill("#username", "vic")
            page.fill("#email", "vic@example.org")
            page.fill("#password", PASSWORD)
            page.click("main button[type=submit]")
            page.wait_for_url("**/my/nodes")
            page.goto(f"{grid.url}/download")
            assert hashlib.sha256(wheel.read_bytes()).hexdigest() in page.inner_text("main")

            page.goto(f"{grid.url}/my/nodes/add")
            page.fill("#name", "vic-desktop")
            page.click("main button[type=submit]")
            token = page.inner_text("#node-token").strip()
            commands = page.locator("code.command").all_inner_texts()
            assert token.startswith("ign_") and len(commands) == 3
            assert not any(token in command for command in commands)

            env = _machine(tmp_path)
            install, save, start = commands
            for command, given in ((install, ""), (save, token + "\n")):
                ran = subprocess.run(
                    ["bash", "-c", command], input=given, env=env, capture_output=True,
                    text=True, timeout=300,
                )  # fmt: skip
                assert ran.returncode == 0, f"{command}\n{ran.stdout}\n{ran.stderr}"
            token_file = Path(env["HOME"]) / ".idlegrid" / "node-token"
            assert token_file.read_text().strip() == token
            assert token_file.stat().st_mode & 0o077 == 0
            log = (tmp_path / "worker.log").open("w")
            worker = subprocess.Popen(
                ["bash", "-c", f"exec {start} {' '.join(TEST_FLAGS)}"], env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                page.goto(f"{grid.url}/my/nodes")
                page.locator("#node-table .state-online").wait_for(timeout=90_000)
                assert "vic-desktop" in page.inner_text("#node-table")
                with grid.client() as client:
                    job = client.submit("sleep", params={"tasks": 2, "seconds": 0.05})
                    assert job.wait(timeout=120)["state"] == "completed"
                    (node,) = [n for n in client.nodes() if n["name"] == "vic-desktop"]
                page.reload()
                row = page.locator("#node-table tbody tr", has_text="vic-desktop")
                assert row.locator("td").nth(7).inner_text() == "2"  # validated results
                # The validated work is credited to the node and to vic, as the API says.
                credit = float(row.locator("td").nth(5).inner_text().replace(",", ""))
                assert credit > 0 and credit == pytest.approx(node["credit_total"], rel=0.01)
                page.goto(f"{grid.url}/leaderboard/accounts")
                vic = page.locator("table.board tbody tr", has_text="vic")
                assert float(vic.locator("td").nth(3).inner_text().replace(",", "")) == credit
            finally:
                os.killpg(worker.pid, signal.SIGTERM)
                worker.wait(60)
                log.close()
    output = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in output, output
    # The worker ran from the wheel that the coordinator served, not from this checkout.
    assert str(ROOT / "src") not in output
