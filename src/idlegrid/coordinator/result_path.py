"""The result path: a node's results checked, recorded once, and their shards verified.

Where the store's commits are one at a time (SQLite: each waits for an fsync), results of
all nodes that arrive while one commit is written go into the next one together (a
group commit): the commit rate, not the result rate, then bounds the grid. The task that
writes those commits is owned by `ResultPath`: `aclose` drains it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from idlegrid import protocol
from idlegrid.blobs.files import BlobError
from idlegrid.coordinator.context import Context
from idlegrid.coordinator.hub import NodeSession
from idlegrid.coordinator.leases import Leases
from idlegrid.coordinator.plans import Plans
from idlegrid.coordinator.verifier import Verifier, compute
from idlegrid.kinds import WrongOutput
from idlegrid.store.base import NewResult, ResultReceipt, TaskInput

log = logging.getLogger(__name__)


class ResultsClosed(RuntimeError):
    """A result came after the result path was closed (the coordinator is stopping)."""


class ResultPath:
    def __init__(
        self, ctx: Context, *, plans: Plans, verification: Verifier, leases: Leases
    ) -> None:
        self._ctx = ctx
        self._plans = plans
        self._verification = verification
        self._leases = leases
        # Group commit (see accept_results): what waits for the next commit, and the
        # task that writes the commits while there is any.
        self._queue: list[_PendingResults] = []
        self._committer: asyncio.Task[None] | None = None
        # Calls being stored now (on either path), for aclose to wait for.
        self._taking = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    async def accept_result(self, session: NodeSession, msg: protocol.Result) -> ResultReceipt:
        """Take a node's result: check it, record it once, verify its shard."""
        async with self._taken():
            return (await self._take_results(session, [msg]))[0]

    async def accept_results(
        self, session: NodeSession, msgs: Sequence[protocol.Result]
    ) -> list[ResultReceipt]:
        """Take several results of a node in one transaction (all or nothing).

        The receipts are for after the commit: acknowledge none of them before this returns.
        Where commits are one at a time, results of all nodes that arrive while one commit
        is written go into the next one together.
        """
        async with self._taken():
            store = self._ctx.store
            if not store.serial_commits:
                return await store.run_batch(functools.partial(self._take_results, session, msgs))
            pending = _PendingResults(session, msgs, asyncio.get_running_loop().create_future())
            self._queue.append(pending)
            if self._committer is None or self._committer.done():
                self._committer = asyncio.create_task(self._commit_results(), name="results")
            return await pending.receipts

    @contextlib.asynccontextmanager
    async def _taken(self) -> AsyncIterator[None]:
        """One call storing results: refused once closed, waited for by aclose."""
        if self._closed:
            raise ResultsClosed("the coordinator is stopping; send the results again later")
        self._taking += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._taking -= 1
            if not self._taking:
                self._idle.set()

    async def aclose(self) -> None:
        """Stop taking results; wait until those taken are stored (or failed).

        The results of a caller that gave up waiting (its node went away) are still
        committed: the committer is awaited too.
        """
        self._closed = True
        await self._idle.wait()
        committer, self._committer = self._committer, None
        if committer is not None:
            await asyncio.gather(committer, return_exceptions=True)

    async def _commit_results(self) -> None:
        while self._queue:
            group, self._queue = self._queue, []
            try:
                await self._commit_group(group)
            except asyncio.CancelledError:
                # Cancelled mid-commit: whoever waits for a receipt must not wait forever
                # (the node sends its unacknowledged results again).
                stopped = ResultsClosed("the coordinator stopped before storing this result")
                for pending in (*group, *self._queue):
                    pending.fail(stopped)
                self._queue = []
                raise

    async def _commit_group(self, group: Sequence[_PendingResults]) -> None:
        store = self._ctx.store
        try:
            async with store.batch():
                receipts = [await self._take_results(p.session, p.msgs) for p in group]
        except Exception as exc:
            if len(group) == 1:
                group[0].fail(exc)
                return
            # One node's batch must not fail the others': each on its own again.
            for pending in group:
                try:
                    async with store.batch():
                        own = await self._take_results(pending.session, pending.msgs)
                except Exception as exc:
                    pending.fail(exc)
                    continue
                pending.done(own)  # after its commit, not before: see accept_results
            return
        for pending, receipt in zip(group, receipts, strict=True):
            pending.done(receipt)

    async def _take_results(
        self, session: NodeSession, msgs: Sequence[protocol.Result]
    ) -> list[ResultReceipt]:
        """Check, record and verify results in a few statements however many there are:
        one read of their inputs, one write of the results, one verification pass over
        the shards they complete."""
        store = self._ctx.store
        inputs = await store.results.task_inputs([m.task_id for m in msgs], session.node_id)
        taking = await self._check_all(session, msgs, inputs)
        good = taking.good
        stored = await store.results.accept_results(
            session.node_id,
            [
                NewResult(msgs[i].task_id, msgs[i].output, msgs[i].output_size, msgs[i].elapsed_s)
                for i in good
            ],
            now=self._ctx.clock(),
        )
        to_verify: list[int] = []
        late: list[int] = []
        for index, receipt in zip(good, stored, strict=True):
            taking.receipts[index] = receipt
            task_id = msgs[index].task_id
            if receipt.status != "rejected":
                taking.finished.append(task_id)
            if receipt.status != "rejected" and task_id in taking.lies:
                # Before the verifier sees its shard: the lie never votes.
                await self._verification.reject(task_id, taking.lies[task_id])
                taking.failed = True  # its shard needs another replica
            if receipt.status == "accepted" and receipt.shard_id is not None:
                to_verify.append(receipt.shard_id)
            elif receipt.status == "late" and not receipt.reason:
                late.append(task_id)  # stored, after its shard was decided
        await self._verify(to_verify, late, replenish=taking.failed)
        ordered = [taking.receipts[index] for index in range(len(msgs))]
        jobs = {inputs[t].job_id for t in taking.finished if t in inputs}
        await store.after_commit(self._settle(session, taking.finished, ordered, jobs))
        return ordered

    async def _check_all(
        self,
        session: NodeSession,
        msgs: Sequence[protocol.Result],
        inputs: Mapping[int, TaskInput],
    ) -> _Taking:
        """Check each result's output; a malformed one fails its task at once."""
        taking = _Taking()
        for index, msg in enumerate(msgs):
            try:
                problem = await self._check_output(msg, inputs.get(msg.task_id))
            except WrongOutput as exc:
                taking.lies[msg.task_id] = str(exc)
                problem = None  # stored like any result, then judged a lie
            if problem is None:
                taking.good.append(index)
                continue
            if await self._ctx.store.results.record_failure(
                msg.task_id,
                session.node_id,
                reason=f"invalid output: {problem}",
                now=self._ctx.clock(),
            ):
                taking.finished.append(msg.task_id)
                taking.failed = True
            taking.receipts[index] = ResultReceipt("rejected", problem)
        return taking

    async def _verify(self, to_verify: list[int], late: list[int], *, replenish: bool) -> None:
        """Verify the shards these results complete, judge the late ones."""
        if to_verify:
            await self._verification.verify_shards(to_verify)
        if late:
            # These results only: a node's batch touches no other node's trust rows, in
            # an order other batches could take the other way round (a deadlock).
            await self._verification.judge_late(task_ids=late)
        if replenish:
            await self._leases.replenish()

    def _settle(
        self,
        session: NodeSession,
        finished: Sequence[int],
        receipts: Sequence[ResultReceipt],
        jobs: set[int],
    ) -> Callable[[], Awaitable[None]]:
        """In-memory bookkeeping for after the commit: a group commit that fails is stored
        again, and must not count its results twice. Long polls of `jobs` wake."""
        counters = self._ctx.counters
        watch = self._ctx.job_watch

        async def settle() -> None:
            for task_id in finished:
                session.forget_task(task_id)
            for receipt in receipts:
                counters.results[receipt.status] += 1
                session.tasks_returned += receipt.status == "accepted"
            watch.changed(jobs)

        return settle

    async def _check_output(self, msg: protocol.Result, assignment: TaskInput | None) -> str | None:
        blobs = self._ctx.blobs
        try:
            size = blobs.size(msg.output)
        except (FileNotFoundError, BlobError):
            return f"output blob {msg.output} was not uploaded"
        if size != msg.output_size:
            return f"output blob has {size} bytes, not {msg.output_size}"
        if assignment is None:
            return None  # not this node's task: accept_results rejects it with the reason
        plan = await self._plans.get(assignment.job_id)
        if plan is None:
            return None
        payload, output = blobs.read(assignment.input_hash), blobs.read(msg.output)
        try:
            size = len(payload) + len(output)
            await compute(plan.kind.check_output, payload, output, plan.params, size=size)
        except WrongOutput:
            raise  # a lie, not a malformed result: see _take_results
        except ValueError as exc:
            return str(exc)
        return None

    async def record_failure(self, session: NodeSession, msg: protocol.Failure) -> bool:
        """A node could not run a task: the task fails and its shard gets another."""
        changed = await self._ctx.store.results.record_failure(
            msg.task_id, session.node_id, reason=msg.reason, now=self._ctx.clock()
        )
        session.forget_task(msg.task_id)
        if changed:
            log.info("task %s failed on node %s: %s", msg.task_id, session.node_id, msg.reason)
            await self._leases.replenish()
        return changed


@dataclass
class _Taking:
    """A batch of results being taken: what is known of each so far."""

    receipts: dict[int, ResultReceipt] = field(default_factory=dict)  # index in msgs ->
    good: list[int] = field(default_factory=list)  # indices of results to store
    lies: dict[int, str] = field(default_factory=dict)  # task id -> why it cannot be right
    finished: list[int] = field(default_factory=list)  # tasks the node no longer holds
    failed: bool = False  # a task failed: its shard needs another replica


@dataclass
class _PendingResults:
    """A node's results waiting for the next group commit, and where the receipts go."""

    session: NodeSession
    msgs: Sequence[protocol.Result]
    receipts: asyncio.Future[list[ResultReceipt]]

    def done(self, receipts: list[ResultReceipt]) -> None:
        if not self.receipts.done():  # its node may have gone meanwhile
            self.receipts.set_result(receipts)

    def fail(self, exc: BaseException) -> None:
        if not self.receipts.done():
            self.receipts.set_exception(exc)
