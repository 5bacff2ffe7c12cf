"""The SQLite write lock: urgent waiters (claims) first, others not starved."""

from __future__ import annotations

import asyncio

import pytest
from helpers import eventually

from idlegrid.store.writelock import WriteLock, urgent


async def _order(lock: WriteLock, waiters: list[tuple[str, bool]]) -> list[str]:
    """Hold the lock while the waiters queue in order, release; the order they got it."""
    got: list[str] = []

    async def wait(name: str, is_urgent: bool) -> None:
        await lock.acquire(is_urgent=is_urgent)
        got.append(name)
        await asyncio.sleep(0)  # held across a turn of the loop, as a real holder does
        lock.release()

    await lock.acquire()
    tasks = []
    for name, is_urgent in waiters:
        tasks.append(asyncio.create_task(wait(name, is_urgent)))
        await eventually(lambda: sum(lock.waiting) == len(tasks), "queued in this order")
    lock.release()
    await asyncio.gather(*tasks)
    assert not lock.locked()
    return got


@pytest.mark.parametrize(
    ("waiters", "expected"),
    [
        ([("r1", False), ("c1", True), ("r2", False), ("c2", True)], ["c1", "c2", "r1", "r2"]),
        ([("r1", False), ("r2", False)], ["r1", "r2"]),
        ([("c1", True), ("c2", True)], ["c1", "c2"]),
        # After max_streak (2 here) urgent hand-offs with others waiting, one other goes.
        (
            [("r1", False), ("c1", True), ("c2", True), ("c3", True), ("r2", False)],
            ["c1", "c2", "r1", "c3", "r2"],
        ),
    ],
)
async def test_urgent_waiters_go_first_without_starving_the_others(
    waiters: list[tuple[str, bool]], expected: list[str]
) -> None:
    assert await _order(WriteLock(max_streak=2), waiters) == expected


async def test_urgent_context_marks_acquires_made_inside() -> None:
    lock = WriteLock()
    got: list[str] = []

    async def claim() -> None:
        with urgent():
            async with lock:
                got.append("claim")

    async def commit() -> None:
        async with lock:
            got.append("commit")

    await lock.acquire()
    tasks = [asyncio.create_task(commit()), asyncio.create_task(claim())]
    await eventually(lambda: lock.waiting == (1, 1), "both to queue")
    lock.release()
    await asyncio.gather(*tasks)
    assert got == ["claim", "commit"]


async def test_a_cancelled_waiter_neither_holds_nor_loses_the_lock() -> None:
    lock = WriteLock()
    await lock.acquire()
    cancelled = asyncio.create_task(lock.acquire(is_urgent=True))
    after = asyncio.create_task(lock.acquire())
    await eventually(lambda: lock.waiting == (1, 1), "both to queue")
    cancelled.cancel()
    await eventually(cancelled.done, "the cancellation")
    lock.release()
    await after  # the lock went to the next waiter
    assert lock.locked()
    lock.release()
    assert not lock.locked() and lock.waiting == (0, 0)


async def test_handed_the_lock_while_being_cancelled_passes_it_on() -> None:
    lock = WriteLock()
    await lock.acquire()
    first = asyncio.create_task(lock.acquire())
    second = asyncio.create_task(lock.acquire())
    await eventually(lambda: lock.waiting == (0, 2), "both to queue")
    lock.release()  # ownership passes to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert lock.locked()
    lock.release()
    assert not lock.locked()


def test_release_of_an_unheld_lock_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        WriteLock().release()
