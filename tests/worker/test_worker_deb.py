"""The Debian package that scripts/build-deb.sh makes: installed with dpkg, its worker run
against a real coordinator as the package's service would run it, then removed.

There is no systemd as PID 1 here, so the test starts the installed unit's command itself,
as the unit says (its account, nice 10, the idle I/O class, its environment file). The
removal step delivers the finished results that wait in the outbox, or keeps them and
says so when no coordinator takes them; nothing but the volunteer's data is left after.

Needs root, dpkg and the one-file worker (CI builds it first); it skips elsewhere and
fails under CI=true.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import psutil
import pytest
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import hash_chain
from idlegrid.worker import packages

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STATE = packages.STATE_DIR
OUTBOX = STATE / "outbox"
ON_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _require() -> None:
    problem = None
    if os.geteuid() != 0:
        problem = "installing a package needs root"
    elif shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None:
        problem = "needs dpkg and dpkg-deb (Debian)"
    elif not (ROOT / "dist" / "idlegrid-worker").is_file() and not ON_CI:
        problem = "no dist/idlegrid-worker (build it: scripts/build-worker-binary.sh)"
    elif _installed():
        problem = "idlegrid-worker is installed on this machine already"
    elif (STATE / "node-token").exists():
        # Data an earlier install left (removing a package keeps it): the install would
        # find a token and print no note, as it should on such a machine.
        problem = f"{STATE} holds an earlier install's node token (dpkg --purge, or remove it)"
    if problem is not None:
        if ON_CI:
            pytest.fail(f"{problem}; CI=true requires it")
        pytest.skip(problem)


def _installed() -> bool:
    done = subprocess.run(["dpkg", "-s", packages.PACKAGE], capture_output=True, text=True)
    return done.returncode == 0 and "Status: install ok installed" in done.stdout


def _dpkg(*args: str) -> str:
    """dpkg, waiting for the lock when another install holds it; its output."""
    deadline = time.monotonic() + 300
    while True:
        done = subprocess.run(["dpkg", *args], capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return output
        if "lock" not in output or time.monotonic() > deadline:
            raise AssertionError(f"dpkg {shlex.join(args)} failed: {output}")
        time.sleep(2)


def _build() -> Path:
    python = os.environ.get("PYTHON", str(Path(sys.executable)))
    done = subprocess.run(
        [str(ROOT / "scripts" / "build-deb.sh")], capture_output=True, text=True,
        env={**os.environ, "PYTHON": python}, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (package,) = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("built")]
    return ROOT / package


def _unit() -> dict[str, str]:
    text = (Path("/") / packages.UNIT_PATH.relative_to("/")).read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _start_as_the_unit_would(log: IO[str]) -> subprocess.Popen[str]:
    """The unit's ExecStart under its account, nice and I/O class, with its environment."""
    unit = _unit()
    assert unit["User"] == "idlegrid" and unit["Nice"] == "10", unit
    assert unit["IOSchedulingClass"] == "idle", unit
    env = {"PATH": "/usr/bin:/bin", "HOME": str(STATE), "PYTHONUNBUFFERED": "1"}
    environment_file = Path(unit["EnvironmentFile"].lstrip("-"))
    for line in environment_file.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            env[name] = value

    def lower_priority() -> None:
        os.nice(int(unit["Nice"]))
        psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)

    return subprocess.Popen(
        shlex.split(unit["ExecStart"]), env=env, stdout=log, stderr=subprocess.STDOUT,
        user=unit["User"], group=unit["Group"], preexec_fn=lower_priority, text=True,
    )  # fmt: skip


def _configure(url: str, token: str) -> None:
    """What the post-install note tells the volunteer to do, plus quick test timings."""
    with packages.DEFAULTS.open("a") as defaults:
        defaults.write(
            f"IDLEGRID_SERVER={url}\nIDLEGRID_CONTROL_PORT=0\nIDLEGRID_DEDICATED=true\n"
            "IDLEGRID_BACKOFF_MAX_S=1\nIDLEGRID_DELIVER_TIMEOUT_S=15\n"
        )
    subprocess.run(
        ["install", "-m", "600", "-o", "idlegrid", "-g", "idlegrid", "/dev/stdin",
         str(STATE / "node-token")], input=token + "\n", text=True, check=True,
    )  # fmt: skip


def _package_files() -> list[Path]:
    listed = _dpkg("-L", packages.PACKAGE).splitlines()
    return [Path(p) for p in listed if p.strip() and not Path(p).is_dir()]


def _stop(worker: subprocess.Popen[str]) -> None:
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)


def _submit(grid: LocalGrid, tasks: int) -> int:
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": tasks, "hashes": 20_000}, replication=1)
        return int(job.id)


def _chains(grid: LocalGrid, job_id: int) -> list[Any]:
    """The job's output chains once it completes (a fresh client: coordinators restart)."""
    with grid.client() as client:
        job = client.job(job_id)
        job.wait(timeout=120)
        return [output["chain"] for output in job.result()]


def test_the_package_installs_runs_delivers_its_outbox_and_leaves_only_the_data(
    tmp_path: Path,
) -> None:
    _require()
    package = _build()
    try:
        installed = _dpkg("-i", str(package))
        assert "To join a grid, give this node its token" in installed, installed
        files = _package_files()
        for path in ("/usr/bin/idlegrid-worker", "/etc/xdg/autostart/idlegrid-tray.desktop",
                     "/usr/share/man/man1/idlegrid-worker.1.gz",
                     "/usr/share/applications/idlegrid-worker.desktop"):  # fmt: skip
            assert Path(path) in files, files
        assert (STATE.stat().st_mode & 0o7777) == 0o2750
        with LocalGrid(tmp_path, backoff_max_s=1.0) as grid:
            _run_outbox_story(grid, tmp_path, package)
        # Nothing of the package is left but the volunteer's data and settings.
        left = [path for path in files if path.exists() or path.is_symlink()]
        assert left == [packages.DEFAULTS], left  # a conffile: dpkg keeps it until purge
        assert (STATE / "node.json").is_file() and not list(OUTBOX.glob("*.json"))
        purged = _dpkg("--purge", packages.PACKAGE)
        assert not STATE.exists() and not packages.DEFAULTS.exists(), purged
        assert subprocess.run(["id", "idlegrid"], capture_output=True).returncode != 0
    finally:
        if _installed() or packages.DEFAULTS.exists():
            subprocess.run(["dpkg", "--purge", packages.PACKAGE], capture_output=True)
        shutil.rmtree(STATE, ignore_errors=True)


def _run_outbox_story(grid: LocalGrid, tmp_path: Path, package: Path) -> None:
    """Tasks complete; then a result waits in the outbox while the coordinator is down, is
    kept and reported by the removal, and delivered by the next one."""
    port = urlsplit(grid.url).port
    assert port is not None
    _configure(grid.url, grid.volunteer_token("volunteer"))
    log_path = tmp_path / "installed-worker.log"
    with log_path.open("w") as log:
        worker = _start_as_the_unit_would(log)
        try:
            grid.wait_for_nodes(1)
            job_id = _submit(grid, 2)
            assert _chains(grid, job_id) == [hash_chain(i, 20_000) for i in range(2)]
            assert psutil.Process(worker.pid).nice() == 10
            assert psutil.Process(worker.pid).username() == "idlegrid"
            # The coordinator now dies as the next result arrives, before storing it.
            grid.kill_coordinator()
            grid.env["IDLEGRID_FAULTS"] = "coordinator-result-received"
            grid.start_coordinator(port=port)
            pending = _submit(grid, 1)
            wait_until(lambda: list(OUTBOX.glob("*.json")), "a result in the outbox", timeout_s=120)
            assert grid.coordinator is not None and grid.coordinator.wait(30) is not None
        finally:
            _stop(worker)
    assert worker.returncode == 0, log_path.read_text()
    removed = _dpkg("-r", packages.PACKAGE)  # no coordinator answers
    assert "kept 1 finished result(s)" in removed, removed
    assert len(list(OUTBOX.glob("*.json"))) == 1 and not Path("/usr/bin/idlegrid-worker").exists()
    # With the coordinator back, installing and removing again delivers it first.
    del grid.env["IDLEGRID_FAULTS"]
    grid.start_coordinator(port=port)
    _dpkg("-i", str(package))
    removed = _dpkg("-r", packages.PACKAGE)
    assert "delivered 1 finished result(s)" in removed, removed
    assert _chains(grid, pending) == [hash_chain(0, 20_000)]
