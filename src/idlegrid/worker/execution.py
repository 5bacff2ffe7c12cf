"""Tasks of the worker daemon: start, run in a task process, report, deliver.

A task's input is fetched before it takes a slot (the prefetch buffer downloads while
the slot's task computes); its result waits in the outbox until the coordinator
acknowledges it, so a disconnect or a restart loses nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import TYPE_CHECKING

from idlegrid import protocol
from idlegrid.kinds import Cancelled, UnknownKind, get_kind
from idlegrid.settings import WorkerSettings
from idlegrid.worker.governor import Governor
from idlegrid.worker.held import RunningTask
from idlegrid.worker.outbox import Outbox
from idlegrid.worker.runner import TaskFailed, TaskHost, TaskSpec
from idlegrid.worker.scratch import ScratchDirs
from idlegrid.worker.slots import Slots

log = logging.getLogger(__name__)

# How long a finished task waits for others finishing with it, to report them together.
REPORT_LINGER_S = 0.002
# A result the coordinator could not store for now goes again after this.
REDELIVER_S = 2.0
# How often idle task processes are looked at (settings.task_process_idle_s ends them).
IDLE_CHECK_S = 5.0


class Execution:
    """Mixed into Worker; the attributes below are the Worker's."""

    settings: WorkerSettings
    kinds: list[str]
    running: dict[int, RunningTask]
    outbox: Outbox
    scratch: ScratchDirs
    governor: Governor
    device: str
    completed: int
    _threads: int
    slots: Slots
    hosts: list[TaskHost]
    _task_runs: set[asyncio.Task[None]]
    _unreported: list[int]
    _reporting: bool

    if TYPE_CHECKING:  # the Worker's and its other mixins' (not defined here: the MRO)

        async def _fetch(self, blob_hash: str) -> bytes: ...
        async def _upload(self, digest: str, output: bytes) -> None: ...
        async def _send(self, message: protocol.BaseModel) -> bool: ...
        async def _send_ready(self) -> None: ...

    async def _release_idle_hosts(self) -> None:
        """End task processes idle for `task_process_idle_s`, until cancelled: what their
        kinds keep (an embedding model: about 1 GB) goes back to the machine. A host is
        taken out of the free queue while its process ends, so no task starts in it."""
        idle_s = self.settings.task_process_idle_s
        if idle_s <= 0:
            return
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, idle_s))
            now = time.monotonic()
            for host in self.slots.free():
                if host.idle_for(now) < idle_s or not self.slots.hold(host):
                    continue
                try:
                    log.info("task process %s idle for %.0f s: ended", host.name, idle_s)
                    await asyncio.to_thread(host.end, "idle: its memory given back")
                finally:
                    self.slots.put(host)

    async def _start(self, assign: protocol.Assign) -> None:
        if assign.task_id in self.running or assign.task_id in self.outbox:
            return
        if assign.kind not in self.kinds:
            self.outbox[assign.task_id] = protocol.Failure(
                task_id=assign.task_id, reason=f"this node does not run {assign.kind}"
            )
            await self._deliver(assign.task_id)
            return
        self.running[assign.task_id] = RunningTask(assign)
        run = asyncio.create_task(self._execute(assign.task_id), name=f"task-{assign.task_id}")
        # Owned: kept in _task_runs until done, cancelled and awaited in _shutdown.
        self._task_runs.add(run)
        run.add_done_callback(self._task_runs.discard)

    def _redeliver_later(self, task_id: int) -> None:
        async def again() -> None:
            await asyncio.sleep(REDELIVER_S)
            await self._deliver(task_id)

        retry = asyncio.create_task(again(), name=f"redeliver-{task_id}")
        self._task_runs.add(retry)  # owned like a task run: cancelled and awaited on shutdown
        retry.add_done_callback(self._task_runs.discard)

    def _drop(self, task_id: int, reason: str) -> None:
        task = self.running.pop(task_id, None)
        if task is not None:
            log.info("task %s cancelled: %s", task_id, reason)
            task.cancel.set()
            if task.host is not None:
                task.host.cancel()
        self.outbox.pop(task_id, None)

    async def _execute(self, task_id: int) -> None:
        task = self.running[task_id]
        assign = task.assign
        try:
            output = await self._run_in_slot(task)
            if output is None:
                return
            digest = hashlib.sha256(output).hexdigest()
            await self._upload(digest, output)
            self.outbox[task_id] = protocol.Result(
                task_id=task_id,
                output=digest,
                output_size=len(output),
                elapsed_s=time.monotonic() - task.started,
            )
            self.completed += 1
            log.info("%s done in %.1f s", _task_name(assign), time.monotonic() - task.started)
        except Cancelled:
            return
        except asyncio.CancelledError:
            raise
        except TaskFailed as exc:
            log.warning("task %s (%s) failed: %s", task_id, assign.kind, exc)
            self.outbox[task_id] = protocol.Failure(task_id=task_id, reason=str(exc)[:2000])
        except Exception as exc:
            log.info("%s failed after %.1f s: %s", _task_name(assign),
                     time.monotonic() - task.started, _reason(exc))  # fmt: skip
            log.debug("task %s failed", task_id, exc_info=True)
            self.outbox[task_id] = protocol.Failure(task_id=task_id, reason=_reason(exc))
        finally:
            self.running.pop(task_id, None)
            if not self.running:
                self.governor.finished()
        await self._report(task_id)

    async def _run_in_slot(self, task: RunningTask) -> bytes | None:
        """The task's output, or None when it was cancelled before or while it ran.

        The input comes before a slot: a task held in the prefetch buffer downloads while
        the slot's task computes, and starts the moment the slot frees. A paused machine
        downloads nothing and starts nothing."""
        if task.assign.gpu and not any(host.device.gpu for host in self.hosts):
            raise TaskFailed("it needs a GPU, and this node runs on no GPU (--device)")
        await self.governor.may_run.wait()
        if task.cancel.is_set():
            return None
        data = await self._fetch(task.assign.input.hash)
        if task.assign.check is not None:  # a check task: the output it checks, too
            task.check = await self._fetch(task.assign.check.hash)
        # A slot on a device that may run now: a GPU if the task needs one (worker/slots.py).
        host = await self.slots.take(
            needs_gpu=task.assign.gpu,
            wants_gpu=uses_gpu(task.assign.kind),
            may_run=self.governor.may_take,
        )
        try:
            if task.cancel.is_set():
                return None  # cancelled while it waited in the buffer
            task.host, task.started = host, time.monotonic()
            task.started_at = task.started
            output = await self._compute(task, data)
        finally:
            task.host = None
            self.slots.put(host)
        return None if task.cancel.is_set() else output

    async def _report(self, task_id: int) -> None:
        """Deliver a finished task, with any that finish at nearly the same moment.

        One reporter at a time: tasks that finish while it lingers or sends join its next
        message, and it asks for more work only when all of them are on their way (the
        coordinator reads a `ready` after the results before it, so it sees what is free).
        """
        self._unreported.append(task_id)
        if self._reporting:
            return  # the reporter delivers this one too
        self._reporting = True
        try:
            if self.running:
                await asyncio.sleep(REPORT_LINGER_S)
            while self._unreported:
                finished, self._unreported = self._unreported, []
                await self._deliver_many(finished)
        finally:
            self._reporting = False  # even if cancelled: the next one delivers them all
        await self._send_ready()

    async def _compute(self, task: RunningTask, data: bytes) -> bytes:
        assign = task.assign
        assert task.host is not None
        scratch = self.scratch.for_task(assign.kind, dict(assign.params), assign.input.hash)
        spec = TaskSpec(
            task_id=assign.task_id,
            kind=assign.kind,
            params=dict(assign.params),
            payload=data,
            device=task.host.device.runtime_device(),
            threads=self.settings.threads or self._threads,
            slowdown=self.settings.slowdown,
            scratch=str(scratch),
            checkpoint_every_s=self.settings.checkpoint_every_s,
            check=task.check,
            p2p_reachability=self.settings.p2p_reachability,
            sequences=self.settings.sequences,
        )
        progress = lambda fraction: setattr(task, "progress", fraction)  # noqa: E731
        try:
            output = await task.host.run(spec, fetch=self._fetch, progress=progress)
        except TaskFailed:
            self.scratch.remove(scratch)
            raise
        # Kept when cancelled or given back: the same work may come back to this node.
        self.scratch.remove(scratch)
        return output

    async def _deliver_many(self, task_ids: list[int]) -> None:
        """Results in `results` frames (one commit each at the coordinator), failures alone."""
        results = []
        for task_id in task_ids:
            message = self.outbox.get(task_id)
            if isinstance(message, protocol.Result):
                results.append(message)
            else:
                await self._deliver(task_id)
        for start in range(0, len(results), protocol.MAX_BATCH):
            chunk = results[start : start + protocol.MAX_BATCH]
            if len(chunk) == 1:
                await self._send(chunk[0])
            else:
                await self._send(protocol.Results(results=chunk))

    async def _deliver(self, task_id: int) -> None:
        message = self.outbox.get(task_id)
        if message is None:
            return
        if isinstance(message, protocol.Failure):
            if await self._send(message):
                self.outbox.pop(task_id, None)  # failures need no acknowledgement
            return
        await self._send(message)  # kept in the outbox until result_ack


def uses_gpu(kind: str) -> bool:
    """Whether a kind computes faster on a GPU (it takes a GPU slot before a CPU one)."""
    try:
        return get_kind(kind).uses_gpu
    except UnknownKind:
        return False


def _task_name(assign: protocol.Assign) -> str:
    return f"task {assign.task_id} ({assign.kind}, job {assign.job_id} shard {assign.shard_index})"


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]
