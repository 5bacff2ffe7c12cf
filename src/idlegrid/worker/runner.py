"""Task processes: each slot's tasks run in a child process, never in the daemon.

Why a process: it can be suspended the moment the owner comes back (SIGSTOP on POSIX,
NtSuspendProcess on Windows, both through psutil) and resumed later without losing
its work; it runs at low priority (nice 10, idle I/O class); a kind that crashes or
leaks takes down its process, not the daemon, whose heartbeats go on. A child lives
across tasks, so what a kind keeps between tasks (a loaded model, a training run's
weights) survives; a dead child is started again for the next task.

The parent and child speak over a pipe, in tuples: ("run", task_id, kind, params,
payload, device, threads, slowdown, scratch, checkpoint_every_s) and ("cancel", task_id)
and ("blob", task_id, hash, bytes | None) to the child; ("progress", task_id, fraction),
("fetch", task_id, hash), ("done", task_id, output) and ("failed", task_id, reason) back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from idlegrid.kinds import Cancelled

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.2  # a child reports progress at most this often
NICE = 10


class TaskFailed(Exception):
    """The task's process reported a failure, died, or went over its memory limit."""


@dataclass(frozen=True)
class TaskSpec:
    task_id: int
    kind: str
    params: dict[str, object]
    payload: bytes
    device: str
    threads: int
    slowdown: float
    # Where the kind may keep this task's checkpoint, and how often ("": nowhere).
    scratch: str = ""
    checkpoint_every_s: float = 60.0


class TaskHost:
    """One child process that runs one task at a time (the parent side)."""

    def __init__(self, *, name: str, threads: int = 0) -> None:
        self.name = name
        self.threads = threads
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self.suspended = False
        self.task_id: int | None = None
        self.killed_for: str | None = None
        self._affinity: list[int] | None = None

    # -- process lifecycle -----------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        """Start the child (spawned: it shares no threads or locks with the daemon)."""
        if self.alive():
            return
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(
            target=host_main, args=(child, self.threads), name=self.name, daemon=True
        )
        with _interrupts_blocked():
            self._process.start()
        child.close()
        self._conn = parent
        self.suspended = False
        self.killed_for = None
        if self._affinity is not None:
            self.set_affinity(self._affinity)

    def kill(self, reason: str = "") -> None:
        """Kill the child (its task fails with `reason`); the next task starts a new one."""
        if self._process is None:
            return
        self.killed_for = reason or "killed"
        with contextlib.suppress(psutil.Error, OSError):
            psutil.Process(self._process.pid).kill()
        self._process.join(5)
        self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self) -> None:
        """End the child at daemon shutdown."""
        self.kill("the worker is stopping")

    # -- control of a running task ---------------------------------------------------------

    def suspend(self) -> None:
        if self.alive() and not self.suspended:
            with contextlib.suppress(psutil.Error):
                psutil.Process(self._process.pid).suspend()
                self.suspended = True

    def resume(self) -> None:
        if self.alive() and self.suspended:
            with contextlib.suppress(psutil.Error):
                psutil.Process(self._process.pid).resume()
        self.suspended = False

    def set_affinity(self, cores: list[int] | None) -> None:
        """Pin the child to these cores (None: all) where the platform can."""
        self._affinity = cores
        if not self.alive():
            return
        proc = psutil.Process(self._process.pid)
        if hasattr(proc, "cpu_affinity"):
            with contextlib.suppress(psutil.Error, OSError, ValueError):
                proc.cpu_affinity(cores or [])

    def rss_bytes(self) -> int:
        if not self.alive():
            return 0
        try:
            return int(psutil.Process(self._process.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def cpu_seconds(self) -> float:
        if not self.alive():
            return 0.0
        try:
            times = psutil.Process(self._process.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    def cancel(self) -> None:
        if self.task_id is not None and self._conn is not None:
            self.resume()  # a stopped child cannot see its cancel
            self._send(("cancel", self.task_id))

    # -- one task --------------------------------------------------------------------------

    async def run(
        self,
        spec: TaskSpec,
        *,
        fetch: Callable[[str], Awaitable[bytes]],
        progress: Callable[[float], None],
    ) -> bytes:
        """Run one task in the child; raises Cancelled or TaskFailed."""
        self.start()
        conn = self._conn
        assert conn is not None
        self.task_id = spec.task_id
        try:
            await asyncio.to_thread(
                self._send,
                ("run", spec.task_id, spec.kind, spec.params, spec.payload, spec.device,
                 spec.threads, spec.slowdown, spec.scratch, spec.checkpoint_every_s),
            )  # fmt: skip
            while True:
                try:
                    message = await asyncio.to_thread(conn.recv)
                except (EOFError, OSError):
                    raise TaskFailed(self._death()) from None
                if message[1] != spec.task_id:
                    continue  # a late word about an earlier task
                match message[0]:
                    case "progress":
                        progress(float(message[2]))
                    case "fetch":
                        await self._answer_fetch(spec.task_id, message[2], fetch)
                    case "done":
                        return bytes(message[2])
                    case "cancelled":
                        raise Cancelled()
                    case "failed":
                        raise TaskFailed(str(message[2]))
        finally:
            self.task_id = None

    async def _answer_fetch(
        self, task_id: int, blob_hash: str, fetch: Callable[[str], Awaitable[bytes]]
    ) -> None:
        try:
            blob: bytes | None = await fetch(blob_hash)
        except Exception as exc:
            log.warning("task %s: fetching %s failed: %s", task_id, blob_hash[:12], exc)
            blob = None
        await asyncio.to_thread(self._send, ("blob", task_id, blob_hash, blob))

    def _send(self, message: tuple[Any, ...]) -> None:
        conn = self._conn
        if conn is None:
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            conn.send(message)

    def _death(self) -> str:
        process = self._process
        code = None
        if process is not None:
            process.join(1)
            code = process.exitcode
        self._process = None
        if self.killed_for:
            return f"task process stopped: {self.killed_for}"
        return f"task process died (exit code {code})"


# -- the child -------------------------------------------------------------------------------


def lower_priority() -> None:
    """Nice 10 and the idle I/O class where the platform has them."""
    proc = psutil.Process()
    with contextlib.suppress(psutil.Error, OSError):
        if sys.platform == "win32":
            proc.nice(psutil.BELOW_NORMAL_PRIORITY_CLASS)  # type: ignore[attr-defined]
        else:
            proc.nice(max(proc.nice(), NICE))
    if hasattr(proc, "ionice") and hasattr(psutil, "IOPRIO_CLASS_IDLE"):
        with contextlib.suppress(psutil.Error, OSError):
            proc.ionice(psutil.IOPRIO_CLASS_IDLE)


def ignore_interrupts() -> None:
    """A child of the daemon ignores Ctrl-C. A terminal sends SIGINT to its whole
    foreground process group, children too, and the daemon decides what happens to its
    tasks (finish, or give back); it ends its children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since its start (_interrupts_blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _interrupts_blocked() -> Iterator[None]:
    """SIGINT blocked while a child starts: the child inherits the mask, so a Ctrl-C
    during its interpreter's start-up (before `ignore_interrupts`) waits instead of
    killing it. The daemon gets its own copy of the signal when the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def host_main(conn: Connection, threads: int) -> None:
    """The child's loop: run what the parent sends, one task at a time."""
    ignore_interrupts()
    if threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[name] = str(threads)
    lower_priority()
    # What the kinds log goes to the daemon's output (inherited); libraries stay quiet.
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("idlegrid").setLevel(logging.INFO)
    child = _Child(conn)
    threading.Thread(target=child.read, name="pipe", daemon=True).start()
    while True:
        message = child.inbox.get()
        if message[0] == "run":
            child.run(*message[1:])


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.blobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.cancelled: set[int] = set()
        self.lock = threading.Lock()

    def read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the daemon is gone: so is its task process
            if message[0] == "cancel":
                self.cancelled.add(message[1])
            elif message[0] == "blob":
                self.blobs.put(message)
            else:
                self.inbox.put(message)

    def send(self, *message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def run(
        self, task_id: int, kind_name: str, raw: dict[str, object], payload: bytes,
        device: str, threads: int, slowdown: float, scratch: str, checkpoint_every_s: float,
    ) -> None:  # fmt: skip
        from idlegrid.kinds import RunContext, get_kind

        last = [0.0]

        def report(fraction: float) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or fraction >= 1.0:
                last[0] = now
                self.send("progress", task_id, float(fraction))

        ctx = RunContext(
            device=device,
            threads=threads,
            report_progress=report,
            is_cancelled=lambda: task_id in self.cancelled,
            slowdown=slowdown,
            fetch=lambda blob_hash: self.fetch(task_id, blob_hash),
            scratch=Path(scratch) if scratch else None,
            checkpoint_every_s=checkpoint_every_s,
        )
        try:
            kind = get_kind(kind_name)
            output = kind.run(payload, kind.parse_params(raw), ctx)
        except Cancelled:
            self.send("cancelled", task_id)
        except Exception as exc:
            self.send("failed", task_id, f"{type(exc).__name__}: {exc}"[:2000])
        else:
            self.send("done", task_id, output)
        finally:
            self.cancelled.discard(task_id)

    def fetch(self, task_id: int, blob_hash: str) -> bytes:
        self.send("fetch", task_id, blob_hash)
        while True:
            try:
                _, for_task, got_hash, blob = self.blobs.get(timeout=0.5)
            except queue.Empty:
                if task_id in self.cancelled:
                    raise Cancelled() from None
                continue
            if for_task == task_id and got_hash == blob_hash:
                if blob is None:
                    raise OSError(f"the worker could not fetch blob {blob_hash}")
                return bytes(blob)
