"""The verifier: the I/O around verification's rules, and a finished job assembled.

It reads a shard's results and its nodes' trust from the store and the outputs from the
blobs; `verification.judging` decides (the kind's `compare`, weighted by each node's
credibility); the store records the decision once (one decision wins any race) and
writes what it changes in trust and credit (`store.ledger`). A shard its results did not
decide gets what `judging.follow_up` says; results that came after their shard was
decided are judged against the canonical one (`judge_late`). When every shard of a job
is decided, the kind's `assemble` builds the job's result; training jobs are the round
driver's to finish.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.leases import Leases
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.devtools import faults
from idlegrid.kinds.base import Verdict
from idlegrid.states import ShardState
from idlegrid.store.base import DecisionOutcome, ShardDecision, ShardForVerify
from idlegrid.verification import checking, judging, probes
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.quorum import Decision

log = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024  # see compute
# A check verdict is a few hundred bytes; a larger output of a generation task is read as
# a generation without being parsed.
CHECK_VERDICT_BYTES = 4096
T = TypeVar("T")


async def compute(function: Callable[..., T], *args: Any, size: int) -> T:
    """`function(*args)` in a thread, or on the loop when its data is small enough that the
    thread hop would cost more than the call (no-op and sleep outputs, tiny shards)."""
    if size <= INLINE_BYTES:
        return function(*args)
    return await asyncio.to_thread(function, *args)


class Verifier:
    """Shards verified, late results judged, finished jobs assembled (see the module)."""

    def __init__(
        self,
        ctx: Context,
        *,
        fanout: FanOut,
        plans: Plans,
        rounds: RoundDriver,
        leases: Leases,
    ) -> None:
        self._ctx = ctx
        self._fanout = fanout
        self._plans = plans
        self._rounds = rounds
        self._leases = leases

    async def verify_shards(self, shard_ids: Sequence[int]) -> None:
        """Verify several shards: one read of their results, one write of the decisions."""
        store = self._ctx.store
        await self.judge_known_answers(shard_ids=shard_ids)
        found = await store.verification.shards_for_verify(shard_ids)
        decided: list[tuple[ShardForVerify, JobPlan, Decision]] = []
        for shard_id in dict.fromkeys(shard_ids):
            item = found.get(shard_id)
            if item is None or not item.results:
                continue
            plan = await self._plans.get(item.job.id)
            assert plan is not None
            decided.append((item, plan, await self._decide(item, plan)))
        await self.record(decided)

    async def record(self, decided: Sequence[tuple[ShardForVerify, JobPlan, Decision]]) -> None:
        """Write decisions (one transaction), then what follows: cancels, escalations,
        assembly; a shard failed by its decision fails its job, naming the shard."""
        store = self._ctx.store
        outcomes = await store.verification.decide_shards(
            [
                ShardDecision(
                    item.shard.id,
                    decision.canonical,
                    decision.valid,
                    decision.invalid,
                    decision.fail_reason,
                    decision.held,
                    decision.moot,
                )
                for item, _, decision in decided
            ],
            now=self._ctx.clock(),
        )
        to_assemble: dict[int, None] = {}
        short = False
        for (item, plan, decision), outcome in zip(decided, outcomes, strict=True):
            await store.after_commit(
                functools.partial(self._shard_decided, item.shard.id, outcome, decision)
            )
            rounds = self._rounds.drives(plan.kind)  # its round closes without the shard
            if outcome.decided and decision.fail_reason is not None and not rounds:
                await self._fail_job(item, decision.fail_reason)
            elif outcome.job_done or (outcome.decided and rounds):
                to_assemble[item.job.id] = None
            elif not outcome.decided:
                await self._undecided(item, plan, decision)
                short = True
            # A node caught lying had what it decided alone opened again (store.recheck).
            short = short or bool(decision.invalid)
        for job_id in to_assemble:
            await self.assemble(job_id)
        if short:
            await self._leases.replenish()

    async def _fail_job(self, found: ShardForVerify, reason: str) -> None:
        """A shard failed: its job fails with it, its other live tasks are cancelled."""
        await self.fail_job(found.job.id, f"shard {found.shard.index} failed: {reason}")

    async def _decide(self, found: ShardForVerify, plan: JobPlan) -> Decision:
        terms = _terms(found, plan)
        if judging.waits(terms, len(found.results)):
            return Decision(canonical=None, valid=(), invalid=())
        blobs = self._ctx.blobs
        if checked(found, plan):
            return self._decide_checked(found, plan)
        votes = [judging.Vote(r.task_id, blobs.read(r.output_hash), r.trust) for r in found.results]
        return await compute(
            judging.decide,
            terms,
            votes,
            lambda a, b: plan.kind.compare(a, b, plan.params),
            self._ctx.settings.trust,
            size=sum(len(vote.output) for vote in votes),
        )

    def _decide_checked(self, found: ShardForVerify, plan: JobPlan) -> Decision:
        """A shard verified by check tasks (`verification.checking`)."""
        second_pass = found.shard.quorum >= probes.SECOND_PASS_QUORUM
        outcome = checking.decide(self.checked_votes(found, plan), second_pass=second_pass)
        counters = self._ctx.counters.verified
        counters["checks_passed" if outcome.decision.canonical else "checks_pending"] += 1
        return outcome.decision

    def checked_votes(self, found: ShardForVerify, plan: JobPlan) -> list[checking.CheckedVote]:
        """A checked shard's results as its rule reads them: the kind reads each check's
        verdict (small outputs: no thread)."""
        settings, blobs, kind = self._ctx.settings.trust, self._ctx.blobs, plan.kind
        return [
            checking.CheckedVote(
                task_id=r.task_id,
                output_hash=r.output_hash,
                checks=r.checks_hash,
                verdict=kind.check_verdict(blobs.read(r.output_hash))
                if r.checks_hash is not None or r.output_size < CHECK_VERDICT_BYTES
                else None,
                credibility=trust_rules.credibility(r.trust, settings),
                established=probes.established(r.trust),
                decides=(
                    r.checks_hash is None
                    or r.output_size >= CHECK_VERDICT_BYTES
                    or kind.check_decides(blobs.read(r.output_hash))
                ),
                build=r.build if kind.names_builds else None,
                claimed_build=(
                    kind.claimed_build(blobs.read(r.output_hash))
                    if kind.names_builds and r.checks_hash is None
                    else None
                ),
            )
            for r in found.results
        ]

    async def _undecided(self, found: ShardForVerify, plan: JobPlan, decision: Decision) -> None:
        """A shard its results did not decide: escalate it or raise its target."""
        shard, store = found.shard, self._ctx.store
        if checked(found, plan):  # one more task: the check it waits for, or a new output
            # Counted without the results this decision found invalid or set aside: after
            # a caught lie the shard needs one new output, not one more task besides it.
            gone = {*decision.invalid, *decision.moot}
            left = [r for r in found.results if r.task_id not in gone]
            await store.claims.set_target(shard.id, target=len(left) + 1)
            return
        then = judging.follow_up(_terms(found, plan), len(found.results), decision)
        if then.suspects:
            await store.verification.suspect(then.suspects, now=self._ctx.clock())
            self._ctx.counters.alone["suspected"] += len(then.suspects)
        if then.escalate and await store.claims.escalate(
            shard.id, target=plan.replication, quorum=plan.min_quorum, now=self._ctx.clock()
        ):
            self._ctx.counters.alone["escalated"] += 1
        elif then.raise_target:
            await store.claims.raise_target(shard.id, results_seen=len(found.results))

    async def finish_pending(self) -> None:
        """Verify results and assemble jobs that a crash left between two steps, then judge
        known answers and late results. Each shard and job is a step of its own: one that
        raises is logged and tried again next pass, and never holds back the others, nor
        the late judging."""
        store = self._ctx.store
        for shard_id in await store.verification.shards_to_verify(limit=100):
            await _isolated(self.verify_shards([shard_id]), "verifying shard", shard_id)
        for job_id in await store.jobs.jobs_to_assemble():
            await _isolated(self.assemble(job_id), "assembling job", job_id)
        await self.judge_known_answers()
        await self.judge_late()

    async def record_start(self, *, now: float) -> None:
        """This process (re)started now: results it makes late are paid
        (`verification.credit.late_result_paid`)."""
        ctx = self._ctx
        await ctx.store.verification.record_start(
            ctx.process_id, now=now, grace_s=ctx.settings.restart_grace_s
        )

    async def reject(self, task_id: int, why: str) -> None:
        """A stored result that cannot be right (NaN, zeros, a constant): invalid, as if
        outvoted, with all that follows for its node (`store.recheck`)."""
        log.info("task %s returned a wrong output: %s", task_id, why)
        await self._ctx.store.verification.judge_late(task_id, agrees=False, now=self._ctx.clock())
        self._ctx.counters.verified["wrong_output"] += 1

    async def judge_late(self, *, limit: int = 100, task_ids: Sequence[int] | None = None) -> int:
        """Check results that came after their shard was decided against its canonical
        result: they count for or against their node's trust (and earn credit if valid).

        `task_ids`: only these (a node's batch); None: any, oldest first (the monitor).
        """
        store, blobs = self._ctx.store, self._ctx.blobs
        late = await store.verification.late_results(limit=limit, task_ids=task_ids)
        caught = False
        for result in late:
            plan = await self._plans.get(result.job_id)
            agrees: bool | None = False
            if plan is not None and result.canonical_hash is not None:
                try:
                    canonical = blobs.read(result.canonical_hash)
                    output = blobs.read(result.output_hash)
                    verdict = await asyncio.to_thread(
                        plan.kind.compare, canonical, output, plan.params
                    )
                    agrees = judging.agrees(verdict)
                    if plan.kind.checks and verdict == Verdict.INCONCLUSIVE:
                        # Another build's tokens, or a verdict about an output found
                        # wrong before: nothing to judge it by (neither paid nor blamed).
                        agrees = None
                except Exception:  # an output its kind cannot read agrees with nothing
                    log.exception("task %s: its late result could not be compared", result.task_id)
            await store.verification.judge_late(
                result.task_id, agrees=agrees, now=self._ctx.clock()
            )
            outcome = {True: "late_valid", False: "late_invalid", None: "late_moot"}[agrees]
            self._ctx.counters.verified[outcome] += 1
            caught = caught or agrees is False
        if caught:
            await self._leases.replenish()  # what the caught node decided alone reopened
        return len(late)

    async def judge_known_answers(
        self, *, limit: int = 100, shard_ids: Sequence[int] | None = None
    ) -> int:
        """Judge answered known-answer checks (of these shards; None: any, oldest first):
        right, they confirm their node's word; wrong, they are lies
        (`verification.probes`). A wrong answer reopens what its node vouched for."""
        store, blobs = self._ctx.store, self._ctx.blobs
        answered = await store.verification.known_answers(limit=limit, shard_ids=shard_ids)
        caught = False
        for answer in answered:
            plan = await self._plans.get(answer.job_id)
            verdict = None
            if plan is not None:
                output = blobs.read(answer.output_hash)
                verdict = (
                    plan.kind.check_verdict(output) if len(output) < CHECK_VERDICT_BYTES else None
                )
            right = probes.answered_right(answer.known, answer.planted_hash, verdict)
            if await store.verification.judge_known_answer(
                answer.task_id, right=right, now=self._ctx.clock()
            ):
                self._ctx.counters.verified["known_right" if right else "known_wrong"] += 1
                caught = caught or not right
        if caught:
            await self._leases.replenish()
        return len(answered)

    async def _shard_decided(
        self, shard_id: int, outcome: DecisionOutcome, decision: Decision
    ) -> None:
        """After a decision committed: cancel the shard's other replicas, count verdicts,
        flag accounts whose nodes were wrong together."""
        await self._fanout.send_cancels(outcome.to_cancel, reason=f"shard {shard_id} is decided")
        self._count_verdicts(outcome.decided, decision)
        if outcome.decided and decision.colluding:
            flagged = await self._ctx.store.verification.flag_colluders(
                decision.colluding, now=self._ctx.clock()
            )
            if flagged:
                log.warning("accounts %s flagged: wrong together, the same way", flagged)
                self._ctx.counters.verified["colluders_flagged"] += len(flagged)

    def _count_verdicts(self, decided: bool, decision: Decision) -> None:
        # The store marks results only for the decision that won (or an undecided one).
        verified = self._ctx.counters.verified
        if decided:
            verified["valid"] += len(decision.valid)
        if decided or (decision.canonical is None and decision.fail_reason is None):
            verified["invalid"] += len(decision.invalid)

    async def assemble(self, job_id: int) -> None:
        """Build and store a finished job's result from its canonical outputs; a job
        whose result its kind cannot build fails with the reason (it never stays
        running). A store error propagates: it says nothing of the job."""
        plan = await self._plans.get(job_id)
        if plan is None:
            await self.fail_job(job_id, "its kind and parameters could not be read")
            return
        if self._rounds.drives(plan.kind):  # its rounds decide when it is done
            await self._rounds.progress(job_id)
            return
        store = self._ctx.store
        shards = await store.jobs.list_shards(job_id)
        if any(shard.state != ShardState.DONE for shard in shards):
            return  # a shard was opened again (its lone node was caught) meanwhile
        if await self._hold_for_audit(job_id):
            return
        hashes = await store.jobs.canonical_outputs(job_id)
        inputs = [shard.input_hash for shard in shards]
        try:
            result_hash, size = await asyncio.to_thread(
                self._assemble, job_id, plan, inputs, hashes
            )
        except Exception as exc:  # the kind's assemble, over outputs and researcher's inputs
            log.exception("job %s: its result could not be assembled", job_id)
            await self.fail_job(job_id, f"its result could not be assembled: {_why(exc)}")
            return
        if await store.jobs.complete_job(
            job_id, result_hash=result_hash, result_size=size, now=self._ctx.clock()
        ):
            log.info("job %s completed (%d bytes)", job_id, size)
        await self._fanout.job_ended(job_id)

    async def fail_job(self, job_id: int, error: str) -> None:
        """End an open job as failed with `error`; its live tasks are cancelled."""
        held = await self._ctx.store.jobs.fail_job(job_id, error=error, now=self._ctx.clock())
        log.warning("job %s failed: %s", job_id, error)
        await self._fanout.send_cancels(held, reason=f"job {job_id} failed")
        await self._fanout.job_ended(job_id)

    async def _hold_for_audit(self, job_id: int) -> bool:
        """Hold a job back while a node that decided some of its shards alone has passed
        no check since: its latest such shard is spot-checked first (the job completes
        when that check agrees; if it disagrees, the node's lone shards are replicated).
        A lie told alone at the end of a job thus never reaches the researcher."""
        store = self._ctx.store
        unvouched = await store.verification.unvouched_alone(job_id)
        if not unvouched:
            return False
        ready = await store.verification.audit(unvouched, now=self._ctx.clock())
        self._ctx.counters.alone["audited"] += len(ready)
        await self._fanout.enqueue(ready)
        return True

    def _assemble(
        self, job_id: int, plan: JobPlan, inputs: Sequence[str], hashes: Sequence[str]
    ) -> tuple[str, int]:
        faults.failure(f"assemble-job-{job_id}", RuntimeError("a fault point broke it"))
        blobs = self._ctx.blobs
        result = plan.kind.assemble_with_inputs(
            [blobs.read(h) for h in inputs], [blobs.read(h) for h in hashes], plan.params
        )
        return blobs.keep(result), len(result)


async def _isolated(step: Coroutine[Any, Any, None], doing: str, what: int) -> None:
    """Await `step`; an exception is logged with what it was doing, not raised."""
    try:
        await step
    except Exception:
        log.exception("monitor: %s %s failed; tried again next pass", doing, what)


def _why(exc: Exception) -> str:
    """An exception in words for a job's page: its message, or its type without one."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def checked(found: ShardForVerify, plan: JobPlan) -> bool:
    """Whether the shard is verified by check tasks: not when its job asked for one result
    (replication 1, no verification) or a trusted node ran it alone."""
    return plan.kind.checks and plan.replication > 1 and found.shard.mode != "alone"


def _terms(found: ShardForVerify, plan: JobPlan) -> judging.ShardTerms:
    shard = found.shard
    return judging.ShardTerms(
        mode=shard.mode,
        target=shard.target,
        quorum=shard.quorum,
        live_tasks=shard.live_tasks,
        replication=plan.replication,
        min_quorum=plan.min_quorum,
    )
