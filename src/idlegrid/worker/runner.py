"""Task processes: each slot's tasks run in a child process, never in the daemon.

Why a process: it can be suspended the moment the owner comes back (SIGSTOP on POSIX,
NtSuspendProcess on Windows, both through psutil) and resumed later without losing
its work; it runs at low priority (nice 10, idle I/O class); a kind that crashes or
leaks takes down its process, not the daemon, whose heartbeats go on. A child lives
across tasks, so what a kind keeps between tasks (a loaded model, a training run's
weights) survives; a dead child is started again for the next task.

The parent and child speak over a pipe, in tuples: ("run", task_id, kind, params,
payload, device, threads, slowdown, scratch, checkpoint_every_s, check, p2p_reachability,
sequences)
and ("cancel", task_id)
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

from idlegrid.kinds import Cancelled, UnknownKind, get_kind
from idlegrid.worker.devices import CPU_DEVICE, Device

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.2  # a child reports progress at most this often
STOP_GRACE_S = 3.0  # a child asked to end at shutdown is killed after this long
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
    # A check task's claimed output (kinds verified by checks); None: a normal task.
    check: bytes | None = None
    # WorkerSettings.p2p_reachability, for peer-to-peer training rounds.
    p2p_reachability: str = "auto"
    # WorkerSettings.sequences, for llm-generate.
    sequences: int = 1


class TaskHost:
    """One child process that runs one task at a time (the parent side), on one device
    for its life (worker/devices.py: the child sees that GPU only, or none)."""

    def __init__(self, *, name: str, threads: int = 0, device: Device = CPU_DEVICE) -> None:
        self.name = name
        self.threads = threads
        self.device = device
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self.suspended = False
        self.task_id: int | None = None
        self.killed_for: str | None = None
        self._affinity: list[int] | None = None
        # When the child finished its last task (time.monotonic()), and whether that
        # task's kind keeps state in it for a later one.
        self.idle_since: float | None = None
        self.holds_state = False

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
            target=host_main,
            args=(child, self.threads),
            name=self.name,
            daemon=True,
        )
        with _interrupts_blocked(), _environment(self.device.environment()):
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
        self.end("the worker is stopping")

    def idle_for(self, now: float) -> float:
        """Seconds since the child finished its last task (0 without a child, while it
        runs one, or when the last one's kind keeps state in it for the next)."""
        if self.task_id is not None or self.idle_since is None or self.holds_state:
            return 0.0
        return now - self.idle_since if self.alive() else 0.0

    def end(self, reason: str, grace_s: float = STOP_GRACE_S) -> None:
        """End the child: asked first (SIGTERM, resumed if suspended), so it exits through
        its finalizers (what it registered with multiprocessing's resource tracker is
        released, and the tracker has nothing to warn about), then killed if it has not
        within `grace_s`. The next task starts a new one."""
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(psutil.Error, OSError):
                process = psutil.Process(self._process.pid)
                process.terminate()
                if self.suspended:
                    process.resume()
            self._process.join(grace_s)
        self.kill(reason)
        self.idle_since = None

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
        self.holds_state = holds_state(spec.kind)
        try:
            await asyncio.to_thread(
                self._send,
                ("run", spec.task_id, spec.kind, spec.params, spec.payload, spec.device,
                 spec.threads, spec.slowdown, spec.scratch, spec.checkpoint_every_s, spec.check,
                 spec.p2p_reachability, spec.sequences),
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
            self.idle_since = time.monotonic()

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


def helper_child(parent_pid: int) -> None:
    """Set up a helper child of the daemon (a process pool's worker): it ignores Ctrl-C
    and ends once the daemon is gone. A pool's worker waits on a queue whose writing end
    it holds itself, so it would never see a killed daemon's end on its own."""
    ignore_interrupts()
    threading.Thread(target=_end_with, args=(parent_pid,), name="parent", daemon=True).start()


def _end_with(parent_pid: int, every_s: float = 1.0) -> None:
    """End this process once its parent `parent_pid` is gone (it was killed, or it would
    have ended its children): its parent is then another process."""
    while os.getppid() == parent_pid:
        time.sleep(every_s)
    os._exit(1)


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


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in the environment while a child starts: it inherits them from its first
    instruction (which GPUs it sees: worker/devices.py), before any runtime in it reads
    them. The daemon's own environment is as it was afterwards; the daemon starts its
    task processes from its event loop, one at a time."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def holds_state(kind_name: str) -> bool:
    """Whether a task of this kind leaves state in its process for a later task."""
    try:
        return get_kind(kind_name).holds_state
    except UnknownKind:
        return False


def exit_on_terminate() -> None:
    """SIGTERM (the daemon's stop, or `systemctl stop` to the whole group) ends the child
    as an exception would: multiprocessing's finalizers run and unregister what it made
    (semaphores), where the default action would leave them for the resource tracker to
    warn about at shutdown."""

    def leave(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one (the group's
        raise SystemExit(0)  # and the daemon's) must not break into the finalizers

    signal.signal(signal.SIGTERM, leave)


def _thread_only_progress_lock() -> None:
    """tqdm (the progress bars of sentence-transformers and transformers) makes a
    multiprocessing lock, a named semaphore, on its first bar; a task process needs no
    lock between processes, so it gets a thread lock instead."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def host_main(conn: Connection, threads: int) -> None:
    """The child's loop: run what the parent sends, one task at a time."""
    ignore_interrupts()
    exit_on_terminate()
    _thread_only_progress_lock()
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
                # The daemon is gone: so is its task process, through its finalizers.
                os.kill(os.getpid(), signal.SIGTERM)
                return
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
        check: bytes | None = None, p2p_reachability: str = "auto", sequences: int = 1,
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
            check=check,
            p2p_reachability=p2p_reachability,
            sequences=sequences,
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
