"""What a worker holds in memory after an embed-text job, and after an idle minute.

    .venv/bin/python benchmarks/task_memory.py [--texts 512] [--idle-s 60]

Starts a coordinator (SQLite, temporary directory) and one `idlegrid worker` (embed-text
only, no benchmark), embeds `--texts` paragraphs with replication 1, then reads the RSS
of the worker's processes (the daemon and its task processes; multiprocessing's resource
tracker is counted with the daemon) right after the job, and again once the task
process has been idle for the worker's `task_process_idle_s` (`--idle-s`) plus the
check's period: it ends and gives back the model it kept.

The last line is `rss_mb after_job: daemon D task_processes T; after_idle: daemon D2
task_processes T2`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.worker.execution import IDLE_CHECK_S


def _rss_mb(worker: psutil.Process) -> tuple[float, float]:
    """(daemon and its helpers, task processes) resident set sizes in MB."""
    daemon, tasks = worker.memory_info().rss, 0
    for child in worker.children():
        try:
            rss = child.memory_info().rss
            helper = "resource_tracker" in " ".join(child.cmdline())
        except psutil.Error:
            continue
        if helper:
            daemon += rss
        else:
            tasks += rss
    return daemon / 1e6, tasks / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--idle-s", type=float, default=60.0)
    args = parser.parse_args()
    texts = [
        f"Paragraph {i}: volunteers lend idle machines to research." for i in range(args.texts)
    ]
    with tempfile.TemporaryDirectory() as root:
        env = {"IDLEGRID_TASK_PROCESS_IDLE_S": str(args.idle_s)}
        with LocalGrid(Path(root), extra_env=env) as grid:
            worker = psutil.Process(grid.start_worker("m", kinds="embed-text", benchmark=False).pid)
            grid.wait_for_nodes(1)
            with grid.client() as client:
                job = client.submit_embeddings(texts, shard_size=256, replication=1)
                job.wait(timeout=900)
            after_job = _rss_mb(worker)
            print(f"after the job: daemon {after_job[0]:.0f} MB, task processes "
                  f"{after_job[1]:.0f} MB")  # fmt: skip
            time.sleep(args.idle_s + IDLE_CHECK_S + 5)
            after_idle = _rss_mb(worker)
    print(
        f"rss_mb after_job: daemon {after_job[0]:.0f} task_processes {after_job[1]:.0f}; "
        f"after_idle: daemon {after_idle[0]:.0f} task_processes {after_idle[1]:.0f}"
    )


if __name__ == "__main__":
    main()
