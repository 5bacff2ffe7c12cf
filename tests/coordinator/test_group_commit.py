"""Results of several nodes stored together: the grid's group commit and its fallbacks.

A grid in one process (real store, memory broker, blobs) with nodes whose sent messages
are captured, as in test_training_driver.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import FakeNode, fake_node

from idlegrid import protocol
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.result_path import ResultsClosed
from idlegrid.kinds.noop import OUTPUT

T0 = 1_000_000.0


@dataclass
class Node(FakeNode):
    def results_for(self, grid: Grid) -> list[protocol.Result]:
        """A result for every task it was assigned (the noop kind's one output)."""
        output = grid.blobs.put(OUTPUT)
        return [
            protocol.Result(
                task_id=m["task_id"], output=output, output_size=len(OUTPUT), elapsed_s=0.01
            )  # fmt: skip
            for m in self.assigned()
        ]


@pytest.fixture
def grid(in_process_grid: Callable[..., Grid]) -> Grid:
    return in_process_grid(clock=lambda: T0, max_blob_bytes=1 << 30)


async def _node(grid: Grid, account_id: int, key: str, tasks: int) -> Node:
    node = await fake_node(
        grid.store, account_id, key, now=T0, kinds=["noop"], slots=tasks,
        address="10.0.0.1", node_type=Node,
    )  # fmt: skip
    grid.hub.add(node.session)
    node.session.requested = tasks
    return node


async def _two_nodes_with_work(grid: Grid) -> tuple[Node, Node, int]:
    account = await grid.store.accounts.create_account("alice", is_admin=False, now=T0)
    job = await grid.submit_job(
        account_id=account.id, kind_name="noop", inputs={}, params={"tasks": 6},
        replication=1, priority=0,
    )  # fmt: skip
    first = await _node(grid, account.id, "node-first", 3)
    second = await _node(grid, account.id, "node-second", 3)
    for node in (first, second):
        assert await grid.fill(node.session) == 3
    return first, second, job.id


@contextlib.asynccontextmanager
async def _counting_batches(grid: Grid, count: list[int]) -> AsyncIterator[None]:
    batch = grid.store.db.batch  # what `store.batch` and `store.run_batch` open

    def counting() -> contextlib.AbstractAsyncContextManager[None]:
        count[0] += 1
        return batch()

    grid.store.db.batch = counting  # type: ignore[method-assign]
    try:
        yield
    finally:
        grid.store.db.batch = batch  # type: ignore[method-assign]


async def test_results_of_two_nodes_arriving_together_share_one_commit(grid: Grid) -> None:
    first, second, job_id = await _two_nodes_with_work(grid)
    batches = [0]
    async with _counting_batches(grid, batches):
        receipts = await asyncio.gather(
            grid.accept_results(first.session, first.results_for(grid)),
            grid.accept_results(second.session, second.results_for(grid)),
        )
    assert [r.status for rs in receipts for r in rs] == ["accepted"] * 6
    # SQLite commits one at a time: one group for both; PostgreSQL: one each, side by side.
    assert batches[0] == (1 if grid.store.serial_commits else 2)
    job = await grid.store.jobs.get_job(job_id)
    assert job is not None and job.state.value == "completed"
    assert not first.session.live and not second.session.live


def _break_batches_of(grid: Grid, node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storing `node`'s results raises (and fails the transaction it runs in)."""
    accept = grid.store.results.accept_results

    async def failing_for_node(node_id: int, results: Any, *, now: float) -> Any:
        if node_id == node.session.node_id:
            raise RuntimeError("this node's batch breaks the transaction")
        return await accept(node_id, results, now=now)

    monkeypatch.setattr(grid.store.results, "accept_results", failing_for_node)


def _slow_commits(grid: Grid, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch's commit takes a while (an fsync on a busy disk): a receipt given out
    before the commit would reach the node while its results could still be lost."""
    batch = grid.store.db.batch  # what `store.batch` and `store.run_batch` open

    @contextlib.asynccontextmanager
    async def slow() -> AsyncIterator[None]:
        async with batch():
            yield
            await asyncio.sleep(0.05)  # the slow commit is the point: a sleep stands for it

    monkeypatch.setattr(grid.store.db, "batch", slow)


async def test_one_nodes_failing_batch_does_not_fail_the_others_in_its_group(
    grid: Grid, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, job_id = await _two_nodes_with_work(grid)
    _break_batches_of(grid, first, monkeypatch)
    _slow_commits(grid, monkeypatch)
    outcome = await asyncio.gather(
        grid.accept_results(first.session, first.results_for(grid)),
        grid.accept_results(second.session, second.results_for(grid)),
        return_exceptions=True,
    )
    assert isinstance(outcome[0], RuntimeError)
    assert not isinstance(outcome[1], BaseException)
    assert [r.status for r in outcome[1]] == ["accepted"] * 3
    shards = await grid.store.jobs.list_shards(job_id)
    assert sorted(s.state.value for s in shards) == ["done"] * 3 + ["open"] * 3


async def test_a_retried_group_counts_each_result_once(
    grid: Grid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node that went first in a group that then failed is stored again on its own:
    its results, returned tasks and verdicts are counted once, after the commit."""
    first, second, _ = await _two_nodes_with_work(grid)
    _break_batches_of(grid, first, monkeypatch)
    _slow_commits(grid, monkeypatch)
    outcome = await asyncio.gather(
        grid.accept_results(second.session, second.results_for(grid)),
        grid.accept_results(first.session, first.results_for(grid)),
        return_exceptions=True,
    )
    assert isinstance(outcome[1], RuntimeError)
    assert [r.status for r in outcome[0]] == ["accepted"] * 3  # type: ignore[union-attr]
    assert grid.counters.results["accepted"] == 3
    assert grid.counters.verified["valid"] == 3
    assert second.session.tasks_returned == 3 and not second.session.live
    assert first.session.tasks_returned == 0 and len(first.session.live) == 3


async def test_closing_the_grid_stores_the_results_it_took_and_refuses_later_ones(
    grid: Grid,
) -> None:
    first, second, job_id = await _two_nodes_with_work(grid)
    storing = [
        asyncio.create_task(grid.accept_results(node.session, node.results_for(grid)))
        for node in (first, second)
    ]
    # One turn of the loop, no more: both taken (queued for the group commit, or storing)
    # and not stored yet; any longer wait could let them finish before aclose.
    await asyncio.sleep(0)
    await grid.aclose()
    assert all(task.done() for task in storing)  # aclose waited for them
    receipts = [task.result() for task in storing]
    assert [r.status for rs in receipts for r in rs] == ["accepted"] * 6
    job = await grid.store.jobs.get_job(job_id)
    assert job is not None and job.state.value == "completed"
    with pytest.raises(ResultsClosed, match="stopping"):
        await grid.accept_results(first.session, first.results_for(grid))
    await grid.aclose()  # closing twice is harmless
