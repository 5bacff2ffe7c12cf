"""The worker as its owner runs it: a real `idlegrid worker` process, driven by its
subcommands and by Ctrl-C (SIGINT), against a real coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[LocalGrid]:
    # A node timeout far beyond the test's waits: a task that comes back within them came
    # back because the worker gave it back, not because its lease expired.
    with LocalGrid(tmp_path, node_timeout_s=120.0) as grid:
        yield grid


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idlegrid", *args], capture_output=True, text=True, timeout=60
    )


def _heard(log: Path) -> int:
    """How many stop signals the worker has answered (its log says so for each)."""
    text = log.read_text()
    return text.count("finishing the running tasks, then stopping") + text.count(
        "giving the running tasks back to the coordinator and stopping"
    )


def _running_task(state_dir: Path) -> dict[str, Any] | None:
    done = _cli("worker", "--state-dir", str(state_dir), "status", "--json")
    if done.returncode != 0:
        return None
    tasks = json.loads(done.stdout)["tasks"]
    return next((t for t in tasks if t["state"] == "running"), None)


def _start(grid: LocalGrid, name: str) -> tuple[subprocess.Popen[str], Path]:
    worker = grid.start_worker(name, kinds="sleep", benchmark=False)
    grid.wait_for_nodes(1)
    return worker, grid.root / name


def test_the_subcommands_drive_the_running_worker(grid: LocalGrid) -> None:
    _, state_dir = _start(grid, "w")
    base = ["worker", "--state-dir", str(state_dir)]

    def said(*command: str) -> str:
        done = _cli(*base, *command)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        return done.stdout

    assert said("status").startswith("running: ")
    paused = said("pause")
    assert paused.strip() == "paused by the owner"  # the state said once
    status = said("status")
    assert status.startswith("paused by the owner\n")
    assert "control page: http://127.0.0.1:" in status and "?token=" in status
    assert said("resume").startswith("running: ")
    assert said("snooze", "--minutes", "5").startswith("paused: snoozed until ")
    assert said("resume").startswith("running: ")
    assert "finishing the current tasks" in said("finish")
    assert said("resume").startswith("running: ")
    missing = _cli("worker", "--state-dir", str(state_dir / "nowhere"), "status")
    assert missing.returncode == 1 and "no worker has run" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_ctrl_c_finishes_the_running_task_then_stops(grid: LocalGrid) -> None:
    worker, state_dir = _start(grid, "w")
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 1, "seconds": 3.0}, replication=1)
        wait_until(lambda: _running_task(state_dir), "the task to start", timeout_s=60)
        # As a terminal sends it: to the whole process group, task processes too.
        os.killpg(worker.pid, signal.SIGINT)
        assert worker.wait(60) == 0
        # The task finished and its result was delivered before the worker stopped.
        assert job.info()["state"] == "completed"
    log = (grid.root / "w.log").read_text()
    assert "finishing the running tasks" in log and "done in" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "signals", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM,)], ids=["ctrl-c-twice", "sigterm"]
)
def test_the_task_is_given_back_and_the_worker_stops_at_once(
    grid: LocalGrid, signals: tuple[signal.Signals, ...]
) -> None:
    worker, state_dir = _start(grid, "w")
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 1, "seconds": 600.0}, replication=1)
        wait_until(lambda: _running_task(state_dir), "the task to start", timeout_s=60)
        task_processes = psutil.Process(worker.pid).children(recursive=True)
        assert task_processes
        log = grid.root / "w.log"
        for said, number in enumerate(signals, 1):  # Ctrl-C as a terminal sends it: to the group
            os.killpg(worker.pid, number) if number == signal.SIGINT else worker.send_signal(number)
            wait_until(lambda n=said: _heard(log) >= n, "the worker to answer the signal")
        started = time.monotonic()
        assert worker.wait(30) == 0
        assert time.monotonic() - started < 10, "the worker did not stop at once"
        # Its task processes end with it (multiprocessing's helpers once they see it gone).
        _, alive = psutil.wait_procs(task_processes, timeout=5)
        assert not alive, [" ".join(p.cmdline()) for p in alive]

        # The coordinator made a new attempt at once: it heard that the task came back,
        # long before the node's timeout (120 s) would have expired its lease.
        def retried() -> dict[str, Any] | None:
            (shard,) = job.info(shards=True)["shards"]
            return shard if shard["attempts"] == 2 else None

        assert wait_until(retried, "the shard's next attempt", timeout_s=10)["state"] == "open"
    log = (grid.root / "w.log").read_text()
    assert "given back: the worker was stopped" in log and "Traceback" not in log


def _alive_in_group(pgid: int) -> list[int]:
    """The processes of a process group still running (zombies have ended)."""
    alive = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def test_sigterm_to_the_group_after_embeddings_stops_without_warnings(grid: LocalGrid) -> None:
    """As `systemctl stop` does: SIGTERM to the daemon and its task processes at once,
    after a task process made progress bars (tqdm's lock between processes)."""
    worker = grid.start_worker("e", kinds="embed-text,sleep", benchmark=False)
    grid.wait_for_nodes(1)
    with grid.client() as client:
        client.submit_embeddings(["one text", "another"], replication=1).wait(timeout=300)
        client.submit("sleep", params={"tasks": 1, "seconds": 600.0}, replication=1)
        wait_until(lambda: _running_task(grid.root / "e"), "the sleep task to start", timeout_s=60)
    os.killpg(worker.pid, signal.SIGTERM)
    assert worker.wait(30) == 0
    # The resource tracker (it ignores SIGTERM) warns as it ends, after the daemon: every
    # process of the group has ended once its warnings are in the log.
    wait_until(lambda: not _alive_in_group(worker.pid), "the worker's processes to end")
    log = (grid.root / "e.log").read_text()
    assert "given back: the worker was stopped" in log
    for bad in ("resource_tracker", "leaked", "Traceback", "Exception ignored"):
        assert bad not in log, log


def test_an_idle_task_process_ends_and_the_next_task_starts_a_new_one(tmp_path: Path) -> None:
    """What a task process keeps (a model) goes back to the machine once it idles."""
    with LocalGrid(tmp_path, extra_env={"IDLEGRID_TASK_PROCESS_IDLE_S": "2"}) as grid:
        worker = grid.start_worker("i", kinds="sleep", benchmark=False)
        grid.wait_for_nodes(1)

        def task_processes() -> list[psutil.Process]:
            # The daemon's children less multiprocessing's resource tracker.
            found = []
            for child in psutil.Process(worker.pid).children():
                try:
                    if "resource_tracker" not in " ".join(child.cmdline()):
                        found.append(child)
                except psutil.Error:  # ended meanwhile (a zombie until reaped)
                    pass
            return found

        with grid.client() as client:
            client.submit("sleep", params={"tasks": 1, "seconds": 0.1}, replication=1).wait(
                timeout=60
            )
            (first,) = task_processes()
            wait_until(lambda: not task_processes(), "the idle task process to end", timeout_s=20)
            # Ended, and reaped by the daemon (a zombie for the moment between the two).
            wait_until(lambda: not first.is_running(), "the daemon to reap it", timeout_s=20)
            job = client.submit("sleep", params={"tasks": 1, "seconds": 0.1}, replication=1)
            assert job.wait(timeout=60)["state"] == "completed"
    assert "task process" in (tmp_path / "i.log").read_text()
