"""How a standing averager's process starts (p2p/launch.py): a fork of a worker's task
process on Linux, a new interpreter elsewhere. The real averagers of a grid's workers:
tests/training/test_training_p2p.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from idlegrid.p2p import launch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")


def _echo(argv: list[str]) -> int:
    """A child's main: names itself, answers each line with it upper-cased and `argv`."""
    launch.name_this_process()
    for line in sys.stdin:
        if line.strip() == "exit":
            return int(argv[0])
        print(line.strip().upper(), *argv, flush=True)
        print("said it", file=sys.stderr, flush=True)
    return 0


def _fails(argv: list[str]) -> int:
    raise RuntimeError("the child's main failed")


def _forks_here(answer: multiprocessing.SimpleQueue[bool]) -> None:
    answer.put(launch.forks())


def _close(child: launch.Forked) -> None:
    child.stdin.close()
    child.stdout.close()


@linux_only
def test_a_forked_child_talks_over_its_pipes_and_exits_with_its_code(tmp_path: Path) -> None:
    keep = tempfile.TemporaryDirectory(dir=tmp_path)  # the parent's: the child must not remove it
    with (tmp_path / "child.log").open("w") as log:
        child = launch.fork(_echo, ["7"], {"IDLEGRID_TEST_FORK": "1"}, log)
        assert psutil.Process(child.pid).name() in (launch.NAME, psutil.Process().name())
        child.stdin.write("hello\n")
        child.stdin.flush()
        assert child.stdout.readline() == "HELLO 7\n"
        assert psutil.Process(child.pid).name() == launch.NAME
        child.stdin.write("exit\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 7
        assert child.poll() == 7
        _close(child)
    assert (tmp_path / "child.log").read_text() == "said it\n"
    assert Path(keep.name).is_dir()
    assert "IDLEGRID_TEST_FORK" not in os.environ  # set in the child only
    keep.cleanup()


@linux_only
def test_a_forked_child_whose_main_raises_says_why_and_exits_1(tmp_path: Path) -> None:
    with (tmp_path / "child.log").open("w") as log:
        child = launch.fork(_fails, [], {}, log)
        assert child.wait(timeout=10) == 1
        _close(child)
    assert "RuntimeError: the child's main failed" in (tmp_path / "child.log").read_text()


@linux_only
def test_a_child_that_does_not_end_is_waited_for_then_killed(tmp_path: Path) -> None:
    with (tmp_path / "child.log").open("w") as log:
        child = launch.fork(_echo, ["0"], {}, log)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        assert child.poll() is None
        child.kill()
        assert child.wait(timeout=10) == -signal.SIGKILL
        _close(child)


def test_only_a_workers_task_process_forks_its_averagers() -> None:
    """A worker's task process is a daemonic child (it may start no multiprocessing
    children, and has torch imported): there, on Linux, averagers are forks."""
    assert launch.forks() is False
    context = multiprocessing.get_context("spawn")
    answer: multiprocessing.SimpleQueue[bool] = context.SimpleQueue()
    process = context.Process(target=_forks_here, args=(answer,), daemon=True)
    process.start()
    process.join(60)
    assert answer.get() is sys.platform.startswith("linux")
