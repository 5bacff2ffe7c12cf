"""Background passes of the coordinator, each a small idempotent function of "now".

Each pass looks at what is due in the store and broker and fixes it; calling one twice
does nothing the second time. Tests call them one at a time; `Monitor.run` loops them.
With several coordinator processes, the passes over the whole grid run in the one that
holds the monitor lease (`leader.Leadership`); each process looks after its own
connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.heap import HeapKeeper

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 30.0
STALEMATE_INTERVAL_S = 5.0
SYNC_LIMIT = 10_000
RESUBSCRIBE_S = 1.0


async def expire_leases(grid: Grid) -> int:
    """Overdue tasks lose their lease; their shards get new tasks."""
    return await grid.expire_overdue()


async def mark_silent_nodes_offline(grid: Grid, *, leader: bool = True) -> int:
    """Nodes not heard from within the timeout go offline and lose their leases.

    Every process closes its own connections to them; the `leader` also records it.
    """
    return await grid.mark_silent_nodes_offline(leader=leader)


async def record_presence(grid: Grid) -> None:
    """Persist last-seen times (and uptime) of the nodes heard from."""
    await grid.record_presence()


async def finish_pending(grid: Grid) -> None:
    """Verify results and assemble jobs that a crash left between two steps, then judge
    late results. Each shard and job is a step of its own: one that raises is logged and
    tried again next pass, and never holds back the others, nor the late judging."""
    await grid.finish_pending()


async def settle_stalled(grid: Grid) -> None:
    """Shards no node can add a result to: decided on their evidence, or failed
    (`coordinator/stalemate.py`). It reads the open shards that have results and a ready
    replica nobody holds, so it runs every STALEMATE_INTERVAL_S, not every pass."""
    await grid.settle_stalled()


async def top_up(grid: Grid) -> None:
    """Give shards short of tasks new ones (a safety net: the grid tops a shard up where
    it falls short, on a failure, an expiry or an undecided verdict). It reads every open
    shard under the write lock, so it runs every SYNC_INTERVAL_S, not every pass."""
    await grid.replenish()


async def check_broker(grid: Grid) -> bool:
    """Rebuild the broker's contents from the store if it lost them (Redis restarted)."""
    return await grid.check_broker()


async def sync_queue(grid: Grid) -> None:
    """Put the oldest ready tasks of the store into the queue again (idempotent).

    A safety net for pushes lost while the broker was unreachable; a task claimed
    meanwhile is harmless there (the next claim finds it gone and discards it).
    """
    await grid.sync_queue(limit=SYNC_LIMIT)


def offer_work(grid: Grid) -> None:
    """Wake the dispatcher if a node here waits for work (a lost "work" message)."""
    grid.offer_work()


async def close_due_rounds(grid: Grid) -> int:
    """Training rounds whose timer ran out close with the updates that arrived."""
    return await grid.close_due_rounds()


async def run_once(grid: Grid, *, expire: bool = True) -> None:
    """One pass of the leader (or of the only process): the whole grid.

    `expire` False (a restart's grace, `Monitor`): no task expires, and no node goes
    offline, while the workers reconnect; this process still closes its own connections
    to silent nodes.
    """
    await check_broker(grid)
    if expire:
        await expire_leases(grid)
        await mark_silent_nodes_offline(grid)
    else:
        await mark_silent_nodes_offline(grid, leader=False)
    await finish_pending(grid)
    await close_due_rounds(grid)
    offer_work(grid)


async def run_local(grid: Grid) -> None:
    """One pass of a process that does not lead: its own connections only."""
    await mark_silent_nodes_offline(grid, leader=False)
    offer_work(grid)


class Monitor:
    """Owns the coordinator's background loops; started and stopped by the app lifespan."""

    def __init__(self, grid: Grid, *, tune_gc: bool = False) -> None:
        self.grid = grid
        self.tune_gc = tune_gc
        self.leadership = grid.leadership()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        # Until then (grid.clock) this process expires nothing: see `_startup`.
        self.grace_until = 0.0

    async def start(self) -> None:
        await self.leadership.renew()
        await self._startup()
        interval = self.grid.settings.monitor_interval_s
        self._tasks = [
            asyncio.create_task(self._lead(), name="leader"),
            asyncio.create_task(self._loop(self._pass, interval), name="monitor"),
            asyncio.create_task(self._loop(record_presence, 10.0, lead=True), name="presence"),
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
            asyncio.create_task(self._loop(sync_queue, SYNC_INTERVAL_S, lead=True), name="sync"),
            # Its first pass runs at start: shards a crash left short get their tasks.
            asyncio.create_task(self._loop(top_up, SYNC_INTERVAL_S, lead=True), name="top-up"),
            asyncio.create_task(
                self._loop(settle_stalled, STALEMATE_INTERVAL_S, lead=True), name="stalemates"
            ),
            asyncio.create_task(self._listen(), name="listen"),
        ]
        settings = self.grid.settings
        if self.tune_gc and settings.gc_freeze_s > 0:
            keeper = HeapKeeper(
                young_every_s=min(settings.gc_young_s, settings.gc_freeze_s),
                freeze_every_s=settings.gc_freeze_s,
                full_every_s=max(settings.gc_full_s, settings.gc_freeze_s),
            )
            self._tasks.append(asyncio.create_task(keeper.run(self._stopping), name="heap"))

    async def _startup(self) -> None:
        """Rebuild in-memory state from the store after a (re)start."""
        now = await self.grid.recover()
        # The workers of a coordinator that was down retry with a backoff: tasks expired
        # before they are back would run twice, and their nodes be charged errors. So
        # nothing expires until the longest backoff and a node timeout have passed; a worker
        # back by then reclaims what it holds (`Leases.reconcile`), and the nodes
        # not heard from by then go offline at the first pass after it.
        self.grace_until = now + self.grid.settings.restart_grace_s
        if self.leadership.is_leader:
            await finish_pending(self.grid)

    async def stop(self) -> None:
        self._stopping.set()
        self.grid.work_available.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.leadership.release()

    async def _pass(self, grid: Grid) -> None:
        if self.leadership.is_leader:
            await run_once(grid, expire=grid.clock() >= self.grace_until)
        else:
            await run_local(grid)

    async def _lead(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.leadership.renew_every_s)
            if not self._stopping.is_set():
                await self.leadership.renew()

    async def _loop(self, step, interval: float, *, lead: bool = False) -> None:  # type: ignore[no-untyped-def]
        """Run `step` every `interval` seconds (`lead`: only while this process leads)."""
        while not self._stopping.is_set():
            if self.leadership.is_leader or not lead:
                try:
                    await step(self.grid)
                except Exception:
                    log.exception("monitor pass %s failed", getattr(step, "__name__", step))
            await self._wait(interval, lead=lead)

    async def _wait(self, interval: float, *, lead: bool) -> None:
        """Sleep `interval`; a leader's loop wakes early when this process starts to lead,
        so a new leader runs the passes its predecessor left at once."""
        leading = self.leadership.is_leader
        deadline = asyncio.get_running_loop().time() + interval
        while not self._stopping.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or (lead and not leading and self.leadership.is_leader):
                return
            nap = min(left, self.leadership.renew_every_s) if lead else left
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), nap)

    async def _listen(self) -> None:
        """Handle what the other coordinator processes publish, until stopped."""
        while not self._stopping.is_set():
            try:
                async with self.grid.peer_messages() as messages:
                    async for message in messages:
                        try:
                            await self.grid.on_peer_message(message)
                        except Exception:
                            log.exception("handling broker message %s failed", message)
            except Exception:
                log.exception("broker subscription failed; subscribing again")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), RESUBSCRIBE_S)

    async def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            await self.grid.work_available.wait()
            self.grid.work_available.clear()
            try:
                await self.grid.fill_waiting()
            except Exception:
                log.exception("dispatch pass failed")
