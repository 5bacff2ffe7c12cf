"""The one-file `idlegrid-worker` that scripts/build-worker-binary.sh makes, run against a
real coordinator until its tasks complete and are verified.

CI builds the binary first (.ci/run). Elsewhere the test uses `dist/idlegrid-worker`, or
the file that IDLEGRID_WORKER_BINARY names; it skips when there is none or when a source
file is newer than it (a stale build), and fails instead under CI=true.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import hash_chain

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _binary() -> Path:
    path = Path(os.environ.get("IDLEGRID_WORKER_BINARY", ROOT / "dist" / "idlegrid-worker"))
    problem = None
    if not path.is_file():
        problem = f"no worker binary at {path}"
    else:
        built = path.stat().st_mtime
        newer = [p for p in (ROOT / "src" / "idlegrid").rglob("*.py") if p.stat().st_mtime > built]
        if newer:
            problem = f"{path} is older than {newer[0].relative_to(ROOT)}"
    if problem is not None:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{problem}; CI builds it with scripts/build-worker-binary.sh")
        pytest.skip(f"{problem} (build it: scripts/build-worker-binary.sh)")
    return path


def test_the_one_file_worker_completes_verified_tasks(tmp_path: Path) -> None:
    binary = _binary()
    with LocalGrid(tmp_path) as grid:
        token = grid.volunteer_token("alice")
        log = (tmp_path / "binary.log").open("w")
        worker = subprocess.Popen(
            [str(binary), "--server", grid.url, "--state-dir", str(tmp_path / "state"),
             "--name", "binary", "--no-benchmark", "--dedicated", "--control-port", "0"],
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                 "IDLEGRID_NODE_TOKEN": token},
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            grid.wait_for_nodes(1)
            with grid.client() as client:
                job = client.submit("sleep", params={"tasks": 2, "hashes": 20_000}, replication=1)
                job.wait(timeout=120)
                outputs = job.result()
                (node,) = client.nodes()
            assert [o["chain"] for o in outputs] == [hash_chain(i, 20_000) for i in range(2)]
            assert node["name"] == "binary"
            # Its own subcommands reach it through the control page.
            status = subprocess.run(
                [str(binary), "--state-dir", str(tmp_path / "state"), "status"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert status.returncode == 0 and "completed 2" in status.stdout, status
        finally:
            worker.terminate()
            started = time.monotonic()
            worker.wait(60)
            log.close()
    output = (tmp_path / "binary.log").read_text()
    assert worker.returncode == 0 and time.monotonic() - started < 60, output
    assert "done in" in output and "Traceback" not in output, output
