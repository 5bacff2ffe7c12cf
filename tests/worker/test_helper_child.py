"""A helper child of the daemon (the hardware probe's and the benchmark's process) ends
when the daemon is killed mid-call, instead of waiting for ever on its pool's queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from helpers import wait_until

PARENT = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from idlegrid.worker.daemon import in_child_process

    def slow(path):
        with open(path, "w") as out:
            out.write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        asyncio.run(in_child_process(slow, sys.argv[1]))
    """
)


def test_a_helper_child_ends_when_the_daemon_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)], cwd=tmp_path)
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), "the helper child",
                   timeout_s=120)  # fmt: skip
        child = psutil.Process(int(pid_file.read_text()))
        assert child.ppid() == parent.pid
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
               "the helper child to end", timeout_s=15)  # fmt: skip
