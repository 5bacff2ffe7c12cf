"""How a standing averager's process starts: a fork of the worker's task process, or a
new interpreter.

A new interpreter (`python -m idlegrid.p2p.averaging`) imports numpy, torch and
Hivemind before it can join the DHT: two CPU seconds, which on a busy machine stretch
the first round of a job while the member trains. A worker's task process has imported
most of that already (torch, numpy, idlegrid), so on Linux it forks instead: the child
starts with those modules loaded, imports only what is left (Hivemind), and joins.

The fork is taken from the task process's main thread, between two tasks' steps, where
no torch operation runs; the child uses no torch operation (its all-reduce is numpy on
integer codes), starts no multiprocessing child (its DHT node and p2p daemon run in its
own event loop and a subprocess), and leaves through `os._exit`, so nothing the parent
owns (its temporary folders, its pipe to the daemon) is finalized by it. Elsewhere
(macOS, Windows, a test's process) it is a new interpreter, as it always could be.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

# The name the averager's process goes by (`ps`, `top`, psutil's `name()`), on Linux.
NAME = "idlegrid-p2p"


def name_this_process() -> None:
    """Call this process `NAME` where the system lets it (a fork would otherwise show its
    parent's name and command line)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(NAME)


def forks() -> bool:
    """Whether averagers started here are forks: on Linux, in a worker's task process
    (a daemonic child of the worker, which may not start multiprocessing children)."""
    return sys.platform.startswith("linux") and bool(multiprocessing.current_process().daemon)


class Forked:
    """A forked child with the parts of `subprocess.Popen` a standing averager's handle
    uses: its pid, a text pipe to its stdin and from its stdout, poll, wait and kill."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone all the same
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def fork(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str],
         log: IO[str]) -> Forked:  # fmt: skip
    """Run `main(argv)` in a forked child whose stdin and stdout are pipes to the parent
    and whose stderr is `log`; the child never returns into the parent's code."""
    from_parent, to_child = os.pipe()
    from_child, to_parent = os.pipe()
    for stream in (sys.stdout, sys.stderr, log):
        stream.flush()
    gc.freeze()  # the child's collections leave the parent's objects (and pages) alone
    try:
        pid = os.fork()
    except OSError:
        gc.unfreeze()
        for fd in (to_child, from_parent, from_child, to_parent):
            os.close(fd)
        raise
    if pid == 0:  # the child
        code = 1
        try:
            os.dup2(from_parent, 0)
            os.dup2(to_parent, 1)
            os.dup2(log.fileno(), 2)
            for fd in (to_child, from_parent, from_child, to_parent):
                os.close(fd)
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
            os.environ.update(env)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = main(argv)
        except BaseException:  # noqa: BLE001 - whatever it was, the child ends here
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    gc.unfreeze()
    os.close(from_parent)
    os.close(to_parent)
    return Forked(pid, open(to_child, "w", encoding="utf-8"),  # noqa: SIM115
                  open(from_child, encoding="utf-8"))  # noqa: SIM115  # fmt: skip


def spawn(module: str, argv: list[str], env: dict[str, str], log: IO[str]) -> Any:
    """Run `python -m module *argv` with pipes for its stdin and stdout, stderr to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )  # fmt: skip
