"""Dispatch: fill a node's free slots with the best tasks it can run, claimed atomically.

The scheduler (pure) ranks the queue's candidates for the node; the store claims them
(one replica per node, account and network for replicated jobs; a daily quota per
kind); the node hears `assign` for each claim once it committed. Replication-1 tasks of
one kind are claimed many in one statement; replicated ones one at a time, where
adaptive replication may let a trusted node's first replica run alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from idlegrid import protocol
from idlegrid.coordinator.context import Context
from idlegrid.coordinator.hub import NodeSession
from idlegrid.coordinator.leases import Leases, lease_seconds, measure
from idlegrid.coordinator.matching import Matcher, node_reliability
from idlegrid.coordinator.peers import unless_broker_away
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.policy import scheduler
from idlegrid.store.base import Assignment, Claimer, ClaimMiss, Distinct, ReadyTask
from idlegrid.verification import probes
from idlegrid.verification import trust as trust_policy

log = logging.getLogger(__name__)

CANDIDATES_PER_CLAIM = 64
# A node whose quota is used up, or that is suspended, asks the store again after this.
CLAIM_BACKOFF_S = 60.0
# With nothing queued, this many idle nodes (the fastest) are offered backup copies.
BACKUP_OFFERS_PER_PASS = 4


class Dispatcher:
    def __init__(self, ctx: Context, *, plans: Plans, matcher: Matcher, leases: Leases) -> None:
        self._ctx = ctx
        self._plans = plans
        self._matcher = matcher
        self._leases = leases
        settings = ctx.settings
        self._distinct = Distinct(
            accounts=settings.distinct_accounts, networks=settings.distinct_networks
        )

    async def fill(self, session: NodeSession) -> int:
        """Give a node as many tasks as it wants and can run; return how many it got."""
        async with session.fill_lock:
            if session.closed:
                return 0  # a pass over the hub's sessions may come just after it left
            await measure(self._ctx, session)  # its leases follow what it was measured at
            # The node's whole request in one transaction: one commit, not one per task.
            # A retried batch starts again from the GPU slots the node said were free.
            gpu_free = session.gpu_free
            claimed = await self._ctx.store.run_batch(
                functools.partial(self._claim, session, gpu_free=gpu_free)
            )
            if session.closed:
                # It left while the claims were written: it will never hear of them.
                await self._release(session, claimed, why="its connection closed")
                return 0
            for assignment in claimed:  # committed: the node must hear of each one
                session.live.add(assignment.task_id)
                session.shard_of[assignment.task_id] = assignment.shard_id
                session.requested -= 1
            unsent = await _send_assigns(session, claimed, self._needs_gpu)
            await self._release(session, unsent, why="its assignment could not be sent")
        return len(claimed) - len(unsent)

    def _needs_gpu(self, assignment: Assignment) -> bool:
        try:
            plan = self._plans.loaded(assignment.job_id)
        except KeyError:  # a job that ended meanwhile: its task is cancelled anyway
            return False
        return scheduler.needs_gpu(plan.requirements)

    def _took_slots(self, session: NodeSession, claimed: Sequence[Assignment]) -> None:
        """Claims that need a GPU take the node's free GPU slots (it said how many)."""
        if session.gpu_free is not None:
            session.gpu_free -= sum(1 for a in claimed if self._needs_gpu(a))

    async def _release(
        self, session: NodeSession, claimed: Sequence[Assignment], *, why: str
    ) -> None:
        """Give back claims its node never heard of, at once: otherwise they would sit
        until their leases ran out, and be charged to the node as errors."""
        if not claimed:
            return
        released = await self._ctx.store.claims.release_claims(
            [a.task_id for a in claimed], session.node_id, now=self._ctx.clock()
        )
        for assignment in claimed:
            session.forget_task(assignment.task_id)
        if released:
            log.info("node %s: %d claim(s) released: %s", session.node_id, len(released), why)
            await self._leases.replenish()

    async def _claim(self, session: NodeSession, *, gpu_free: int | None) -> list[Assignment]:
        """Claim what the node wants: many at once while it can, then one by one.

        Candidates another transaction was claiming (skipped, not waited for) are passed
        over for the rest of this fill: each round either claims or passes over some.
        """
        session.gpu_free = gpu_free
        wanted = session.wants
        claimed: list[Assignment] = []
        passed: set[int] = set()
        while len(claimed) < wanted:
            # Beyond its free slots a claim goes to the node's buffer, which only kinds
            # that may wait there (TaskKind.buffered) fill.
            slots = session.slots - len(session.live) - len(claimed)
            many = await self._claim_many(session, wanted - len(claimed), passed, slots=slots)
            if many:
                claimed += many
                self._took_slots(session, many)
                continue
            if many is not None:
                continue  # others took every one it picked: pick again, without them
            assignment = await self._claim_one(session, passed, slots=slots)
            # A backup copy is worth its cost only if it starts now, in a free slot.
            if assignment is None and self._ctx.settings.backups and slots > 0:
                assignment = await self._matcher.claim_backup(session)
            if assignment is None:
                break
            claimed.append(assignment)
            self._took_slots(session, [assignment])
        return claimed

    def offer_work(self) -> None:
        """Wake the dispatcher if a node here waits for work (a lost "work" message)."""
        if any(session.wants > 0 for session in self._ctx.hub.sessions()):
            self._ctx.work_available.set()

    async def fill_waiting(self) -> None:
        """Offer queued work to every connected node that asked for some."""
        broker, hub = self._ctx.broker, self._ctx.hub
        # A fleet of idle nodes all want work: don't visit each one for an empty queue;
        # only the fastest few of them, which may take a backup copy of a straggler.
        if await broker.ready_count() == 0:
            if self._ctx.settings.backups:
                idle = sorted(
                    (s for s in hub.sessions() if s.wants > 0),
                    key=lambda s: -s.view.gflops,
                )
                for session in idle[:BACKUP_OFFERS_PER_PASS]:
                    await self.fill(session)
            return
        for session in hub.sessions():
            got_none = session.wants > 0 and not await self.fill(session)
            if got_none and await broker.ready_count() == 0:
                return

    async def _claim_many(
        self, session: NodeSession, wanted: int, passed: set[int], *, slots: int
    ) -> list[Assignment] | None:
        """Claim up to `wanted` of the best tasks for the node at once, while they are of
        replication-1 jobs and of one kind. None: nothing to try this way (an empty
        list: it tried, and other claims had taken them; they join `passed`).

        One statement for them all (the daily quota is per kind); tasks of replicated
        jobs, whose claims check the distinct-replica rules and may run alone, are left
        to `_claim_one`, as is everything ranked below the first of them.
        """
        if wanted < 1 or time.monotonic() < session.idle_until:
            return None
        now = self._ctx.clock()
        by_id, ranked, plans = await self._ranked(session, now=now, passed=passed, slots=slots)
        if not ranked:
            return None
        kind = ranked[0].kind
        plan = plans[ranked[0].job_id]
        if not plan.kind.buffered:
            wanted = min(wanted, slots)  # `_ranked` left it out when no slot is free
        if session.gpu_free is not None and scheduler.needs_gpu(plan.requirements):
            wanted = min(wanted, session.gpu_free)  # one a GPU slot
        picked: list[int] = []
        for candidate in ranked:
            if plans[candidate.job_id].replication != 1 or candidate.kind != kind:
                break
            picked.append(candidate.task_id)
            if len(picked) == wanted:
                break
        if not picked:
            return None
        settings = self._ctx.settings
        with self._matcher.claiming(picked):
            claimed = await self._ctx.store.claims.claim_tasks(
                {t: now + lease_seconds(settings, session, by_id[t]) for t in picked},
                _claimer(session),
                kind=kind,
                now=now,
            )
        if isinstance(claimed, ClaimMiss):
            _back_off(session, claimed)
            return None
        for claim in claimed:
            entry = by_id[claim.task_id]
            self._note_claim(session, claim, entry, plans[entry.job_id], now=now)
        await self._drop_from_queue(picked, claimed)
        passed.update(picked)
        return claimed

    async def _drop_from_queue(self, picked: Sequence[int], claimed: Sequence[Assignment]) -> None:
        """Out of the queue: the claimed, and those another claim took first.

        The store tries the lowest ids first (as many as the node's quota allows), so an
        unclaimed id below a claimed one was tried and gone; one above may not have been.
        """
        taken = [claim.task_id for claim in claimed]
        last, held = max(taken, default=0), set(taken)
        gone = [t for t in picked if t not in held and t < last]
        for task_id in gone:
            self._matcher.forget_entry(task_id)
        with unless_broker_away("discarding claimed tasks"):
            await self._ctx.broker.discard(taken + gone)

    async def _ranked(
        self, session: NodeSession, *, now: float, passed: set[int], slots: int
    ) -> tuple[dict[int, ReadyTask], Sequence[scheduler.Candidate], dict[int, JobPlan]]:
        """The queue's candidates this node can run, best first, the entries by id, and
        the plans of their jobs (held here: a job that ends meanwhile drops its plan
        from `Plans`, and its claim then fails in the store as GONE).

        Entries of jobs that ended leave the queue on the way. Left out: those this fill
        passed over, those another claim of this process is taking now, and, with no
        free slot (`slots` < 1), those of kinds that may not wait in a node's buffer.
        """
        entries = await self._matcher.entries(CANDIDATES_PER_CLAIM)
        skip = passed | self._matcher.in_flight
        entries = [entry for entry in entries if entry.task_id not in skip]
        candidates, plans = [], {}
        for entry in entries:
            plan = await self._plans.get(entry.job_id)
            if plan is None:
                await self._ctx.broker.discard([entry.task_id])
                continue
            if slots < 1 and not plan.kind.buffered:
                continue
            plans[entry.job_id] = plan
            candidates.append(self._matcher.candidate(entry, plan, now=now))
        view = session.view_now(reliability=node_reliability(session))
        ranked = scheduler.rank(view, candidates, now=now, weights=self._matcher.weights)
        by_id = {entry.task_id: entry for entry in entries}
        # Replicas that check a caught node's work first, whatever the score (stable).
        return by_id, sorted(ranked, key=lambda c: not by_id[c.task_id].urgent), plans

    def _note_claim(
        self,
        session: NodeSession,
        claim: Assignment,
        entry: ReadyTask,
        plan: JobPlan,
        *,
        now: float,
    ) -> None:
        self._matcher.claimed(session, claim, plan, entry.cost_flops, now=now)
        session.reliability = trust_policy.credibility(claim.trust, self._ctx.settings.trust)

    async def _claim_one(
        self, session: NodeSession, passed: set[int], *, slots: int
    ) -> Assignment | None:
        if time.monotonic() < session.idle_until:
            return None  # its quota is used up, or it is suspended: ask again later
        now = self._ctx.clock()
        by_id, ranked, plans = await self._ranked(session, now=now, passed=passed, slots=slots)
        claimer = _claimer(session)
        for candidate in ranked:
            entry = by_id[candidate.task_id]
            plan = plans[entry.job_id]
            # Not marked in flight: a replica's claim may fail for this node alone (one
            # replica per node, account and network), and another node must still try it.
            claim = await self._ctx.store.claims.claim_task(
                entry.task_id,
                claimer,
                kind=entry.kind,
                now=now,
                lease_deadline=now + lease_seconds(self._ctx.settings, session, entry),
                distinct=self._distinct if plan.replication > 1 else None,
                check_build_wait_s=(
                    self._ctx.settings.check_build_wait_s
                    if plan.kind.checks and plan.kind.names_builds
                    else None
                ),
            )
            if claim is ClaimMiss.CONFLICT:
                passed.add(entry.task_id)
            if isinstance(claim, Assignment):
                if plan.kind.checks:
                    claim = await self._role(claim, plan)
                self._note_claim(session, claim, entry, plan, now=now)
                # The claim is committed: the node must hear of it even if the broker is
                # away (a later claim discards the stale entry).
                with unless_broker_away("discarding a claimed task"):
                    await self._ctx.broker.discard([entry.task_id])
                    await self._maybe_alone(plan, claim)
                return claim
            if claim is ClaimMiss.GONE:
                self._matcher.forget_entry(entry.task_id)
                await self._ctx.broker.discard([entry.task_id])
            elif claim in (ClaimMiss.QUOTA, ClaimMiss.SUSPENDED):
                _back_off(session, claim)
                return None
        return None

    async def _role(self, claim: Assignment, plan: JobPlan) -> Assignment:
        """A claim of a shard verified by checks: the check of its output, if it has one;
        now and then, by the node's record as a checker, a known-answer check instead."""
        store = self._ctx.store
        target = await store.claims.assign_check(claim.shard_id, claim.task_id)
        if target is None:
            return claim
        self._ctx.counters.verified["check_tasks"] += 1
        check_hash, check_size = target
        draw = self._ctx.random
        if probes.sends_probe(claim.trust, draw=draw.random()):
            planted = plan.kind.plant_defect(self._ctx.blobs.read(check_hash), draw.random())
            if planted is not None:
                planted_hash = self._ctx.blobs.put(planted)
                ready = await store.claims.make_known_answer(
                    claim.task_id, planted_hash=planted_hash, known="fail", now=self._ctx.clock()
                )
                await store.after_commit(functools.partial(self._enqueue, ready))
                self._ctx.counters.verified["known_answer_checks"] += 1
                return dataclasses.replace(claim, check_hash=planted_hash, check_size=len(planted))
        if probes.wants_second_pass(draw=draw.random()):
            await store.claims.want_quorum(claim.shard_id, quorum=probes.SECOND_PASS_QUORUM)
        return dataclasses.replace(claim, check_hash=check_hash, check_size=check_size)

    async def _enqueue(self, ready: Sequence[ReadyTask]) -> None:
        """Queue tasks made while claiming (once committed), and wake the nodes waiting."""
        if ready:
            self._matcher.invalidate()
            with unless_broker_away("queueing a task made while claiming"):
                await self._ctx.broker.push_ready(ready)
            self._ctx.work_available.set()

    async def _maybe_alone(self, plan: JobPlan, claim: Assignment) -> None:
        """Adaptive replication: a trusted node's first replica may run unreplicated.

        BOINC's rule (verification.trust.may_run_alone), decided when the first replica of a
        shard is handed out; a share of such shards keeps one replica for a spot check by
        a second trusted node. The node is not told: it cannot cheat only when alone.
        """
        if plan.replication < 2 or not claim.first_replica or claim.check_hash:
            return
        trust, draw = self._ctx.settings.trust, self._ctx.random
        if not trust_policy.may_run_alone(claim.trust, trust, draw=draw.random()):
            return
        spot = trust_policy.needs_spot_check(trust, draw=draw.random())
        if spot and plan.kind.checks:
            return  # spot-checked as every shard of such a kind is: one check after it
        checkers = trust_policy.spot_checkers(trust, draw=draw.random())
        dropped = await self._ctx.store.claims.run_alone(
            claim.shard_id, claim.task_id, spot_check=spot, checkers=checkers
        )
        if dropped:
            await self._ctx.broker.discard(dropped)
            self._ctx.counters.alone["spot" if spot else "alone"] += 1


def _back_off(session: NodeSession, miss: ClaimMiss) -> None:
    log.info("node %s gets no tasks for now: %s", session.node_id, miss.value)
    session.idle_until = time.monotonic() + CLAIM_BACKOFF_S


def _claimer(session: NodeSession) -> Claimer:
    return Claimer(
        node_id=session.node_id,
        account_id=session.account_id,
        network=session.network,
        backend=session.backend,
        build=session.llama_build,
    )


async def _send_assigns(
    session: NodeSession, claimed: Sequence[Assignment], needs_gpu: Callable[[Assignment], bool]
) -> list[Assignment]:
    """Send each claim to its node; return those it did not get (all after a failure)."""
    for sent, assignment in enumerate(claimed):
        try:
            message = _assign_message(assignment, gpu=needs_gpu(assignment))
        except (ValueError, OverflowError, OSError) as exc:  # a deadline no clock can show
            log.error("task %s: no assignment message: %s", assignment.task_id, exc)
            return list(claimed[sent:])
        if not await session.send(message):
            return list(claimed[sent:])
    return []


def _assign_message(assignment: Assignment, *, gpu: bool = False) -> protocol.Assign:
    return protocol.Assign(
        gpu=gpu,
        task_id=assignment.task_id,
        job_id=assignment.job_id,
        shard_index=assignment.shard_index,
        kind=assignment.kind,
        params=assignment.params,
        input=protocol.BlobRef(hash=assignment.input_hash, size=assignment.input_size),
        lease_deadline=datetime.fromtimestamp(assignment.lease_deadline, UTC),
        check=(
            protocol.BlobRef(hash=assignment.check_hash, size=assignment.check_size)
            if assignment.check_hash
            else None
        ),
    )
