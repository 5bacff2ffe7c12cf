"""Waiting for a job to change: what `GET /v1/jobs/{id}?wait_s=N` sleeps on.

A job changes here when a commit of this process stores results of its tasks, and when
it ends (completed, failed, cancelled) in this process or, told through the broker, in
another one. A waiter re-reads the job from the store when woken; it also re-reads it
every `RECHECK_S` on its own, for changes no message tells this process of (results
stored by another coordinator process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECHECK_S = 1.0


class JobWatch:
    """Per-job wake-ups for long polls (one process; futures, no polling)."""

    def __init__(self) -> None:
        self._waiters: dict[int, set[asyncio.Future[None]]] = {}

    def changed(self, job_ids: Iterable[int]) -> None:
        """Wake whoever waits on these jobs."""
        for job_id in set(job_ids):
            for waiter in self._waiters.pop(job_id, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self, job_id: int, seconds: float) -> bool:
        """Until the job changes (True) or `seconds` pass (False)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, set()).add(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, seconds))
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiters[job_id]

    def waiting(self) -> int:
        """Long polls waiting now (all jobs)."""
        return sum(len(w) for w in self._waiters.values())
