"""The coordinator's core: jobs in, tasks out, results verified, jobs assembled.

`Grid` wires the store (truth), the broker (ready queue, presence), the blob store and
the hub of connected nodes (one `Context`) around the pure policies (scheduler, verifier).
The REST API, the WebSocket handler and the monitor all call it; none of them touch SQL.
The parts it holds (matching, the round driver) get the context and the fan-out, not it.

Several coordinator processes may share one store and one broker; each has its own hub.
What concerns a node connected to another process (a cancel) or every process (new work
in the shared queue, a job that ended) goes out on the broker's `grid` channel (`publish`);
`peers` handles what the other processes sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from random import Random
from typing import Any, TypeVar

from idlegrid import protocol
from idlegrid.blobs import BlobError, BlobStore, is_blob_hash
from idlegrid.broker.base import Broker
from idlegrid.coordinator import peers
from idlegrid.coordinator.context import Context, Counters, PresencePause
from idlegrid.coordinator.fanout import GridFanOut
from idlegrid.coordinator.hub import Hub, NodeSession
from idlegrid.coordinator.leases import lease_for, lease_seconds
from idlegrid.coordinator.matching import Matcher, Shares, node_reliability
from idlegrid.coordinator.peers import unless_broker_away
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.kinds import KindParams, TaskKind, Verdict, get_kind
from idlegrid.policy import scheduler, sybil, verifier
from idlegrid.policy import trust as trust_policy
from idlegrid.policy.trust import TrustSettings
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import (
    Assignment,
    Claimer,
    ClaimMiss,
    DecisionOutcome,
    Distinct,
    JobRecord,
    NewJob,
    NewResult,
    NewShard,
    NodeTask,
    ReadyTask,
    RegistrationLimits,
    ResultReceipt,
    ShardDecision,
    ShardForVerify,
    Store,
    TaskInput,
)

log = logging.getLogger(__name__)

CANDIDATES_PER_CLAIM = 64
INLINE_BYTES = 64 * 1024  # see _compute
T = TypeVar("T")
# A node whose quota is used up, or that is suspended, asks the store again after this.
CLAIM_BACKOFF_S = 60.0
# With nothing queued, this many idle nodes (the fastest) are offered backup copies.
BACKUP_OFFERS_PER_PASS = 4


class JobInputError(ValueError):
    """A job request that cannot be accepted; the message is for the researcher."""


class Grid:
    def __init__(
        self,
        *,
        settings: CoordinatorSettings,
        store: Store,
        broker: Broker,
        blobs: BlobStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.context = Context(
            settings=settings,
            store=store,
            broker=broker,
            blobs=blobs,
            hub=Hub(),
            clock=clock,
            counters=Counters(),
            process_id=f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}",
            work_available=asyncio.Event(),
            random=Random(),
            presence_pause=PresencePause(),
        )
        ctx = self.context
        shares = Shares(store, settings.shares)
        self.plans = Plans(store, on_new_plan=shares.resolve)
        self.matcher = Matcher(ctx, plans=self.plans, shares=shares)
        self.fanout = GridFanOut(ctx, plans=self.plans, matcher=self.matcher)
        self.rounds = RoundDriver(  # training jobs: one round after another
            ctx, fanout=self.fanout, plans=self.plans, matcher=self.matcher
        )
        self.distinct = Distinct(
            accounts=settings.distinct_accounts, networks=settings.distinct_networks
        )
        # Group commit of results (see accept_results): what waits for the next commit.
        self._result_queue: list[_PendingResults] = []
        self._committer: asyncio.Task[None] | None = None
        self.registration_limits = RegistrationLimits(
            max_nodes_per_account=settings.max_nodes_per_account,
            per_account_per_hour=settings.node_registrations_per_account_per_hour,
            per_address_per_hour=settings.node_registrations_per_address_per_hour,
        )

    # -- the context, for callers of the facade ------------------------------------------

    @property
    def settings(self) -> CoordinatorSettings:
        return self.context.settings

    @property
    def store(self) -> Store:
        return self.context.store

    @property
    def broker(self) -> Broker:
        return self.context.broker

    @property
    def blobs(self) -> BlobStore:
        return self.context.blobs

    @property
    def hub(self) -> Hub:
        return self.context.hub

    @property
    def clock(self) -> Callable[[], float]:
        return self.context.clock

    @property
    def counters(self) -> Counters:
        return self.context.counters

    @property
    def process_id(self) -> str:
        return self.context.process_id

    @property
    def work_available(self) -> asyncio.Event:
        return self.context.work_available

    @property
    def random(self) -> Random:
        return self.context.random

    @property
    def trust(self) -> TrustSettings:
        return self.context.settings.trust

    # -- jobs ----------------------------------------------------------------------------

    async def submit_job(
        self,
        *,
        account_id: int,
        kind_name: str,
        inputs: Mapping[str, str],
        params: Mapping[str, Any],
        replication: int | None,
        priority: int,
        max_total_results: int | None = None,
    ) -> JobRecord:
        """Validate, split and store a job; its tasks enter the ready queue."""
        kind = get_kind(kind_name)
        parsed = kind.parse_params(params)
        missing = set(kind.input_names) - set(inputs)
        extra = set(inputs) - set(kind.input_names)
        if missing or extra:
            raise JobInputError(
                f"kind {kind.name!r} takes inputs {list(kind.input_names)}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for name, blob_hash in inputs.items():
            if not is_blob_hash(blob_hash) or not self.blobs.exists(blob_hash):
                raise JobInputError(f"input {name!r}: no blob {blob_hash}; upload it first")
        specs = await asyncio.to_thread(self._split, kind, parsed, inputs)
        shards = [
            NewShard(
                index=s.index,
                input_hash=h,
                input_size=len(s.payload),
                items=s.items,
                cost_flops=s.cost_flops,
            )
            for s, h in specs
        ]
        replication = replication or kind.default_replication or self.settings.default_replication
        if max_total_results is not None and max_total_results < replication:
            raise JobInputError(
                f"max_total_results ({max_total_results}) is below replication ({replication})"
            )
        record, ready = await self.store.create_job(
            NewJob(
                account_id=account_id,
                kind=kind.name,
                params=parsed.model_dump(mode="json"),
                inputs=dict(inputs),
                replication=replication,
                min_quorum=1 if replication == 1 else 2,
                max_attempts=max_total_results or max(self.settings.max_attempts, replication + 2),
                priority=priority,
                shards=shards,
            ),
            now=self.clock(),
        )
        await self.enqueue(ready)
        if self.rounds.drives(kind):
            await self.rounds.start(record)
        log.info(
            "job %s: %s, %d shards, %d items", record.id, kind.name, len(shards), record.items_total
        )
        return record

    def _split(
        self, kind: TaskKind, params: KindParams, inputs: Mapping[str, str]
    ) -> list[tuple[Any, str]]:
        data = {name: self.blobs.read(blob_hash) for name, blob_hash in inputs.items()}
        return [(spec, self.blobs.put(spec.payload)) for spec in kind.split(data, params)]

    async def plan(self, job_id: int) -> JobPlan | None:
        return await self.plans.get(job_id)

    async def waiting_for(self, job: JobRecord) -> list[str]:
        """What a live job waits for that the fleet cannot give, in words; [] if nothing:
        no registered node can run it, or too few connected ones to hold its replicas."""
        if job.state.value not in ("queued", "running"):
            return []
        nodes = await self.store.list_nodes()
        reasons = await self.matcher.waiting_for(job, nodes=nodes)
        if job.replication <= 1:
            return reasons
        connected = set(await self.broker.connections()) | {s.node_id for s in self.hub.sessions()}
        able = [
            (node.account_id, node.network)
            for node in nodes
            if node.id in connected and job.kind in node.kinds and node.suspended_at is None
        ]
        shortfall = sybil.replication_shortfall(
            job.replication,
            able,
            distinct_accounts=self.settings.distinct_accounts,
            distinct_networks=self.settings.distinct_networks,
        )
        return reasons + ([shortfall] if shortfall else [])

    async def cancel_job(self, job_id: int) -> None:
        held = await self.store.cancel_job(job_id, now=self.clock())
        # Its ready tasks stay in the broker until a claim finds them gone.
        await self.fanout.send_cancels(held, reason=f"job {job_id} was cancelled")
        await self.fanout.job_ended(job_id)

    # -- dispatch ------------------------------------------------------------------------

    async def fill(self, session: NodeSession) -> int:
        """Give a node as many tasks as it wants and can run; return how many it got."""
        async with session.fill_lock:
            wanted = session.wants
            claimed: list[Assignment] = []
            # The node's whole request in one transaction: one commit, not one per task.
            async with self.store.batch():
                while len(claimed) < wanted:
                    many = await self._claim_many(session, wanted - len(claimed))
                    if many:
                        claimed += many
                        continue
                    assignment = await self._claim_one(session)
                    if assignment is None and self.settings.backups:
                        assignment = await self.matcher.claim_backup(session)
                    if assignment is None:
                        break
                    claimed.append(assignment)
            for assignment in claimed:  # committed: the node must hear of each one
                session.live.add(assignment.task_id)
                session.shard_of[assignment.task_id] = assignment.shard_id
                session.requested -= 1
            for assignment in claimed:
                if not await session.send(_assign_message(assignment)):
                    break  # the lease runs out and the monitor requeues the task
        return len(claimed)

    async def _claim_many(self, session: NodeSession, wanted: int) -> list[Assignment]:
        """Claim up to `wanted` of the best tasks for the node at once, while they are of
        replication-1 jobs and of one kind.

        One statement for them all (the daily quota is per kind); tasks of replicated
        jobs, whose claims check the distinct-replica rules and may run alone, are left
        to `_claim_one`, as is everything ranked below the first of them.
        """
        if wanted < 1 or time.monotonic() < session.idle_until:
            return []
        now = self.clock()
        by_id, ranked = await self._ranked(session, now=now)
        if not ranked:
            return []
        kind = ranked[0].kind
        picked: list[int] = []
        for candidate in ranked:
            if self.plans.loaded(candidate.job_id).replication != 1 or candidate.kind != kind:
                break
            picked.append(candidate.task_id)
            if len(picked) == wanted:
                break
        if not picked:
            return []
        claimed = await self.store.claim_tasks(
            {t: now + self.lease_seconds(session, by_id[t]) for t in picked},
            self._claimer(session),
            kind=kind,
            now=now,
        )
        if isinstance(claimed, ClaimMiss):
            self._back_off(session, claimed)
            return []
        for claim in claimed:
            self._note_claim(session, claim, by_id[claim.task_id], now=now)
        # Out of the queue: the claimed, and those another claim took first. The store
        # tries the lowest ids first (as many as the node's quota allows), so an unclaimed
        # id below a claimed one was tried and gone; one above may not have been tried.
        taken = [claim.task_id for claim in claimed]
        last, held = max(taken, default=0), set(taken)
        gone = [t for t in picked if t not in held and t < last]
        for task_id in gone:
            self.matcher.forget_entry(task_id)
        with unless_broker_away("discarding claimed tasks"):
            await self.broker.discard(taken + gone)
        return claimed

    async def _ranked(
        self, session: NodeSession, *, now: float
    ) -> tuple[dict[int, ReadyTask], Sequence[scheduler.Candidate]]:
        """The queue's candidates this node can run, best first, and the entries by id.

        Entries of jobs that ended leave the queue on the way.
        """
        entries = await self.matcher.entries(CANDIDATES_PER_CLAIM)
        candidates = []
        for entry in entries:
            plan = await self.plan(entry.job_id)
            if plan is None:
                await self.broker.discard([entry.task_id])
                continue
            candidates.append(self.matcher.candidate(entry, plan, now=now))
        view = session.view_now(reliability=self.node_reliability(session))
        ranked = scheduler.rank(view, candidates, now=now, weights=self.matcher.weights)
        return {entry.task_id: entry for entry in entries}, ranked

    def _note_claim(
        self, session: NodeSession, claim: Assignment, entry: ReadyTask, *, now: float
    ) -> None:
        plan = self.plans.loaded(entry.job_id)
        self.matcher.claimed(session, claim, plan, entry.cost_flops, now=now)
        session.reliability = trust_policy.credibility(claim.trust, self.trust)

    @staticmethod
    def _back_off(session: NodeSession, miss: ClaimMiss) -> None:
        log.info("node %s gets no tasks for now: %s", session.node_id, miss.value)
        session.idle_until = time.monotonic() + CLAIM_BACKOFF_S

    @staticmethod
    def _claimer(session: NodeSession) -> Claimer:
        return Claimer(
            node_id=session.node_id,
            account_id=session.account_id,
            network=session.network,
            backend=session.backend,
        )

    async def _claim_one(self, session: NodeSession) -> Assignment | None:
        if time.monotonic() < session.idle_until:
            return None  # its quota is used up, or it is suspended: ask again later
        now = self.clock()
        by_id, ranked = await self._ranked(session, now=now)
        claimer = self._claimer(session)
        for candidate in ranked:
            entry = by_id[candidate.task_id]
            plan = self.plans.loaded(entry.job_id)
            claim = await self.store.claim_task(
                entry.task_id,
                claimer,
                kind=entry.kind,
                now=now,
                lease_deadline=now + self.lease_seconds(session, entry),
                distinct=self.distinct if plan.replication > 1 else None,
            )
            if isinstance(claim, Assignment):
                self._note_claim(session, claim, entry, now=now)
                # The claim is committed: the node must hear of it even if the broker is
                # away (a later claim discards the stale entry).
                with unless_broker_away("discarding a claimed task"):
                    await self.broker.discard([entry.task_id])
                    await self._maybe_alone(plan, claim)
                return claim
            if claim is ClaimMiss.GONE:
                self.matcher.forget_entry(entry.task_id)
                await self.broker.discard([entry.task_id])
            elif claim in (ClaimMiss.QUOTA, ClaimMiss.SUSPENDED):
                self._back_off(session, claim)
                return None
        return None

    async def _maybe_alone(self, plan: JobPlan, claim: Assignment) -> None:
        """Adaptive replication: a trusted node's first replica may run unreplicated.

        BOINC's rule (policy.trust.may_run_alone), decided when the first replica of a
        shard is handed out; a share of such shards keeps one replica for a spot check by
        a second trusted node. The node is not told: it cannot cheat only when alone.
        """
        if plan.replication < 2 or not claim.first_replica:
            return
        if not trust_policy.may_run_alone(claim.trust, self.trust, draw=self.random.random()):
            return
        spot = trust_policy.needs_spot_check(self.trust, draw=self.random.random())
        dropped = await self.store.run_alone(claim.shard_id, claim.task_id, spot_check=spot)
        if dropped:
            await self.broker.discard(dropped)
            self.counters.alone["spot" if spot else "alone"] += 1

    def node_reliability(self, session: NodeSession) -> float:
        return node_reliability(session)

    def lease_seconds(self, session: NodeSession, entry: ReadyTask) -> float:
        return lease_seconds(self.settings, session, entry)

    def lease_for(
        self, view: scheduler.NodeView, kind: str, *, items: int, cost_flops: float
    ) -> float:
        return lease_for(self.settings, view, kind, items=items, cost_flops=cost_flops)

    async def fill_waiting(self) -> None:
        """Offer queued work to every connected node that asked for some."""
        # A fleet of idle nodes all want work: don't visit each one for an empty queue;
        # only the fastest few of them, which may take a backup copy of a straggler.
        if await self.broker.ready_count() == 0:
            if self.settings.backups:
                idle = sorted(
                    (s for s in self.hub.sessions() if s.wants > 0),
                    key=lambda s: -s.view.gflops,
                )
                for session in idle[:BACKUP_OFFERS_PER_PASS]:
                    await self.fill(session)
            return
        for session in self.hub.sessions():
            got_none = session.wants > 0 and not await self.fill(session)
            if got_none and await self.broker.ready_count() == 0:
                return

    # -- results -------------------------------------------------------------------------

    async def accept_result(self, session: NodeSession, msg: protocol.Result) -> ResultReceipt:
        """Take a node's result: check it, record it once, verify its shard."""
        return (await self._take_results(session, [msg]))[0]

    async def accept_results(
        self, session: NodeSession, msgs: Sequence[protocol.Result]
    ) -> list[ResultReceipt]:
        """Take several results of a node in one transaction (all or nothing).

        The receipts are for after the commit: acknowledge none of them before this returns.
        Where commits are one at a time (SQLite: each waits for an fsync), results of all
        nodes that arrive while one commit is written go into the next one together, a
        group commit: the commit rate, not the result rate, then bounds the grid.
        """
        if not self.store.serial_commits:
            async with self.store.batch():
                return await self._take_results(session, msgs)
        pending = _PendingResults(session, msgs, asyncio.get_running_loop().create_future())
        self._result_queue.append(pending)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_results(), name="results")
        return await pending.receipts

    async def _commit_results(self) -> None:
        while self._result_queue:
            group, self._result_queue = self._result_queue, []
            try:
                async with self.store.batch():
                    receipts = [await self._take_results(p.session, p.msgs) for p in group]
            except Exception as exc:
                if len(group) == 1:
                    group[0].fail(exc)
                    continue
                # One node's batch must not fail the others': each on its own again.
                for pending in group:
                    try:
                        async with self.store.batch():
                            pending.done(await self._take_results(pending.session, pending.msgs))
                    except Exception as exc:
                        pending.fail(exc)
                continue
            for pending, receipt in zip(group, receipts, strict=True):
                pending.done(receipt)

    async def _take_results(
        self, session: NodeSession, msgs: Sequence[protocol.Result]
    ) -> list[ResultReceipt]:
        """Check, record and verify results in a few statements however many there are:
        one read of their inputs, one write of the results, one verification pass over
        the shards they complete."""
        inputs = await self.store.task_inputs([m.task_id for m in msgs], session.node_id)
        receipts: dict[int, ResultReceipt] = {}  # index in msgs -> receipt
        good: list[int] = []
        finished: list[int] = []  # tasks the node no longer holds once this commits
        failed = False
        for index, msg in enumerate(msgs):
            problem = await self._check_output(session, msg, inputs.get(msg.task_id))
            if problem is None:
                good.append(index)
                continue
            if await self.store.record_failure(
                msg.task_id, session.node_id, reason=f"invalid output: {problem}", now=self.clock()
            ):
                finished.append(msg.task_id)
                failed = True
            receipts[index] = ResultReceipt("rejected", problem)
        stored = await self.store.accept_results(
            session.node_id,
            [
                NewResult(msgs[i].task_id, msgs[i].output, msgs[i].output_size, msgs[i].elapsed_s)
                for i in good
            ],
            now=self.clock(),
        )
        to_verify: list[int] = []
        late = False
        for index, receipt in zip(good, stored, strict=True):
            receipts[index] = receipt
            if receipt.status != "rejected":
                finished.append(msgs[index].task_id)
            if receipt.status == "accepted" and receipt.shard_id is not None:
                to_verify.append(receipt.shard_id)
            elif receipt.status == "late" and not receipt.reason:
                late = True  # stored, after its shard was decided
        if to_verify:
            await self.verify_shards(to_verify)
        if late:
            await self.judge_late()
        if failed:
            await self.replenish()
        ordered = [receipts[index] for index in range(len(msgs))]

        async def settle() -> None:
            # In-memory bookkeeping after the commit: a group commit that fails is stored
            # again, and must not count its results twice.
            for task_id in finished:
                session.forget_task(task_id)
            for receipt in ordered:
                self.counters.results[receipt.status] += 1
                session.tasks_returned += receipt.status == "accepted"

        await self.store.after_commit(settle)
        return ordered

    async def _check_output(
        self, session: NodeSession, msg: protocol.Result, assignment: TaskInput | None
    ) -> str | None:
        try:
            size = self.blobs.size(msg.output)
        except (FileNotFoundError, BlobError):
            return f"output blob {msg.output} was not uploaded"
        if size != msg.output_size:
            return f"output blob has {size} bytes, not {msg.output_size}"
        if assignment is None:
            return None  # not this node's task: accept_results rejects it with the reason
        plan = await self.plan(assignment.job_id)
        if plan is None:
            return None
        payload, output = self.blobs.read(assignment.input_hash), self.blobs.read(msg.output)
        try:
            size = len(payload) + len(output)
            await _compute(plan.kind.check_output, payload, output, plan.params, size=size)
        except ValueError as exc:
            return str(exc)
        return None

    async def record_failure(self, session: NodeSession, msg: protocol.Failure) -> bool:
        changed = await self.store.record_failure(
            msg.task_id, session.node_id, reason=msg.reason, now=self.clock()
        )
        session.forget_task(msg.task_id)
        if changed:
            log.info("task %s failed on node %s: %s", msg.task_id, session.node_id, msg.reason)
            await self.replenish()
        return changed

    async def verify_shard(self, shard_id: int) -> None:
        """Run the verifier over a shard's results and store its decision."""
        await self.verify_shards([shard_id])

    async def verify_shards(self, shard_ids: Sequence[int]) -> None:
        """Verify several shards: one read of their results, one write of the decisions."""
        found = await self.store.shards_for_verify(shard_ids)
        decided: list[tuple[ShardForVerify, JobPlan, verifier.Decision]] = []
        for shard_id in dict.fromkeys(shard_ids):
            item = found.get(shard_id)
            if item is None or not item.results:
                continue
            plan = await self.plan(item.job.id)
            assert plan is not None
            decided.append((item, plan, await self._decide(item, plan)))
        outcomes = await self.store.decide_shards(
            [
                ShardDecision(
                    item.shard.id,
                    decision.canonical,
                    decision.valid,
                    decision.invalid,
                    decision.fail_reason,
                )
                for item, _, decision in decided
            ],
            now=self.clock(),
        )
        to_assemble: dict[int, None] = {}
        short = False
        for (item, plan, decision), outcome in zip(decided, outcomes, strict=True):
            await self.store.after_commit(
                functools.partial(self._shard_decided, item.shard.id, outcome, decision)
            )
            if outcome.job_done or (outcome.decided and self.rounds.drives(plan.kind)):
                to_assemble[item.job.id] = None
            elif not outcome.decided:
                await self._undecided(item, plan)
                short = True
        for job_id in to_assemble:
            await self.assemble(job_id)
        if short:
            await self.replenish()

    async def _decide(self, found: ShardForVerify, plan: JobPlan) -> verifier.Decision:
        outputs = [(r.task_id, self.blobs.read(r.output_hash)) for r in found.results]
        credibility = {
            r.task_id: trust_policy.credibility(r.trust, self.trust) for r in found.results
        }
        return await _compute(
            functools.partial(
                verifier.decide,
                min_quorum=found.shard.quorum,
                credibility=credibility,
                min_credibility=(
                    trust_policy.required_credibility_alone(self.trust)
                    if found.shard.mode == "alone"
                    else trust_policy.required_credibility(self.trust, plan.replication)
                ),
            ),
            outputs,
            lambda a, b: plan.kind.compare(a, b, plan.params),
            size=sum(len(output) for _, output in outputs),
        )

    async def _undecided(self, found: ShardForVerify, plan: JobPlan) -> None:
        """A shard its results did not decide: escalate it or raise its target."""
        shard = found.shard
        # The spot check disagreed (or the lone node lost its credibility): back to full
        # replication; the quorum then says who was wrong.
        if (
            shard.mode in ("alone", "spot")
            and len(found.results) >= shard.target
            and await self.store.escalate(shard.id, target=plan.replication, quorum=plan.min_quorum)
        ):
            self.counters.alone["escalated"] += 1
        elif shard.quorum == 1 and len(found.results) >= shard.target:
            # A lone result without the credibility to stand (its node was caught or
            # suspended meanwhile): one more replica, as BOINC raises a target.
            await self.store.raise_target(shard.id, results_seen=len(found.results))

    async def judge_late(self, *, limit: int = 100) -> int:
        """Check results that came after their shard was decided against its canonical
        result: they count for or against their node's trust (and earn credit if valid)."""
        late = await self.store.late_results(limit=limit)
        for result in late:
            plan = await self.plan(result.job_id)
            agrees = False
            if plan is not None and result.canonical_hash is not None:
                canonical = self.blobs.read(result.canonical_hash)
                output = self.blobs.read(result.output_hash)
                verdict = await asyncio.to_thread(plan.kind.compare, canonical, output, plan.params)
                agrees = verdict == Verdict.AGREE
            await self.store.judge_late(result.task_id, agrees=agrees, now=self.clock())
            self.counters.verified["late_valid" if agrees else "late_invalid"] += 1
        return len(late)

    async def _shard_decided(
        self, shard_id: int, outcome: DecisionOutcome, decision: verifier.Decision
    ) -> None:
        """After a decision committed: cancel the shard's other replicas, count verdicts."""
        await self.fanout.send_cancels(outcome.to_cancel, reason=f"shard {shard_id} is decided")
        self._count_verdicts(outcome.decided, decision)

    def _count_verdicts(self, decided: bool, decision: verifier.Decision) -> None:
        # The store marks results only for the decision that won (or an undecided one).
        if decided:
            self.counters.verified["valid"] += len(decision.valid)
        if decided or (decision.canonical is None and decision.fail_reason is None):
            self.counters.verified["invalid"] += len(decision.invalid)

    async def assemble(self, job_id: int) -> None:
        """Build and store a finished job's result from its canonical outputs."""
        plan = await self.plan(job_id)
        assert plan is not None
        if self.rounds.drives(plan.kind):  # its rounds decide when it is done
            await self.rounds.progress(job_id)
            return
        hashes = await self.store.canonical_outputs(job_id)
        inputs = [shard.input_hash for shard in await self.store.list_shards(job_id)]
        result_hash, size = await asyncio.to_thread(self._assemble, plan, inputs, hashes)
        if await self.store.complete_job(
            job_id, result_hash=result_hash, result_size=size, now=self.clock()
        ):
            log.info("job %s completed (%d bytes)", job_id, size)
        await self.fanout.job_ended(job_id)

    def _assemble(
        self, plan: JobPlan, inputs: Sequence[str], hashes: Sequence[str]
    ) -> tuple[str, int]:
        result = plan.kind.assemble_with_inputs(
            [self.blobs.read(h) for h in inputs], [self.blobs.read(h) for h in hashes], plan.params
        )
        return self.blobs.put(result), len(result)

    # -- leases and nodes ----------------------------------------------------------------

    async def replenish(self) -> None:
        ready, failed_jobs, to_cancel = await self.store.replenish(now=self.clock())
        for job_id in failed_jobs:
            log.warning("job %s failed: a shard ran out of attempts", job_id)
            await self.fanout.job_ended(job_id)
        await self.fanout.send_cancels(to_cancel, reason="the job failed")
        await self.enqueue(ready)

    async def expire(self, expired: Sequence[NodeTask], *, why: str) -> None:
        """Requeue the shards of expired tasks; tell connected holders."""
        if not expired:
            return
        log.info("%d task(s) expired: %s", len(expired), why)
        self.counters.lease_expiries += len(expired)
        for task in expired:
            session = self.hub.get(task.node_id)
            if session is not None:
                session.forget_task(task.task_id)
                session.tasks_expired += 1
        await self.replenish()

    async def rebuild_queue(self) -> None:
        """Refill the broker's ready queue from the store (startup, broker loss)."""
        await peers.rebuild_queue(self.context)

    def forget_plan(self, job_id: int) -> None:
        self.plans.forget(job_id)

    # -- fan-out -------------------------------------------------------------------------

    async def enqueue(self, ready: Sequence[ReadyTask]) -> None:
        await self.fanout.enqueue(ready)

    async def send_cancels(self, held: Sequence[NodeTask], *, reason: str) -> None:
        await self.fanout.send_cancels(held, reason=reason)

    async def job_ended(self, job_id: int) -> None:
        await self.fanout.job_ended(job_id)

    async def publish(self, message: dict[str, Any]) -> None:
        """Tell the other coordinator processes (see `peers`)."""
        await self.fanout.publish(message)

    async def cancel_locally(self, node_id: int, task_id: int, reason: str) -> bool:
        """Tell a node connected to this process to drop a task; False if it is not here."""
        return await self.hub.cancel(node_id, task_id, reason)

    async def on_peer_message(self, message: dict[str, Any]) -> None:
        """Handle what another coordinator process published on the grid channel."""
        await peers.on_message(self.context, self.plans, message)


async def _compute(function: Callable[..., T], *args: Any, size: int) -> T:
    """`function(*args)` in a thread, or on the loop when its data is small enough that the
    thread hop would cost more than the call (no-op and sleep outputs, tiny shards)."""
    if size <= INLINE_BYTES:
        return function(*args)
    return await asyncio.to_thread(function, *args)


@dataclass
class _PendingResults:
    """A node's results waiting for the next group commit, and where the receipts go."""

    session: NodeSession
    msgs: Sequence[protocol.Result]
    receipts: asyncio.Future[list[ResultReceipt]]

    def done(self, receipts: list[ResultReceipt]) -> None:
        if not self.receipts.done():  # its node may have gone meanwhile
            self.receipts.set_result(receipts)

    def fail(self, exc: Exception) -> None:
        if not self.receipts.done():
            self.receipts.set_exception(exc)


def _assign_message(assignment: Assignment) -> protocol.Assign:
    return protocol.Assign(
        task_id=assignment.task_id,
        job_id=assignment.job_id,
        shard_index=assignment.shard_index,
        kind=assignment.kind,
        params=assignment.params,
        input=protocol.BlobRef(hash=assignment.input_hash, size=assignment.input_size),
        lease_deadline=datetime.fromtimestamp(assignment.lease_deadline, UTC),
    )
