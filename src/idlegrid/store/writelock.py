"""SQLite's one writer, shared fairly between waiting nodes and background commits.

On SQLite every write transaction of a coordinator waits for one lock. Two kinds wait on
it: claims (a node that asked for work sits idle until its claim commits) and background
commits (results, verdicts, replenishment: nobody waits on them but their own tasks).
Measured with `benchmarks/dispatch.py`, a claim waited 19 ms at the median and 87 ms at
the 90th percentile behind result commits while both the event loop and the database
thread were mostly idle: the grid's rate was set by how long nodes waited for work.

`WriteLock` hands the lock to urgent waiters (claims: `urgent()`) before the others, in
arrival order within each class, and after `max_streak` urgent hand-offs in a row with
others waiting it gives one to the longest-waiting other, so a stream of claims cannot
hold results back indefinitely. Ownership passes directly from releaser to waiter (the
lock never appears free while someone waits), so a newcomer cannot barge in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from types import TracebackType

_URGENT: ContextVar[bool] = ContextVar("idlegrid_store_urgent", default=False)


@contextlib.contextmanager
def urgent() -> Iterator[None]:
    """Write transactions started inside (in this task) go ahead of background commits."""
    token = _URGENT.set(True)
    try:
        yield
    finally:
        _URGENT.reset(token)


class WriteLock:
    """An asyncio lock with two classes of waiters: urgent ones go first."""

    def __init__(self, *, max_streak: int = 4) -> None:
        if max_streak < 1:
            raise ValueError("max_streak must be at least 1")
        self.max_streak = max_streak
        self._held = False
        self._streak = 0  # urgent hand-offs in a row while others waited
        self._urgent: collections.deque[asyncio.Future[None]] = collections.deque()
        self._others: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self._held

    @property
    def waiting(self) -> tuple[int, int]:
        """(urgent, other) waiters."""
        return len(self._urgent), len(self._others)

    async def acquire(self, *, is_urgent: bool | None = None) -> None:
        if is_urgent is None:
            is_urgent = _URGENT.get()
        if not self._held and not self._urgent and not self._others:
            self._held = True
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._urgent if is_urgent else self._others
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the lock as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("release of an unheld WriteLock")
        waiter = self._next()
        if waiter is None:
            self._held = False
        else:
            waiter.set_result(None)  # ownership passes: the lock stays held

    def _next(self) -> asyncio.Future[None] | None:
        while self._urgent or self._others:
            take_urgent = bool(self._urgent) and not (
                self._others and self._streak >= self.max_streak
            )
            queue = self._urgent if take_urgent else self._others
            waiter = queue.popleft()
            if waiter.done():  # cancelled while waiting
                continue
            self._streak = self._streak + 1 if take_urgent and self._others else 0
            return waiter
        return None

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
