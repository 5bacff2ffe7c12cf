"""The worker daemon's footprint while idle, and how fast it steps aside.

    .venv/bin/python benchmarks/worker_footprint.py [--idle-seconds 30]

Starts a coordinator (SQLite, temporary directory) and one `idlegrid worker` process
(kind `sleep` only, so no ML library is loaded; its idle policy on, reading the user's
idle time from the session-helper file only, which this script writes: the simulated
user input). Then:

1. Idle and connected, with no task: the daemon's CPU over `--idle-seconds` (percent of
   one core) and its RSS (MB).
2. Step aside: a busy task (SHA-256 rounds) runs in the worker's task process; the
   script writes "user active" into the helper file and times until the task process
   is stopped (its state, polled every 2 ms), then checks it used no CPU for 0.5 s.

The last line is `idle_cpu_pct: X rss_mb: Y step_aside_ms: Z`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.worker.idle.desktop import write_helper_reading


def _feed_idle(state_dir: Path, seconds: float, until: float) -> None:
    while time.monotonic() < until:
        write_helper_reading(state_dir, seconds, "benchmark")
        time.sleep(0.5)


def _task_process(worker: psutil.Process) -> psutil.Process | None:
    # The busiest child: the task process (multiprocessing's resource tracker idles).
    return max(worker.children(), key=lambda c: c.cpu_times().user, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, LocalGrid(Path(root)) as grid:
        grid.start_coordinator()
        state_dir = Path(root) / "volunteer"
        write_helper_reading(state_dir, 3600.0, "benchmark")
        popen = grid.start_worker(
            "volunteer", kinds="sleep", benchmark=False, dedicated=False,
            extra=("--idle-probe", "session-helper", "--idle-after", "5",
                   "--suspend-cpu-usage", "0", "--run-on-battery"),
        )  # fmt: skip
        grid.wait_for_nodes(1)
        worker = psutil.Process(popen.pid)
        _feed_idle(state_dir, 3600.0, time.monotonic() + 3.0)  # settle after connecting
        before, started = worker.cpu_times(), time.monotonic()
        _feed_idle(state_dir, 3600.0, started + args.idle_seconds)
        after, elapsed = worker.cpu_times(), time.monotonic() - started
        cpu = (after.user + after.system - before.user - before.system) / elapsed * 100
        rss_mb = worker.memory_info().rss / 2**20
        print(f"idle, connected, no task: {cpu:.2f}% of one core, RSS {rss_mb:.1f} MB")

        client = grid.client()
        job = client.submit("sleep", params={"tasks": 1, "hashes": 10**8}, replication=1)
        task = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            write_helper_reading(state_dir, 3600.0, "benchmark")
            task = _task_process(worker)
            if task is not None and task.cpu_times().user > 0.5:
                break
            time.sleep(0.1)
        assert task is not None, "the task never started"
        touched = time.monotonic()
        write_helper_reading(state_dir, 0.0, "benchmark")  # the owner is back
        while task.status() != psutil.STATUS_STOPPED:
            time.sleep(0.002)
        step_aside_ms = (time.monotonic() - touched) * 1000
        stopped = task.cpu_times()
        time.sleep(0.5)
        still = task.cpu_times()
        assert still.user + still.system - stopped.user - stopped.system < 0.01, "it computes"
        print(f"step aside: {step_aside_ms:.0f} ms; task process status {task.status()}")
        print(json.dumps({"job": job.id}))
        job.cancel()
        print(f"idle_cpu_pct: {cpu:.2f} rss_mb: {rss_mb:.1f} step_aside_ms: {step_aside_ms:.0f}")


if __name__ == "__main__":
    main()
